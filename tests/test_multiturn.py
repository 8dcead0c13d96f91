"""Multi-turn episodes (docs/multiturn.md, extensions/multiturn.py): the episode loop
(multiturn.run_episodes) with a scripted engine and with the HF engine, GAE over turns by hand,
the action mask (no observation token in any loss, gradient or statistic, in every loss mode, with
GSPO, and through a replayed ppo_step,
checked against the same episodes with their observations cut out), and the bad inputs a task
can give. The ChatML template test is in test_real_model.py (it needs that
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
import model_parallel
import rollout
import train_ppo
from _dist import _free_port
from extensions import evaluation, gspo, multiturn, offpolicy
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
    (ids, lps, mask, calls, ended), = multiturn.run_episodes(engine, task, cfg_of(), [[1, 2]], [(3, 4, 5)],
                                                             1.0)
    assert ids == [7, EOS, 40, 41, 42, 7, EOS, 40, 41, 42, 7, EOS]  # 3 turns, the last one's end
    # the third turn is a call too, on the last allowed turn: counted, never answered
    assert calls == 3 and ended == "max_turns"
    assert mask == [1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1]
    assert lps == [-0.5, -0.5, 0.0, 0.0, 0.0] * 2 + [-0.5, -0.5]  # an observation's logprob is 0
    # each turn is generated on the ids so far (no re-tokenizing), with the turn's own seed
    contexts = [call[0][0] for call in engine.calls]
    assert contexts == [[1, 2], [1, 2, *ids[:5]], [1, 2, *ids[:10]]]
    assert [call[1][0] for call in engine.calls] == [rollout.sample_seed(5, 3, 4, 5, t) for t in range(3)]
    assert rollout.sample_seed(5, 3, 4, 5, 0) == rollout.sample_seed(5, 3, 4, 5)  # single-turn's seed
    assert len(set(call[1][0] for call in engine.calls)) == 3
    # observe saw each finished turn, the last one too, with the episode so far
    assert task.seen == [([7, EOS], [1, 2, 7, EOS]), ([7, EOS], [1, 2, *ids[:7]]), ([7, EOS], [1, 2, *ids])]


def test_episode_ends_at_none_at_a_cut_turn_and_before_an_observation_that_would_not_fit():
    # observe says None: over after one turn
    ids, _, mask, calls, ended = multiturn.run_episodes(ScriptedEngine(lambda ids: [7, EOS]), Echo(None),
                                                      cfg_of(), [[1]], [(0, 0, 0)], 1.0)[0]
    assert ids == [7, EOS] and mask == [1, 1] and (calls, ended) == (0, "stop")
    # a call answered, then the answer: a natural end after one call
    replies = iter([[40], None])
    task = Echo(None)
    task.observe = lambda turn, episode: next(replies)
    ids, _, mask, calls, ended = multiturn.run_episodes(ScriptedEngine(lambda ids: [7, EOS]), task, cfg_of(),
                                                      [[1]], [(0, 0, 0)], 1.0)[0]
    assert mask == [1, 1, 0, 1, 1] and (calls, ended) == (1, "stop")
    # a turn cut off by its budget (no stop token) is not observed: the episode is over
    engine = ScriptedEngine(lambda ids: [7, 7, 7, 7, 7, EOS])
    ids, _, _, calls, ended = multiturn.run_episodes(engine, Echo([40]), cfg_of(), [[1]], [(0, 0, 0)], 1.0)[0]
    assert ids == [7, 7, 7, 7] and engine.calls[0][2] == [4] and (calls, ended) == (0, "length")
    # max_model_len 12: prompt 2 + turn 2 + observation 8 = 12 leaves no room for a turn: the
    # observation is not cut, the episode ends before it
    cfg = cfg_of(max_model_len=12)
    ids, _, _, calls, ended = multiturn.run_episodes(ScriptedEngine(lambda ids: [7, EOS]), Echo([40] * 8),
                                                     cfg, [[1, 2]], [(0, 0, 0)], 1.0)[0]
    assert ids == [7, EOS] and (calls, ended) == (1, "context")  # a call whose output did not fit
    # with 7 observation ids one token of room is left: the next turn's budget is 1
    engine = ScriptedEngine(lambda ids: [7, EOS])
    ids, _, mask, calls, ended = multiturn.run_episodes(engine, Echo([40] * 7), cfg, [[1, 2]], [(0, 0, 0)],
                                                      1.0)[0]
    assert ids == [7, EOS, *[40] * 7, 7] and engine.calls[1][2] == [1] and len(ids) + 2 == 12
    assert (calls, ended) == (1, "length")


def test_a_task_that_never_ends_is_bounded_by_max_turns_and_single_turn_tasks_make_one_call():
    engine = ScriptedEngine(lambda ids: [7, EOS])
    episodes = multiturn.run_episodes(engine, Echo([40]), cfg_of(max_turns=5), [[1], [2, 3]],
                                    [(0, 0, 0), (0, 0, 1)], 1.0)
    assert [sum(mask) for _, _, mask, _, _ in episodes] == [10, 10] and len(engine.calls) == 5
    assert [(calls, ended) for *_, calls, ended in episodes] == [(5, "max_turns")] * 2
    engine = ScriptedEngine(lambda ids: [7, EOS])
    (ids, _, mask, calls, ended), = multiturn.run_episodes(engine, rollout.ToyTask(0), cfg_of(), [[1]],
                                                         [(0, 0, 0)], 1.0)
    assert ids == [7, EOS] and mask == [1, 1] and len(engine.calls) == 1  # no observe: one turn
    assert (calls, ended) == (0, "stop")


@pytest.mark.parametrize("observation", ["7", 7, [1.0], [262], [-1]])  # text, an id, a float, out of vocab
def test_a_bad_observation_is_one_clear_error(observation):
    with pytest.raises(rollout.TaskError, match=r"observe\(\) must return a list of token ids in \[0, 262\)"):
        multiturn.run_episodes(ScriptedEngine(lambda ids: [7, EOS]), Echo(observation), cfg_of(), [[1]],
                             [(0, 0, 0)], 1.0)


def test_toy_tool_task_calls_the_calculator_and_rewards_the_last_turn():
    task = multiturn.ToyToolTask(seed=1)
    prompt, answer = task.prompts(0, 1)[0]
    a, b = map(int, prompt[:-1].split("+"))
    assert 10 <= a < 100 and 10 <= b < 100 and answer == str(a + b)
    call = task.tok.encode("?") + [task.eos_id]
    observation = task.observe(call, task.encode(prompt) + call)
    assert task.decode(observation) == f"[{a + b}]"
    assert task.observe(task.tok.encode(answer) + [task.eos_id], []) is None  # an answer ends it
    trace, mask = task.target(answer)
    assert trace == call + observation + task.tok.encode(answer) + [task.eos_id]
    # the warm-up trains on the call and the answer, not on the tool's output
    assert mask == [1, 1] + [0] * len(observation) + [1] * (len(answer) + 1)
    # the reward reads the model's last turn, its answer, not the tool's output before it
    answered = rollout.last_turn(trace, mask)
    assert answered == task.tok.encode(answer) + [task.eos_id]
    assert task.reward(task.decode(answered), answer, "stop") == 1.0
    for ended in ("length", "max_turns", "context"):  # cut off, or a call never answered
        assert task.reward(task.decode(answered), answer, ended) == 0.0
    assert task.reward(str(a + b + 1), answer, "stop") == 0.0  # copied wrong
    assert task.reward("?", answer, "max_turns") == 0.0  # a call on the last turn
    assert task.reward(answer, answer, "stop") == 1.0  # a direct answer counts too (max_turns=1)
    assert rollout.last_turn([1, 2], [1, 1]) == [1, 2]  # single-turn: the whole response
    # without the tool (max_turns=1) the warm-up teaches the direct answer, with no call
    assert multiturn.ToyToolTask(seed=1, tool=False).target(answer) == task.tok.encode(answer) + [task.eos_id]


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


def _episodes(turns, observations):
    """Responses, action masks and the model's tokens alone, of episodes given as their turns and
    the observations after them."""
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
    return responses, masks, kept


MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# What the trainer holds outside the mask (an observation's tokens, and the prompt and padding) of
# the episodes with observations in the test below: wild numbers, another in each field, so that no
# two cancel (KL = old - ref, the ratio = new - old, the TIS weight = old - engine) and any one let
# into a loss, a gradient or a statistic shows. The old policy's is -7 plus noise. The cut rows hold
# 0 there (ZEROS): a computation that read outside the mask would then differ between the two.
OFF_MASK = dict(engine_lp=-2.0, ref_lp=3.0, lp=-0.5, entropy=9.0, values=50.0, new_values=-30.0,
                advantages=5.0, returns=-40.0)
ZEROS = dict.fromkeys(OFF_MASK, 0.0)


def _spread(batch, on_actions, off):
    """A (b, S) tensor: `on_actions` on the model's tokens (row-major), `off` (a number, or a
    (b, S) tensor) everywhere else."""
    out = torch.full(batch.ids.shape, off) if isinstance(off, float) else off.clone()
    out[batch.mask.bool()] = on_actions
    return out


def _batches(estimator, **overrides):
    """The same 3 episodes twice: with their observations (where every trainer-side number is
    OFF_MASK's) and with the observations cut out (single-turn rows of the model's tokens alone,
    0 outside the mask).
    Prompt lengths 3, 2, 4; episode 0 has two turns, episode 2 three. Also returns, per model
    token (row-major, the same order in both), how far the new policy's logprob, entropy and the
    new values lie from the old ones."""
    g = torch.Generator().manual_seed(0)
    prompts = [[5, 6, 7], [5, 6], [5, 6, 7, 8]]
    turns = [[[1, 2], [3, 4, 5]], [[1, 2, 3]], [[1], [2, 3], [4, EOS]]]
    responses, masks, kept = _episodes(turns, [[[40, 41]], [], [[42], [43, 44, 45]]])
    engine = [[x if m else OFF_MASK["engine_lp"] for x, m in zip(torch.randn(len(mask), generator=g).tolist(),
                                                                 mask)] for mask in masks]
    full = train_ppo.make_batch(prompts, responses, 0, engine, action_masks=masks)
    cut = train_ppo.make_batch(prompts, kept, 0, [[x for x, m in zip(lp, mask) if m] for lp, mask in
                                                  zip(engine, masks)])
    n = int(cut.mask.sum())  # the model's tokens
    assert int(full.mask.sum()) == n, "the batch's mask must be the action mask (1 on the model's tokens)"
    numbers = {name: torch.randn(n, generator=g) for name in ("old_lp", "ref_lp", "entropy", "values")}
    moves = dict(lp=0.3 * torch.randn(n, generator=g), entropy=torch.randn(n, generator=g),
                 values=0.3 * torch.randn(n, generator=g))

    def fields(batch, off):
        out = {name: _spread(batch, numbers[name], off.get(name, 0.0)) for name in numbers}
        if off is OFF_MASK:  # -7 plus noise
            noise = torch.randn(batch.ids.shape, generator=g)
            out["old_lp"] = _spread(batch, numbers["old_lp"], -7.0 + noise)
        return out

    shared = dict(index=[0, 1, 2], reward=torch.tensor([1.0, 0.0, 0.5]),
                  task_score=torch.tensor([1.0, 0.0, 0.5]))
    full = dataclasses.replace(full, **shared, **fields(full, OFF_MASK))
    cut = dataclasses.replace(cut, **shared, **fields(cut, ZEROS))
    cfg = config.Config(**{**dict(advantage_estimator=estimator, samples_per_prompt=3, offpolicy_is="token",
                                  entropy_coef=0.01, kl_coef=0.1, gamma=0.9, lam=0.8, gspo_clip_ratio=0.2,
                                  gspo_clip_ratio_high=0.2), **overrides})
    return full, cut, cfg, moves


@pytest.mark.parametrize("ratio", ["ppo", "gspo"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("estimator", ["gae", "grpo"])  # the KL as a per-token reward; as a loss term
def test_observation_tokens_are_in_no_loss_gradient_or_statistic(estimator, mode, ratio, monkeypatch):
    """The episodes with observations, whose every trainer-side number there is wild and its own
    (OFF_MASK: old, reference, new and engine logprobs, entropy, old and new values, and, as the
    losses' inputs, advantages, returns and TIS weights), give every advantage, loss term, gradient
    (w.r.t. the new logprobs, entropy and values) and metric that the same episodes with the
    observations cut out give, in every loss_agg_mode, with the token's ratio and GSPO's: an
    independent computation, since GAE's "next action", the token and sequence means (GSPO's
    included), whitening, KL and every statistic then see plain single-turn rows."""
    monkeypatch.setattr(train_ppo, "dp_sum", lambda tensor, mesh: tensor)  # one rank
    mesh = {"dp": types.SimpleNamespace(get_group=lambda: None)}  # masked_whiten: no all-reduce
    full, cut, cfg, moves = _batches(estimator, loss_agg_mode=mode, policy_loss_mode=ratio)
    results = []
    for batch, off in ((full, OFF_MASK), (cut, ZEROS)):
        on = batch.mask.bool()
        advantages, returns = train_ppo.compute_advantages(batch, batch.reward, cfg, mesh)
        batch = dataclasses.replace(batch, advantages=advantages, returns=returns)
        computed = {name: getattr(batch, name) for name in ("advantages", "returns")
                    if getattr(batch, name) is not None}
        # the losses' inputs: wild numbers off the mask instead of compute_advantages' zeros there
        inputs = dataclasses.replace(batch, **{name: torch.where(on, x, off[name])
                                               for name, x in computed.items()})
        # the correction's weights, as ppo_step computes them in the passes without grad
        weight, corrected = offpolicy.weigh(inputs, cfg, mesh)
        inputs = dataclasses.replace(inputs, weight=inputs.weight * weight)
        # the new policy's logprobs and entropy, the critic's new values: leaves, for the gradients
        new = dict(lp=_spread(batch, batch.old_lp[on] + moves["lp"], off["lp"]),
                   entropy=_spread(batch, moves["entropy"], off["entropy"]),
                   values=_spread(batch, batch.values[on] + moves["values"], off["new_values"]))
        for leaf in new.values():
            leaf.requires_grad_()
        aggregate = functools.partial(train_ppo.aggregate_loss, mode=cfg.loss_agg_mode,
                                      num_tokens=batch.mask.sum(), num_seqs=3, norm=8)  # one rank's = global
        terms, clipped = train_ppo.policy_loss_terms(new["lp"], new["entropy"], inputs, torch.arange(3),
                                                     aggregate, cfg)
        if batch.returns is not None:  # the critic's loss
            per_token = train_ppo.value_loss(new["values"], inputs.values, inputs.returns, 0.2)
            terms["value_loss"] = aggregate(per_token, batch.mask)
        sum(terms.values()).backward()
        grads = {name: leaf.grad for name, leaf in new.items() if leaf.grad is not None}
        sums = train_ppo.UpdateSums({name: term.detach() for name, term in terms.items()},
                                    {"clipped_tokens": clipped}, {"grad_norm": 1.0})
        metrics = {**train_ppo.step_metrics(batch, sums, cfg, mesh), **corrected}
        results.append(dict(on=on, computed=computed, terms=sums[0], grads=grads, metrics=metrics))
    full, cut = results
    for name in cut["computed"]:  # on the actions; 0 elsewhere (step_metrics sums returns unmasked)
        torch.testing.assert_close(full["computed"][name][full["on"]], cut["computed"][name][cut["on"]],
                                   msg=lambda text: f"{name}: {text}")
        assert not full["computed"][name][~full["on"]].any(), name
    # surrogate, entropy, and the critic's loss (gae) or the KL term (grpo)
    assert set(full["terms"]) == set(cut["terms"]) and len(cut["terms"]) == 3
    for name in cut["terms"]:
        torch.testing.assert_close(full["terms"][name], cut["terms"][name],
                                   msg=lambda text: f"{name}: {text}")
    learned = {"lp", "entropy", "values"} if estimator == "gae" else {"lp", "entropy"}
    assert set(full["grads"]) == set(cut["grads"]) == learned
    for name, grad in full["grads"].items():
        label = f"the gradient w.r.t. the new {name}"
        torch.testing.assert_close(grad[full["on"]], cut["grads"][name][cut["on"]],
                                   msg=lambda text: f"{label}, on actions: {text}")
        torch.testing.assert_close(grad[~full["on"]], torch.zeros((~full["on"]).sum()),
                                   msg=lambda text: f"{label}, elsewhere: {text}")  # none outside the mask
    assert cut["grads"]["lp"].abs().sum() > 0.1  # some tokens (GSPO: sequences) unclipped
    m_full, m_cut = full["metrics"], cut["metrics"]
    assert m_full["tokens"] > m_cut["tokens"]  # prompt + response tokens: the observations too
    assert {k: v for k, v in m_full.items() if k != "tokens"} == pytest.approx(
        {k: v for k, v in m_cut.items() if k != "tokens"})


class TokenTable(torch.nn.Module):
    """A stand-in for the policy or the critic: the numbers at position i are row x_i of `table`
    (logprob and entropy, or value), the token's alone, so that a model token gets the same
    numbers with or without the observations before it. Its gradients and AdamW steps are real."""

    def __init__(self, table):
        super().__init__()
        self.table = torch.nn.Parameter(table)  # (vocab, columns)


def table_policy(model, ids, lens, mesh, cfg, temperature=1.0, with_entropy=False, unscored=0):
    rows = model.table[ids]  # (b, S, 2)
    return rows[..., 0], rows[..., 1] if with_entropy else None


def table_critic(critic, ids, lens, mesh, cfg, shift=True):
    return critic.table[ids][..., 0]  # (b, S)


OBSERVATION_IDS = list(range(40, 46))


def _stand_in_models(estimator):
    """Models of TokenTable stand-ins (seeded: the same each call). The policy's logprobs of the
    observation ids are -7 plus noise, their entropy 9; the reference's logprobs there are +3; the
    critic's values 50. On the other ids, the reference's logprobs differ from the policy's."""
    g = torch.Generator().manual_seed(1)
    policy = torch.stack([-1.5 + 0.3 * torch.randn(262, generator=g),  # logprob
                          1.0 + 0.1 * torch.rand(262, generator=g)], 1)  # entropy
    reference = policy.clone()
    reference[:, 0] += 0.2 * torch.randn(262, generator=g)
    critic = torch.randn(262, 1, generator=g)
    policy[OBSERVATION_IDS] = torch.stack([-7.0 + torch.randn(6, generator=g), torch.full((6,), 9.0)], 1)
    reference[OBSERVATION_IDS, 0] = 3.0
    critic[OBSERVATION_IDS] = 50.0
    parts = {}
    for name, table, lr in (("policy", policy, 0.05), ("critic", critic, 0.05)):
        if name == "critic" and estimator != "gae":
            continue
        model = TokenTable(table)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        parts[name] = train_ppo.Part(model, optimizer, schedule)
    # the reference policy: its table swapped into the policy, as build_models makes it
    snapshot = model_parallel.snapshot_weights(TokenTable(reference))
    swap = functools.partial(model_parallel.swapped_weights, parts["policy"].model, snapshot)
    return train_ppo.Models(parts, swap, None)


def _dump(path, prompts, responses, masks, rewards, engine_lps):
    """A step's samples as a run dumps them (rollouts/step_0.jsonl), for replay_rollouts: each
    observation answered a call, and each episode ended naturally."""
    os.makedirs(path)
    with open(os.path.join(path, "step_0.jsonl"), "w") as f:
        for j, sample in enumerate(zip(prompts, responses, masks, rewards, engine_lps)):
            names = ("prompt_ids", "response_ids", "action_mask", "reward", "engine_logprobs")
            calls = sum(a > b for a, b in zip(sample[2], sample[2][1:]))  # observations
            f.write(json.dumps(dict(index=j, calls=calls, ended="stop", **dict(zip(names, sample)))) + "\n")


@pytest.mark.parametrize("estimator, mode, ratio", [("gae", "token-mean", "ppo"),
                                                    ("grpo", "seq-mean-token-mean", "gspo")])
def test_replayed_episodes_train_as_their_cut_rows(estimator, mode, ratio, tmp_path, monkeypatch):
    """A replayed step of 4 episodes (a dump's step_0.jsonl, through train_ppo.ppo_step on a
    one-rank gloo mesh: make_batch with the action masks, score, GAE, whitening, update() with its
    own token counts over 2 minibatches x 2 epochs x microbatches of one row, AdamW, step_metrics)
    against the same episodes with their observations cut out, dumped as single-turn rows.
    The policy and critic are TokenTable stand-ins (the real model's numbers depend on the
    context, which the cut changes), wild on the observation ids. Both runs must log the same
    losses, KL, entropy, grad norms and statistics, and leave the same weights; the batch update()
    trains on carries the correction's weights (offpolicy_is=token), by hand. With gamma 0.9 and
    lam 0.8, a GAE that stepped through the observations would discount across them; with the
    mask ignored, the observations' numbers would enter everything."""
    prompts = [[5, 6, 7], [5, 6], [5, 6, 7, 8], [6, 7]]
    turns = [[[1, 2], [3, 4, EOS]], [[1, 2, 3, EOS]], [[1], [2, 3], [4, EOS]], [[2, EOS], [1, EOS]]]
    observations = [[[40, 41]], [], [[42], [43, 44, 45]], [[45, 40, 41]]]
    responses, masks, kept = _episodes(turns, observations)
    rewards = [1.0, 0.0, 0.5, 1.0]  # groups (0, 1) and (2, 3) differ within: GRPO's advantages are not 0
    g = torch.Generator().manual_seed(2)
    engine = [[-1.5 + 0.3 * torch.randn((), generator=g).item() if m else 0.0 for m in mask]  # 0: as dumped
              for mask in masks]
    _dump(tmp_path / "full", prompts, responses, masks, rewards, engine)
    _dump(tmp_path / "cut", prompts, kept, [[1] * len(r) for r in kept], rewards,
          [[x for x, m in zip(lp, mask) if m] for lp, mask in zip(engine, masks)])
    monkeypatch.setattr(model_parallel, "forward_policy", table_policy)
    monkeypatch.setattr(model_parallel, "forward_critic", table_critic)
    monkeypatch.setattr(rollout, "dump_rollouts", lambda *args: None)
    # the batch update() trains on: the correction's weights are in it (ppo_step applies them)
    seen, real_update = [], train_ppo.update
    monkeypatch.setattr(train_ppo, "update", lambda parts, batch, *args, **kwargs:
                        seen.append(batch) or real_update(parts, batch, *args, **kwargs))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    mesh, runs = None, {}
    try:
        mesh = model_parallel.make_mesh(1, 1, 1, "cpu")
        for name in ("full", "cut"):
            cfg = config.Config(advantage_estimator=estimator, loss_agg_mode=mode, policy_loss_mode=ratio,
                                prompts_per_step=2, samples_per_prompt=2, num_minibatches=2,
                                micro_batch_size=1, ppo_epochs=2, entropy_coef=0.01, kl_coef=0.1,
                                offpolicy_is="token",
                                gamma=0.9, lam=0.8, gspo_clip_ratio=0.2, gspo_clip_ratio_high=0.2,
                                max_new_tokens=4,
                                replay_rollouts=str(tmp_path / name), out_dir=str(tmp_path / "out"))
            models = _stand_in_models(estimator)
            metrics, _, _ = train_ppo.ppo_step({"step": 0, "prompts_drawn": 0}, models, None,
                                            types.SimpleNamespace(pad_id=0), cfg, mesh)
            weights = {part: models.parts[part].model.table.detach() for part in models.parts}
            runs[name] = metrics, weights
            # offpolicy_is=token, truncate at 2: min(pi_old / pi_engine, 2) on the loss's tokens
            trained = seen[-1]
            tis = (trained.old_lp - trained.engine_lp).exp().clamp(max=2.0) * trained.mask
            torch.testing.assert_close(trained.weight, tis)
            assert ((tis - 1).abs() > 0.1).any()  # weights that are not 1: the check sees them
    finally:
        torch.distributed.destroy_process_group()
        if mesh is not None:
            model_parallel.release_mesh(mesh)
    (m_full, w_full), (m_cut, w_cut) = runs["full"], runs["cut"]
    differ = {"tokens", "turns_per_episode", "tool_calls_per_episode", "tokens_per_s", "mem_used_gb"}
    same = {k: v for k, v in m_cut.items() if k not in differ and not k.startswith("time_")}
    assert {k: m_full[k] for k in same} == pytest.approx(same, rel=1e-5, abs=1e-7)
    initial = _stand_in_models(estimator).parts
    for part in w_cut:
        torch.testing.assert_close(w_full[part], w_cut[part], rtol=1e-5, atol=1e-7,
                                   msg=lambda text: f"{part}'s weights: {text}")
        assert not torch.equal(w_cut[part], initial[part].model.table.detach())  # it trained
    # the check has something to see: episodes of 2 turns on average, and no loss term is 0
    assert m_full["turns_per_episode"] == pytest.approx(8 / 4) and m_cut["turns_per_episode"] == 1.0
    losses = ("policy_loss", "entropy_loss", "value_loss" if estimator == "gae" else "kl_loss")
    assert all(same[k] != 0 for k in losses + ("kl", "grad_norm")), same


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
            # why it ended, and the calls: each "[wrong]" answered one; a wrong answer on the last
            # turn (or one whose "[wrong]" did not fit) is a call never answered
            if last[-1] != task.eos_id:
                expected = {"length"}
            elif task.decode(last) == s["answer"]:
                expected = {"stop"}
            else:  # a wrong answer the checker answered, its "[wrong]" never appended
                expected = {"max_turns", "context"}
            assert s["ended"] in expected and s["finished"] == (s["ended"] == "stop")
            assert s["calls"] == len(observations) + (s["ended"] in ("max_turns", "context"))
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
    line = "task error: observe() must return a list of token ids in [0, 262), not empty, or None, not [999]"
    assert proc.stderr.strip().splitlines()[-1] == line, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert open(tmp_path / "out" / "metrics.jsonl").read() == ""  # no step logged
    assert os.listdir(tmp_path / "out" / "rollouts") == []  # none dumped


# ---- edges a review against verl, TRL and NeMo-RL found (issue 43); each test fails with its fix
# reverted

def test_a_tool_task_gets_turns_by_default():
    """max_turns defaulted to 1, which ended every episode at its first tool call, silently. With
    the default config, an episode whose task keeps observing runs until the context is full
    (max_model_len 16: prompt 1 + (turn 2 + observation 1) x 5)."""
    cfg = config.Config(max_new_tokens=4, max_model_len=16)
    engine = ScriptedEngine(lambda ids: [7, EOS])
    (ids, _, mask, calls, ended), = multiturn.run_episodes(engine, Echo([40]), cfg, [[1]], [(0, 0, 0)], 1.0)
    assert mask == [1, 1, 0] * 4 + [1, 1]  # 5 turns: a 6th would start at 16, max_model_len
    assert (calls, ended) == (5, "context")  # the 5th call's output left no room for a turn
    # a task without observe() is single-turn whatever max_turns says
    engine = ScriptedEngine(lambda ids: [7, EOS])
    multiturn.run_episodes(engine, rollout.ToyTask(0), cfg, [[1]], [(0, 0, 0)], 1.0)
    assert len(engine.calls) == 1


def test_an_empty_observation_is_refused():
    """[] would merge the turns before and after it into one run of 1s (one turn fewer counted)."""
    with pytest.raises(rollout.TaskError, match=r"not empty, or None, not \[\]"):
        multiturn.run_episodes(ScriptedEngine(lambda ids: [7, EOS]), Echo([]), config.Config(), [[1]],
                             [(0, 0, 0)], 1.0)


def test_gspo_is_finite_where_a_logprob_on_an_observation_is_minus_inf():
    """GSPO's token value log s_b + log pi_t - (log pi_t).detach() is -inf - -inf = NaN on an
    observation token whose trainer logprob is -inf; the mask must select it away (NaN * 0 is
    NaN). The loss and its gradient equal those of the same row with the observation cut out."""
    mask = torch.tensor([[0.0, 1, 1, 0, 0, 1, 1]])  # prompt, turn, observation, turn
    old = torch.tensor([[0.0, -1.0, -2.0, 0.0, 0.0, -0.5, -1.5]])
    adv = torch.tensor([[0.0, 0.7, 0.7, 5.0, 5.0, 0.7, 0.7]])
    new = torch.tensor([[0.0, -0.9, -2.2, float("-inf"), -3.0, -0.4, -1.1]], requires_grad=True)
    keep = [1, 2, 5, 6]  # the model's tokens
    cut = new.detach()[:, keep].clone().requires_grad_(True)

    def loss(lp, old_lp, advantages, m):
        per_token, _ = train_ppo.policy_loss(gspo.sequence_log_ratio(lp, old_lp, m), advantages, 0.2)
        return train_ppo.aggregate_loss(per_token, m, mode="seq-mean-token-mean")
    with_gaps, plain = loss(new, old, adv, mask), loss(cut, old[:, keep], adv[:, keep], torch.ones(1, 4))
    with_gaps.backward()
    plain.backward()
    assert torch.isfinite(with_gaps) and torch.isfinite(new.grad).all()
    torch.testing.assert_close(with_gaps, plain)
    torch.testing.assert_close(new.grad[:, keep], cut.grad)
    assert (new.grad[0, [0, 3, 4]] == 0).all()


def test_a_value_of_the_wrong_type_reads_as_english():
    with pytest.raises(config.ConfigError, match=r"max_turns='x' is not of type int: write it like "
                                                 r"--max_turns=1000"):
        config.parse_args(["--max_turns=x"])


@pytest.fixture
def one_rank(monkeypatch):
    """A one-rank gloo process group and its (1, 1, 1) mesh, released after the test."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    mesh = None
    try:
        mesh = model_parallel.make_mesh(1, 1, 1, "cpu")
        yield mesh
    finally:
        torch.distributed.destroy_process_group()
        if mesh is not None:
            model_parallel.release_mesh(mesh)


def test_the_warm_up_trains_on_the_models_tokens_of_a_tool_trace(one_rank, tmp_path, monkeypatch):
    """The SFT warm-up on toy_tool's traces "?<eos>[68]68<eos>" (train_ppo.sft_warmup, one rank,
    a TokenTable policy whose AdamW steps are real): the rows of the call's and the answer's ids
    move, the brackets', which only the tool writes, never do. Trained on the whole trace, the
    model would be taught to predict the tool's output."""
    task = multiturn.ToyToolTask(seed=1)
    policy = TokenTable(torch.full((262, 2), -1.0))
    monkeypatch.setattr(model_parallel, "load_policy", lambda *args: policy)
    monkeypatch.setattr(model_parallel, "forward_policy", table_policy)
    monkeypatch.setattr(model_parallel, "save_hf", lambda *args, **kwargs: None)
    cfg = config.Config(task="toy_tool", sft_steps=2, sft_batch_size=4, sft_lr=0.1, micro_batch_size=4,
                        max_model_len=32, out_dir=str(tmp_path))
    train_ppo.sft_warmup("unused", task, cfg, one_rank)
    moved = set((policy.table[:, 0] != -1.0).nonzero().flatten().tolist())
    answers = [a for _, a in task.prompts(0, 8)]  # the warm-up's 2 x 4 examples
    said = set(task.tok.encode("?" + "".join(answers))) | {task.eos_id}  # the model's tokens
    assert moved == said
    assert not moved & set(task.tok.encode("[]"))


def test_episode_metrics_count_turns_calls_and_endings():
    """Three episodes by hand: two turns around an answered call that ended naturally; a call on
    the last turn (counted, never answered); a response cut off by its budget, out of the loss
    (overlong_mask). Its length is the model's tokens: (4 + 2 + 3) / 3."""
    samples = [dict(action_mask=[1, 1, 0, 0, 1, 1], calls=1, ended="stop"),
               dict(action_mask=[1, 1], calls=1, ended="max_turns"),
               dict(action_mask=[1, 1, 1], loss_mask=[0, 0, 0], calls=0,
                    ended="length")]
    assert rollout.episode_metrics(samples) == pytest.approx(dict(
        response_len_mean=3.0, turns_per_episode=4 / 3, tool_calls_per_episode=2 / 3,
        ended_stop_rate=1 / 3, ended_length_rate=1 / 3, ended_max_turns_rate=1 / 3,
        ended_context_rate=0.0))


def test_a_prompt_that_leaves_no_room_is_one_clear_error():
    """max_model_len=6 and a 6-token prompt: no token of room. The engine (as vLLM: "max_tokens
    must be at least 1") is never asked for one."""
    class Strict(ScriptedEngine):
        def generate(self, prompt_ids, seeds, budgets, temperature):
            assert min(budgets) >= 1, f"a budget of {min(budgets)} tokens reached the engine"
            return super().generate(prompt_ids, seeds, budgets, temperature)
    task = multiturn.ToyToolTask(seed=1)
    prompt = task.encode("23+45=")
    with pytest.raises(rollout.TaskError, match="a prompt of 6 tokens leaves no room for a response within "
                                                "max_model_len=6: raise max_model_len"):
        multiturn.run_episodes(Strict(lambda ids: [7, EOS]), task, cfg_of(max_model_len=6), [prompt],
                             [(0, 0, 0)], 1.0)
    (ids, *_), = multiturn.run_episodes(Strict(lambda ids: [7, EOS]), task, cfg_of(max_model_len=7), [prompt],
                                      [(0, 0, 0)], 1.0)
    assert ids == [7]  # one token of room: cut off


def test_a_bad_observation_in_validation_stops_every_rank_with_one_line(one_rank):
    task = Echo([999])
    task.val, task.encode = [("1+1=", "2")], lambda q: [1]
    with pytest.raises(SystemExit, match=r"^task error: observe\(\) must return a list of token ids in"):
        evaluation.validation(ScriptedEngine(lambda ids: [7, EOS]), task, cfg_of())


def test_the_tool_is_taken_away_with_max_turns_1_from_the_warm_up_too(tmp_path):
    """max_turns=1: toy_tool's warm-up teaches the direct answer, so that the one-turn run is a
    model taught to answer, not one taught to call a tool that never answers."""
    for turns, tool in ((1, False), (2, True), (1000, True)):
        task = rollout.make_task(config.Config(task="toy_tool", max_turns=turns), str(tmp_path))
        assert task.tool is tool
        assert isinstance(task.target("68"), tuple) is tool  # (ids, mask) with the tool


def test_dr_grpos_constant_is_the_episodes_longest_response(one_rank, tmp_path, monkeypatch):
    """seq-mean-token-sum-norm divides token sums by a constant. A multi-turn episode can hold
    up to max_model_len response tokens, not one turn's max_new_tokens (verl: its response
    length): start_run sets it so for a task with turns, and config.json records it."""
    monkeypatch.setattr(model_parallel, "setup",
                        lambda cfg: (torch.device("cpu"), one_rank, str(tmp_path), "masked"))
    for task, turns, norm in (("toy_tool", 1000, 32), ("toy_tool", 1, 0), ("toy_add", 1000, 0)):
        cfg = config.Config(task=task, max_turns=turns, max_model_len=32, max_new_tokens=4,
                            out_dir=str(tmp_path / f"{task}{turns}"))
        train_ppo.start_run(cfg, None)
        assert cfg.loss_agg_norm == norm, (task, turns)
        assert json.load(open(tmp_path / f"{task}{turns}" / "config.json"))["loss_agg_norm"] == norm


def _write_dump(path, samples):
    with open(path, "w") as f:
        f.writelines(json.dumps(s) + "\n" for s in samples)


def test_a_dump_the_trainer_cannot_train_on_is_refused_in_one_line(one_rank, tmp_path):
    """Replaying a dump of an older version (no action_mask) gave a KeyError traceback; a dump whose
    last token is an observation would silently lose its score."""
    good = dict(index=0, prompt_ids=[1], response_ids=[7, EOS], engine_logprobs=[-1.0, -1.0],
                action_mask=[1, 1], calls=0, ended="stop", task_score=1.0, reward=1.0)
    cfg = config.Config(replay_rollouts=str(tmp_path))
    replayed = dict(rollout_samples=0, rollout_prompts=cfg.prompts_per_step)  # none generated
    # a dump written before rule_reward and loss_mask had keys of their own: the task's score (with
    # no overlong penalty), and the model's tokens
    read = dict(good, rule_reward=1.0, loss_mask=[1, 1])
    _write_dump(tmp_path / "step_0.jsonl", [good])
    assert rollout.rollouts(None, None, cfg, 0, 0) == ({0: read}, cfg.prompts_per_step, replayed)
    # a dump written before task_score had a key of its own: its reward is the task's score
    _write_dump(tmp_path / "step_0.jsonl", [{k: v for k, v in good.items() if k != "task_score"}])
    assert rollout.rollouts(None, None, cfg, 0, 0) == ({0: read}, cfg.prompts_per_step, replayed)
    old = {k: v for k, v in good.items() if k not in ("action_mask", "calls", "ended")}
    _write_dump(tmp_path / "step_0.jsonl", [good, old])
    with pytest.raises(SystemExit, match=rf"^replay error: {tmp_path}/step_0.jsonl:2: the sample has no "
                                         "action_mask, calls, ended: a dump of an older version"):
        rollout.rollouts(None, None, cfg, 0, 0)
    _write_dump(tmp_path / "step_0.jsonl", [dict(good, response_ids=[7, 40], action_mask=[1, 0])])
    with pytest.raises(SystemExit, match=r"step_0.jsonl:1: the response's last token is not the model's"):
        rollout.rollouts(None, None, cfg, 0, 0)
    with pytest.raises(SystemExit, match=r"step_1.jsonl is missing"):
        rollout.rollouts(None, None, cfg, 1, 0)
