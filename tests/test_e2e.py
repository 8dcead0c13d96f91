"""The real CLI, end to end: torchrun train_ppo.py on CPU ranks.

One 3-step run at dp=2 generates rollouts; replays of those rollouts at dp=1 and dp=2
must give the same training numbers (mesh invariance), and the generating run's own
numbers too, since it trained on the same rollouts from the same warmed-up weights. The
generating run's console is counted too (few lines besides progress, no traceback). The GPU
recipe replays the same rollouts: bf16 within stated tolerances, the varlen path exactly.

The rollouts are multi-turn episodes (task toy_tool, max_turns=2, vLLM): after a warm-up on its
traces the policy calls the calculator, so every row holds a model turn, the tool's output
(context: out of every loss) and a second turn, of lengths that differ by row. A single-turn row
is the special case of one turn (test_train_loop.py and the rest replay those). These replays and
the run they are compared with all read the same action masks, so they cannot tell whether the
masks are obeyed (and with test_tiny's gamma = lam = 1 a GAE that stepped through the
observations would give the same advantages): test_multiturn.py's
test_replayed_episodes_train_as_their_cut_rows checks that, against the episodes' cut rows."""
import json
import math
import os
import re

import pytest

import config
import train_ppo
from _dist import run_ranks
from conftest import ROOT, close, cpu_env, paired, read_metrics, run_cli

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
    # its workers itself (and says so on the console, which the console check must see); no GPU
    env = {k: v for k, v in cpu_env().items() if k != "OMP_NUM_THREADS"}
    # a warm-up long enough that the policy calls the tool: 30 steps of 16 traces (measured: every
    # sample of the 3 steps called it; 5 steps of 8, test_tiny's, gave no call)
    tool = ["--task=toy_tool", "--max_turns=2", "--sft_steps=30", "--sft_batch_size=16", "--sft_lr=3e-3"]
    proc = run_cli(2, "--config", "configs/test_tiny.toml", "--steps=3", f"--out_dir={out}", *tool, env=env)
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
    observations = 0
    for step in range(3):
        with open(os.path.join(out, "rollouts", f"step_{step}.jsonl")) as f:
            samples = [json.loads(line) for line in f]
        assert [s["index"] for s in samples] == list(range(8))  # 4 prompts x 2 samples, both ranks
        for s in samples:
            assert s["prompt"].endswith("=") and s["reward"] in (0.0, 1.0)
            assert len(s["response_ids"]) == len(s["engine_logprobs"]) == len(s["action_mask"]) >= 1
            # the tool's output: logprob 0, mask 0, between two turns (the last token the model's)
            gap = [k for k, m in enumerate(s["action_mask"]) if m == 0]
            assert all(s["engine_logprobs"][k] == 0.0 for k in gap) and s["action_mask"][-1] == 1
            observations += bool(gap)
        assert [r["turns_per_episode"] for r in rows][step] == pytest.approx(1 + sum(
            0 in s["action_mask"] for s in samples) / len(samples))
    assert observations >= 12  # of 24 episodes: measured 24
    assert os.path.getsize(os.path.join(out, "curves.png")) > 1000
    with open(os.path.join(out, "config.json")) as f:
        saved = json.load(f)
    # the runner vLLM took, named: V1, the one every CPU test covers
    assert saved["steps"] == 3 and saved["vllm_model_runner"] == "V1", saved
    assert "fresh start, vLLM's V1 model runner" in proc.stdout


def test_console_has_no_traceback(generated):
    _, proc = generated
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-6000:]


# Measured: 8 lines: our 2 (mesh, fresh start), torchrun's 4-line OMP_NUM_THREADS notice and
# vLLM's NUMA note (one a rank). FSDP2's "returned a view tensor" and torch's flattened-mesh
# warnings were ours and are fixed at their cause (model_parallel.ValueHead, DTensor logits,
# mesh.dp_cp kept), not filtered.
def test_console_at_most_10_lines_besides_progress(generated):
    """What the demo prints besides progress, counted on this cheaper run of the same launcher
    (vLLM engine, 2 ranks): the same set-up lines and warnings, fewer steps."""
    _, proc = generated
    extra = [line for line in (proc.stdout + proc.stderr).splitlines()
             if line.strip() and not PROGRESS.match(line)]
    assert len(extra) <= CONSOLE_BUDGET, f"{len(extra)} lines besides progress:\n" + "\n".join(extra)


MESHES = [(1, 1, 1), (2, 1, 1), (1, 1, 2), (1, 2, 1), (2, 1, 2), (1, 2, 2)]  # (dp, cp, tp)

# The GPU recipe on the generating run's rollouts: bf16 (FSDP2 mixed precision) against an fp32
# replay, and the varlen attention path against fp32 exactly. Both replays train at lr 1e-5
# (test_tiny's 1e-4 is 10x that for a fast toy): AdamW's first updates are ~lr * sign(grad), so
# bf16 rounding that flips the sign of a near-zero gradient moves that weight a full step, and at
# 1e-4 the value loss drifts more with each step. Measured (value loss, policy and critic grad
# norms; relative to fp32, worst of 3 steps): at lr 1e-4, dp2 5.7%, 1.2%, 3.3%; tp2 1.6%, 0.5%,
# 1.0%; cp2+packed 4.5%, 0.4%, 2.7%; at lr 1e-5, see the printed figures (pytest -s).
VALUE_LOSS_TOL, GRAD_NORM_TOL = 0.05, 0.20
BF16_MESHES = [(2, 1, 1, False), (1, 1, 2, False), (1, 2, 1, True)]  # (dp, cp, tp, packing)
LR_1E5 = ["--lr=1e-5", "--critic_lr=1e-5"]


def mesh_flags(dp, cp, tp, packing):
    return [f"--tp_size={tp}", f"--cp_size={cp}", f"--packing={str(packing).lower()}"]


# Every replay, by the world size it runs at: (name, the command line's flags beyond the shared
# ones). The replays of one world size run in one spawn of its ranks, one after the other: starting
# ranks (importing torch and transformers) is most of a launch on 2 cores.
REPLAYS = {1: [], 2: [], 4: [], 8: []}
for _dp, _cp, _tp in MESHES + [(2, 2, 2)]:
    for _packing in (False, True):
        _name = f"dp{_dp}cp{_cp}tp{_tp}-{_packing}"
        REPLAYS[_dp * _cp * _tp].append((_name, mesh_flags(_dp, _cp, _tp, _packing)))
# the 8 ranks replay the first 2 of the 3 steps (8 processes on 2 cores are the suite's slowest
# spawn; the second step already trains on weights the first one updated)
REPLAYS[8] = [(name, [*flags, "--steps=2"]) for name, flags in REPLAYS[8]]
REPLAYS[2] += [("kept-gathered", ["--reshard_after_forward=false"]), ("fp32-lr1e-5", LR_1E5)]
REPLAYS[2] += [(f"bf16-dp{d}cp{c}tp{t}", ["--dtype=bf16", *LR_1E5, *mesh_flags(d, c, t, p)])
               for d, c, t, p in BF16_MESHES]
REPLAYS[4] += [("varlen", ["--attention=varlen", *mesh_flags(1, 2, 2, True)])]
# LoRA (rank 8; lr 1e-2, so that the adapters, which start at B = 0, move the numbers): one process,
# and every axis split at once, padded and packed
LORA = ["--lora_rank=8", "--lora_alpha=16", "--lr=1e-2"]
REPLAYS[1] += [("lora", [*LORA, "--steps=2"])]
REPLAYS[8] += [(f"lora-dp2cp2tp2-{p}", [*LORA, *mesh_flags(2, 2, 2, p), "--steps=2"]) for p in (False, True)]
# on-policy distillation from the initial policy ({sft}: the replays' own start) as the teacher:
# one process, and every axis split at once, packed
TEACHER = ["--teacher={sft}"]
REPLAYS[1] += [("teacher", TEACHER)]
REPLAYS[8] += [("teacher-dp2cp2tp2", [*TEACHER, *mesh_flags(2, 2, 2, True), "--steps=2"])]


def _replays_body(rank, world_size, out, target):
    """This world size's replays through train_ppo.main, each a config parsed from the command
    line the CLI would get (test_tiny.toml, 3 steps on the generating run's rollouts)."""
    train_ppo.dist.destroy_process_group = lambda *args: None  # keep the group for the next run
    for name, flags in REPLAYS[world_size]:
        argv = ["--config", os.path.join(ROOT, "configs", "test_tiny.toml"), "--steps=3", "--sft_steps=0",
                f"--model={out}/sft", f"--replay_rollouts={out}/rollouts",
                f"--out_dir={os.path.join(target, name)}", *[f.format(sft=f"{out}/sft") for f in flags]]
        cfg = config.parse_args(argv)
        config.validate(cfg, world_size)
        train_ppo.main(cfg)


@pytest.fixture(scope="module")
def replayed(generated, tmp_path_factory):
    """replayed(world_size, name): that replay's metrics (its world size's spawn runs once)."""
    out, dirs = generated[0], {}

    def metrics(world_size, name):
        if world_size not in dirs:
            dirs[world_size] = str(tmp_path_factory.mktemp(f"replays{world_size}"))
            run_ranks(_replays_body, world_size, out, dirs[world_size])
        return read_metrics(os.path.join(dirs[world_size], name))
    return metrics


def assert_same_numbers(original, replay, keys, label, steps=3):
    for a, b in paired(original[:steps], replay, steps):
        assert a["reward_mean"] == b["reward_mean"]  # the very same rollouts
        for k in keys:
            assert close(a[k], b[k]), (label, a["step"], k, a[k], b[k])


@pytest.mark.parametrize("dp, cp, tp", MESHES, ids=[f"dp{d}cp{c}tp{t}" for d, c, t in MESHES])
def test_replay_is_mesh_invariant(generated, replayed, dp, cp, tp):
    """Train on the generating run's rollouts on another mesh, padded and packed: same numbers,
    up to fp32 reduction order (1e-4 relative, 1e-6 absolute near zero)."""
    for packing in (False, True):
        name = f"dp{dp}cp{cp}tp{tp}-{packing}"
        assert_same_numbers(read_metrics(generated[0]), replayed(dp * cp * tp, name), COMPARED, name)


def test_replay_on_8_ranks_with_every_axis_split(generated, replayed):
    """Issue 28: the mesh an 8-GPU user with tp=2 and cp=2 runs, (dp, cp, tp) = (2, 2, 2), every
    axis above 1 at once (8 gloo ranks on the CPU), padded and packed: the generating run's
    numbers, as every smaller mesh gives them."""
    for packing in (False, True):
        name = f"dp2cp2tp2-{packing}"
        keys = COMPARED + ("critic_grad_norm",)
        assert_same_numbers(read_metrics(generated[0]), replayed(8, name), keys, name, steps=2)


def test_lora_replay_on_8_ranks_equals_one_process(replayed):
    """LoRA at (dp, cp, tp) = (2, 2, 2), padded and packed: one process's numbers over 2 steps (the
    adapters' TP split, their FSDP2 shards beside the frozen base's, CP, packing)."""
    one = replayed(1, "lora")
    assert one[1]["kl"] != 0.0 and one[1]["grad_norm"] > 0, "the adapters must move the policy"
    for packing in (False, True):
        name = f"lora-dp2cp2tp2-{packing}"
        assert_same_numbers(one, replayed(8, name), COMPARED + ("critic_grad_norm",), name, steps=2)


def test_teacher_logprobs_are_mesh_invariant_and_the_references_for_the_initial_policy(replayed):
    """A teacher (distillation's reward form beside the task's loss) at (dp, cp, tp) = (2, 2, 2),
    packed: one process's numbers over 2 steps, the teacher's metrics and term included. The
    teacher is the initial policy, the reference itself, loaded as a module of its own: its
    logprobs are the reference's, so distill_kl_k1 equals kl (k1) at every step, an independent
    check of the teacher's pass."""
    one = replayed(1, "teacher")
    for row in one:
        assert abs(row["distill_kl_k1"] - row["kl"]) <= 1e-6 + 1e-5 * abs(row["kl"]), row
        assert row["teacher_logprob"] < 0 and row["distill_kl_k3"] >= 0 and "distill_loss" in row
    assert one[1]["kl"] != 0.0, "the policy must move from its start"
    keys = COMPARED + ("critic_grad_norm", "distill_kl_k1", "distill_kl_k3", "teacher_logprob",
                       "distill_loss")
    assert_same_numbers(one, replayed(8, "teacher-dp2cp2tp2"), keys, "teacher", steps=2)


def test_layers_kept_gathered_change_no_number(generated, replayed):
    """reshard_after_forward=false (each layer gathered once per no-grad pass and kept from forward
    to backward) at dp2: the generating run's numbers. The reference weight swap must still
    reshard the gathered policy, or the reference would score with the live weights (kl = 0)."""
    keys = COMPARED + ("critic_grad_norm",)
    assert_same_numbers(read_metrics(generated[0]), replayed(2, "kept-gathered"), keys, "kept gathered")


def relative(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("dp, cp, tp, packing", BF16_MESHES,
                         ids=[f"dp{d}cp{c}tp{t}{'-packed' * p}" for d, c, t, p in BF16_MESHES])
def test_bf16_replay_stays_close_to_fp32(replayed, dp, cp, tp, packing):
    """dtype=bf16 on the same rollouts: value loss and both grad norms within the tolerances
    above of the fp32 run (dp2), every step (bf16 rounding, nothing else, differs)."""
    for a, b in paired(replayed(2, "fp32-lr1e-5"), replayed(2, f"bf16-dp{dp}cp{cp}tp{tp}"), 3):
        assert b["value_loss"] != a["value_loss"], "no bf16 rounding seen: is dtype=bf16 in effect?"
        print(f"bf16 dp{dp}cp{cp}tp{tp} step {a['step']}: " + ", ".join(
            f"{k} {relative(b[k], a[k]):.2%}" for k in ("value_loss", "grad_norm", "critic_grad_norm")))
        value_loss_error = relative(b["value_loss"], a["value_loss"])
        assert value_loss_error <= VALUE_LOSS_TOL, (a["step"], a["value_loss"], b["value_loss"])
        for k in ("grad_norm", "critic_grad_norm"):
            assert relative(b[k], a[k]) <= GRAD_NORM_TOL, (a["step"], k, a[k], b[k])


def test_varlen_replay_equals_masked(generated, replayed):
    """attention=varlen at the richest mesh (cp 2 x tp 2, packed): the fp32 numbers of the
    generating run (masked attention) to 1e-4, as every masked mesh gives them."""
    keys = COMPARED + ("critic_grad_norm",)
    assert_same_numbers(read_metrics(generated[0]), replayed(4, "varlen"), keys, "varlen")
