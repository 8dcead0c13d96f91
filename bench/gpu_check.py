"""Everything a GPU can tell that a CPU cannot, in one command that keeps what it measures.

    python bench/gpu_check.py --out gpu_check        # one GPU, whatever torch it has: <= 6 min on
                                                     # an H100 (make gpu-check)
    python bench/gpu_check.py --smoke --out DIR      # the same stages on CPU, tiny model (a fast
                                                     # test runs this): its figures mean nothing

A GPU is lent rarely and briefly, so each stage runs in its own process under a time cap, and
whatever it wrote stays in --out even if the cap stops it; the figures are read back from what was
written. The stages, in order:

  1. test_cuda   pytest tests/test_cuda.py (the trainer's passes against HF on the GPU, the
                 varlen kernels, the CLI's train/resume/export, offload's freed bytes): passed,
                 failed, skipped (test_cuda.log, test_cuda.xml)
  2. masked      bench/gpu_step.py's step at the Qwen2.5-0.5B shape (random weights written here,
                 the toy tokenizer's vocab of 262: 358M parameters; 64 prompts x 8 samples of up
                 to 256 new tokens, 4 minibatches, the HF engine, bf16, GAE with a critic),
                 padded rows and masked SDPA, 64 rows a microbatch
  3. packed      the same, packed rows of 16,384 tokens and the varlen kernel
                 (each: the first step's time, then the median of the later steps of each phase,
                 the update's MFU (gpu_step.py's count) and the memory in use after the update;
                 its metrics.jsonl and config.json under masked/ and packed/)
  4. offload     the bytes move_optimizer_state(optimizer, "host") frees on the GPU at that shape,
                 against AdamW's two moments (8 bytes a parameter), and whether they come back the
                 same (offload.json)

Each step stage runs 3 PPO steps (the first is CUDA's warm-up: 45-67 s at this shape on an H200
before the HF engine sampled on the device); its cap leaves room for it. All figures go to
figures.json; the last line is RESULT key=value ... (a stage that did not finish reports
*_finished=0 and no figures). Needs only what tests/test_cuda.py needs (torch with CUDA,
transformers at the lock's version, tiktoken, pytest): docs/gpus.md says what to bring to a
machine without network.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

# Qwen2.5-0.5B's shape (its config.json) with the toy tokenizer's vocab: 358M parameters
QWEN_05B = dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, head_dim=64, vocab_size=262,
                max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True,
                bos_token_id=256, eos_token_id=256, pad_token_id=257)
STEP = ["--task=toy_add", "--rollout_engine=hf", "--dtype=bf16", "--sft_steps=0", "--plot_every=0",
        "--prompts_per_step=64", "--samples_per_prompt=8", "--max_new_tokens=256", "--num_minibatches=4",
        "--max_model_len=512"]
LAYOUTS = {"masked": ["--attention=masked", "--micro_batch_size=64"],
           "packed": ["--attention=varlen", "--packing=true", "--max_tokens_per_microbatch=16384"]}
# seconds each stage may run (the sum is 6 minutes); measured on an H200: test_cuda 125 s
CAPS = {"test_cuda": 150, "masked": 90, "packed": 90, "offload": 30}


def write_model(path, smoke):
    """The Qwen2.5-0.5B-shaped checkpoint (random weights), or tiny-qwen2 for --smoke."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    import model_parallel
    if smoke:
        return model_parallel.materialize_tiny_model("tiny-qwen2", os.path.dirname(path), seed=1)
    if not os.path.isfile(os.path.join(path, "config.json")):
        fields = dict(QWEN_05B)
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        torch.manual_seed(1)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def test_cuda(out, env, cap):
    """Stage 1: tests/test_cuda.py under pytest; its counts from the summary line."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py",
           f"--junitxml={os.path.join(out, 'test_cuda.xml')}"]
    log = os.path.join(out, "test_cuda.log")
    with open(log, "w") as f:
        try:
            subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=cap)
        except subprocess.TimeoutExpired:
            return {"test_cuda_finished": 0}
    summary = open(log).read().strip().splitlines()[-1]
    found = re.findall(r"(\d+) (passed|failed|skipped|error)", summary)
    counts = {f"test_cuda_{word}": int(n) for n, word in found}
    return {"test_cuda_finished": 1, "test_cuda_passed": 0, "test_cuda_failed": 0, **counts}


def step(name, model, out, env, cap, smoke):
    """Stages 2 and 3: three PPO steps through the CLI (gpu_step.py's run), kept in out/name."""
    from gpu_step import run_trainer, step_figures
    run = os.path.join(out, name)
    extra = [f"--model={model}", *STEP, *LAYOUTS[name]]
    if smoke:  # the same flags at a toy size
        extra += ["--prompts_per_step=4", "--samples_per_prompt=2", "--max_new_tokens=8",
                  "--num_minibatches=1", "--micro_batch_size=8", "--max_tokens_per_microbatch=512",
                  "--dtype=fp32"]
    code = run_trainer([], 1, 2 if smoke else 3, run, extra, env, timeout=cap)
    figures = step_figures(run, 1, 989.0) if os.path.isfile(os.path.join(run, "metrics.jsonl")) else {}
    for key in ("attention", "dtype", "engine"):
        figures.pop(key, None)
    return {f"{name}_finished": int(code == 0), **{f"{name}_{k}": v for k, v in figures.items()}}


def offload(model, out, env, cap):
    """Stage 4, in a process of its own (it joins a process group)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--offload_stage", model, "--out", out]
    try:
        subprocess.run(cmd, cwd=ROOT, env=env, timeout=cap, check=True)
        with open(os.path.join(out, "offload.json")) as f:
            return {"offload_finished": 1, **json.load(f)}
    except (subprocess.TimeoutExpired, subprocess.CalledProcessError):
        return {"offload_finished": 0}


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
    with open(os.path.join(out, "offload.json"), "w") as f:
        json.dump(figures, f)
    torch.distributed.destroy_process_group()
    mp.release_mesh(mesh)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="the folder for every figure and run (default gpu_check; --smoke: a "
                   "temporary folder, removed)")
    p.add_argument("--smoke", action="store_true",
                   help="the stages on CPU at a toy size (a fast test runs this)")
    p.add_argument("--offload_stage", help=argparse.SUPPRESS)  # internal: stage 4, in its process
    args = p.parse_args()
    scratch = tempfile.TemporaryDirectory(prefix="gpu_check_") if args.smoke and not args.out else None
    args.out = args.out or (scratch.name if scratch else "gpu_check")
    os.makedirs(args.out, exist_ok=True)
    if args.offload_stage:
        return offload_stage(args.offload_stage, args.out)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.smoke:  # CPU even where a GPU is present
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    else:
        import torch
        if not torch.cuda.is_available():
            sys.exit("bench/gpu_check.py needs a CUDA GPU (none found); on CPU use --smoke")
    start = time.time()
    model = write_model(os.path.join(os.path.abspath(args.out), "qwen2.5-0.5b-shape"), args.smoke)
    figures = test_cuda(args.out, env, CAPS["test_cuda"])
    for name in LAYOUTS:
        figures.update(step(name, model, os.path.abspath(args.out), env, CAPS[name], args.smoke))
    figures.update(offload(model, os.path.abspath(args.out), env, CAPS["offload"]))
    figures["total_s"] = time.time() - start
    with open(os.path.join(args.out, "figures.json"), "w") as f:
        json.dump(figures, f, indent=1)
    for key, value in figures.items():
        print(f"{key:32s} {value:.4g}")
    print("RESULT " + " ".join(f"{k}={v:.4g}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
