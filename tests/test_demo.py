"""The demo's learning check: `make demo`'s exact config must learn the toy task.
Takes a few minutes on 2 cores; it is the one test that shows PPO works, not just runs."""
import importlib.util
import json
import os
import re

import pytest

from conftest import ROOT, cpu_env, read_metrics, run_cli

PROGRESS = re.compile(r"(sft|step) \d+/\d+")  # the progress lines; at most 10 others


@pytest.mark.slow
def test_demo_learns(tmp_path):
    env = {k: v for k, v in cpu_env().items() if k != "OMP_NUM_THREADS"}  # as `make demo` runs it
    proc = run_cli(2, "--config", "configs/demo_cpu.toml", f"--out_dir={tmp_path}", timeout=1200, env=env)
    rows = read_metrics(tmp_path)
    # the console: a few lines besides progress, the last one the run's summary
    extra = [line for line in (proc.stdout + proc.stderr).splitlines()
             if line.strip() and not PROGRESS.match(line)]
    assert len(extra) <= 10, "\n".join(extra)
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("done: 35 steps in ") and f"in {tmp_path}: config.json, curves.png, " in last, last
    assert f"reward {sum(r['reward_mean'] for r in rows[:5]) / 5:.3f} (first 5 steps)" in last, last
    assert "hf/" in last and "ckpt" not in last, last  # exported; the demo saves no checkpoint
    rewards = [r["reward_mean"] for r in rows]
    last5 = sum(rewards[-5:]) / 5
    print(json.dumps({"step0": rewards[0], "last5": last5}))
    assert last5 >= 0.75, rewards
    assert last5 - rewards[0] >= 0.35, rewards
    assert os.path.isfile(os.path.join(tmp_path, "curves.png"))


def test_reward_reached_by_hand():
    """scripts/reward_reached.py (what `make distill-demo` prints last), on rewards worked by hand:
    0.9 first at step 2 (1 s of steps before it); the 5-step windows' means 0.66, 0.82, 0.82, 0.9:
    the first >= 0.85 ends at step 8; a level never reached says so."""
    spec = importlib.util.spec_from_file_location(
        "reward_reached", os.path.join(ROOT, "scripts", "reward_reached.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rewards = [0.1, 0.9, 0.5, 0.9, 0.9, 0.9, 0.9, 0.9]
    rows = [{"reward_mean": r, "time_step_s": 1.0 + i} for i, r in enumerate(rewards)]
    assert script.reached(rows, 0.85) == (2, 8, 1.0)
    assert script.reached(rows, 0.95) == (None, None, None)
