"""One PPO step on GPUs, broken into its phases (needs CUDA).

    python bench/gpu_step.py --config configs/gsm8k_qwen2.5_0.5b_1gpu.toml --nproc 1
    python bench/gpu_step.py --config configs/gsm8k_qwen2.5_1.5b_8gpu.toml --nproc 8
    python bench/gpu_step.py --smoke    # no GPU needed: this code on CPU, tiny-llama, HF engine
                                        # (seconds)

Runs the real trainer (torchrun train_ppo.py) for --steps steps, skips the first (vLLM and
CUDA warm-up), and reports the median over the rest of, from metrics.jsonl (--out DIR keeps the
run, metrics.jsonl and all; bench/gpu_check.py reads its figures with step_figures):
  generate_s   time_rollout_s: vLLM generation (+ reward)
  logprobs_s   time_logprobs_s: the no-grad passes (old policy, reference, values) + advantages
  update_s     time_update_s: the PPO update of policy and critic
  refit_s      time_refit_s: gathering the policy and loading it into vLLM
  tokens_per_s_per_gpu  (prompt + response tokens of the step) / step time / GPUs
  update_mfu   model FLOPs of the update / (update_s * GPUs * peak bf16 FLOP/s), per step, with
               6 FLOPs per token per matmul weight (forward + backward, Kaplan et al. 2020),
               attention scores ignored, per PPO epoch: the policy's decoder weights and its
               LM head (vocab x hidden, counted once even when tied to the embedding, whose
               lookup is not a matmul), the critic's decoder weights and its hidden x 1 head.
               Counting 6 x all parameters for both models would overstate it by 8-16%.
  mem_used_gb  the largest per-step mem_used_gb: GPU memory in use by any allocator
               (torch.cuda.mem_get_info), sampled after the update
The attention path and dtype that ran are read back from the run's config.json.
--peak_tflops per GPU defaults to 989 (H100/H200 dense bf16). Last line: RESULT key=value ...
--smoke runs the same trainer and arithmetic on CPU (configs/test_tiny.toml, 2 steps, no SFT,
one process): its figures mean nothing, it only keeps this script from rotting between GPU runs.
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def matmul_weights(model_config, critic):
    """Weights that multiply every token (see update_mfu above), from the model's config alone."""
    import torch
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):  # shapes only, no memory
        model = AutoModelForCausalLM.from_config(model_config)
    decoder = sum(p.numel() for p in model.model.layers.parameters())
    head = model_config.hidden_size * (1 if critic else model_config.vocab_size)
    return decoder + head


def update_flops(model_config, tokens, ppo_epochs, with_critic):
    """FLOPs of one step's PPO update: 6 per token per matmul weight, per epoch."""
    weights = matmul_weights(model_config, critic=False)
    if with_critic:
        weights += matmul_weights(model_config, critic=True)
    return 6 * weights * tokens * ppo_epochs


def read_metrics(out):
    """The rows of a trainer run's out/metrics.jsonl ([] if it wrote none)."""
    if not os.path.isfile(os.path.join(out, "metrics.jsonl")):
        return []
    with open(os.path.join(out, "metrics.jsonl")) as f:
        lines = f.read().splitlines()
    try:
        return [json.loads(line) for line in lines]
    except json.JSONDecodeError:  # a run stopped while writing: its last row is cut off
        return [json.loads(line) for line in lines[:-1]]


def step_figures(out, nproc, peak_tflops):
    """The figures above from a trainer run's out_dir (its metrics.jsonl and config.json), the
    first step left out (warm-up): {} if no step after the first finished. Also the first step's
    time (first_step_s) and the attention path and dtype that ran."""
    every = read_metrics(out)
    rows = every[1:]
    if not rows:
        return {}
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    from transformers import AutoConfig
    sys.path.insert(0, ROOT)
    from model_parallel import TINY_PRESETS
    model_dir = os.path.join(out, "sft") if cfg["sft_steps"] else cfg["model"]
    if cfg["model"] in TINY_PRESETS and not cfg["sft_steps"]:
        model_dir = os.path.join(out, cfg["model"])  # the trainer writes a preset into its out_dir
    model_config = AutoConfig.from_pretrained(model_dir)
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    mfu = [update_flops(model_config, r["tokens"], cfg["ppo_epochs"], cfg["advantage_estimator"] == "gae")
           / (r["time_update_s"] * nproc * peak_tflops * 1e12) for r in rows]
    return dict(
        attention=cfg["attention"], dtype=cfg["dtype"], engine=cfg["rollout_engine"], steps=len(rows),
        first_step_s=every[0]["time_step_s"], step_s=med("time_step_s"),
        generate_s=med("time_rollout_s"), logprobs_s=med("time_logprobs_s"), update_s=med("time_update_s"),
        refit_s=med("time_refit_s"), tokens_per_s_per_gpu=med("tokens_per_s") / nproc,
        update_mfu=statistics.median(mfu), mem_used_gb=max(r["mem_used_gb"] for r in rows),
        params_m=matmul_weights(model_config, critic=False) / 1e6)


def run_trainer(config_file, nproc, steps, out, extra, env, timeout=None, **popen):
    """torchrun train_ppo.py into `out` (kept); returns its exit code (None: stopped at timeout,
    workers and all: run_capped). One process runs without torchrun (train_ppo.py sets up a world
    of one itself). `popen`: stdout, stderr, as subprocess.Popen takes them."""
    torchrun = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone",
                f"--nproc_per_node={nproc}"]
    cmd = [*(torchrun if nproc > 1 else [sys.executable]), "train_ppo.py", *config_file,
           f"--steps={steps}", f"--out_dir={out}", "--save_every=0", "--export_hf=false", *extra]
    return run_capped(cmd, timeout, cwd=ROOT, env=env, **popen)


def run_capped(cmd, timeout=None, grace=3, **popen):
    """subprocess.Popen(cmd, **popen) in a session of its own, waited for at most `timeout` seconds;
    then (or when this process is interrupted, or once it exits) its whole tree is stopped
    (stop_tree). Returns its exit code, None when the cap stopped it."""
    proc = subprocess.Popen(cmd, start_new_session=True, **popen)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        stop_tree(proc, grace)


def stop_tree(proc, grace):
    """SIGTERM to proc's process group and to every process in it or below proc, SIGKILL to those
    left after `grace` seconds, then reap proc. The tree is found by parent links, not by the
    group alone: torchrun starts its workers in sessions of their own, and once torchrun is gone
    they would live on (tests/test_cuda.py runs the CLI under torchrun)."""
    tree = process_tree(proc.pid, descendants=proc.poll() is None)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for kill, pid in [(os.killpg, proc.pid), *((os.kill, pid) for pid in tree)]:
            try:
                kill(pid, sig)
            except (ProcessLookupError, PermissionError):  # gone already
                pass
        deadline = time.monotonic() + grace
        while sig == signal.SIGTERM and time.monotonic() < deadline and any(map(alive, tree)):
            time.sleep(0.1)
        tree = set(filter(alive, tree))
    proc.wait()


def process_tree(root, descendants):
    """pids in process group `root`, and with `descendants` every process below pid `root` (only
    while root is not yet reaped is that pid surely still root's), read from /proc."""
    parents, groups = {}, {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # state, parent pid, process group, ...
        except OSError:  # it ended meanwhile
            continue
        parents[int(name)], groups[int(name)] = int(fields[1]), int(fields[2])
    tree = {pid for pid, group in groups.items() if group == root}
    frontier = {root} if descendants else set()
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - tree
        tree |= frontier
    return tree - {os.getpid()}


def alive(pid):
    """pid still runs (a zombie has ended: only its parent's wait is missing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/gsm8k_qwen2.5_0.5b_1gpu.toml")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--peak_tflops", type=float, default=989.0)
    p.add_argument("--out", help="keep the run here (default: a temporary dir, removed with --smoke)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, HF engine (a fast test runs this)")
    args, extra = p.parse_known_args()  # anything else goes to the trainer (--key=value)
    env = dict(os.environ)
    if args.smoke:  # the step code at the smallest size, on CPU even where a GPU is present
        args.config, args.nproc, args.steps = "configs/test_tiny.toml", 1, 2
        extra = ["--sft_steps=0", "--rollout_engine=hf", "--plot_every=0", *extra]
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")  # 1 thread: spare OpenMP threads only spin
    else:
        import torch
        if not torch.cuda.is_available():
            sys.exit("bench/gpu_step.py needs CUDA GPUs (none found); on CPU use --smoke, or "
                     "bench/peer_trl.py, bench/refit.py, bench/logprob_memory.py or bench/packing.py")
    scratch = tempfile.TemporaryDirectory(prefix="gpu_step_smoke_") if args.smoke and not args.out else None
    out = args.out or (scratch.name if scratch else tempfile.mkdtemp(prefix="gpu_step_"))
    if run_trainer(["--config", args.config], args.nproc, args.steps, out, extra, env):
        sys.exit(f"the trainer failed (its out_dir: {out})")
    figures = step_figures(out, args.nproc, args.peak_tflops)
    print(f"attention={figures.pop('attention')} dtype={figures.pop('dtype')} engine={figures.pop('engine')}")
    for key, value in figures.items():
        print(f"{key:22s} {value:.4g}")
    print("RESULT " + " ".join(f"{k}={v:.4g}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
