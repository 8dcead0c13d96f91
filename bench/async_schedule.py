"""Asynchronous rollouts on the toy demo, and the paper model of the schedules (docs/async.md).

    python bench/async_schedule.py           # the demo (configs/demo_cpu.toml) on 2 trainer ranks
                                             # + 1 rollout rank, at max_staleness 0 and 1 (~5 min)
    python bench/async_schedule.py --smoke   # configs/test_tiny.toml, 3 steps each (a fast test)

Each run: the last 5 steps' reward, the staleness of every step's batch, the mismatch the
correction sees (logprob_mismatch, mismatch_k3 and the weights' ESS, over the steps after the
first), and each side's busy and waiting seconds. On 2 shared cores the two sides compete for the
same cores: these seconds say who waits for whom, not what a GPU split would gain. That is the
paper model's, printed last from phase times measured before (inputs stated): a colocated step of
g seconds of generation and t of training (the no-grad passes and the update) on all N devices,
and w of weight transfer. Training's time scales as 1/devices. Generation's does too, but for a
share `tail` of it: the last, longest responses, decoded token by token while most of the batch
is done, which more devices do not shorten (nor fewer lengthen, while a device's batch is
memory-bound). On n of the N devices generating and the others training:
    g(n) = g (tail + (1 - tail) N / n)
    colocated           g + t + w
    max_staleness 0     g(n) + t N / (N - n) + w        (each side waits for the other)
    max_staleness 1     max(g(n), t N / (N - n)) + w    (the two overlap; the transfer is a meeting)
At tail 0 no split beats colocated (max(g N/n, t N/(N-n)) >= g + t for every n): asynchrony pays
only where the devices would idle, in generation's tail (and, not modelled, the engine's sleep and
wake-up, which a split does not need).
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 8  # devices the paper model splits
TAILS = (0.0, 0.5)  # generation's share that devices do not shorten: none, and half (assumed)

# (what, generation s, training s, transfer s, where the figures come from), each a colocated step
PHASES = [
    ("SmolLM2 GRPO, CPU", 7.0, 45.0 + 14.0, 1.0, "docs/real_model.md, host A: generation ~7 s, "
     "update ~45 s, reference pass ~14 s, refit ~1 s"),
    ("SmolLM2 PPO, CPU", 6.5, 44.5 + 16.0, 1.0, "docs/real_model.md, PPO on host A: generation "
     "5-8 s, update mean 44-45 s, no-grad passes 12-20 s, refit ~1 s"),
    ("generation 50%", 50.0, 48.0, 2.0, "assumed: half of a step generating, 2% transfer"),
    ("generation 70%", 70.0, 28.0, 2.0, "assumed: long chains of thought, 2% transfer"),
]


def schedules(g, t, w, tail):
    """(colocated, best max_staleness-0 (s, n), best max_staleness-1 (s, n)) on N devices."""
    def gen(n):
        return g * (tail + (1 - tail) * N / n)
    k0 = min((gen(n) + t * N / (N - n) + w, n) for n in range(1, N))
    k1 = min((max(gen(n), t * N / (N - n)) + w, n) for n in range(1, N))
    return g + t + w, k0, k1


def run(staleness, smoke, out):
    config = "configs/test_tiny.toml" if smoke else "configs/demo_cpu.toml"
    steps = ["--steps=3", "--sft_steps=0", "--rollout_engine=hf"] if smoke else []
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--nproc_per_node=3", "--standalone", "train_ppo.py", "--config", config,
           *steps, "--rollout_ranks=1", f"--max_staleness={staleness}", "--offpolicy_is=token",
           "--export_hf=false", "--plot_every=0", f"--out_dir={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    later = rows[1:]

    def mean(key, among=later):
        return sum(r[key] for r in among) / len(among)
    trainer_wait = sum(r["async_trainer_wait_s"] + r.get("async_send_wait_s", 0) for r in rows)
    return dict(
        reward_last5=mean("reward_mean", rows[-5:]),
        staleness=[r["async_staleness_max"] for r in rows],
        mismatch=mean("logprob_mismatch"), mismatch_k3=mean("mismatch_k3"),
        ess=mean("offpolicy_ess"),
        trainer_busy_s=sum(r["time_step_s"] for r in rows) - trainer_wait,
        trainer_wait_s=trainer_wait,
        generator_busy_s=sum(r["async_generate_s"] for r in rows),
        generator_wait_s=sum(r["async_generate_wait_s"] for r in rows))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default="out/async_schedule")
    args = parser.parse_args()
    found = {}
    for staleness in (0, 1):
        r = found[staleness] = run(staleness, args.smoke, os.path.join(args.out, f"k{staleness}"))
        print(f"max_staleness={staleness}: reward (last 5 steps) {r['reward_last5']:.3f}, "
              f"staleness by step {r['staleness']}")
        print(f"  after the first step: logprob_mismatch {r['mismatch']:.3g}, mismatch_k3 "
              f"{r['mismatch_k3']:.3g}, the weights' ESS {r['ess']:.4f}")
        print(f"  trainer ranks: busy {r['trainer_busy_s']:.1f} s, waiting {r['trainer_wait_s']:.1f}"
              f" s; rollout rank: busy {r['generator_busy_s']:.1f} s, waiting "
              f"{r['generator_wait_s']:.1f} s")
    print(f"\nthe paper model on {N} devices (step seconds; n = devices generating):")
    print("| phases (s) | tail | colocated | max_staleness 0 (best n) | max_staleness 1 (best n) "
          "| 1 / colocated |")
    print("|---|---|---|---|---|---|")
    for what, g, t, w, source in PHASES:
        for tail in TAILS:
            colocated, (k0, n0), (k1, n1) = schedules(g, t, w, tail)
            print(f"| {what}: g={g:g} t={t:g} w={w:g} | {tail:g} | {colocated:.1f} | {k0:.1f} "
                  f"({n0}) | {k1:.1f} ({n1}) | {k1 / colocated:.2f} |")
    for what, *_, source in PHASES:
        print(f"  {what}: {source}")
    k0, k1 = found[0], found[1]
    grpo = schedules(*PHASES[0][1:4], 0.5)
    gen70 = schedules(*PHASES[3][1:4], 0.5)
    print(f"RESULT k1_reward_last5={k1['reward_last5']:.4f} "
          f"k1_staleness_min_after_first={min(k1['staleness'][1:])} "
          f"k1_staleness_max={max(k1['staleness'])} k0_staleness_max={max(k0['staleness'])} "
          f"k0_mismatch={k0['mismatch']:.3g} k1_mismatch={k1['mismatch']:.3g} "
          f"k1_ess={k1['ess']:.4f} grpo_cpu_tail05_k1_over_colocated={grpo[2][0] / grpo[0]:.3f} "
          f"gen70_tail05_k1_over_colocated={gen70[2][0] / gen70[0]:.3f}")


if __name__ == "__main__":
    main()
