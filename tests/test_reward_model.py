"""A learned reward model (issue 30): a *ForSequenceClassification checkpoint, sharded on the
training mesh as the policy is, scored at each sequence's last token; a critic started from it;
and the trainer's run against it, with the task's rule logged beside it.

Every score is checked against the plain single-process HF model: `model(input_ids).logits` of
each sequence alone (no padding, no packing), which is HF's own read of the last token."""
import json
import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

import config
import model_parallel as mp
import rollout
import train_ppo
from _dist import run_ranks
from conftest import paired, toy_batch

SEED = 7
LENS = [14, 9, 12, 5]  # rows of the toy batch: their last tokens sit at different positions
FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-qwen3"]
MESHES = {1: [(1, 1, 1)], 2: [(2, 1, 1), (1, 1, 2), (1, 2, 1)], 4: [(2, 1, 2), (1, 2, 2)]}


def tiny_reward_model(root, preset):
    """A random-init `*ForSequenceClassification` with one label, saved as an HF dir. Its score
    head is scaled up from HF's std 0.02 init, so that scores differ visibly between sequences."""
    path = os.path.join(root, preset + "-rm")
    if not os.path.isfile(os.path.join(path, "config.json")):
        fields = dict(mp.TINY_PRESETS[preset])
        model_type = fields.pop("model_type")
        with torch.random.fork_rng():
            torch.manual_seed(SEED)
            model = AutoModelForSequenceClassification.from_config(
                AutoConfig.for_model(model_type, num_labels=1, **fields), dtype=torch.float32)
            with torch.no_grad():
                model.score.weight.mul_(20.0)
        model.save_pretrained(path + ".tmp")
        os.replace(path + ".tmp", path)
    return path


def hf_scores(path, ids, lens):
    """(B,) HF's logits of each sequence alone: the score at its last token."""
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.stack([model(input_ids=ids[b:b + 1, :n]).logits[0, 0] for b, n in enumerate(lens)])


def hf_per_position(path, ids):
    """(B, S) the score head on every position's hidden state (unshifted)."""
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model.score(model.model(input_ids=ids).last_hidden_state)[..., 0]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("rm"))
    for preset in FAMILIES:
        tiny_reward_model(root, preset)
    return root


def _gathered_once_a_pass(world_size, root):
    """The reward model lives in host memory between its passes (FSDP2's CPU offload). A pass of 4
    microbatches all-gathers (copies from host onto the GPU) each unit once, as a pass of one
    microbatch does: not once a microbatch. Its scores are HF's."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group
    gathered = []  # the parameters of each FSDP all-gather (under offload: each a host -> GPU copy)
    all_gather = _fsdp_param_group.foreach_all_gather

    def recording(fsdp_params, *args, **kwargs):
        gathered.append(len(fsdp_params))
        return all_gather(fsdp_params, *args, **kwargs)
    _fsdp_param_group.foreach_all_gather = recording
    mesh = mp.make_mesh(world_size, 1, 1, "cpu")
    cfg = config.Config(micro_batch_size=1, dtype="fp32", attention="masked")  # a microbatch a row
    reward_model = mp.load_reward_model(os.path.join(root, "tiny-llama-rm"), mesh, cfg)
    ids, _, _ = toy_batch(LENS, prompt_len=3)
    rows = [row[:n].tolist() for row, n in zip(ids, LENS)]
    passes = {}
    for n_rows in (1, len(LENS)):
        batch = train_ppo.make_batch([r[:3] for r in rows[:n_rows]], [r[3:] for r in rows[:n_rows]], 0)
        gathered.clear()
        with torch.no_grad():
            outputs, = train_ppo.forward_batch(mp.forward_reward_model, reward_model, batch, cfg, mesh)
        mp.reshard(reward_model)  # as train_ppo.reward_model_scores does after the pass
        passes[n_rows] = list(gathered)
        last = torch.tensor(LENS[:n_rows]) - 1
        expected = hf_scores(os.path.join(root, "tiny-llama-rm"), ids[:n_rows], LENS[:n_rows])
        torch.testing.assert_close(outputs[torch.arange(n_rows), last], expected, atol=1e-5, rtol=1e-5)
    # every unit gathered once for the pass, however many microbatches it has
    assert passes[1] and passes[len(LENS)] == passes[1], passes
    mp.release_mesh(mesh)
    _fsdp_param_group.foreach_all_gather = all_gather


def _mesh_body(rank, world_size, root):
    ids, _, _ = toy_batch(LENS, prompt_len=3)
    last = torch.tensor(LENS) - 1
    for preset in FAMILIES:
        path = os.path.join(root, preset + "-rm")
        expected = hf_scores(path, ids, LENS)
        for dp, cp, tp in MESHES[world_size]:
            mesh = mp.make_mesh(world_size, tp, cp, "cpu")
            for packing in (False, True):
                cfg = config.Config(tp_size=tp, cp_size=cp, packing=packing, max_tokens_per_microbatch=48,
                                    dtype="fp32", attention="masked")
                reward_model = mp.load_reward_model(path, mesh, cfg)
                assert not any(p.requires_grad for p in reward_model.parameters())  # frozen
                with torch.no_grad():
                    out = mp.forward_reward_model(reward_model, ids, LENS, mesh, cfg)  # (B, S)
                scores = out[torch.arange(len(LENS)), last]  # (B,)
                torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"{preset} {(dp, cp, tp)} packing={packing}: {m}")
            mp.release_mesh(mesh)
    if world_size == 2:  # dp=2: FSDP2 shards it
        _gathered_once_a_pass(world_size, root)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_reward_model_scores_equal_hf_on_every_mesh(root, world_size):
    """Llama, Qwen2 and Qwen3 reward models at (1,1,1), (2,1,1), (1,1,2), (1,2,1), (2,1,2), (1,2,2),
    padded and packed: the score at each row's last token is HF's logits to 1e-5. At dp=2, a pass
    of 4 microbatches gathers each FSDP unit once (_gathered_once_a_pass)."""
    run_ranks(_mesh_body, world_size, root)


def _critic_body(rank, world_size, root):
    path = os.path.join(root, "tiny-qwen2-rm")
    ids, _, _ = toy_batch(LENS, prompt_len=3)
    mesh = mp.make_mesh(world_size, 1, 1, "cpu")
    critic = mp.load_critic(path, mesh, config.Config(seed=SEED))
    head = {n.split(".")[-1]: p.full_tensor() for n, p in critic.named_parameters() if "lm_head" in n}
    rm = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    torch.testing.assert_close(head["weight"], rm.score.weight.detach(), atol=0, rtol=0)
    assert torch.equal(head["bias"], torch.zeros(1))  # HF's score heads have no bias
    with torch.no_grad():
        values = mp.forward_critic(critic, ids, LENS, mesh, config.Config())  # (B, S)
    per_position = hf_per_position(path, ids)  # (B, S)
    for b, n in enumerate(LENS):
        # V at position i is the reward model's output at i - 1: shifted one place right
        torch.testing.assert_close(values[b, 1:n], per_position[b, :n - 1], atol=1e-5, rtol=1e-5)
        assert values[b, 0] == 0


def test_critic_from_a_reward_model_starts_as_it(root):
    """critic_model=RM_DIR: the value head is the reward model's score head, and at step 0 the
    values are the reward model's per-position outputs shifted one place right (FSDP2, dp2)."""
    run_ranks(_critic_body, 2, root)


def _rlhf_run_body(rank, world_size, out_dir, reward_model):
    rollout.HFEngine.shutdown = lambda self: None  # keep the process group: the spawn helper ends it
    cfg = config.Config(out_dir=out_dir, model="tiny-llama", reward_model=reward_model,
                        critic_model=reward_model, critic_warmup_steps=1, steps=2, prompts_per_step=2,
                        samples_per_prompt=4, max_new_tokens=4, micro_batch_size=2, rollout_engine="hf",
                        export_hf=False, plot_every=0)
    config.validate(cfg, world_size)
    train_ppo.main(cfg)


def _rlhf_replay_body(rank, world_size, out_dir, reward_model, rollouts):
    rollout.HFEngine.shutdown = lambda self: None
    cfg = config.Config(out_dir=out_dir, model="tiny-llama", reward_model=reward_model,
                        critic_model=reward_model, critic_warmup_steps=1, steps=2, prompts_per_step=2,
                        samples_per_prompt=4, max_new_tokens=4, micro_batch_size=2, replay_rollouts=rollouts,
                        export_hf=False, plot_every=0)
    config.validate(cfg, world_size)
    train_ppo.main(cfg)


def test_ppo_against_a_reward_model_logs_the_rule_beside_it(root, tmp_path):
    """Two steps against a reward model, the critic started from it, the first step the critic's
    alone: the reward is the reward model's score (not the rule's 0/1), task_score the rule's, the
    dumps keep both, and no policy loss is logged in the warm-up step."""
    path = os.path.join(root, "tiny-llama-rm")
    run_ranks(_rlhf_run_body, 2, str(tmp_path), path)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert "policy_loss" not in rows[0] and "value_loss" in rows[0]  # the critic's warm-up
    assert "policy_loss" in rows[1]
    for step, row in enumerate(rows):  # the metric is the mean of the dumped rule scores
        with open(tmp_path / "rollouts" / f"step_{step}.jsonl") as f:
            dumped = [json.loads(line)["task_score"] for line in f]
        assert row["task_score"] == pytest.approx(sum(dumped) / len(dumped))
    with open(tmp_path / "rollouts" / "step_0.jsonl") as f:
        samples = [json.loads(line) for line in f]
    ids = [s["prompt_ids"] + s["response_ids"] for s in samples]
    lens = [len(x) for x in ids]
    padded = torch.tensor([x + [257] * (max(lens) - len(x)) for x in ids])
    expected = hf_scores(path, padded, lens)
    torch.testing.assert_close(torch.tensor([s["reward"] for s in samples]), expected, atol=1e-4, rtol=1e-4)
    task = rollout.ToyTask(1)
    for s in samples:  # the rule, recomputed from the text
        assert s["task_score"] == task.reward(s["response"], s["answer"], s["ended"])
    assert rows[0]["reward_mean"] == pytest.approx(expected.mean().item(), abs=1e-4)
    # a replay of those dumps (at dp=1): the rule read back from task_score, the reward model's
    # scores computed again; the numbers of the generating run
    replay = tmp_path / "replay"
    run_ranks(_rlhf_replay_body, 1, str(replay), path, str(tmp_path / "rollouts"))
    replayed = [json.loads(line) for line in open(replay / "metrics.jsonl")]
    for a, b in paired(rows, replayed, 2):
        assert b["task_score"] == pytest.approx(a["task_score"]) and b["reward_mean"] == pytest.approx(
            a["reward_mean"], abs=1e-5)


def test_toy_pairs_cover_every_failure_and_train_a_reward_model(tmp_path):
    """scripts/train_reward_model.py: the toy pairs' rejected responses are each a failure the rule
    scores 0 (every chosen one scores 1); 40 Bradley-Terry steps from a tiny preset write a
    sequence-classification dir that the trainer accepts as a reward model, and print RESULT."""
    import subprocess
    import sys
    from conftest import ROOT
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import train_reward_model
    task = rollout.ToyTask(1)
    rows = train_reward_model.toy_pairs(400, seed=0)
    eos = rollout.EOS
    for row in rows:
        # the answer from the prompt "a+b=", not from the chosen response (which would check it
        # against itself)
        a, b = row["prompt"][:-1].split("+")
        answer = str(int(a) + int(b))
        assert row["chosen"] == answer + eos, row
        for text, score in ((row["chosen"], 1.0), (row["rejected"], 0.0)):
            ended = "stop" if text.endswith(eos) else "length"
            assert task.reward(text.removesuffix(eos), answer, ended) == score, row
    rejected = [row["rejected"] for row in rows]
    assert eos in rejected  # the empty response
    assert any(not r.endswith(eos) for r in rejected)  # cut off
    init = mp.materialize_tiny_model("tiny-llama", str(tmp_path), seed=0)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    proc = subprocess.run([sys.executable, "scripts/train_reward_model.py", "train", "--init", init,
                           "--pairs", str(pairs), "--out", str(tmp_path / "rm"), "--steps", "40"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = dict(pair.split("=") for pair in proc.stdout.strip().splitlines()[-1].split()[1:])
    # 40 steps learn something: better than chance on held-out pairs, below the untrained loss
    # log 2 = 0.693 of a model that scores both answers alike
    assert float(result["pairwise_accuracy"]) > 0.6 and float(result["loss"]) < 0.69, result
    assert mp.score_head(str(tmp_path / "rm")).shape == (1, 256)
    mp.check_hf_dir(str(tmp_path / "rm"), tp_size=1)
