"""The engine/trainer mismatch made real on CPU, and what the off-policy correction does with it.

    .venv/bin/python bench/offpolicy.py          # make demo's toy, 2 ranks, vLLM, 10 steps a run
    .venv/bin/python bench/offpolicy.py --smoke  # 1 rank, the HF engine, 1 step, one bf16 run

The trainer computes in fp32; the engine samples in bf16 (engine_dtype=bf16), as a GPU's vLLM
does under fp32 master weights. Three runs of make demo's config from the same warm-up, the same
seed: the engine in fp32 (the floor: the mismatch of two fp32 implementations), then in bf16
under two corrections (old_logprobs=trainer in all three):
  token   offpolicy_is=token, mode mask, [0.5, 2]: IcePop's token mask;
  geo     offpolicy_is=geometric, mode mask, [0.99, 1.01] (SkyRL's default), with
          offpolicy_reject=seq_max_k3 at 0.05.
Each run's means over its steps: mismatch_k3 (KL(pi_engine || pi_old), k3 per token), the
fraction of response tokens and of sequences the correction zeroed, the weights' effective
sample size, and the reward of its last 5 steps. The mismatch is a ratio against the fp32 floor,
measured in the same run of this script.
Last line: RESULT k3_fp32=... k3_bf16=... k3_ratio=... token_masked=... seq_masked_geo=... ...
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {"fp32": ["--engine_dtype=fp32"],
        "token": ["--engine_dtype=bf16", "--offpolicy_is=token", "--offpolicy_is_mode=mask",
                  "--offpolicy_is_lower=0.5", "--offpolicy_is_bound=2"],
        "geo": ["--engine_dtype=bf16", "--offpolicy_is=geometric", "--offpolicy_is_mode=mask",
                "--offpolicy_is_lower=0.99", "--offpolicy_is_bound=1.01",
                "--offpolicy_reject=seq_max_k3", "--offpolicy_reject_bound=0.05"]}


def run(name, flags, out, smoke):
    """One torchrun of make demo's config; the rows of its metrics.jsonl."""
    size = (["--steps=1", "--sft_steps=2", "--prompts_per_step=4", "--samples_per_prompt=2",
             "--micro_batch_size=2", "--rollout_engine=hf"] if smoke else ["--steps=10"])
    ranks = 1 if smoke else 2
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", f"--nproc_per_node={ranks}", "train_ppo.py",
           "--config", "configs/demo_cpu.toml", "--old_logprobs=trainer", "--plot_every=0",
           "--export_hf=false", f"--out_dir={out}/{name}", *size, *flags]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{name}: the run failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    with open(os.path.join(out, name, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def mean(rows, key):
    return sum(r[key] for r in rows) / len(rows)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    smoke = parser.parse_args().smoke
    names = ["token"] if smoke else list(RUNS)
    with tempfile.TemporaryDirectory() as out:
        rows = {name: run(name, RUNS[name], out, smoke) for name in names}
    for name, r in rows.items():
        line = f"{name:6s} mismatch_k3 {mean(r, 'mismatch_k3'):.2e}  reward (last 5) " \
               f"{mean(r[-5:], 'reward_mean'):.3f}"
        if "offpolicy_ess" in r[0]:
            line += (f"  masked tokens {mean(r, 'offpolicy_token_masked'):.4f} sequences "
                     f"{mean(r, 'offpolicy_seq_masked'):.4f}  ESS {mean(r, 'offpolicy_ess'):.4f}")
        print(line)
    k3 = {name: mean(r, "mismatch_k3") for name, r in rows.items()}
    result = [f"k3_bf16={k3['token']:.3e}",
              f"token_masked={mean(rows['token'], 'offpolicy_token_masked'):.4f}",
              f"ess_token={mean(rows['token'], 'offpolicy_ess'):.4f}"]
    if not smoke:
        result = [f"k3_fp32={k3['fp32']:.3e}", *result,
                  f"k3_ratio={k3['token'] / max(k3['fp32'], 1e-30):.0f}",
                  f"seq_masked_geo={mean(rows['geo'], 'offpolicy_seq_masked'):.4f}",
                  f"token_masked_geo={mean(rows['geo'], 'offpolicy_token_masked'):.4f}",
                  *[f"reward_{n}={mean(r[-5:], 'reward_mean'):.3f}" for n, r in rows.items()]]
    print("RESULT " + " ".join(result))


if __name__ == "__main__":
    main()
