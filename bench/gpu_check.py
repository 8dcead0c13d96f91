"""Everything a GPU can tell that a CPU cannot, in one command that keeps every figure it learns.

    python bench/gpu_check.py --out gpu_check        # one GPU, whatever torch it has: at most 9 min
                                                     # (make gpu-check)
    python bench/gpu_check.py --out gpu_check --stages masked,real_vocab
                                                     # those stages again; figures.json keeps the
                                                     # others' figures
    python bench/gpu_check.py --smoke --out DIR      # the same stages on CPU, tiny models (a fast
                                                     # test runs this): its figures mean nothing

A GPU is lent rarely and briefly (at most 10 minutes a command), so nothing measured may be lost.
Each stage runs in processes of its own, in a session of its own, under a time cap; at the cap
its whole process tree is stopped (SIGTERM, then SIGKILL: pytest's mp.spawn children and
torchrun's workers too). figures.json in --out is rewritten after every stage (atomically), each
stage's figures are printed as it finishes, and a stage that fails or is stopped reports
<stage>_finished=0 (figures.json also has <stage>_error, a line) while the next stage still runs.
The last line is RESULT key=value ... of the stages that ran; --stages merges into figures.json.
Each stage's wall time (<stage>_wall_s) and the models' writing times (write_model_s,
real_vocab_write_s) are figures too: the next caps are to be sized from them.

The stages, in order, with their caps (CAPS below; measured on one H200, 2026-11-26, docs/gpus.md):

  test_cuda   150 s  pytest tests/test_cuda.py: passed, failed, skipped, errors (test_cuda.log,
                     test_cuda.xml); a run stopped by the cap counts the tests that finished.
                     Measured: 125 s (6 of 7 passed), before the sampler's test (B=512 at Qwen's
                     vocab, the CPU's draws among them: ~10 s, estimated)
  masked      130 s  bench/gpu_step.py's PPO step at the Qwen2.5-0.5B shape (random weights and a
                     262-id byte-level BPE written here: 358M parameters; 64 prompts x 8 samples
                     of up to 256 new tokens, 4 minibatches, the HF engine, bf16, GAE with a
                     critic) on GSM8K-format sums of 1 to 12 terms (task=gsm8k: ragged prompts of
                     about 30 to 100 tokens, so left padding and the masks run on the GPU), padded
                     rows and masked SDPA, 64 rows a microbatch. 2 steps: the first (CUDA's
                     warm-up) measured 45-67 s, a later one 39 s (with 4-token toy prompts; ~10%
                     more for these), ~15 s to start and load
  packed      125 s  the same with packed rows of 16,384 tokens and the varlen kernel: a later
                     step measured 30-35 s (each step stage: the first step's time, the later
                     step's phases, the update's MFU, the memory in use; metrics.jsonl and
                     config.json kept in masked/ and packed/)
  offload      30 s  the bytes move_optimizer_state(optimizer, "host") frees on the GPU at that
                     shape, against AdamW's two moments, and whether they come back the same
                     (offload.json). Not measured: a start, a load and one AdamW step, ~20 s
  real_vocab   60 s  generation at Qwen's real vocab (151,936 ids; the Qwen2.5-0.5B shape, random
                     weights written by the stage in bf16: 494M parameters): HFEngine.generate for
                     256 prompts of 16 to 80 random ids, 128 new tokens each (no stop ids), after
                     a warm-up call; tokens per second, and the share of that time the sampler
                     takes, timed alone on (256, 151,936) bf16 logits (real_vocab.json). Not
                     measured: writing took 11-14 s on 2 CPU cores; ~10 s to generate

Besides the caps: 3 s a stage for its processes to end after SIGTERM, and 25 s for this process's
start and the 358M model it writes in fp32 (8 s on 2 CPU cores): 535 s in all (<= 540, asserted).
Needs only what tests/test_cuda.py needs (torch with CUDA, transformers at the lock's version and
its tokenizers, tiktoken, pytest): docs/gpus.md says what to bring to a machine without network.
"""
import argparse
import json
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

from gpu_step import run_capped  # bench/ is on sys.path from the line above

# Qwen2.5-0.5B's shape (its config.json) at the BPE's vocab below: 358M parameters. Ids 0 and 1
# are the BPE's SPECIAL tokens: padding and the end of a response
QWEN_05B = dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, head_dim=64, vocab_size=262,
                max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True,
                bos_token_id=1, eos_token_id=1, pad_token_id=0)
SPECIAL = ["<|endoftext|>", "<|im_end|>"]  # the BPE's ids 0 (padding) and 1 (EOS)
REAL_VOCAB = 151936  # Qwen2.5's
STEPS = 2  # per step stage: the first is CUDA's warm-up, so one step is measured
# a short instruction: GSM8K's (rollout.GSM8K_INSTRUCTION) would add ~50 tokens to every row, time
# the caps do not have
STEP = ["--task=gsm8k", "--instruction= Answer after ####.", "--rollout_engine=hf", "--dtype=bf16",
        "--sft_steps=0", "--plot_every=0", "--prompts_per_step=64", "--samples_per_prompt=8",
        "--max_new_tokens=256", "--num_minibatches=4", "--max_model_len=512"]
LAYOUTS = {"masked": ["--attention=masked", "--micro_batch_size=64"],
           "packed": ["--attention=varlen", "--packing=true", "--max_tokens_per_microbatch=16384"]}
# Seconds each stage's processes may run (the module docstring has the measurements behind them)
CAPS = {
    "test_cuda": 150,  # measured 125 s on an H200, + the sampler's test (~10 s, estimated)
    "masked": 130,  # start ~15 s + first step 45-67 s + a later step 39 s (+10%: longer prompts)
    "packed": 125,  # the same with a later step of 30-35 s
    "offload": 30,  # not measured: start, load, one AdamW step (~20 s)
    "real_vocab": 60,  # not measured: write 494M in bf16 (11-14 s on 2 CPU cores), generate (~10 s)
}
GRACE_S = 3  # after a cap's SIGTERM, before SIGKILL
SETUP_S = 25  # this process's start and the step stages' model, 358M in fp32 (8 s on 2 CPU cores)
BUDGET_S = 540  # 9 minutes: one 10-minute command on the lent GPU machine, with a minute to spare
assert sum(CAPS.values()) + GRACE_S * len(CAPS) + SETUP_S <= BUDGET_S


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
    """(model dir, prompts file) of the step stages and offload, written by the first stage that
    needs them (once: a failed write fails the others at once): the Qwen2.5-0.5B shape, or
    tiny-qwen2 for --smoke, in fp32, with the BPE and the sums it was trained on."""
    import torch
    import model_parallel
    path = os.path.join(run.out, "tiny-qwen2" if run.smoke else "qwen2.5-0.5b-shape")
    prompts = os.path.join(run.out, "sums.jsonl")
    questions = write_sums(prompts)  # the same every time (seeded): what the BPE was trained on
    if run.model is None and not os.path.isfile(os.path.join(path, "tokenizer.json")):
        run.model = "failed"  # until it is written
        start = time.time()
        tiny = dict(model_parallel.TINY_PRESETS["tiny-qwen2"], bos_token_id=1, eos_token_id=1, pad_token_id=0)
        fields = tiny if run.smoke else QWEN_05B
        save_random_model(path + ".tmp", fields, torch.float32)
        save_tokenizer(path + ".tmp", questions, fields["vocab_size"])  # last: the dir is whole
        publish(path + ".tmp", path)
        run.model = path
        run.written["write_model_s"] = time.time() - start
    if run.model == "failed":
        raise RuntimeError("writing the model failed in an earlier stage (its error)")
    return path, prompts


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
    """pytest tests/test_cuda.py; finished = it ran to its end (every test passed or failed)."""
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "tests/test_cuda.py",
           f"--junitxml={os.path.join(run.out, 'test_cuda.xml')}"]
    log = os.path.join(run.out, "test_cuda.log")
    with open(log, "w") as f:
        code = run_capped(cmd, cap, GRACE_S, cwd=ROOT, env=run.env, stdout=f, stderr=subprocess.STDOUT)
    with open(log, errors="replace") as f:
        counts = pytest_counts(f.read())
    return {"test_cuda_finished": int(code in (0, 1)), **{f"test_cuda_{k}": n for k, n in counts.items()}}


def step(name, run, cap):
    """STEPS PPO steps through the CLI (gpu_step.py's), the run kept in out/name."""
    from gpu_step import run_trainer, step_figures
    model, prompts = step_model(run)
    out = os.path.join(run.out, name)
    if os.path.isfile(os.path.join(out, "metrics.jsonl")):  # not an earlier run's figures
        os.remove(os.path.join(out, "metrics.jsonl"))
    extra = [f"--model={model}", f"--prompts={prompts}", *STEP, *LAYOUTS[name]]
    if run.smoke:  # the same flags at a toy size
        extra += ["--prompts_per_step=4", "--samples_per_prompt=2", "--max_new_tokens=8",
                  "--num_minibatches=1", "--micro_batch_size=8", "--max_tokens_per_microbatch=512",
                  "--dtype=fp32"]
    code = run_trainer([], 1, STEPS, out, extra, run.env, timeout=cap)
    figures = step_figures(out, 1, 989.0) if os.path.isfile(os.path.join(out, "metrics.jsonl")) else {}
    for key in ("attention", "dtype", "engine"):
        figures.pop(key, None)
    return {f"{name}_finished": int(code == 0), **{f"{name}_{k}": v for k, v in figures.items()}}


def in_own_process(name, flag, model, run, cap):
    """Run this file with `flag model` (a stage's body in a process of its own) and read the
    name.json it writes."""
    result = os.path.join(run.out, f"{name}.json")
    if os.path.isfile(result):  # not an earlier run's figures
        os.remove(result)
    cmd = [sys.executable, os.path.abspath(__file__), flag, model, "--out", run.out,
           *(["--smoke"] if run.smoke else [])]
    code = run_capped(cmd, cap, GRACE_S, cwd=ROOT, env=run.env)
    if code != 0 or not os.path.isfile(result):
        return {f"{name}_finished": 0}
    with open(result) as f:
        return {f"{name}_finished": 1, **json.load(f)}


def offload(run, cap):
    return in_own_process("offload", "--offload_stage", step_model(run)[0], run, cap)


def real_vocab(run, cap):
    model = os.path.join(run.out, "real-vocab-tiny" if run.smoke else "qwen2.5-0.5b-real-vocab")
    return in_own_process("real_vocab", "--real_vocab_stage", model, run, cap)


STAGES = {"test_cuda": test_cuda,
          "masked": lambda run, cap: step("masked", run, cap),
          "packed": lambda run, cap: step("packed", run, cap),
          "offload": offload,
          "real_vocab": real_vocab}
assert list(STAGES) == list(CAPS)


def write_json(path, figures):
    """Atomically: a reader (or a kill) never meets half a file."""
    with open(path + ".tmp", "w") as f:
        json.dump(figures, f, indent=1)
    os.replace(path + ".tmp", path)


def offload_stage(model, out):
    """One AdamW step of the policy (bf16 recipe, fp32 master weights), then its moments to the
    host: the GPU bytes freed against the moments' bytes, and the moments back unchanged."""
    import torch
    import config
    import model_parallel as mp
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    _, _, device = mp.init_distributed()
    mesh = mp.make_mesh(1, 1, 1, device.type)
    cfg = config.Config(dtype="bf16")
    policy = mp.load_policy(model, mesh, cfg)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6, fused=True)
    lp, _ = mp.forward_policy(policy, torch.tensor([list(range(1, 65))]), [64], mesh, cfg)
    lp.sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    keys = ("exp_avg", "exp_avg_sq")
    moments = [mp._local(s[k]).clone() for s in optimizer.state.values() for k in keys]

    def used():  # bytes the caching allocator has handed out (0 on CPU)
        if device.type != "cuda":
            return 0
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()
    before = used()
    start = time.perf_counter()
    mp.move_optimizer_state(optimizer, "host")
    out_s = time.perf_counter() - start
    freed = before - used()
    mp.move_optimizer_state(optimizer, device)
    back = [mp._local(s[k]) for s in optimizer.state.values() for k in keys]
    same = all(torch.equal(a, b) for a, b in zip(back, moments))
    figures = dict(offload_freed_gb=freed / 2**30, offload_moments_gb=sum(m.nbytes for m in moments) / 2**30,
                   offload_out_s=out_s, offload_same_after=int(same))
    write_json(os.path.join(out, "offload.json"), figures)
    torch.distributed.destroy_process_group()
    mp.release_mesh(mesh)


def real_vocab_stage(model, out, smoke):
    """HFEngine.generate at Qwen's vocab (the model written first if absent), and the sampler alone
    on logits of the same shape and dtype for as many tokens: the figures in real_vocab.json."""
    import torch
    import model_parallel
    import rollout
    cuda = torch.cuda.is_available()
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    batch, new = (4, 4) if smoke else (256, 128)
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
    logits = torch.randn(batch, engine.vocab_size, device=device, dtype=dtype)  # (B, V)
    seed_ids = torch.tensor(seeds, device=device)  # (B,)
    rollout.sample(logits, seed_ids, 0, 1.0)  # warm-up
    start = clock()
    for t in range(new):
        rollout.sample(logits, seed_ids, t, 1.0)  # (T = 1: its in-place division changes nothing)
    sampler_s = clock() - start
    figures.update(real_vocab_vocab=engine.vocab_size, real_vocab_batch=batch, real_vocab_new_tokens=new,
                   real_vocab_generate_s=generate_s, real_vocab_tokens_per_s=batch * new / generate_s,
                   real_vocab_sampler_s=sampler_s, real_vocab_sampler_share=sampler_s / generate_s)
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
    p.add_argument("--offload_stage", help=argparse.SUPPRESS)  # internal: a stage's body, in its process
    p.add_argument("--real_vocab_stage", help=argparse.SUPPRESS)  # the same
    args = p.parse_args(argv)
    asked = args.stages.split(",")
    if not set(asked) <= set(STAGES):
        print(f"gpu_check.py: unknown stage(s) {','.join(s for s in asked if s not in STAGES)} in --stages: "
              f"choose from {','.join(STAGES)}", file=sys.stderr)
        sys.exit(2)
    scratch = tempfile.TemporaryDirectory(prefix="gpu_check_") if args.smoke and not args.out else None
    args.out = os.path.abspath(args.out or (scratch.name if scratch else "gpu_check"))
    os.makedirs(args.out, exist_ok=True)
    if args.offload_stage:
        return offload_stage(args.offload_stage, args.out)
    if args.real_vocab_stage:
        return real_vocab_stage(args.real_vocab_stage, args.out, args.smoke)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.smoke:  # CPU even where a GPU is present
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    else:
        import torch
        if not torch.cuda.is_available():
            sys.exit("bench/gpu_check.py needs a CUDA GPU (none found); on CPU use --smoke")
    print(f"caps {CAPS} s, +{GRACE_S} s each to stop, +{SETUP_S} s to start and write the model: "
          f"{sum(CAPS.values()) + GRACE_S * len(CAPS) + SETUP_S} s of {BUDGET_S}", flush=True)
    run = SimpleNamespace(out=args.out, env=env, smoke=args.smoke, model=None, written={})
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
    try:
        with open(path) as f:
            figures = json.load(f)
    except (OSError, ValueError):  # none yet
        figures = {}
    ran = {}
    for name in names:
        began = time.time()
        try:
            got = STAGES[name](run, CAPS[name])
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
