"""Peak memory and time of forward+backward of per-token logprobs: plain autograd vs logprobs.py.

    .venv/bin/python bench/logprob_memory.py                                  # B=4 S=1024 V=32768
    .venv/bin/python bench/logprob_memory.py --batch 1 --seq 256 --vocab 4096 # quick look
    .venv/bin/python bench/logprob_memory.py --smoke  # B=1 S=128 V=65536 (32 MiB), 1 round: seconds

Variants (one process, tp = cp = 1, on CPU; loss = sum(logprobs * fixed random weights)):
  plain         fp32 logits: log_softmax(logits)[:, :-1].gather(ids[:, 1:]) through autograd
  ours          fp32 logits: token_logprobs(logits, ids), hand-written backward, softmax kept
  chunked       fp32 logits: token_logprobs(logits, ids, chunk_size=C), softmax recomputed per block
  plain_bf16    bf16 logits (what a bf16 model returns): logits.float().log_softmax().gather()
  chunked_bf16  bf16 logits: token_logprobs(..., chunk_size=C), upcast per block, bf16 gradient

How peak memory is measured (CPU has no max_memory_allocated): every variant runs in a fresh
subprocess, which allocates its inputs in place (no temporaries), warms the kernels up on a tiny
input, reads its peak resident set size (getrusage ru_maxrss), runs forward+backward once, and
reads ru_maxrss again. The difference is everything the variant needs beyond its inputs,
including the (B, S, V) gradient it must hand back. RSS follows live tensors here because glibc
serves blocks above 32 MiB with mmap and unmaps them on free, and every big buffer is >= 64 MiB.
Time: one more subprocess runs the variants interleaved for --rounds rounds (after a warm-up
round) and reports each one's median, so the changing load of a shared machine hits all alike.
The last line is RESULT with each variant's ratio to plain.
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for logprobs.py
from logprobs import token_logprobs  # noqa: E402

VARIANTS = ("plain", "ours", "chunked", "plain_bf16", "chunked_bf16")
TIMED = ("plain", "ours", "chunked")


def make_inputs(batch, seq, vocab, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    logits = torch.empty(batch, seq, vocab, dtype=dtype).normal_(generator=gen)  # (B, S, V)
    logits.requires_grad_(True)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)  # (B, S)
    weights = torch.randn(batch, seq, generator=gen)  # (B, S)
    return logits, ids, weights


def step(variant, logits, ids, weights, chunk_size):
    """One forward+backward; the gradient lands in logits.grad."""
    logits.grad = None
    if variant.startswith("plain"):
        logp = torch.log_softmax(logits.float(), dim=-1)  # (B, S, V)  fp32 (a copy for bf16 logits)
        scores = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]  # (B, S-1)
        loss = (scores * weights[:, 1:]).sum()
    else:
        chunk_size = chunk_size if variant.startswith("chunked") else 0
        lp = token_logprobs(logits, ids, chunk_size=chunk_size)  # (B, S)
        loss = (lp * weights).sum()
    loss.backward()


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def child_memory(args):
    dtype = torch.bfloat16 if args.variant.endswith("bf16") else torch.float32
    logits, ids, weights = make_inputs(args.batch, args.seq, args.vocab, dtype)
    step(args.variant, *make_inputs(2, 8, 16, dtype), args.chunk_size)  # load lazily initialised kernels
    baseline = peak_rss_bytes()
    step(args.variant, logits, ids, weights, args.chunk_size)
    print(json.dumps({"variant": args.variant, "extra_peak": peak_rss_bytes() - baseline}))


def child_time(args):
    inputs = make_inputs(args.batch, args.seq, args.vocab)
    times = {v: [] for v in TIMED}
    for round_index in range(args.rounds + 1):
        for variant in TIMED:
            start = time.perf_counter()
            step(variant, *inputs, args.chunk_size)
            if round_index > 0:  # round 0 is the warm-up
                times[variant].append(time.perf_counter() - start)
    print(json.dumps({v: statistics.median(t) for v, t in times.items()}))


def run_child(args, *extra):
    cmd = [sys.executable, __file__, f"--batch={args.batch}", f"--seq={args.seq}"]
    cmd += [f"--vocab={args.vocab}", f"--chunk-size={args.chunk_size}", f"--rounds={args.rounds}"]
    done = subprocess.run(cmd + list(extra), check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--chunk-size", type=int, default=512, help="tokens per 'chunked' block")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (median reported)")
    parser.add_argument("--variant", choices=VARIANTS, help="internal: one variant's memory")
    parser.add_argument("--time", action="store_true", help="internal: time all variants")
    parser.add_argument("--smoke", action="store_true",
                        help="B=1 S=128 V=65536, chunk 32, 1 round (a fast test runs this); the buffers "
                        "stay >= 32 MiB, so the peaks still follow them (see above)")
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.seq, args.vocab, args.chunk_size, args.rounds = 1, 128, 65536, 32, 1
    if args.variant:
        return child_memory(args)
    if args.time:
        return child_time(args)

    mib = 2**20
    full_mib = args.batch * args.seq * args.vocab * 4 / mib
    print(f"B={args.batch} S={args.seq} V={args.vocab}, chunk={args.chunk_size} tokens; "
          f"one fp32 (B, S, V) tensor = {full_mib:.0f} MiB; torch threads={torch.get_num_threads()}")
    peaks = {v: run_child(args, f"--variant={v}")["extra_peak"] for v in VARIANTS}
    times = run_child(args, "--time")
    for v in VARIANTS:
        extra = peaks[v] / mib
        timing = f"   fwd+bwd {times[v]:6.3f} s (median of {args.rounds})" if v in times else ""
        print(f"{v:12s} extra peak {extra:8.0f} MiB ({extra / full_mib:4.2f} x fp32 B*S*V){timing}")
    print(f"RESULT chunked_peak_ratio={peaks['chunked'] / peaks['plain']:.3f} "
          f"ours_peak_ratio={peaks['ours'] / peaks['plain']:.3f} "
          f"chunked_time_ratio={times['chunked'] / times['plain']:.3f} "
          f"bf16_chunked_peak_ratio={peaks['chunked_bf16'] / peaks['plain_bf16']:.3f}")


if __name__ == "__main__":
    main()
