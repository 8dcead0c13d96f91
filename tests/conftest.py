"""Helpers shared by the test modules, imported as `from conftest import run_cli, read_metrics`
(pytest puts tests/ on sys.path; so does running a script in tests/). No test module imports
another: what two of them need lives here. Plain functions, no fixtures, no hooks.

The `slow` marker (pytest.ini) tags the tier that `make test-fast` leaves out: CLI runs under
torchrun, vLLM engines, the demo."""
import json
import os
import signal
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def cpu_env(**extra):
    """The environment for a child process: one OpenMP thread per process (the ranks share
    a couple of cores), plus extra variables."""
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def torchrun_cmd(nproc, *args, script="train_ppo.py"):
    return [TORCHRUN, f"--nproc_per_node={nproc}", "--standalone", script, *args]


def run_cli(nproc, *args, timeout=600, env=None):
    """torchrun the trainer; fail the test with its output if it fails. Returns the finished
    process: .stdout and .stderr as text."""
    cmd = torchrun_cmd(nproc, *args)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=cpu_env() if env is None else env)
    first = proc.stderr.find("Traceback")  # the first rank's traceback, not torchrun's summary
    assert proc.returncode == 0, (f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[max(first, 0):][:6000]}")
    return proc


def read_metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def close(a, b, rel=1e-4, abs_=1e-6):
    return abs(a - b) <= max(rel * max(abs(a), abs(b)), abs_)


def torchrun_workers(pid):
    """pids of the worker processes torchrun `pid` started: they run in sessions of their own, so
    killing torchrun's process group does not reach them."""
    workers = []
    for child in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{child}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:  # the parent pid field
                    workers.append(int(child))
        except OSError:
            continue
    return workers


def kill_torchrun(pid):
    """SIGKILL torchrun `pid` and its workers (workers first: torchrun's death does not reach them)."""
    for p in torchrun_workers(pid) + [pid]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:  # already gone
            pass


# ---- the independent reference for per-token logprobs

def at_positions(scores, seq_starts=()):
    """(B, S-1) scores of tokens 1..S-1 -> (B, S) with token i's score at position i; 0 at
    position 0 and at each packed sequence's start (nothing before it predicts it)."""
    out = torch.cat([torch.zeros_like(scores[:, :1]), scores], dim=1)
    keep = torch.ones(out.shape[1])
    keep[list(seq_starts)] = 0.0
    return out * keep


def plain_logprobs(logits, ids, seq_starts=()):
    """out[:, i] = log_softmax(logits[:, i-1])[ids[:, i]] on the full, unsharded (B, S, V) logits:
    the single-process computation every sharded path is compared with."""
    scores = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]  # (B, S-1)
    return at_positions(scores, seq_starts)
