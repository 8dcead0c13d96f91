"""The demo's learning check: `make demo`'s exact config must learn the toy task.
Takes a few minutes on 2 cores; it is the one test that shows PPO works, not just runs."""
import json
import os

import pytest

from conftest import read_metrics, run_cli


@pytest.mark.slow
def test_demo_learns(tmp_path):
    run_cli(2, "--config", "configs/demo_cpu.toml", f"--out_dir={tmp_path}", timeout=1200)
    rows = read_metrics(tmp_path)
    rewards = [r["reward_mean"] for r in rows]
    last5 = sum(rewards[-5:]) / 5
    print(json.dumps({"step0": rewards[0], "last5": last5}))
    assert last5 >= 0.75, rewards
    assert last5 - rewards[0] >= 0.35, rewards
    assert os.path.isfile(os.path.join(tmp_path, "curves.png"))
