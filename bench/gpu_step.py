"""One PPO step on GPUs, broken into its phases (needs CUDA).

    python bench/gpu_step.py --config configs/gsm8k_qwen2.5_0.5b_1gpu.toml --nproc 1
    python bench/gpu_step.py --config configs/gsm8k_qwen2.5_1.5b_8gpu.toml --nproc 8

Runs the real trainer (torchrun train_ppo.py) for --steps steps, skips the first (vLLM and
CUDA warm-up), and reports the median over the rest of, from metrics.jsonl:
  generate_s   time_rollout_s: vLLM generation (+ reward)
  logprobs_s   time_logprobs_s: the three no-grad passes (old, reference, values)
  train_s      time_train_s - time_logprobs_s: the PPO update of policy and critic
  refit_s      time_refit_s: gathering the policy and loading it into vLLM
  tokens_per_s_per_gpu  (prompt + response tokens of the global batch) / step time / GPUs
  train_mfu    model FLOPs of the update / (train_s * GPUs * peak bf16 FLOP/s): 6 N per token
               for each of policy and critic per epoch (forward + backward, Kaplan et al.
               2020's 6N rule, attention ignored), over --peak_tflops per GPU (989: H100/H200
               dense bf16)
  peak_mem_gb  the largest per-step peak_mem_gb (torch.cuda.max_memory_allocated)
Last line: RESULT key=value ...
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/gsm8k_qwen2.5_0.5b_1gpu.toml")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--peak_tflops", type=float, default=989.0)
    args, extra = p.parse_known_args()  # anything else goes to the trainer (--key=value)
    import torch
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_step.py needs CUDA GPUs (none found); on CPU use bench/refit.py, "
                 "bench/logprob_memory.py or bench/packing.py")
    out = tempfile.mkdtemp(prefix="gpu_step_")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    subprocess.run([torchrun, "--standalone", f"--nproc_per_node={args.nproc}", "train_ppo.py",
                    "--config", args.config, f"--steps={args.steps}", f"--out_dir={out}",
                    "--save_every=0", "--export_hf=false", *extra], cwd=ROOT, check=True)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))][1:]
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    med = lambda key: statistics.median(r[key] for r in rows)

    # parameters of the policy (the critic has the same backbone, without the LM head)
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg["model"]))
    n_params = sum(p.numel() for p in model.parameters())
    tokens = med("tokens_per_s") * med("time_step_s")  # global tokens of one step
    train_s = med("time_train_s") - med("time_logprobs_s")
    flops = 2 * 6 * n_params * tokens * cfg["ppo_epochs"]  # policy + critic, fwd + bwd
    figures = dict(
        generate_s=med("time_rollout_s"), logprobs_s=med("time_logprobs_s"), train_s=train_s,
        refit_s=med("time_refit_s"), tokens_per_s_per_gpu=med("tokens_per_s") / args.nproc,
        train_mfu=flops / (train_s * args.nproc * args.peak_tflops * 1e12),
        peak_mem_gb=max(r["peak_mem_gb"] for r in rows), params_m=n_params / 1e6)
    for key, value in figures.items():
        print(f"{key:22s} {value:.4g}")
    print("RESULT " + " ".join(f"{k}={v:.4g}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
