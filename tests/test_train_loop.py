"""The trainer's loop (train_ppo.main) run in-process on spawned gloo ranks: GRPO without a
critic and its advantages by hand (plus the spawn helper's closing barrier, which that check
once lost a race without); a fork's extra loss term trained and logged, with GRPO and no KL
term; the metrics, console line, plot and summary of such a run against hand-computed means;
the generation shares of generated_by by hand; and small defects a GPU review found
that a CPU can test (log-ratio clamp, GSM8K reward needs EOS, gpu_step's FLOP count), plus the
README's recipe. The engine-call order of a GPU run is in tests/test_gpu_paths.py."""
import contextlib
import dataclasses
import io
import json
import math
import os
import subprocess
import sys
import time
from collections import Counter

import pytest
import torch

import config
import model_parallel
import rollout
import train_ppo
from _dist import run_ranks
from conftest import ROOT, cpu_env, paired, python_block, torchrun_cmd
from extensions import optimizer_offload


def _grpo_body(rank, world_size):
    """2 prompts x 4 samples, 2 minibatches, dp=2: rank 0 holds samples 0,1,4,5 and rank 1
    holds 2,3,6,7, so each prompt's group of 4 is split across the two ranks; global_scores
    gathers every score by its global index."""
    cfg = config.Config(prompts_per_step=2, samples_per_prompt=4, num_minibatches=2,
                        advantage_estimator="grpo")
    mesh = model_parallel.make_mesh(world_size, 1, 1, "cpu")
    scores = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]  # global, prompt-major
    # by hand: group 0 has mean 1/4 and unbiased std sqrt((.75^2 + 3 * .25^2) / 3) = 1/2, so
    # (1 - .25) / (.5 + eps) and (0 - .25) / (.5 + eps); group 1: mean 3/4, std 1/2 (eps = 1e-4)
    by_hand = [d / (0.5 + 1e-4) for d in (0.75, -0.25, -0.25, -0.25, 0.25, 0.25, -0.75, 0.25)]
    mine = [[0, 1, 4, 5], [2, 3, 6, 7]][rank]
    batch = train_ppo.make_batch([[1, 2]] * 4, [[3, 4, 5]] * 4, pad_id=0)
    batch.old_lp = batch.ref_lp = batch.engine_lp
    batch.index = mine
    batch.reward = torch.tensor([scores[j] for j in mine])
    every_score = train_ppo.global_rewards(batch, len(scores), mesh)  # the other rank's rows' scores too
    assert every_score.tolist() == scores
    advantages, returns = train_ppo.compute_advantages(batch, every_score, cfg, mesh)
    batch = dataclasses.replace(batch, advantages=advantages, returns=returns)
    for row, j in enumerate(mine):  # the same advantage on every response token, 0 elsewhere
        expected = torch.tensor([0.0, 0.0] + [by_hand[j]] * 3)
        torch.testing.assert_close(batch.advantages[row], expected, atol=1e-6, rtol=0)


def test_grpo_advantages_by_hand_with_groups_split_across_dp_ranks():
    run_ranks(_grpo_body, 2)


def _late_mesh_body(rank, world_size):
    """Rank 0 builds its mesh and returns; rank 1 builds its own 2 s later. Every group is built
    through the store that rank 0 hosts, and nothing here is a collective: the race the check
    above lost once in CI (rank 1: "Connection reset by peer"), made certain."""
    if rank == 1:
        time.sleep(2)
    model_parallel.make_mesh(world_size, 1, 1, "cpu")


def test_a_rank_that_ends_first_waits_for_the_others():
    run_ranks(_late_mesh_body, 2)  # tests/_dist.py's barrier after the body keeps rank 0 alive


def _grpo_run_body(rank, world_size, out_dir):
    def no_critic(*args):
        raise AssertionError("GRPO must not build a critic")
    model_parallel.load_critic = no_critic
    rollout.HFEngine.shutdown = lambda self: None  # keep the process group: the spawn helper ends it
    cfg = config.Config(out_dir=out_dir, advantage_estimator="grpo", steps=2, prompts_per_step=2,
                        samples_per_prompt=4, num_minibatches=2, max_new_tokens=4, micro_batch_size=2,
                        rollout_engine="hf", save_every=2, export_hf=False, plot_every=0)
    config.validate(cfg, world_size)
    train_ppo.main(cfg)


def test_grpo_runs_without_a_critic(tmp_path):
    run_ranks(_grpo_run_body, 2, str(tmp_path))
    with open(tmp_path / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 2 and all("kl_loss" in r and "value_loss" not in r for r in rows)
    saved = torch.distributed.checkpoint.FileSystemReader(str(tmp_path / "ckpt" / "step_2")).read_metadata()
    keys = list(saved.state_dict_metadata)
    assert any(k.startswith("policy.") for k in keys) and not any(k.startswith("critic") for k in keys)


def _fork_term_body(rank, world_size, out_dir):
    rollout.HFEngine.shutdown = lambda self: None  # keep the process group: the spawn helper ends it
    base = train_ppo.policy_loss_terms
    grads, values = [], []

    def with_ratio_penalty(lp, entropy, batch, idx, aggregate, cfg):  # policy_loss_terms' example
        terms, clipped = base(lp, entropy, batch, idx, aggregate, cfg)
        drift = (lp - batch.old_lp[idx]) ** 2  # (rows, S)
        penalty = 0.1 * aggregate(drift, batch.mask[idx])
        penalty.register_hook(grads.append)  # runs in the backward only if the loss holds the term
        values.append(float(penalty.detach()))
        terms["ratio_penalty"] = penalty
        return terms, clipped

    train_ppo.policy_loss_terms = with_ratio_penalty
    cfg = config.Config(out_dir=out_dir, advantage_estimator="grpo", kl_coef=0.0, lr=1e-3, steps=2,
                        entropy_coef=0.1, prompts_per_step=2, samples_per_prompt=4, num_minibatches=2,
                        ppo_epochs=2, max_new_tokens=4, micro_batch_size=4, rollout_engine="hf",
                        export_hf=False, plot_every=1)
    config.validate(cfg, world_size)
    console = io.StringIO()
    with contextlib.redirect_stdout(console):
        train_ppo.main(cfg)

    # one microbatch per minibatch: 2 epochs x 2 minibatches = 4 optimizer steps a PPO step, each
    # with the term in its loss at weight 1
    assert len(values) == 2 * 4 and [float(g) for g in grads] == [1.0] * 8
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    for row, mine in paired(rows, (values[:4], values[4:]), 2):
        assert not {"kl_loss", "value_loss", "critic_grad_norm"} & set(row), row
        assert row["ratio_penalty"] == pytest.approx(sum(mine) / 4, rel=1e-6, abs=1e-12)
    # each PPO step's first optimizer step starts at pi_old (no drift); the entropy bonus moves the
    # policy even where GRPO's advantages are 0, so the later ones have some
    assert values[0] < 1e-9 and values[4] < 1e-9 and min(values[1:4] + values[5:]) > 0, values
    lines = console.getvalue().splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 2, lines
    assert all("| policy_loss " in line and "| ratio_penalty " in line for line in steps), lines
    assert not any("kl_loss" in line for line in lines) and lines[-1].startswith("done: 2 steps in ")
    assert os.path.getsize(os.path.join(out_dir, "curves.png")) > 1000


def test_a_forks_loss_term_is_trained_and_logged_with_grpo_and_no_kl_term(tmp_path):
    """policy_loss_terms wrapped as its docstring shows: the new term is in every backward and in
    metrics.jsonl (the mean of what the wrapper returned over each step's optimizer steps), the
    console and the plot; kl_coef=0 leaves GRPO with no kl_loss, and nothing expects one."""
    run_ranks(_fork_term_body, 1, str(tmp_path))


def test_step_metrics_console_plot_and_summary_follow_the_loss_terms(tmp_path, monkeypatch, capsys):
    """GRPO with kl_coef=0: no kl_loss, no critic; an entropy bonus and a made-up "ratio_penalty"
    instead. One rank (dp_sum is the identity), 2 epochs x 2 minibatches = 4 optimizer steps, the
    third skipped. Every number by hand."""
    import matplotlib.figure
    monkeypatch.setattr(train_ppo, "dp_sum", lambda tensor, mesh: tensor)
    monkeypatch.setattr(train_ppo.dist, "get_rank", lambda: 0)  # no process group here
    cfg = config.Config(out_dir=str(tmp_path), advantage_estimator="grpo", kl_coef=0.0,
                        entropy_coef=0.01, ppo_epochs=2, num_minibatches=2, steps=2, plot_every=1,
                        export_hf=False)
    # 4 sequences of 10 prompt + 5 response tokens, rewards 1, 1, 1, 0; KL 0.01 a token (k1), the
    # engine's logprobs those of pi_old
    batch = train_ppo.make_batch([[1] * 10] * 4, [[2] * 5] * 4, pad_id=257)
    batch = dataclasses.replace(batch, reward=torch.tensor([1.0, 1.0, 1.0, 0.0]), old_lp=batch.engine_lp,
                                ref_lp=batch.engine_lp - 0.01 * batch.mask,
                                task_score=torch.tensor([1.0, 1.0, 1.0, 0.0]))
    # the update's sums over its 4 optimizer steps (the third skipped): policy_loss 0.1, -0.3, 0.2,
    # 0.4; entropy_loss -0.004, -0.002, -0.002, -0.004; ratio_penalty 0.01, 0.02, 0.03, 0.06; grad
    # norms 1, 2, 3, 6; 8 clipped tokens
    losses = Counter(policy_loss=0.4, entropy_loss=-0.012, ratio_penalty=0.12)
    norms = Counter(grad_norm=12.0, skipped_updates=1)
    sums = train_ppo.UpdateSums(losses, Counter(clipped_tokens=8), norms)
    named = train_ppo.step_metrics(batch, sums, cfg, mesh=None)
    # beside them in ppo_step: rollout.episode_metrics' length (by hand in test_multiturn.py)
    metrics = {"step": 0, **named, "response_len_mean": 5.0, "time_step_s": 2.0}
    # means over the 4 optimizer steps, skipped one included; clip_frac over 2 epochs of 20 tokens
    by_hand = dict(step=0, reward_mean=0.75, reward_std=math.sqrt(0.75 - 0.75 ** 2), kl=0.01,
                   response_len_mean=5.0, logprob_mismatch=0.0, token_mult_prob_error=1.0,
                   mismatch_k1=0.0, mismatch_k3=0.0, task_score=0.75, clip_frac=0.2,
                   skipped_updates=1, policy_loss=0.1, entropy_loss=-0.003, ratio_penalty=0.03,
                   grad_norm=3.0, time_step_s=2.0, tokens=60)
    assert metrics == pytest.approx(by_hand)  # the same keys, and these values

    titles = []
    savefig = matplotlib.figure.Figure.savefig

    def recording_savefig(fig, *args, **kwargs):
        titles.append([ax.get_title() for ax in fig.axes if ax.axison])
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", recording_savefig)
    for step in (0, 1):
        train_ppo.log_step(dict(metrics, step=step), list(losses), cfg, time.time(), 0, None)
    first, second = capsys.readouterr().out.splitlines()
    fields = first.split(" | ")
    assert fields[:7] == ["step 1/2", "reward 0.750", "kl 0.0100", "policy_loss +0.1000",
                          "entropy_loss -0.0030", "ratio_penalty +0.0300", "len 5.0"], first
    assert fields[7] == "2.0s/step" and fields[8].startswith("elapsed ") and fields[9].startswith("eta ")
    assert len(fields) == 10, first
    assert second.startswith("step 2/2 | ")
    # 5 panels (a 3 x 2 grid, the sixth turned off), redrawn after each step (plot_every=1)
    assert titles == [["reward_mean", "kl", "policy_loss", "entropy_loss", "ratio_penalty"]] * 2
    assert os.path.getsize(tmp_path / "curves.png") > 1000
    assert [json.loads(line) for line in open(tmp_path / "metrics.jsonl")] == [metrics, dict(metrics, step=1)]
    (tmp_path / "rollouts").mkdir()
    last = train_ppo.summary(cfg, 90.0)  # what out_dir holds, directories marked
    assert last == ("done: 2 steps in 1.5 min | reward 0.750 (first 5 steps) -> 0.750 (last 5) | "
                    f"in {tmp_path}: curves.png, metrics.jsonl, rollouts/")


def test_generation_shares_by_hand():
    """generated_by's rule by hand: the step's samples in equal contiguous shares over every rank,
    whatever the mesh (the update's split comes later, from the lengths). 16 samples over 8 ranks:
    two each, in order; 3 samples over 4 ranks: rank 0 draws none, each sample is drawn once."""
    cfg = config.Config(prompts_per_step=8, samples_per_prompt=2, num_minibatches=2)
    by_hand = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert [rollout.generated_by(cfg.global_batch_size, rank, 8) for rank in range(8)] == by_hand
    cfg = config.Config(prompts_per_step=3, samples_per_prompt=1, num_minibatches=1)
    assert [rollout.generated_by(cfg.global_batch_size, rank, 4) for rank in range(4)] == [[], [0], [1], [2]]


def _old_logprobs_body(rank, world_size, out_dir):
    rollout.HFEngine.shutdown = lambda self: None  # keep the process group for the second run
    # the engine run under DDP: its policy's first forward is then the reference pass, so DDP is
    # built inside the weight swap; and FSDP2 and DDP must train alike
    for source, data_parallel in (("trainer", "fsdp"), ("engine", "ddp")):
        cfg = config.Config(out_dir=os.path.join(out_dir, source), old_logprobs=source,
                            data_parallel=data_parallel, steps=2, prompts_per_step=2, samples_per_prompt=4,
                            num_minibatches=2, ppo_epochs=2, max_new_tokens=4, micro_batch_size=2,
                            rollout_engine="hf", export_hf=False, plot_every=0)
        config.validate(cfg, world_size)
        train_ppo.main(cfg)


def test_engine_logprobs_as_old_policy_train_the_same_in_fp32(tmp_path):
    """old_logprobs=engine skips the old-policy pass; with the HF engine in fp32 the engine's
    logprobs are the trainer's up to float rounding, so both runs must train the same: every
    loss, KL and grad norm of 2 steps x 2 epochs (the second epoch's ratio is not 1) to 1e-4.
    The trainer run is FSDP2, the engine run DDP (built inside the reference swap)."""
    run_ranks(_old_logprobs_body, 2, str(tmp_path))
    trainer, engine = ([json.loads(line) for line in open(tmp_path / source / "metrics.jsonl")]
                       for source in ("trainer", "engine"))
    for a, b in paired(trainer, engine, 2):
        assert "entropy" in a and "entropy" not in b and b["logprob_mismatch"] == 0.0
        assert a["logprob_mismatch"] < 1e-5  # what makes the engine's logprobs usable here
        for key in ("reward_mean", "kl", "policy_loss", "value_loss", "grad_norm", "critic_grad_norm",
                    "clip_frac"):
            assert abs(a[key] - b[key]) <= 1e-4 * max(abs(a[key]), 1e-2), (key, a[key], b[key])


def _offload_body(rank, world_size, out_dir):
    rollout.HFEngine.shutdown = lambda self: None  # keep the process group for the second run
    for offloaded in (False, True):
        cfg = config.Config(out_dir=os.path.join(out_dir, str(offloaded)), offload_optimizer=offloaded,
                            steps=3,
                            prompts_per_step=2, samples_per_prompt=4, num_minibatches=2, ppo_epochs=2,
                            lr=1e-4, max_new_tokens=4, micro_batch_size=2, rollout_engine="hf",
                            export_hf=False, plot_every=0, save_every=3)
        config.validate(cfg, world_size)
        train_ppo.main(cfg)
    # issue 28: the offloaded run resumed for a 4th step. AdamW's moments, which loading creates on
    # the trainer's device, must go to host memory before the engine starts (on a GPU, vLLM takes
    # the room they would hold): the calls in order, recorded
    calls = []
    move, make_engine = optimizer_offload.move_optimizer_state, rollout.make_engine

    def recording_move(optimizer, device):
        """Where the moments are after the move: "host" if each moment is one flat host buffer,
        the device's name if every state has a tensor of its own (on CPU both are host memory)."""
        move(optimizer, device)
        states = [s for s in optimizer.state.values() if "exp_avg" in s]
        where = set()
        for key in ("exp_avg", "exp_avg_sq"):
            storages = {s[key].to_local().untyped_storage().data_ptr() for s in states}
            where.add({1: "host", len(states): str(device)}.get(len(storages), f"{len(storages)} storages"))
        calls.append(" and ".join(sorted(where)))
    optimizer_offload.move_optimizer_state = recording_move
    rollout.make_engine = lambda *args: (calls.append("engine"), make_engine(*args))[1]
    cfg.steps, cfg.resume = 4, "auto"
    train_ppo.main(cfg)
    if rank == 0:
        with open(os.path.join(out_dir, "resume_calls.json"), "w") as f:
            json.dump(calls, f)


def test_optimizer_state_moved_out_and_back_trains_the_same(tmp_path):
    """offload_optimizer=true (AdamW's sharded states to host memory between updates, back before
    each): on CPU the moves are copies that rebuild each DTensor state from its local shard, so
    3 steps x 2 epochs x 2 minibatches must train exactly as without them (FSDP2, dp=2)."""
    run_ranks(_offload_body, 2, str(tmp_path))
    plain, offloaded = ([json.loads(line) for line in open(tmp_path / str(flag) / "metrics.jsonl")]
                        for flag in (False, True))
    assert len(offloaded) == 4  # the 4th step is the resumed run's, appended below
    for a, b in paired(plain, offloaded[:3], 3):
        for key in ("reward_mean", "kl", "policy_loss", "value_loss", "grad_norm", "critic_grad_norm"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    assert plain[-1]["step"] == 2 and plain[-1]["kl"] != 0.0  # three steps, and the policy moved
    with open(tmp_path / "resume_calls.json") as f:
        calls = json.load(f)
    # policy's and critic's moments out at load, then the engine; then the update's in and out,
    # each where it was sent: one flat host buffer a moment, or back on the trainer's device
    assert calls == ["host", "host", "engine", "cpu", "cpu", "host", "host"], calls


def _warmup_checkpoint_body(rank, world_size, out_dir):
    rollout.HFEngine.shutdown = lambda self: None  # keep the process group for the next run
    saves, real_save = [], train_ppo.dcp.save

    def recording_save(state, **kwargs):  # which states each checkpoint holds
        saves.append(sorted(state))
        return real_save(state, **kwargs)
    train_ppo.dcp.save = recording_save
    for save_every in (0, 1):
        cfg = config.Config(out_dir=os.path.join(out_dir, str(save_every)), critic_warmup_steps=2,
                            steps=3, save_every=save_every, prompts_per_step=2, samples_per_prompt=4,
                            num_minibatches=2, lr=1e-4, max_new_tokens=4, micro_batch_size=2,
                            rollout_engine="hf", export_hf=False, plot_every=0)
        config.validate(cfg, world_size)
        train_ppo.main(cfg)
    # the saving run, resumed from its warm-up checkpoint (step 2 of 3: the policy not yet stepped)
    cfg.resume = os.path.join(out_dir, "1", "ckpt", "step_2")
    cfg.out_dir = os.path.join(out_dir, "resumed")
    train_ppo.main(cfg)
    if rank == 0:
        with open(os.path.join(out_dir, "saves.json"), "w") as f:
            json.dump(saves, f)


def test_a_checkpoint_in_the_critics_warm_up_changes_no_number(tmp_path):
    """critic_warmup_steps=2: the policy's AdamW has not stepped when a checkpoint is saved, and
    saving gives it a state (torch's get_state_dict runs a step at lr 0). A run that saves every
    step, and one resumed from its warm-up checkpoint, train exactly as a run that never saved;
    the first policy update is step 2's."""
    run_ranks(_warmup_checkpoint_body, 2, str(tmp_path))
    never, saving, resumed = ([json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
                              for name in ("0", "1", "resumed"))
    assert [("policy_loss" in r) for r in never] == [False, False, True]
    assert [r["step"] for r in resumed] == [2]  # its own out_dir: the one step it ran
    # issue 34: no warm-up checkpoint asks for the policy's AdamW state (which would create it,
    # on the GPU, with vLLM awake); the saving run's steps 1, 2, 3, then the resumed run's step 3
    with open(tmp_path / "saves.json") as f:
        saves = json.load(f)
    warm_up, trained = ["critic", "critic_optimizer", "policy"], ["critic", "critic_optimizer", "policy",
                                                                  "policy_optimizer"]
    assert saves == [warm_up, warm_up, trained, trained], saves
    for key in ("policy_loss", "grad_norm", "value_loss", "kl"):
        assert saving[2][key] == never[2][key], (key, saving[2][key], never[2][key])
        assert resumed[-1][key] == never[2][key], (key, resumed[-1][key], never[2][key])


def _tensorboard_body(rank, world_size, out_dir):
    rollout.HFEngine.shutdown = lambda self: None  # keep the process group: the spawn helper ends it
    cfg = config.Config(out_dir=out_dir, tensorboard=True, steps=2, prompts_per_step=2, samples_per_prompt=2,
                        max_new_tokens=4, micro_batch_size=2, rollout_engine="hf", export_hf=False,
                        plot_every=0)
    config.validate(cfg, world_size)
    train_ppo.main(cfg)


def test_tensorboard_holds_the_metrics_of_metrics_jsonl(tmp_path):
    """tensorboard=true: every metric of every row of metrics.jsonl is a scalar of that name at that
    step in out_dir/tensorboard, with the same value (TensorBoard stores float32)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run_ranks(_tensorboard_body, 1, str(tmp_path))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(rows) == 2 and set(events.Tags()["scalars"]) == set(rows[0])
    for row in rows:
        for name, value in row.items():
            (point,) = [e for e in events.Scalars(name) if e.step == row["step"]]
            assert point.value == pytest.approx(value, rel=1e-6, abs=1e-30), (name, row["step"])


def test_policy_ratio_is_clamped_before_exp():
    logprobs, old = torch.tensor([[0.0, 1000.0]]), torch.tensor([[0.0, 0.0]])  # a wild token
    per_token, _ = train_ppo.policy_loss(logprobs - old, torch.tensor([[0.0, -1.0]]), 0.2)
    assert torch.isfinite(per_token).all()


def test_gsm8k_reward_needs_the_end_of_text():
    task = rollout.GSM8KTask.__new__(rollout.GSM8KTask)  # only the reward: no tokenizer needed
    task.format_reward = 0.0
    assert task.reward("so the answer is 7", "3 + 4 = 7 #### 7", ended="stop") == 1.0
    # cut off by max_new_tokens while the last number happened to be the answer
    assert task.reward("so the answer is 7", "3 + 4 = 7 #### 7", ended="length") == 0.0


@pytest.mark.slow  # a CLI run under torchrun
def test_readme_recipe_for_your_own_task_runs_as_written(tmp_path):
    """The "Your own task and reward" block of README.md, copied verbatim into a file and
    launched the way its first line says (smaller: test_tiny, 2 steps)."""
    script = tmp_path / "my_task.py"
    script.write_text(python_block("README.md", "### Your own task and reward"))
    # (the HF engine: the recipe is the task, vLLM's start would only add a minute)
    proc = subprocess.run(torchrun_cmd(2, "--config", "configs/test_tiny.toml", "--steps=2",
                                       "--rollout_engine=hf", f"--out_dir={tmp_path / 'out'}",
                                       script=str(script)),
                          cwd=ROOT, capture_output=True, text=True, timeout=900, env=cpu_env(PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(tmp_path / "out" / "rollouts" / "step_1.jsonl") as f:
        samples = [json.loads(line) for line in f]
    assert len(samples) == 8  # test_tiny: 4 prompts x 2 samples
    for s in samples:  # the task's prompts, answers and reward, not the toy task's
        word = s["prompt"][:-1]
        assert s["prompt"].endswith(">") and len(word) == 3 and set(word) <= set("abcd")
        assert s["answer"] == word[::-1]
        finished = s["response_ids"][-1] == rollout.ToyTask(0).eos_id
        assert s["ended"] == ("stop" if finished else "length") and s["calls"] == 0
        assert s["finished"] == finished and s["reward"] == float(finished and s["response"] == s["answer"])


@pytest.mark.slow  # a CLI run under torchrun
def test_readme_recipe_for_a_new_loss_term_runs_as_written(tmp_path):
    """The "A new loss term" block of README.md, verbatim, launched as its first line says
    (smaller: test_tiny, 2 steps), with GRPO and kl_coef=0: the new term is logged by its name
    (that a wrapped term is also trained, its gradient in every backward, is the test of
    policy_loss_terms' own example above), and a run with no kl_loss term logs none and ends."""
    script = tmp_path / "my_loss.py"
    script.write_text(python_block("README.md", "### A new loss term"))
    proc = subprocess.run(torchrun_cmd(2, "--config", "configs/test_tiny.toml", "--steps=2",
                                       "--rollout_engine=hf", "--sft_steps=0",
                                       "--advantage_estimator=grpo", "--kl_coef=0",
                                       f"--out_dir={tmp_path / 'out'}", script=str(script)),
                          cwd=ROOT, capture_output=True, text=True, timeout=900, env=cpu_env(PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert len(rows) == 2
    for row in rows:  # the new term, logged by its name; no KL term at all
        assert math.isfinite(row["drift_penalty"]) and row["drift_penalty"] >= 0
        assert "kl_loss" not in row and "value_loss" not in row
    assert "drift_penalty" in proc.stdout and proc.stdout.strip().splitlines()[-1].startswith("done: 2 steps")


def test_gpu_step_bench_counts_matmul_weights_once():
    """bench/gpu_step.py's MFU numerator by hand for the tiny-llama preset (hidden 256, MLP 512,
    2 layers, 4 query / 2 KV heads of 64, vocab 262): per layer q, o 256x256, k, v 256x128,
    gate, up 256x512, down 512x256, two norms of 256."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import gpu_step
    from transformers import AutoConfig
    fields = dict(model_parallel.TINY_PRESETS["tiny-llama"], tie_word_embeddings=True)
    model_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    layer = 2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 512 + 2 * 256
    policy, critic = 2 * layer + 262 * 256, 2 * layer + 256  # LM head once (tied); value head 256 x 1
    with_critic = gpu_step.update_flops(model_config, tokens=10, ppo_epochs=2, with_critic=True)
    assert with_critic == 6 * (policy + critic) * 10 * 2
    without = gpu_step.update_flops(model_config, tokens=10, ppo_epochs=2, with_critic=False)
    assert without == 6 * policy * 10 * 2


def _host_reads_body(rank, world_size, tmp):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from host_reads import count_update_reads
    for packing in (False, True):
        counts = [count_update_reads(packing, micro, tmp) for micro in (2, 8)]
        # policy and critic, one optimizer step each: the microbatch count and the NaN flag
        assert counts == [4, 4], (packing, counts)


def test_host_reads_of_an_update_do_not_grow_with_its_microbatches(tmp_path):
    """Issue 34: every microbatch read its loss, each term and each count back to the host
    (float()), the ids' range (bool()) and indexed the batch with Python lists: on a GPU the host
    waited for the device each time (99 reads at 2 microbatches, 333 at 8, padded). Counted with a
    TorchFunctionMode recorder (conftest.HostReads) around one update (bench/host_reads.py): two a
    model's optimizer step (how many microbatches, and whether the step is finite), at 2 and at 8
    microbatches, padded and packed."""
    run_ranks(_host_reads_body, 1, str(tmp_path))


def _ddp_microbatches_body(rank, world_size, root):
    """Two ranks of DDP replicas, each with its own two rows in two microbatches: one optimizer
    step must leave both replicas the same (every microbatch's gradients summed over the ranks).
    DDP reads at the forward whether the next backward all-reduces: a sync flag set after the
    forward left the last microbatch unreduced and the replicas drifted apart without an error."""
    cfg = config.Config(data_parallel="ddp", dtype="fp32", attention="masked", micro_batch_size=1)
    mesh = model_parallel.make_mesh(world_size, 1, 1, "cpu")
    policy = model_parallel.load_policy(model_parallel.materialize_tiny_model("tiny-llama", root, seed=0),
                                        mesh, cfg)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2, fused=True)
    gen = torch.Generator().manual_seed(rank)  # each rank's rows differ
    responses = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (4, 6)]
    batch = train_ppo.make_batch([[1, 2, 3]] * 2, responses, pad_id=257)

    before = torch.cat([p.detach().flatten() for p in policy.parameters()])
    # the trainer's own minibatch (its microbatch loop sets DDP's sync flag): advantage 1 on every
    # response token, pi_old the engine's zeros
    batch = dataclasses.replace(batch, old_lp=batch.engine_lp, advantages=batch.mask)
    part = train_ppo.Part(policy, optimizer, None)
    _, _, _, stepped = train_ppo.train_minibatch("policy", part, range(2), batch, cfg, mesh)
    assert stepped
    after = torch.cat([p.detach().flatten() for p in policy.parameters()])
    replicas = [torch.zeros_like(after) for _ in range(world_size)]
    torch.distributed.all_gather(replicas, after)
    assert not torch.equal(before, after)  # a step was taken
    assert torch.equal(replicas[0], replicas[1]), "DDP replicas differ after one step"


def test_ddp_sums_every_microbatch_over_the_ranks(tmp_path):
    run_ranks(_ddp_microbatches_body, 2, str(tmp_path))
