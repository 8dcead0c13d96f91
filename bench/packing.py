"""How many of the tokens the trainer pushes through the model are padding, padded vs packed.

    python bench/packing.py            # 256 sequences per mix (seconds)
    python bench/packing.py --smoke    # 32 sequences per mix: the same code, faster

Padded: the trainer's (b, S) layout, S = the longest sequence of the batch, micro_batch_size
rows per forward. Packed: model_parallel.microbatches() bins the same sequences first-fit
decreasing into rows of at most max_tokens_per_microbatch, and each row is only padded to a
multiple of 2*cp*tp (here cp = tp = 1: a multiple of 2). Both numbers come from the rows that
model_parallel builds, so they are what the model computes on. Two length mixes:
  toy        the demo: prompts "a+b=" (4-6 bytes) + responses of 1-6 tokens
  long-tail  chat-like: prompts 20-300 tokens, log-normal responses up to 2000 tokens
Last line: RESULT for the toy mix.
"""
import argparse
import dataclasses
import os
import random
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import config  # noqa: E402  (after the path fix above)
import model_parallel as mp  # noqa: E402


def toy_lengths(rng, n):
    # prompt "a+b=" with a, b in 0..99 is 4-6 bytes; the response is the answer's 1-3 digits and
    # EOS, or early in training some rambling: 1-6 tokens, weighted towards short answers
    prompts = [len(f"{rng.randrange(100)}+{rng.randrange(100)}=") for _ in range(n)]
    responses = rng.choices(range(1, 7), weights=[10, 30, 25, 15, 10, 10], k=n)
    return [p + r for p, r in zip(prompts, responses)]


def long_tail_lengths(rng, n):
    # log-normal response lengths (median ~150 tokens) with a long tail cut at 2000 tokens
    return [rng.randint(20, 300) + min(2000, max(1, int(rng.lognormvariate(5.0, 1.0)))) for _ in range(n)]


def pad_fractions(lens, cfg, mesh):
    """(padded fraction, packed fraction, packed rows) for one batch of sequence lengths."""
    ids = torch.zeros(len(lens), max(lens), dtype=torch.long)  # (b, S) the ids do not matter here
    real = sum(lens)
    padded = packed = rows = 0
    for layout_packing, counter in ((False, "padded"), (True, "packed")):
        run_cfg = dataclasses.replace(cfg, packing=layout_packing)
        for micro in mp.microbatches(lens, run_cfg, mesh):
            computed = mp._layout(ids[micro], [lens[i] for i in micro], mesh, run_cfg).ids.numel()
            if counter == "padded":
                padded += computed
            else:
                packed, rows = packed + computed, rows + 1
    return 1 - real / padded, 1 - real / packed, rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="32 sequences per mix (a fast test runs this)")
    n = 32 if parser.parse_args().smoke else 256
    # a world of one without a TCP port: microbatches() runs its dp all-reduce on it
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = mp.make_mesh(1, 1, 1, "cpu")
    rng = random.Random(0)
    results = {}
    print(f"{'mix':<10} {'seqs':>5} {'tokens':>7} {'padded pad_frac':>16} {'packed rows':>12} {'packed pad_frac':>16}")
    for name, lengths, cfg in (
        # real Configs (what the trainer passes), masked attention: "auto" is resolved only at start-up
        ("toy", toy_lengths(rng, n), config.Config(micro_batch_size=8, max_tokens_per_microbatch=512, attention="masked")),
        ("long-tail", long_tail_lengths(rng, n),
         config.Config(micro_batch_size=4, max_tokens_per_microbatch=4096, attention="masked")),
    ):
        padded_frac, packed_frac, rows = pad_fractions(lengths, cfg, mesh)
        results[name] = (padded_frac, packed_frac)
        print(f"{name:<10} {len(lengths):>5} {sum(lengths):>7} {padded_frac:>16.3f} {rows:>12} {packed_frac:>16.3f}")
    dist.destroy_process_group()
    padded_frac, packed_frac = results["toy"]
    print(f"RESULT padded_pad_frac={padded_frac:.3f} packed_pad_frac={packed_frac:.3f}")


if __name__ == "__main__":
    main()
