"""Multi-turn episodes (docs/multiturn.md): the episode loop (rollout.run_episodes) with a scripted
engine and with the HF engine, GAE over turns by hand, the action mask (no observation token in
any loss or statistic, checked against the same episodes with their observations cut out), and
the bad inputs a task can give. The ChatML template test is in test_real_model.py (it needs that
file's tokenizer); vLLM's episodes against the HF engine's in _vllm_checks.py; replay on every
mesh in test_e2e.py, whose generating run samples toy_tool episodes."""
import dataclasses
import functools
import json
import os
import subprocess
import sys
import types

import pytest
import torch

import config
import rollout
import train_ppo
from _dist import _free_port
from conftest import ROOT, cpu_env, python_block, torchrun_cmd
from train_ppo import compute_gae

EOS = 256


class ScriptedEngine:
    """An engine that answers each request from a script: (its context ids) -> the turn's ids.
    Records every call (contexts, seeds, budgets); logprob -0.5 a token."""
    stop_ids = [EOS]
    vocab_size = 262

    def __init__(self, script):
        self.script, self.calls = script, []

    def generate(self, prompt_ids, seeds, budgets, temperature):
        self.calls.append((prompt_ids, seeds, budgets))
        turns = [self.script(ids)[:budget] for ids, budget in zip(prompt_ids, budgets)]
        return [(turn, [-0.5] * len(turn)) for turn in turns]


class Echo:
    """A task whose every finished turn gets the same observation (a fork's tool, reduced)."""

    def __init__(self, observation):
        self.observation, self.seen = observation, []

    def observe(self, turn, episode):
        self.seen.append((turn, episode))
        return self.observation


def cfg_of(**kwargs):
    return config.Config(**{"max_turns": 3, "max_new_tokens": 4, "max_model_len": 64, "seed": 5, **kwargs})


def test_episode_of_turns_and_observations_with_masks_logprobs_and_seeds():
    engine = ScriptedEngine(lambda ids: [7, EOS])  # every turn: one token and the stop
    task = Echo([40, 41, 42])
    (ids, lps, mask), = rollout.run_episodes(engine, task, cfg_of(), [[1, 2]], [(3, 4, 5)], 1.0)
    assert ids == [7, EOS, 40, 41, 42, 7, EOS, 40, 41, 42, 7, EOS]  # 3 turns, the last one's end
    assert mask == [1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1]
    assert lps == [-0.5, -0.5, 0.0, 0.0, 0.0] * 2 + [-0.5, -0.5]  # an observation's logprob is 0
    # each turn is generated on the ids so far (no re-tokenizing), with the turn's own seed
    contexts = [call[0][0] for call in engine.calls]
    assert contexts == [[1, 2], [1, 2, *ids[:5]], [1, 2, *ids[:10]]]
    assert [call[1][0] for call in engine.calls] == [rollout.sample_seed(5, 3, 4, 5, t) for t in range(3)]
    assert rollout.sample_seed(5, 3, 4, 5, 0) == rollout.sample_seed(5, 3, 4, 5)  # single-turn's seed
    assert len(set(call[1][0] for call in engine.calls)) == 3
    # observe saw each finished turn but the last (max_turns), with the episode so far
    assert task.seen == [([7, EOS], [1, 2, 7, EOS]), ([7, EOS], [1, 2, *ids[:7]])]


def test_episode_ends_at_none_at_a_cut_turn_and_before_an_observation_that_would_not_fit():
    # observe says None: over after one turn
    ids, _, mask = rollout.run_episodes(ScriptedEngine(lambda ids: [7, EOS]), Echo(None), cfg_of(),
                                        [[1]], [(0, 0, 0)], 1.0)[0]
    assert ids == [7, EOS] and mask == [1, 1]
    # a turn cut off by its budget (no stop token) is not observed: the episode is over
    engine = ScriptedEngine(lambda ids: [7, 7, 7, 7, 7, EOS])
    ids, _, _ = rollout.run_episodes(engine, Echo([40]), cfg_of(), [[1]], [(0, 0, 0)], 1.0)[0]
    assert ids == [7, 7, 7, 7] and engine.calls[0][2] == [4]
    # max_model_len 12: prompt 2 + turn 2 + observation 8 = 12 leaves no room for a turn: the
    # observation is not cut, the episode ends before it
    cfg = cfg_of(max_model_len=12)
    ids, _, _ = rollout.run_episodes(ScriptedEngine(lambda ids: [7, EOS]), Echo([40] * 8), cfg,
                                     [[1, 2]], [(0, 0, 0)], 1.0)[0]
    assert ids == [7, EOS]
    # with 7 observation ids one token of room is left: the next turn's budget is 1
    engine = ScriptedEngine(lambda ids: [7, EOS])
    ids, _, mask = rollout.run_episodes(engine, Echo([40] * 7), cfg, [[1, 2]], [(0, 0, 0)], 1.0)[0]
    assert ids == [7, EOS, *[40] * 7, 7] and engine.calls[1][2] == [1] and len(ids) + 2 == 12


def test_a_task_that_never_ends_is_bounded_by_max_turns_and_single_turn_tasks_make_one_call():
    engine = ScriptedEngine(lambda ids: [7, EOS])
    episodes = rollout.run_episodes(engine, Echo([40]), cfg_of(max_turns=5), [[1], [2, 3]],
                                    [(0, 0, 0), (0, 0, 1)], 1.0)
    assert [sum(mask) for _, _, mask in episodes] == [10, 10] and len(engine.calls) == 5
    engine = ScriptedEngine(lambda ids: [7, EOS])
    (ids, _, mask), = rollout.run_episodes(engine, rollout.ToyTask(0), cfg_of(), [[1]], [(0, 0, 0)], 1.0)
    assert ids == [7, EOS] and mask == [1, 1] and len(engine.calls) == 1  # no observe: one turn


@pytest.mark.parametrize("observation", ["7", 7, [1.0], [262], [-1]])  # text, an id, a float, out of vocab
def test_a_bad_observation_is_one_clear_error(observation):
    with pytest.raises(rollout.TaskError, match=r"observe\(\) must return a list of token ids in \[0, 262\)"):
        rollout.run_episodes(ScriptedEngine(lambda ids: [7, EOS]), Echo(observation), cfg_of(), [[1]],
                             [(0, 0, 0)], 1.0)


def test_toy_tool_task_calls_the_calculator_and_rewards_the_last_turn():
    task = rollout.ToyToolTask(seed=1)
    prompt, answer = task.prompts(0, 1)[0]
    a, b = map(int, prompt[:-1].split("+"))
    assert 10 <= a < 100 and 10 <= b < 100 and answer == str(a + b)
    call = task.tok.encode("?") + [task.eos_id]
    observation = task.observe(call, task.encode(prompt) + call)
    assert task.decode(observation) == f"[{a + b}]"
    assert task.observe(task.tok.encode(answer) + [task.eos_id], []) is None  # an answer ends it
    trace = task.target(answer)
    assert trace == call + observation + task.tok.encode(answer) + [task.eos_id]
    assert task.reward(task.decode(trace), answer, True) == 1.0
    assert task.reward(task.decode(trace), answer, False) == 0.0  # cut off
    assert task.reward(f"?[{a + b}]{a + b + 1}", answer, True) == 0.0  # copied wrong
    assert task.reward(answer, answer, True) == 1.0  # a direct answer counts too (max_turns=1)


def test_gae_over_two_turns_by_hand():
    # prompt (0, 1), turn 1 at 2-3, the tool's output at 4-5 (large rewards and values that must be
    # ignored), turn 2 at 6-7, padding at 8. gamma = .9, lam = .8: the next state after 3 is 6.
    #   t=7: delta = 1 + .9*0 - 4 = -3                  A7 = -3
    #   t=6: delta = -.1 + .9*4 - 3 = .5                A6 = .5 + .72*(-3) = -1.66
    #   t=3: delta = .2 + .9*3 - 2 = .9                 A3 = .9 + .72*(-1.66) = -.2952
    #   t=2: delta = 0 + .9*2 - 1 = .8                  A2 = .8 + .72*(-.2952) = .587456
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.2, 50.0, 60.0, -0.1, 1.0, 9.0]])
    values = torch.tensor([[0.0, 0.0, 1.0, 2.0, 70.0, 80.0, 3.0, 4.0, 9.0]])
    mask = torch.tensor([[0.0, 0, 1, 1, 0, 0, 1, 1, 0]])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    expected = torch.tensor([[0.0, 0.0, 0.587456, -0.2952, 0.0, 0.0, -1.66, -3.0, 0.0]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, (expected + values) * mask)


def _batches(estimator):
    """The same 3 episodes twice: with their observations (whose trainer-side numbers are garbage)
    and with the observations cut out (single-turn rows of the model's tokens alone). Prompt
    lengths 3, 2, 4; episode 0 has two turns, episode 2 three."""
    g = torch.Generator().manual_seed(0)
    prompts = [[5, 6, 7], [5, 6], [5, 6, 7, 8]]
    turns = [[[1, 2], [3, 4, 5]], [[1, 2, 3]], [[1], [2, 3], [4, EOS]]]
    observations = [[[40, 41]], [], [[42], [43, 44, 45]]]
    responses, masks, kept = [], [], []
    for episode, seen in zip(turns, observations):
        ids, mask = [], []
        for k, turn in enumerate(episode):
            ids += turn
            mask += [1] * len(turn)
            if k < len(seen):
                ids += seen[k]
                mask += [0] * len(seen[k])
        responses.append(ids)
        masks.append(mask)
        kept.append([t for turn in episode for t in turn])
    lps = [torch.randn(len(r), generator=g).tolist() for r in responses]
    full = train_ppo.make_batch(prompts, responses, 0, lps, action_masks=masks)
    cut = train_ppo.make_batch(prompts, kept, 0, [[x for x, m in zip(lp, mask) if m] for lp, mask in
                                                  zip(lps, masks)])

    names = ("old_lp", "ref_lp", "entropy", "values")
    numbers = {name: torch.randn(int(full.mask.sum()), generator=g) for name in names}

    def fields(batch, garbage):
        """Trainer-side tensors: `numbers` on the model's tokens (row-major: the same order in both
        batches), `garbage` on an observation's."""
        out = {}
        for name in names:
            out[name] = torch.full(batch.ids.shape, garbage)
            out[name][batch.mask.bool()] = numbers[name]
        return out

    shared = dict(index=[0, 1, 2], scores=torch.tensor([1.0, 0.0, 0.5]))
    full = dataclasses.replace(full, **shared, **fields(full, 1e3))
    cut = dataclasses.replace(cut, **shared, **fields(cut, 0.0))
    cfg = config.Config(advantage_estimator=estimator, samples_per_prompt=3, tis_cap=2.0, entropy_coef=0.01,
                        kl_coef=0.1, loss_agg_mode="seq-mean-token-mean")
    return full, cut, cfg


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_observation_tokens_are_in_no_loss_or_statistic(estimator, monkeypatch):
    """The episodes with observations (garbage logprobs, values, entropy there) give every
    advantage, loss term and metric that the same episodes with the observations cut out give:
    an independent computation, since GAE's "next action", the token means, whitening, KL and
    every statistic then see plain single-turn rows."""
    monkeypatch.setattr(train_ppo, "dp_sum", lambda tensor, mesh: tensor)  # one rank
    mesh = {"dp": types.SimpleNamespace(get_group=lambda: None)}  # masked_whiten: no all-reduce
    torch.manual_seed(0)
    full, cut, cfg = _batches(estimator)
    results = []
    for batch in (full, cut):
        scores = batch.scores  # (the global batch is this one)
        batch = dataclasses.replace(batch, **train_ppo.compute_advantages(batch, scores, cfg, mesh))
        aggregate = functools.partial(train_ppo.aggregate_loss, mode=cfg.loss_agg_mode,
                                      num_tokens=batch.mask.sum(), num_seqs=3)  # one rank's = global
        lp = batch.old_lp + 0.3 * batch.mask  # a policy that moved: ratios away from 1
        rows = torch.arange(3)
        terms, clipped = train_ppo.policy_loss_terms(lp, batch.entropy, batch, rows, aggregate, cfg)
        if batch.returns is not None:  # the critic's loss, on values that moved
            moved = train_ppo.value_loss(batch.values + 0.3, batch.values, batch.returns, 0.2)
            terms["value_loss"] = aggregate(moved, batch.mask)
        sums = (terms, {"clipped_tokens": clipped}, {"grad_norm": 1.0})
        metrics = train_ppo.step_metrics(batch, sums, cfg, mesh)
        on_actions = {name: getattr(batch, name)[batch.mask.bool()]
                      for name in ("advantages", "returns", "tis") if getattr(batch, name) is not None}
        results.append((on_actions, terms, metrics))
    (adv_full, terms_full, m_full), (adv_cut, terms_cut, m_cut) = results
    for name in adv_cut:
        torch.testing.assert_close(adv_full[name], adv_cut[name])
    assert set(terms_full) == set(terms_cut) and len(terms_full) >= 3  # surrogate, entropy, KL or not
    for name in terms_cut:
        torch.testing.assert_close(terms_full[name], terms_cut[name])
    assert m_full["turns_per_episode"] == pytest.approx(6 / 3) and m_full["tool_calls_per_episode"] == 1.0
    assert m_cut["turns_per_episode"] == 1.0  # the cut rows are single-turn
    differ = {"tokens", "turns_per_episode", "tool_calls_per_episode"}  # prompt + response tokens
    assert {k: v for k, v in m_full.items() if k not in differ} == pytest.approx(
        {k: v for k, v in m_cut.items() if k not in differ})


@pytest.mark.slow  # a CLI run under torchrun
def test_recipe_for_your_own_tool_runs_as_written(tmp_path):
    """The "Your own tool" block of docs/multiturn.md, copied verbatim into a file and launched as
    its first line says (smaller: test_tiny, 2 steps, the HF engine). Every episode in the dumps
    follows the checker's rule: each turn but the last ended by EOS with a wrong answer and got
    "[wrong]"; the last one is right, cut off, or the third."""
    script = tmp_path / "my_tool.py"
    script.write_text(python_block("docs/multiturn.md", "## Your own tool"))
    proc = subprocess.run(torchrun_cmd(2, "--config", "configs/test_tiny.toml", "--max_turns=3", "--steps=2",
                                       "--rollout_engine=hf", f"--out_dir={tmp_path / 'out'}",
                                       script=str(script)),
                          cwd=ROOT, capture_output=True, text=True, timeout=900, env=cpu_env(PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-4000:]
    task = rollout.ToyTask(0)
    wrong = task.tok.encode("[wrong]")
    turns_seen = []
    for step in range(2):
        with open(tmp_path / "out" / "rollouts" / f"step_{step}.jsonl") as f:
            samples = [json.loads(line) for line in f]
        for s in samples:
            ids, mask = s["response_ids"], s["action_mask"]
            turns, observations, k = [], [], 0
            while k < len(ids):  # split the response into its runs of model and tool tokens
                run = next((j for j in range(k, len(ids)) if mask[j] != mask[k]), len(ids))
                (turns if mask[k] else observations).append(ids[k:run])
                k = run
            assert len(turns) == len(observations) + 1 <= 3 and all(o == wrong for o in observations)
            for turn in turns[:-1]:
                assert turn[-1] == task.eos_id and task.decode(turn) != s["answer"]
            last = turns[-1]
            assert task.decode(last) == s["answer"] or last[-1] != task.eos_id or len(turns) == 3
            assert s["reward"] == float(s["finished"] and task.decode(last) == s["answer"])
            turns_seen.append(len(turns))
    assert max(turns_seen) >= 2  # the tool answered at least once (measured: most episodes)


BAD_TOOL = '''import os, sys
import config, rollout, train_ppo

class BadTool(rollout.ToyTask):
    def observe(self, turn, episode):
        return [999]  # an id past the model's vocabulary (262)

if __name__ == "__main__":
    cfg = config.load(sys.argv[1:], world_size=int(os.environ.get("WORLD_SIZE", "1")))
    train_ppo.main(cfg, task=BadTool(cfg.seed))
'''


@pytest.mark.slow  # a CLI run
def test_a_bad_observation_stops_the_run_with_one_line_before_the_step_is_trained(tmp_path):
    """A fork's observe returns an id out of the vocabulary, mid-step: one line, exit 1, no
    traceback, and nothing of the step trained, logged or dumped (one rank, as the CLI's other
    bad-input tests run: under torchrun its own failure report follows, as for any rank that
    exits non-zero)."""
    script = tmp_path / "bad_tool.py"
    script.write_text(BAD_TOOL)
    env = cpu_env(WORLD_SIZE="1", MASTER_PORT=str(_free_port()), PYTHONPATH=ROOT)
    # test_tiny's warm-up (5 steps) teaches EOS: turns end, and observe is called
    proc = subprocess.run([sys.executable, str(script), "--config", "configs/test_tiny.toml", "--max_turns=2",
                           "--rollout_engine=hf", f"--out_dir={tmp_path / 'out'}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = "task error: observe() must return a list of token ids in [0, 262) or None, not [999]"
    assert proc.stderr.strip().splitlines()[-1] == line, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert open(tmp_path / "out" / "metrics.jsonl").read() == ""  # no step logged
    assert os.listdir(tmp_path / "out" / "rollouts") == []  # none dumped
