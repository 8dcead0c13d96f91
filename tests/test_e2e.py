"""The real CLI, end to end: torchrun train_ppo.py on CPU ranks.

One 3-step run at dp=2 generates rollouts; replays of those rollouts at dp=1 and dp=2
must give the same training numbers (mesh invariance), and the generating run's own
numbers too, since it trained on the same rollouts from the same warmed-up weights."""
import json
import math
import os

import pytest

from conftest import close, read_metrics, run_cli

pytestmark = pytest.mark.slow  # every test here launches torchrun (~1 min a launch on 2 cores)

KEYS = ("step", "reward_mean", "reward_std", "kl", "policy_loss", "value_loss",
        "value_explained_var", "entropy", "clip_frac", "grad_norm", "response_len_mean",
        "tokens_per_s", "time_rollout_s", "time_logprobs_s", "time_update_s", "time_step_s")
COMPARED = ("policy_loss", "value_loss", "kl", "grad_norm")


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("gen"))
    proc = run_cli(2, "--config", "configs/test_tiny.toml", "--steps=3", f"--out_dir={out}")
    return out, proc


def test_run_writes_metrics_rollouts_plot_and_progress(generated):
    out, proc = generated
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        for k in KEYS:
            assert k in r and math.isfinite(r[k]), (k, r)
        assert 0.0 <= r["reward_mean"] <= 1.0 and 0.0 <= r["clip_frac"] <= 1.0
    assert "step 3/3" in proc.stdout and "eta" in proc.stdout
    for step in range(3):
        with open(os.path.join(out, "rollouts", f"step_{step}.jsonl")) as f:
            samples = [json.loads(line) for line in f]
        assert [s["index"] for s in samples] == list(range(8))  # 4 prompts x 2 samples, both ranks
        for s in samples:
            assert s["prompt"].endswith("=") and s["reward"] in (0.0, 1.0)
            assert len(s["response_ids"]) == len(s["engine_logprobs"]) >= 1
    assert os.path.getsize(os.path.join(out, "curves.png")) > 1000
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["steps"] == 3


MESHES = [(1, 1, 1), (2, 1, 1), (1, 1, 2), (1, 2, 1), (2, 1, 2), (1, 2, 2)]  # (dp, cp, tp)


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("dp, cp, tp", MESHES, ids=[f"dp{d}cp{c}tp{t}" for d, c, t in MESHES])
def test_replay_is_mesh_invariant(generated, dp, cp, tp, packing, tmp_path):
    """Train on the generating run's rollouts on another mesh: same numbers, up to fp32
    reduction order (1e-4 relative, 1e-6 absolute near zero)."""
    out, _ = generated
    run_cli(dp * cp * tp, "--config", "configs/test_tiny.toml", "--steps=3", "--sft_steps=0",
            f"--tp_size={tp}", f"--cp_size={cp}", f"--packing={str(packing).lower()}",
            f"--model={out}/sft", f"--replay_rollouts={out}/rollouts", f"--out_dir={tmp_path}")
    original, replayed = read_metrics(out), read_metrics(tmp_path)
    assert len(replayed) == 3
    for a, b in zip(original, replayed):
        assert a["reward_mean"] == b["reward_mean"]  # the very same rollouts
        for k in COMPARED:
            assert close(a[k], b[k]), (a["step"], k, a[k], b[k])
