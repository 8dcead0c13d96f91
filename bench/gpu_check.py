"""Everything a GPU can tell that a CPU cannot, in one command that keeps every figure it learns.

    python bench/gpu_check.py --out gpu_check        # one GPU, whatever torch it has: ~5.3 min
                                                     # expected, 7.4 at most (make gpu-check)
    python bench/gpu_check.py --out gpu_check --stages masked,real_vocab
                                                     # those stages again; figures.json keeps the
                                                     # others' figures
    python bench/gpu_check.py --smoke --out DIR      # the same stages on CPU, tiny models (a fast
                                                     # test runs this): its figures mean nothing

A GPU is lent rarely and briefly (15 minutes of device time a task, each start a minute or more),
so nothing measured may be lost, and a rerun must fit after a failure: the check is planned for
about 5 minutes by the figures measured so far, so that a second start and a rerun fit the lease.
Each stage runs in processes of its own, in a session of its own, under a time cap; at the cap
its whole process tree is stopped (SIGTERM, then SIGKILL: pytest's mp.spawn children and
torchrun's workers too). figures.json in --out is rewritten after every stage (atomically), each
stage's figures are printed as it finishes, and a stage that fails or is stopped reports
<stage>_finished=0 (figures.json also has <stage>_error, a line) while the next stage still runs.
The last line is RESULT key=value ... of the stages that ran; --stages merges into figures.json.
Each stage's wall time (<stage>_wall_s) and the models' writing times (write_model_s,
real_vocab_write_s) are figures too, and test_cuda's log has each test's time (--durations=0):
the next caps are to be sized from them.

The stages, in order: the never-run and the cheap first, so that a lease cut short loses the
least. Cap and expected time on one H100/H200, in seconds; "measured" figures are docs/gpus.md's
(H200, 2026-11-26; H100, 2026-11-23), "estimated" ones are not, and say how they were reckoned:

  preflight    10   8 estimated  The carried wheels (--wheels, default .whl/: the lock's
                                 transformers) installed into out/site, first on every later
                                 stage's path; torch's and transformers' versions (transformers
                                 must be the lock's), CUDA and bf16, the five modules imported.
                                 4.8 s of CPU to start Python and import torch, transformers and
                                 the five modules, 2.0 s to install the transformers wheel without
                                 byte-compiling (7.3 s with: hence --no-compile), both measured on
                                 the 2-core CPU box; ~1 s for CUDA's context
  sampler      20   8 estimated  rollout.sample at (256, 151,936) bf16 logits, T=0.7: the same
                                 tokens in batches of 256, 64 and 1 rows in any order, logprobs
                                 to 1e-5; the CPU's draws on >= 98% of rows; at most 3 new (B, V)
                                 tensors a token; ms a token against the Gumbel-max step it
                                 replaced (at least twice as fast). ~5 s to start and import (as
                                 preflight's), ~1 s for the host's logits and the CPU's draws,
                                 46 timed steps of at most 7 ms (Gumbel-max's 6-7 ms on an H100)
  lora         30  15 estimated  2 PPO steps of configs/test_tiny.toml (tiny-llama, toy_add, its
                                 5 SFT steps) with --lora_rank=16 --dtype=bf16, the HF engine:
                                 FSDP2 over the frozen bf16 base and fp32 adapters on NCCL, the
                                 reference as the adapters off, merged weights refit into the HF
                                 engine; the step's figures and the largest logprob_mismatch. The
                                 H100 ran the demo (tiny-llama, HF engine) at 1.0-1.1 s a step,
                                 59 s for 50 steps: 5-9 s to start; 7 steps of at most ~1 s
  multiturn    45  25 estimated  task=toy_tool (2 turns, a calculator's output between them)
                                 through the HF engine on test_tiny, dtype and attention left to
                                 `auto`: 2 steps with a checkpoint, resumed for a third, the HF
                                 export loaded back (what test_cuda's CLI test did, on toy_add):
                                 turns and tool calls per episode, the resolved dtype (bf16) and
                                 attention. Two starts of 5-9 s, 5 SFT and 3 PPO steps of ~1.5 s,
                                 a checkpoint and the export (~2 s)
  real_vocab   45  30 estimated  HFEngine.generate at Qwen's real vocab (151,936 ids, the
                                 Qwen2.5-0.5B shape otherwise, random bf16 weights written by the
                                 stage: 494M parameters): 256 prompts of 16 to 80 random ids, 128
                                 new tokens each, after a warm-up call; tokens a second, and the
                                 sampler's share from the sampler stage's time a token. ~5 s to
                                 start, 11-14 s to write the model (measured on 2 CPU cores), ~2 s
                                 to load it; the H100 generated 512 rows x 256 tokens at the 0.5B
                                 shape in 13 s (before issue 42 made sampling and the cache
                                 cheaper): half the decoding steps here, ~7 s
  test_cuda   125 103 measured   pytest tests/test_cuda.py: passed, failed, skipped, errors
                                 (test_cuda.log, test_cuda.xml); a run stopped by the cap counts
                                 the tests that finished. Its tests (the passes against HF, the
                                 varlen kernels, the offload) and the CLI test ran 125 s on the
                                 H200; less the CLI test (estimated: two starts and 8 steps of
                                 test_tiny, ~22 s)
  masked      130 114 measured   bench/gpu_step.py's PPO step at the Qwen2.5-0.5B shape (random
                                 weights and a 262-id byte-level BPE written here: 358M
                                 parameters; 64 prompts x 8 samples of up to 256 new tokens, 4
                                 minibatches, the HF engine, bf16, GAE with a critic) on
                                 GSM8K-format sums of 1 to 12 terms (task=gsm8k: ragged prompts of
                                 about 30 to 100 tokens, so left padding and the masks run on the
                                 GPU), padded rows and masked SDPA, 64 rows a microbatch. 2 steps:
                                 the first (CUDA's warm-up) measured 45-67 s, a later one 39 s
                                 (with 4-token toy prompts; ~10% more for these), ~15 s to start
                                 and load: 103-125 s (the first step's time, the later step's
                                 phases, the update's MFU, the memory in use; metrics.jsonl and
                                 config.json kept in masked/)
  async_split   5   1 estimated  The paper model of asynchronous rollouts (bench/async_schedule.py)
                                 fed with the masked stage's phases, measured on this GPU:
                                 generation g, training t (the no-grad passes and the update) and
                                 refit w; the step time on 8 such GPUs colocated, and with the
                                 best split of them into generating and training ones at
                                 max_staleness 1, with generation's undivisible tail at 0 and at
                                 half (docs/async.md). Arithmetic on figures.json: ~0 s

Left out, as repeats: `packed` (the same step, packed with the varlen kernel: the H100 timed it,
the H200 too), `offload` (test_cuda's offload test checks the same bytes, more strictly), and
from test_cuda's stage its sampler test (now the sampler stage) and its CLI test (now the
multiturn stage, which adds the multi-turn path to it).

Besides the caps: 3 s a stage for its processes to end after SIGTERM, and 15 s for this process's
start and masked's 358M model, written in fp32 (8 s on 2 CPU cores): 319 s expected (<= 360,
asserted), 449 s if every stage ran to its cap (<= 540: one 10-minute command, asserted).
Needs torch with CUDA, transformers at the lock's version (carried as a wheel where the machine's
is another) and its tokenizers, tiktoken, pytest: docs/gpus.md says what to bring to a machine
without network.
"""
import argparse
import glob
import importlib
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

# bench/ is on sys.path from the line above
from gpu_step import read_metrics, run_capped, run_trainer, step_figures

# Qwen2.5-0.5B's shape (its config.json) at the BPE's vocab below: 358M parameters. Ids 0 and 1
# are the BPE's SPECIAL tokens: padding and the end of a response
QWEN_05B = dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, head_dim=64, vocab_size=262,
                max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True,
                bos_token_id=1, eos_token_id=1, pad_token_id=0)
SPECIAL = ["<|endoftext|>", "<|im_end|>"]  # the BPE's ids 0 (padding) and 1 (EOS)
REAL_VOCAB = 151936  # Qwen2.5's
STEPS = 2  # per trainer stage: the first is CUDA's warm-up, so one step is measured
# masked: a short instruction (GSM8K's, rollout.GSM8K_INSTRUCTION, would add ~50 tokens to every
# row, time the cap does not have); --smoke: the same flags at a toy size
MASKED = ["--task=gsm8k", "--instruction= Answer after ####.", "--rollout_engine=hf",
          "--dtype=bf16", "--sft_steps=0", "--plot_every=0", "--prompts_per_step=64",
          "--samples_per_prompt=8", "--max_new_tokens=256", "--num_minibatches=4",
          "--max_model_len=512", "--attention=masked", "--micro_batch_size=64"]
MASKED_SMOKE = ["--prompts_per_step=4", "--samples_per_prompt=2", "--max_new_tokens=8",
                "--num_minibatches=1", "--micro_batch_size=8", "--dtype=fp32"]
# lora and multiturn: configs/test_tiny.toml (tiny-llama, 5 SFT steps), the same on CPU and GPU
TINY = ["--config", "configs/test_tiny.toml"]
LORA = ["--rollout_engine=hf", "--plot_every=0", "--dtype=bf16", "--lora_rank=16"]
MULTITURN = ["--rollout_engine=hf", "--plot_every=0", "--task=toy_tool", "--max_turns=2",
             "--max_model_len=32"]
MODULES = ("config", "logprobs", "model_parallel", "rollout", "train_ppo")  # the five
# Seconds each stage's processes may run, and what they are expected to take on one H100/H200
# (the module docstring says where each comes from: measured, or an estimate and its arithmetic)
CAPS = dict(preflight=10, sampler=20, lora=30, multiturn=45, real_vocab=45, test_cuda=125,
            masked=130, async_split=5)
EXPECTED = dict(preflight=8, sampler=8, lora=15, multiturn=25, real_vocab=30, test_cuda=103,
                masked=114, async_split=1)
GRACE_S = 3  # after a cap's SIGTERM, before SIGKILL
SETUP_S = 15  # this process's start and masked's model, 358M in fp32 (8 s on 2 CPU cores)
PLAN_S = 360  # expected: 6 minutes at most, so that a second start and a rerun fit the lease
BUDGET_S = 540  # every stage to its cap: one 10-minute command, with a minute to spare
assert sum(EXPECTED.values()) + SETUP_S <= PLAN_S
assert sum(CAPS.values()) + GRACE_S * len(CAPS) + SETUP_S <= BUDGET_S
# --smoke: a toy size on CPU, where caps sized for a GPU mean nothing (on the project's shared
# 2-core box, importing torch, transformers and the five modules alone took 19 s)
SMOKE_CAP_S = 120


def save_random_model(path, fields, dtype):
    """A checkpoint of random weights (seed 1) with the config `fields`, saved in `dtype`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    fields = dict(fields)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(1)
    # drawn in fp32, then cast: bf16 draws took 18 s on 2 CPU cores at the real vocab, these 11-14
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(dtype).save_pretrained(path)


def publish(tmp, path):
    """tmp becomes path: a model dir is whole or absent, never cut off by a cap or a kill."""
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def write_sums(path, n=256):
    """n GSM8K-format sums of 1 to 12 terms ("What is 12 + 345?", "12 + 345 = 357\\n#### 357"):
    prompts of ragged lengths. Returns the questions."""
    rng = random.Random(1)
    questions = []
    with open(path + ".tmp", "w") as f:
        for _ in range(n):
            terms = " + ".join(str(rng.randint(1, 999)) for _ in range(rng.randint(1, 12)))
            total = sum(map(int, terms.split(" + ")))
            questions.append(f"What is {terms}?")
            answer = f"{terms} = {total}\n#### {total}"
            f.write(json.dumps({"question": questions[-1], "answer": answer}) + "\n")
    os.replace(path + ".tmp", path)
    return questions


def save_tokenizer(path, corpus, vocab_size):
    """A byte-level BPE of at most vocab_size ids trained on corpus with the tokenizers library,
    nothing downloaded (tests/test_real_model.py's recipe); ids 0 and 1 are SPECIAL."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=SPECIAL[0], eos_token=SPECIAL[1])
    assert len(fast) <= vocab_size and (fast.pad_token_id, fast.eos_token_id) == (0, 1), len(fast)
    fast.save_pretrained(path)


def step_model(run):
    """(model dir, prompts file) of the masked stage, written once: the Qwen2.5-0.5B shape, or
    tiny-qwen2 for --smoke, in fp32, with the BPE and the sums it was trained on."""
    import torch
    import model_parallel
    path = os.path.join(run.out, "tiny-qwen2" if run.smoke else "qwen2.5-0.5b-shape")
    prompts = os.path.join(run.out, "sums.jsonl")
    questions = write_sums(prompts)  # the same every time (seeded): what the BPE was trained on
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        start = time.time()
        tiny = dict(model_parallel.TINY_PRESETS["tiny-qwen2"], bos_token_id=1, eos_token_id=1, pad_token_id=0)
        fields = tiny if run.smoke else QWEN_05B
        save_random_model(path + ".tmp", fields, torch.float32)
        save_tokenizer(path + ".tmp", questions, fields["vocab_size"])  # last: the dir is whole
        publish(path + ".tmp", path)
        run.written["write_model_s"] = time.time() - start
    return path, prompts


def verdict(name, checks):
    """{name_error: the checks that failed}, or {} when every one of `checks` ({what: ok}) held."""
    failed = [what for what, ok in checks.items() if not ok]
    return {f"{name}_error": "failed: " + "; ".join(failed)} if failed else {}


def in_own_process(name, run, cap, *args):
    """Run this file as `--body name *args` (a stage's body in a process of its own, its output in
    name.log) and read the name.json it writes: its figures, kept when a check failed (the body
    then exits 1 with name_error among them); a crash's last line is the error."""
    result = os.path.join(run.out, f"{name}.json")
    log = os.path.join(run.out, f"{name}.log")
    if os.path.isfile(result):  # not an earlier run's figures
        os.remove(result)
    cmd = [sys.executable, os.path.abspath(__file__), "--body", name, *args, "--out", run.out,
           *(["--smoke"] if run.smoke else [])]
    with open(log, "w") as f:
        code = run_capped(cmd, cap, GRACE_S, cwd=ROOT, env=run.env, stdout=f,
                          stderr=subprocess.STDOUT)
    figures = read_json(result) if os.path.isfile(result) else {}
    if code != 0 and f"{name}_error" not in figures:
        with open(log, errors="replace") as f:
            lines = f.read().strip().splitlines() or ["(no output)"]
        figures[f"{name}_error"] = "stopped at the cap" if code is None else lines[-1][:300]
    return {f"{name}_finished": int(code == 0 and bool(figures)), **figures}


def read_json(path):
    with open(path) as f:
        return json.load(f)


def read_figures(out):
    """figures.json in out, or {} before the first stage has written it."""
    try:
        return read_json(os.path.join(out, "figures.json"))
    except (OSError, ValueError):
        return {}


def write_json(path, figures):
    """Atomically: a reader (or a kill) never meets half a file."""
    with open(path + ".tmp", "w") as f:
        json.dump(figures, f, indent=1)
    os.replace(path + ".tmp", path)


def fresh(run, name):
    """The stage's own dir, emptied: no earlier run's figures or checkpoint."""
    out = os.path.join(run.out, name)
    shutil.rmtree(out, ignore_errors=True)
    return out


def trainer_figures(name, out, finished):
    """<name>_finished and step_figures' figures of the trainer run in out: the first step's time,
    the later steps' phases, MFU and memory, the dtype and attention that ran (none if no step
    after the first finished)."""
    figures = step_figures(out, 1, 989.0) if read_metrics(out) else {}
    return {f"{name}_finished": int(finished), **{f"{name}_{k}": v for k, v in figures.items()}}


# -----------------------------------------------------------------------------
# The stages, in the order they run. Each takes (run, cap) and returns its figures, keys prefixed
# with its name, <name>_finished among them.

def preflight(run, cap):
    figures = in_own_process("preflight", run, cap, "--wheels", run.wheels)
    importlib.invalidate_caches()  # out/site may be new: this process imports from it too (main)
    return figures


def sampler(run, cap):
    return in_own_process("sampler", run, cap)


def lora(run, cap):
    """STEPS PPO steps of test_tiny under LoRA (the module docstring), and the largest
    logprob_mismatch: the engine's logprob of each sampled token, from merged bf16 weights,
    against the trainer's, from the base and the adapters apart."""
    out = fresh(run, "lora")
    code = run_trainer(TINY, 1, STEPS, out, LORA, run.env, timeout=cap)
    figures = trainer_figures("lora", out, code == 0)
    rows = read_metrics(out)
    if rows:
        figures["lora_logprob_mismatch"] = max(r["logprob_mismatch"] for r in rows)
    return figures


def multiturn(run, cap):
    """toy_tool on test_tiny, dtype and attention `auto`: STEPS steps with a checkpoint, resumed
    for one more (its output in multiturn/resume.log), the HF export loaded back on the CPU."""
    deadline = time.monotonic() + cap
    out = fresh(run, "multiturn")
    first = [*MULTITURN, f"--save_every={STEPS}"]
    code = run_trainer(TINY, 1, STEPS, out, first, run.env, timeout=cap)
    resumed = finite = False
    if code == 0:
        log = os.path.join(out, "resume.log")
        then = [*MULTITURN, "--resume=auto", "--export_hf=true"]
        with open(log, "w") as f:
            code = run_trainer(TINY, 1, STEPS + 1, out, then, run.env,
                               timeout=max(deadline - time.monotonic(), 1), stdout=f,
                               stderr=subprocess.STDOUT)
        with open(log, errors="replace") as f:
            resumed = "resumed from" in f.read()  # a fresh start would write steps 0-2 too
        finite = code == 0 and export_is_finite(os.path.join(out, "hf"))
    rows = read_metrics(out)
    figures = trainer_figures("multiturn", out, code == 0)
    for key in ("turns_per_episode", "tool_calls_per_episode"):
        figures[f"multiturn_{key}"] = sum(r[key] for r in rows) / len(rows) if rows else 0.0
    figures.update(multiturn_resumed=int(resumed), multiturn_export_finite=int(finite))
    figures.update(verdict("multiturn", {
        "both runs": code == 0, "resumed from the checkpoint": resumed,
        "steps 0-2 in metrics.jsonl": [r["step"] for r in rows] == list(range(STEPS + 1)),
        "finite losses and KL": all(math.isfinite(r[k]) for r in rows
                                    for k in ("policy_loss", "value_loss", "kl")),
        "the HF export's logits finite": finite,
        # dtype=auto picks the GPU recipe on CUDA (--smoke: fp32 on CPU)
        "dtype auto resolved to bf16": run.smoke or figures.get("multiturn_dtype") == "bf16"}))
    figures["multiturn_finished"] = int("multiturn_error" not in figures)
    return figures


def export_is_finite(path):
    """The trainer's HF export loads in transformers (fp32, CPU) and gives finite logits."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return bool(torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all())


def real_vocab(run, cap):
    model = os.path.join(run.out, "real-vocab-tiny" if run.smoke else "qwen2.5-0.5b-real-vocab")
    figures = in_own_process("real_vocab", run, cap, "--model", model)
    # the sampler's share of generation: its time a token at the same (B, V), from the sampler
    # stage (this run's or an earlier one's, in figures.json)
    done = read_figures(run.out)
    shape = [(done.get(f"sampler_{k}"), figures.get(f"real_vocab_{k}")) for k in ("batch", "vocab")]
    timed = "sampler_ms_a_token" in done and "real_vocab_generate_s" in figures
    if timed and all(a == b for a, b in shape):
        sampler_s = done["sampler_ms_a_token"] / 1e3 * figures["real_vocab_new_tokens"]
        figures["real_vocab_sampler_share"] = sampler_s / figures["real_vocab_generate_s"]
    return figures


def pytest_counts(log):
    """passed, failed, skipped, errors from a pytest -v log: its summary line, or, in a log cut off
    by the cap (no summary), the outcome of each test that finished. ("errors", not "error":
    test_cuda_error is the stage's own error, as every stage's.)"""
    counts = dict(passed=0, failed=0, skipped=0, errors=0)
    lines = log.strip().splitlines()
    summary = lines[-1] if lines and re.search(r" in [\d.]+s\b", lines[-1]) else ""
    for n, word in re.findall(r"(\d+) (passed|failed|skipped|error)", summary):
        counts[word if word != "error" else "errors"] += int(n)
    for word in re.findall(r"^\S+::.* (PASSED|FAILED|SKIPPED|ERROR)\b", log, re.M) if not summary else ():
        counts[word.lower() if word != "ERROR" else "errors"] += 1
    return counts


def test_cuda(run, cap):
    """pytest tests/test_cuda.py; finished = it ran to its end (every test passed or failed). Each
    test's time is in the log (--durations=0): the next cap is to be sized from them."""
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--durations=0",
           "tests/test_cuda.py", f"--junitxml={os.path.join(run.out, 'test_cuda.xml')}"]
    log = os.path.join(run.out, "test_cuda.log")
    with open(log, "w") as f:
        code = run_capped(cmd, cap, GRACE_S, cwd=ROOT, env=run.env, stdout=f, stderr=subprocess.STDOUT)
    with open(log, errors="replace") as f:
        counts = pytest_counts(f.read())
    return {"test_cuda_finished": int(code in (0, 1)), **{f"test_cuda_{k}": n for k, n in counts.items()}}


def masked(run, cap):
    """STEPS PPO steps at the Qwen2.5-0.5B shape through the CLI (gpu_step.py's), padded rows and
    masked SDPA (the module docstring), the run kept in out/masked."""
    model, prompts = step_model(run)
    out = fresh(run, "masked")
    extra = [f"--model={model}", f"--prompts={prompts}", *MASKED,
             *(MASKED_SMOKE if run.smoke else [])]
    code = run_trainer([], 1, STEPS, out, extra, run.env, timeout=cap)
    return trainer_figures("masked", out, code == 0)


def async_split(run, cap):
    """The paper model of bench/async_schedule.py on the masked stage's phases (this run's or an
    earlier one's, in figures.json): 8 GPUs colocated against the best split at max_staleness 1."""
    import async_schedule
    found = read_figures(run.out)
    g, w = found["masked_generate_s"], found["masked_refit_s"]
    t = found["masked_logprobs_s"] + found["masked_update_s"]
    figures = {"async_split_finished": 1}
    for tail in async_schedule.TAILS:
        colocated, _, (k1, n) = async_schedule.schedules(g, t, w, tail)
        key = f"async_split_tail{tail:g}".replace(".", "")
        figures.update({f"{key}_colocated_s": colocated, f"{key}_k1_s": k1, f"{key}_k1_generating": n})
    return figures


STAGES = {"preflight": preflight, "sampler": sampler, "lora": lora, "multiturn": multiturn,
          "real_vocab": real_vocab, "test_cuda": test_cuda, "masked": masked,
          "async_split": async_split}
assert list(STAGES) == list(CAPS) == list(EXPECTED)


# -----------------------------------------------------------------------------
# The stages' bodies, each run by in_own_process in a process of its own: it writes name.json.

def preflight_stage(out, wheels, smoke):
    """The carried wheels installed into out/site (on every stage's path: main), then what the
    stages need: torch and transformers (the lock's version), CUDA and bf16 (not asked of
    --smoke), the five modules imported."""
    carried = sorted(glob.glob(os.path.join(wheels, "*.whl")))
    if carried:  # --no-compile: byte-compiling transformers took 7.3 s of CPU of the cap's 10
        site = os.path.join(out, "site")
        shutil.rmtree(site + ".tmp", ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--no-compile", "--target", site + ".tmp", *carried], check=True)
        publish(site + ".tmp", site)  # whole or absent: never half installed by a cap
        importlib.invalidate_caches()  # out/site is on sys.path (main) from before it existed
    import torch
    import transformers
    with open(os.path.join(ROOT, "requirements-cpu.lock")) as f:
        lock = re.search(r"^transformers==(\S+)", f.read(), re.M).group(1)
    imported = []
    for name in MODULES:
        try:
            importlib.import_module(name)
            imported.append(name)
        except Exception as e:  # the next still tried: the figures name every one that failed
            print(f"import {name}: {type(e).__name__}: {e}", file=sys.stderr)
    cuda = torch.cuda.is_available()
    version = transformers.__version__
    figures = dict(preflight_wheels=len(carried), preflight_torch=torch.__version__,
                   preflight_transformers=version, preflight_lock_transformers=lock,
                   preflight_cuda=int(cuda),
                   preflight_bf16=int(cuda and torch.cuda.is_bf16_supported()),
                   preflight_gpu=torch.cuda.get_device_name(0) if cuda else "",
                   preflight_modules=len(imported))
    figures.update(verdict("preflight", {
        f"transformers {version} is the lock's {lock}": version == lock,
        f"the five modules import (not {', '.join(n for n in MODULES if n not in imported)})":
            len(imported) == len(MODULES),
        "CUDA with bf16": smoke or figures["preflight_bf16"]}))
    write_json(os.path.join(out, "preflight.json"), figures)
    if "preflight_error" in figures:
        sys.exit(figures["preflight_error"])


def ms_a_token(step, logits, seeds):
    """Milliseconds a call of the sampling step `step(logits, seeds, position, T=0.7)` takes, the
    mean of 20 after 3 to warm up."""
    import torch
    for t in range(3):
        step(logits, seeds, t, 0.7)
    if logits.is_cuda:  # (once every queued kernel has run)
        torch.cuda.synchronize()
    start = time.perf_counter()
    for t in range(20):
        step(logits, seeds, t, 0.7)
    if logits.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / 20 * 1e3


def sampler_stage(out, smoke):
    """rollout.sample on (B, V) bf16 logits at T=0.7 (--smoke: (8, 4096) on CPU) as the HF engine
    calls it. A row's token must not depend on the batch: the cumulative sum is of integers, exact
    in whatever order CUDA's scan adds them (a float cumsum's order changes with the batch's shape:
    ScanUtils.cuh, cub's scan for a row alone); the logprobs' normalizer is a float sum, so they
    agree to fp32 rounding. The CPU's exp may round another way: its draws agree on all but a few
    rows, and where they agree, the logprobs too. At most 3 new (B, V) tensors a token, and at
    least twice as fast as the Gumbel-max step it replaced (21 tensors, 12 of them int64)."""
    import torch
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import rollout
    from conftest import NewTensors, gumbel_step  # the tensor counter and the step it replaced
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    batch, vocab = (8, 4096) if smoke else (256, REAL_VOCAB)
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(batch, vocab, generator=g) * 3).bfloat16()  # (B, V) on the host
    seeds = torch.arange(batch) * 7919  # (B,)
    on_device, device_seeds = logits.to(device), seeds.to(device)
    tokens, logprobs = rollout.sample(on_device, device_seeds, 5, 0.7)  # (B,), (B,)
    order = torch.randperm(batch, generator=g).to(device)  # (B,)
    same, diff = True, 0.0
    for rows in (order, order[:batch // 4], order[:1]):  # every row, a quarter, one; shuffled
        some_tokens, some_logprobs = rollout.sample(on_device[rows], device_seeds[rows], 5, 0.7)
        same = same and torch.equal(tokens[rows], some_tokens)
        diff = max(diff, (logprobs[rows] - some_logprobs).abs().max().item())
    cpu_tokens, cpu_logprobs = rollout.sample(logits, seeds, 5, 0.7)  # (B,), (B,)
    agree = cpu_tokens == tokens.cpu()  # (B,)
    with NewTensors(batch * vocab) as new:
        rollout.sample(on_device, device_seeds, 5, 0.7)
    ours = ms_a_token(rollout.sample, on_device, device_seeds)
    gumbel = ms_a_token(gumbel_step, on_device, device_seeds)
    cpu_diff = (cpu_logprobs - logprobs.cpu())[agree].abs().max().item()  # where they agree
    figures = dict(sampler_batch=batch, sampler_vocab=vocab, sampler_same_tokens=int(same),
                   sampler_logprob_diff=diff, sampler_cpu_same_share=agree.float().mean().item(),
                   sampler_cpu_logprob_diff=cpu_diff,
                   sampler_new_tensors=new.count, sampler_ms_a_token=ours,
                   sampler_gumbel_ms_a_token=gumbel)
    figures.update(verdict("sampler", {
        f"the same tokens in batches of {batch}, {batch // 4} and 1": same,
        "logprobs to 1e-5 in any batch": diff <= 1e-5,
        "the CPU's draws on >= 98% of rows": figures["sampler_cpu_same_share"] > 0.98,
        "the CPU's logprobs to 1e-4": figures["sampler_cpu_logprob_diff"] <= 1e-4,
        f"at most 3 new (B, V) tensors ({', '.join(new.ops)})": new.count <= 3,
        # a GPU's memory traffic is what the step saves; a CPU's time says nothing of it
        "twice as fast as Gumbel-max": not cuda or ours < gumbel / 2}))
    write_json(os.path.join(out, "sampler.json"), figures)
    if "sampler_error" in figures:
        sys.exit(figures["sampler_error"])


def real_vocab_stage(model, out, smoke):
    """HFEngine.generate at Qwen's vocab (the model written first if absent): the figures in
    real_vocab.json."""
    import torch
    import model_parallel
    import rollout
    cuda = torch.cuda.is_available()
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    batch, new = (8, 4) if smoke else (256, 128)  # --smoke: the sampler stage's batch
    figures = {}
    if not os.path.isfile(os.path.join(model, "config.json")):
        start = time.time()
        tiny = dict(model_parallel.TINY_PRESETS["tiny-qwen2"], vocab_size=4096)
        save_random_model(model + ".tmp", tiny if smoke else dict(QWEN_05B, vocab_size=REAL_VOCAB), dtype)
        publish(model + ".tmp", model)
        figures["real_vocab_write_s"] = time.time() - start

    def clock():  # seconds, once every queued kernel has run
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()
    engine = rollout.HFEngine(model, device, stop_ids=[], dtype=dtype)  # no stop: every row runs on
    rng = random.Random(0)
    prompts = [[rng.randrange(engine.vocab_size) for _ in range(rng.randint(16, 80))] for _ in range(batch)]
    seeds = list(range(batch))
    engine.generate(prompts, seeds, [min(new, 8)] * batch, temperature=1.0)  # warm-up: kernels, allocator
    start = clock()
    responses = engine.generate(prompts, seeds, [new] * batch, temperature=1.0)
    generate_s = clock() - start
    assert all(len(ids) == new for ids, _ in responses)
    figures.update(real_vocab_vocab=engine.vocab_size, real_vocab_batch=batch,
                   real_vocab_new_tokens=new, real_vocab_generate_s=generate_s,
                   real_vocab_tokens_per_s=batch * new / generate_s)
    write_json(os.path.join(out, "real_vocab.json"), figures)


def show(figures):
    """One line a figure, flushed: a run stopped later still shows it."""
    for key, value in figures.items():
        print(f"{key:32s} {value:.4g}" if isinstance(value, (int, float)) else f"{key:32s} {value}",
              flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="the folder for every figure and run (default gpu_check; --smoke: a "
                   "temporary folder, removed)")
    p.add_argument("--smoke", action="store_true",
                   help="the stages on CPU at a toy size (a fast test runs this)")
    p.add_argument("--stages", default=",".join(STAGES),
                   help=f"the stages to run, comma-separated (default: all of {','.join(STAGES)}); the "
                   "others' figures stay in figures.json")
    p.add_argument("--wheels", default=os.path.join(ROOT, ".whl"),
                   help="the preflight installs the *.whl here into OUT/site, which every stage "
                   "imports first (default: .whl/ in the repo's root; docs/gpus.md)")
    p.add_argument("--body", help=argparse.SUPPRESS)  # internal: a stage's body, in its process
    p.add_argument("--model", help=argparse.SUPPRESS)  # the same: real_vocab's model dir
    args = p.parse_args(argv)
    asked = args.stages.split(",")
    if not set(asked) <= set(STAGES):
        print(f"gpu_check.py: unknown stage(s) {','.join(s for s in asked if s not in STAGES)} in --stages: "
              f"choose from {','.join(STAGES)}", file=sys.stderr)
        sys.exit(2)
    scratch = tempfile.TemporaryDirectory(prefix="gpu_check_") if args.smoke and not args.out else None
    args.out = os.path.abspath(args.out or (scratch.name if scratch else "gpu_check"))
    os.makedirs(args.out, exist_ok=True)
    # the carried wheels' packages, before the machine's: here and in every stage's processes
    site = os.path.join(args.out, "site")
    sys.path.insert(0, site)
    if args.body == "preflight":
        return preflight_stage(args.out, args.wheels, args.smoke)
    if args.body == "sampler":
        return sampler_stage(args.out, args.smoke)
    if args.body == "real_vocab":
        return real_vocab_stage(args.model, args.out, args.smoke)
    paths = [site, *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(paths))
    if args.smoke:  # CPU even where a GPU is present
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    else:
        import torch
        if not torch.cuda.is_available():
            sys.exit("bench/gpu_check.py needs a CUDA GPU (none found); on CPU use --smoke")
    print(f"caps {CAPS} s, +{GRACE_S} s each to stop, +{SETUP_S} s to start and write the model: "
          f"{sum(CAPS.values()) + GRACE_S * len(CAPS) + SETUP_S} s of {BUDGET_S}; expected "
          f"{sum(EXPECTED.values()) + SETUP_S} s", flush=True)
    run = SimpleNamespace(out=args.out, env=env, smoke=args.smoke, wheels=args.wheels, written={})
    # a SIGTERM (a wrapper's time limit) unwinds, so the running stage's processes are stopped too
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        ran = run_stages([s for s in STAGES if s in asked], run)
    finally:
        signal.signal(signal.SIGTERM, previous)  # main() also runs in-process (tests/test_gpu_check.py)
    print("RESULT " + " ".join(f"{k}={v:.4g}" for k, v in ran.items() if isinstance(v, (int, float))))


def run_stages(names, run):
    """Each stage in turn, into figures.json (merged: a stage's new figures replace its old ones,
    other stages' stay) after every one; returns the figures of this run."""
    start = time.time()
    path = os.path.join(run.out, "figures.json")
    figures = read_figures(run.out)
    ran = {}
    for name in names:
        began = time.time()
        try:
            got = STAGES[name](run, max(CAPS[name], SMOKE_CAP_S) if run.smoke else CAPS[name])
        except Exception as e:  # recorded; the next stage still runs
            got = {f"{name}_finished": 0, f"{name}_error": " ".join(f"{type(e).__name__}: {e}".split())[:300]}
        got = {**got, f"{name}_wall_s": time.time() - began, **run.written}
        run.written = {}
        figures = {k: v for k, v in figures.items() if not k.startswith(name + "_")}
        figures.update(got)
        ran.update(got)
        write_json(path, figures)
        show(got)
    ran["total_s"] = figures["total_s"] = time.time() - start
    write_json(path, figures)
    return ran


if __name__ == "__main__":
    main()
