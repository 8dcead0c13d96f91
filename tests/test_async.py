"""Asynchronous rollouts (extensions/async_rollout.py; docs/async.md).

The fast tier runs the extension's two sides in two spawned processes, a trainer rank and a
rollout rank, with stand-ins for the model, the engine and the rollout that sleep: the staleness
bound and the weight transfer are checked against what each side did, under a slow trainer and a
slow generator. The slow tier runs the real CLI (torchrun, the HF engine): max_staleness=0 against
the colocated run, a resume after steps trained at max_staleness=1, and a rollout rank killed.
"""
import json
import os
import re
import signal
import socket
import subprocess
import time

import pytest
import torch
import torch.multiprocessing as mp

import config
from conftest import ROOT, cpu_env, read_metrics, run_cli, torchrun_cmd, torchrun_workers

STEPS = 5
# (max_staleness, seconds a step trains, seconds a batch is sampled)
CASES = [(0, 0.0, 0.0), (1, 0.2, 0.0), (1, 0.0, 0.2), (2, 0.2, 0.0), (2, 0.0, 0.2)]


class _Engine:
    """The engine's refit contract (rollout.refit): it holds the value every received weight was
    filled with, which the trainer set to the policy's version."""
    dtype = torch.bfloat16  # the trainer's resolved dtype (below), as on a GPU
    serves_adapters = False

    def __init__(self):
        self.held = 0.0  # the initial policy is version 0

    def load_weights(self, named_tensors):
        for _, tensor in named_tensors:
            self.held = tensor.flatten()[0].item()

    def finish_refit(self):
        pass

    def wake_up(self, tags):
        pass

    def sleep(self):  # as vLLM's on a GPU: the weights dropped until the next refit
        self.held = float("nan")

    def shutdown(self):
        pass


class _Task:
    eos_id = 0


def _side(rank, port, cases):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank), CUDA_VISIBLE_DEVICES="")
    torch.set_num_threads(1)
    import model_parallel
    import rollout
    from extensions import async_rollout
    model_parallel.init_distributed(60, rollout_ranks=1)
    base, bridge = async_rollout._SIDE["store"], async_rollout._SIDE["bridge"]
    for n, (staleness, train_s, generate_s) in enumerate(cases):
        cfg = config.parse_args([f"--steps={STEPS}", "--rollout_ranks=1",
                                 f"--max_staleness={staleness}", "--offpolicy_is=token"])
        # each case in keys of its own, over the same groups
        async_rollout._SIDE.update(store=torch.distributed.PrefixStore(f"case{n}/", base),
                                   bridge=bridge)
        if rank == 1:  # the rollout rank: each batch says which weights sampled it
            engine = _Engine()

            def rollouts(engine, task, cfg, step, start):
                time.sleep(generate_s)
                engine.sleep()  # as rollout.rollouts does, for the update on a colocated rank
                # a batch over the store's 8 MiB a value, once
                pad = "x" * (9 * 2**20 if n == step == 0 else 0)
                return {0: dict(index=0, held=engine.held, pad=pad)}, 1, {}

            def make_engine(cfg, *args):  # in the trainer's resolved dtype (below)
                assert cfg.dtype == "bf16", cfg.dtype
                return engine
            rollout.make_engine = make_engine
            rollout.rollouts = rollouts
            async_rollout.serve(cfg, _Task())
            continue
        policy = torch.nn.Linear(2, 2, bias=False)
        cfg.dtype = "bf16"  # as model_parallel.setup resolves "auto" on a GPU
        async_rollout.start(cfg, "unused", dict(step=0, prompts_drawn=0))
        remote = async_rollout.Remote(cfg, torch.device("cpu"))
        waits = dict(trainer=0.0, generator=0.0)  # each side's seconds waiting for the other
        for step in range(STEPS):
            every, drawn, found = remote.receive(step)
            lag = found["async_staleness_max"]
            # the batch's sampler: the version it claims, which the engine held
            assert every[0]["held"] == step - lag, (cases[n], step, found)
            assert len(every[0]["pad"]) == (9 * 2**20 if n == step == 0 else 0)
            # the bound, and held tight: the newest version the bound allows is never waited for
            assert lag == min(step, staleness), (cases[n], step, found)
            waits["trainer"] += found["async_trainer_wait_s"]
            waits["generator"] += found["async_generate_wait_s"]
            time.sleep(train_s)
            with torch.no_grad():
                policy.weight.fill_(step + 1)  # version step + 1
            # the trainer waits for the generator here too: for it to take the version
            waits["trainer"] += remote.send(policy).get("async_send_wait_s", 0.0)
        # the slow side's pace: the other waits about its time a step, but on the first steps
        slow = "trainer" if generate_s else "generator"
        assert waits[slow] > 0.5 * max(train_s, generate_s) * (STEPS - 2 - staleness), (cases[n],
                                                                                        waits)
    torch.distributed.destroy_process_group()


def test_the_staleness_bound_holds_under_a_slow_trainer_and_a_slow_generator():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_side, args=(port, CASES), nprocs=2, join=True)


def test_the_bound_and_its_placement_are_refused_where_they_cannot_work(tmp_path):
    def refusal(*args, world=3):
        with pytest.raises(config.ConfigError) as e:
            config.validate(config.parse_args([f"--out_dir={tmp_path}", *args]), world)
        return str(e.value)
    assert "leaves no rank" in refusal("--rollout_ranks=2", world=2)
    assert "offpolicy_is=token" in refusal("--rollout_ranks=1", "--max_staleness=1")
    assert "old_logprobs=trainer" in refusal("--rollout_ranks=1", "--max_staleness=1",
                                             "--offpolicy_is=token", "--old_logprobs=engine")
    # the trainer's mesh is built over the others: 3 - 1 ranks for tp 2 is fine, 4 - 1 is not
    config.validate(config.parse_args([f"--out_dir={tmp_path}", "--rollout_ranks=1",
                                       "--tp_size=2", "--rollout_engine=hf"]), 3)
    assert "not divisible by tp_size" in refusal("--rollout_ranks=1", "--tp_size=2", world=4)
    assert "the 3 ranks that generate" in refusal("--rollout_ranks=3", "--rollout_tp_size=2",
                                                  "--rollout_engine=vllm", world=4)
    assert "eval_every" in refusal("--rollout_ranks=1", "--eval_every=2")


# -----------------------------------------------------------------------------
# The real CLI: 2 trainer ranks and 1 rollout rank (or the colocated 2), the tiny toy, HF engine.

ARGS = ["--config", "configs/test_tiny.toml", "--rollout_engine=hf", "--sft_steps=0",
        "--export_hf=false", "--plot_every=0"]


def _samples(out_dir, step):
    with open(os.path.join(out_dir, "rollouts", f"step_{step}.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_at_staleness_0_the_rollout_rank_samples_what_the_colocated_run_does(tmp_path):
    """2 + 1 ranks at max_staleness=0 against the colocated 2: the same tokens, sample for
    sample, and the same losses (here bit for bit: the HF engine's rows do not depend on their
    batch on CPU)."""
    run_cli(2, *ARGS, "--steps=3", f"--out_dir={tmp_path}/colocated")
    run_cli(3, *ARGS, "--steps=3", "--rollout_ranks=1", f"--out_dir={tmp_path}/async")
    for step in range(3):
        pairs = zip(_samples(f"{tmp_path}/colocated", step), _samples(f"{tmp_path}/async", step))
        for a, b in pairs:
            assert a["response_ids"] == b["response_ids"], (step, a["index"])
            assert a["engine_logprobs"] == pytest.approx(b["engine_logprobs"], abs=1e-5)
    for a, b in zip(read_metrics(f"{tmp_path}/colocated"), read_metrics(f"{tmp_path}/async")):
        for key in ("policy_loss", "value_loss", "kl", "grad_norm", "critic_grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)
        assert b["async_staleness_max"] == 0


@pytest.mark.slow
def test_a_run_resumed_after_steps_at_staleness_1_equals_the_straight_one(tmp_path):
    """4 steps at max_staleness=1 with a checkpoint after step 2, which holds step 3's batch,
    sampled by the policy after step 1; resumed from it, steps 3 and 4 are the straight run's."""
    staleness = ["--rollout_ranks=1", "--max_staleness=1", "--offpolicy_is=token"]
    run_cli(3, *ARGS, *staleness, "--steps=4", "--save_every=2", f"--out_dir={tmp_path}/a")
    run_cli(3, *ARGS, *staleness, "--steps=4", f"--resume={tmp_path}/a/ckpt/step_2",
            f"--out_dir={tmp_path}/b")
    straight, resumed = read_metrics(f"{tmp_path}/a"), read_metrics(f"{tmp_path}/b")
    assert [r["async_staleness_max"] for r in straight] == [0, 1, 1, 1]
    assert [r["step"] for r in resumed] == [2, 3]
    for a, b in zip(straight[2:], resumed):
        for key in ("policy_loss", "value_loss", "kl", "reward_mean", "logprob_mismatch",
                    "async_staleness_max", "offpolicy_ess"):
            assert a[key] == b[key], (a["step"], key)
    for step in (2, 3):
        assert ([s["response_ids"] for s in _samples(f"{tmp_path}/a", step)]
                == [s["response_ids"] for s in _samples(f"{tmp_path}/b", step)])
    # the lag the correction sees: at staleness 0 the engine's logprobs are the trainer's pi_old
    # to float rounding; one update behind they are not
    assert min(r["logprob_mismatch"] for r in straight[1:]) > 100 * straight[0]["logprob_mismatch"]


def _worker(torchrun_pid, local_rank):
    """The pid of torchrun's worker of `local_rank` (by its environment: pids need not grow in
    the order torchrun started them)."""
    for pid in torchrun_workers(torchrun_pid):
        with open(f"/proc/{pid}/environ", "rb") as f:
            if f"LOCAL_RANK={local_rank}".encode() in f.read().split(b"\0"):
                return pid
    raise AssertionError(f"torchrun {torchrun_pid} has no worker of local rank {local_rank}")


@pytest.mark.slow
def test_a_killed_rollout_rank_stops_the_trainer_with_one_line(tmp_path):
    cmd = torchrun_cmd(3, *ARGS, "--steps=50", "--rollout_ranks=1", "--collective_timeout_s=5",
                       f"--out_dir={tmp_path}")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=cpu_env())
    for line in proc.stdout:
        if line.startswith("step 2/"):
            killed = time.time()
            os.kill(_worker(proc.pid, local_rank=2), signal.SIGKILL)  # the rollout rank
            break
    log = proc.stdout.read()
    proc.wait(timeout=120)
    assert proc.returncode != 0
    lines = [line for line in log.splitlines() if line.startswith("async rollouts:")]
    # where the trainer was when the rank died: waiting for a batch (step 3's, or a later one's
    # if the kill came late), or sending the weights after a step
    assert len(lines) == 1, log[-3000:]
    waited = re.fullmatch(r"async rollouts: no batch for step \d+ came within "
                          r"collective_timeout_s=5: a rank of the other side died or hangs \(its "
                          r"log says why\)", lines[0])
    assert waited or lines[0].startswith("async rollouts: the weight transfer failed, the other "
                                         "side is gone ("), lines[0]
    assert time.time() - killed < 5 + 20, log[-3000:]
