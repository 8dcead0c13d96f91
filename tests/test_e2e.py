"""The real CLI, end to end: torchrun train_ppo.py on CPU ranks.

One 3-step run at dp=2 generates rollouts; replays of those rollouts at dp=1 and dp=2
must give the same training numbers (mesh invariance), and the generating run's own
numbers too, since it trained on the same rollouts from the same warmed-up weights. The
generating run's console is counted too (issue 11: few lines besides progress, no traceback)."""
import json
import math
import os
import re

import pytest

from conftest import close, read_metrics, run_cli

pytestmark = pytest.mark.slow  # every test here launches torchrun (~1 min a launch on 2 cores)

KEYS = ("step", "reward_mean", "reward_std", "kl", "policy_loss", "value_loss",
        "value_explained_var", "entropy", "clip_frac", "grad_norm", "response_len_mean",
        "tokens_per_s", "time_rollout_s", "time_logprobs_s", "time_update_s", "time_step_s")
COMPARED = ("policy_loss", "value_loss", "kl", "grad_norm")


# Issue 11: besides its `sft k/N` and `step k/N` progress lines, a run prints at most 10 console
# lines (stdout and stderr together) and no traceback.
PROGRESS = re.compile(r"(sft|step) \d+/\d+")
CONSOLE_BUDGET = 10


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("gen"))
    # launched from the user's environment as `make demo` is: torchrun sets OMP_NUM_THREADS=1 for
    # its workers itself (and says so on the console, which the console check must see)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = run_cli(2, "--config", "configs/test_tiny.toml", "--steps=3", f"--out_dir={out}", env=env)
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


def test_console_has_no_traceback(generated):
    _, proc = generated
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-6000:]


# Not met yet: 20 lines. 8 are our 2 lines, torchrun's 4-line OMP_NUM_THREADS notice and vLLM's
# NUMA note (one a rank); 12 are torch UserWarnings, on each rank: "FSDP2-wrapped module ...
# returned a view tensor" (the value head and the root, 2 lines each) and "Slicing a flattened
# dim from root mesh" (mesh["dp_cp"] in model_parallel). Strict: it fails once they are gone,
# and this mark goes.
@pytest.mark.xfail(strict=True, reason="20 console lines, 12 of them torch UserWarnings (FSDP2 view "
                   "outputs, flattened-mesh slicing) that rollout.quiet_third_party_output does not filter yet")
def test_console_at_most_10_lines_besides_progress(generated):
    """What the demo prints besides progress, counted on this cheaper run of the same launcher
    (vLLM engine, 2 ranks): the same set-up lines and warnings, fewer steps."""
    _, proc = generated
    extra = [line for line in (proc.stdout + proc.stderr).splitlines()
             if line.strip() and not PROGRESS.match(line)]
    assert len(extra) <= CONSOLE_BUDGET, f"{len(extra)} lines besides progress:\n" + "\n".join(extra)


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
