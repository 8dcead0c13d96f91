"""What the trainer computes against what it must, and how evenly the dp ranks share it, on a
GSM8K-like step: before and after issue 28 (microbatches sized by their own rows, dp ranks given
equal token sums).

    python bench/packing.py            # the 8-GPU GSM8K recipe's step: 512 sequences, 4 minibatches
    python bench/packing.py --smoke    # 64 sequences, 1 minibatch: the same code, seconds

Lengths: prompts of 60-200 tokens (uniform), responses of 20-512 tokens, log-normal with a median
of ~150 and a long tail cut at max_new_tokens = 512 (instruct models on GSM8K write ~100-300
tokens, and a few ramble to the limit). 8 dp ranks, micro_batch_size 8, packed rows of 8192.

- padded ratio = computed tokens / real tokens with unpacked rows.
  before: each rank's rows were its contiguous slice of each minibatch, cut into microbatches in
  order, and every microbatch was padded to the longest row of the rank's whole batch (the (b, S)
  tensor _layout received was never trimmed): rows x that longest, rounded up to a multiple of 2.
  after: the rows of train_ppo.balanced_split, each minibatch's cut by model_parallel.microbatches
  (longest first) and laid out by model_parallel._layout, which pads each to its own longest row:
  counted from the rows the trainer really builds.
- packed ratio: the same rows packed by model_parallel.microbatches into rows of at most 8192
  tokens, each padded to a multiple of 2*cp*tp (here 2), as _layout builds them.
- dp imbalance = max over ranks / mean over ranks of the tokens of one global minibatch (each
  minibatch ends in a gradient reduction that waits for the slowest rank), averaged over the
  minibatches of 5 seeded steps. before: contiguous slices (each rank the r-th part of each
  minibatch); after: train_ppo.balanced_split, in chunks of half a microbatch as the trainer deals
  padded rows (and, last, in single rows as it deals packed ones).

Last line: RESULT padded_ratio_before=... padded_ratio_after=... packed_ratio=...
dp_imbalance_before=... dp_imbalance_after=... dp_imbalance_after_packed=...
"""
import argparse
import os
import random
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import config  # noqa: E402  (after the path fix above)
import model_parallel as mp  # noqa: E402
import train_ppo  # noqa: E402

DP, MICRO_BATCH_SIZE, PACKED_ROW, MAX_NEW_TOKENS = 8, 8, 8192, 512


def gsm8k_lengths(rng, n):
    """Prompt + response tokens of n GSM8K-like samples."""
    responses = [min(MAX_NEW_TOKENS, max(20, int(rng.lognormvariate(5.0, 0.6)))) for _ in range(n)]
    return [rng.randint(60, 200) + r for r in responses]


def computed_tokens(rows, lengths, num_minibatches, cfg, mesh):
    """Tokens the model computes on for one rank's rows, as the update lays them out: each
    minibatch's rows cut into microbatches (model_parallel.microbatches), each laid out by
    model_parallel._layout."""
    lens = [lengths[j] for j in rows]
    ids = torch.zeros(len(lens), max(lens), dtype=torch.long)  # (b, S): the ids do not matter here
    per_minibatch = len(rows) // num_minibatches
    total = 0
    for first in range(0, len(rows), per_minibatch):
        minibatch = list(range(first, first + per_minibatch))
        for micro, _ in mp.microbatches([lens[i] for i in minibatch], cfg, mesh):
            idx = [minibatch[i] for i in micro]
            total += mp._layout(ids[idx], [lens[i] for i in idx], mesh, cfg).ids.numel()
    return total


def step_figures(lengths, num_minibatches, mesh):
    """The five figures of one step's lengths."""
    padded = config.Config(micro_batch_size=MICRO_BATCH_SIZE, attention="varlen")
    packed = config.Config(packing=True, max_tokens_per_microbatch=PACKED_ROW, attention="varlen")
    n = len(lengths)
    # contiguous slices: rank r holds the r-th part of each minibatch
    per_minibatch = n // num_minibatches
    per_rank = per_minibatch // DP
    before = [[m * per_minibatch + r * per_rank + i for m in range(num_minibatches) for i in range(per_rank)]
              for r in range(DP)]
    # the trainer's chunks (train_ppo.training_batch): half a microbatch padded, single rows packed
    after = train_ppo.balanced_split(lengths, num_minibatches, DP, chunk=MICRO_BATCH_SIZE // 2)
    after_packed = train_ppo.balanced_split(lengths, num_minibatches, DP, chunk=1)
    real = sum(lengths)
    # before: every microbatch of a rank as wide as the rank's longest row (rounded up to 2)
    padded_before = sum(len(rows) * (max(lengths[j] for j in rows) + 1) // 2 * 2 for rows in before)
    padded_after = sum(computed_tokens(rows, lengths, num_minibatches, padded, mesh) for rows in after)
    packed_after = sum(computed_tokens(rows, lengths, num_minibatches, packed, mesh) for rows in after_packed)
    per_rank = n // num_minibatches // DP

    def imbalance(split):
        ratios = []
        for m in range(num_minibatches):
            tokens = [sum(lengths[j] for j in rows[m * per_rank:(m + 1) * per_rank]) for rows in split]
            ratios.append(max(tokens) / (sum(tokens) / DP))
        return sum(ratios) / len(ratios)
    return dict(padded_ratio_before=padded_before / real, padded_ratio_after=padded_after / real,
                packed_ratio=packed_after / real, dp_imbalance_before=imbalance(before),
                dp_imbalance_after=imbalance(after), dp_imbalance_after_packed=imbalance(after_packed))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="64 sequences, 1 minibatch (a fast test runs this)")
    smoke = parser.parse_args().smoke
    n, num_minibatches = (64, 1) if smoke else (512, 4)
    # a world of one without a TCP port: microbatches() runs its dp all-reduce on it
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = mp.make_mesh(1, 1, 1, "cpu")
    figures = []
    for seed in range(5):
        figures.append(step_figures(gsm8k_lengths(random.Random(seed), n), num_minibatches, mesh))
        print("seed " + str(seed) + ": " + ", ".join(f"{k} {v:.3f}" for k, v in figures[-1].items()))
    dist.destroy_process_group()
    mean = {k: sum(f[k] for f in figures) / len(figures) for k in figures[0]}
    print(f"{n} sequences, {num_minibatches} minibatches, {DP} dp ranks, micro_batch_size "
          f"{MICRO_BATCH_SIZE}, packed rows of {PACKED_ROW}; means over 5 steps:")
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in mean.items()))


if __name__ == "__main__":
    main()
