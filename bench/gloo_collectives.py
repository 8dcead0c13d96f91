"""What one collective costs on gloo (CPU), for the choice between FSDP2 and DDP on small models.

    .venv/bin/python bench/gloo_collectives.py          # 2 processes on this machine (~20 s)
    .venv/bin/python bench/gloo_collectives.py --smoke  # 14 kB and 112 kB, 2 calls: the same code,
                                                        # seconds

FSDP2 all-gathers each layer's parameters before its forward (and, with reshard_after_forward,
again before its backward) and reduce-scatters its gradients after the backward; DDP keeps whole
replicas and all-reduces the gradients once. In bytes moved, all-gather + reduce-scatter is one
all-reduce, so on NCCL the two layouts cost about the same communication. This script measures
what each call costs on gloo, over the sizes of one decoder layer of the 135M model that
bench/peer_trl.py uses (3.5M fp32 parameters, 14 MB) and of eight of them (112 MB): the mean of
10 calls after one warm-up, rank 0's clock, a barrier before each size.

Last line: RESULT all_reduce_14mb_ms=... reduce_scatter_14mb_ms=... all_gather_14mb_ms=...
(and the same for 112mb) rs_over_ar_14mb=... ag_over_ar_14mb=... (ratios to the all-reduce of
the same tensor: both above ~1 mean FSDP2's two calls cost gloo more than DDP's one).
Measured figures: docs/performance.md.
"""
import argparse
import os
import subprocess
import sys
import time

SIZES = {"14mb": 3_500_000, "112mb": 28_000_000}  # fp32 elements
CALLS = 10
SMOKE_SIZES, SMOKE_CALLS = {"14kb": 3_500, "112kb": 28_000}, 2


def worker(smoke):
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes, calls_per_size = (SMOKE_SIZES, SMOKE_CALLS) if smoke else (SIZES, CALLS)
    figures = {}
    for label, numel in sizes.items():
        full = torch.randn(numel)  # an unsharded gradient / gathered parameter
        shard = torch.empty(numel // world)  # this rank's shard
        gathered = torch.empty(numel)
        calls = {"all_reduce": lambda: dist.all_reduce(full),
                 "reduce_scatter": lambda: dist.reduce_scatter_single(shard, full),
                 "all_gather": lambda: dist.all_gather_single(gathered, shard)}
        for name, call in calls.items():
            call()  # warm-up: gloo sets up its buffers on the first call of a size
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls_per_size):
                call()
            figures[f"{name}_{label}_ms"] = (time.perf_counter() - start) / calls_per_size * 1000
    if rank == 0:
        for label in sizes:
            print(f"{label}: " + ", ".join(f"{n} {figures[f'{n}_{label}_ms']:.1f} ms"
                                          for n in ("all_reduce", "reduce_scatter", "all_gather")))
        for label in sizes:
            ar = figures[f"all_reduce_{label}_ms"]
            figures[f"rs_over_ar_{label}"] = figures[f"reduce_scatter_{label}_ms"] / ar
            figures[f"ag_over_ar_{label}"] = figures[f"all_gather_{label}_ms"] / ar
        print("RESULT " + " ".join(f"{k}={v:.2f}" if "_over_" in k else f"{k}={v:.1f}"
                                   for k, v in figures.items()))
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny tensors, 2 calls (a fast test runs this)")
    args = parser.parse_args()
    if os.environ.get("PPO_GLOO_BENCH_WORKER"):  # a rank, started by torchrun below
        return worker(args.smoke)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, PPO_GLOO_BENCH_WORKER="1")
    cmd = [torchrun, "--standalone", "--nproc_per_node=2", os.path.abspath(__file__)]  # a free port
    sys.exit(subprocess.run(cmd + (["--smoke"] if args.smoke else []), env=env).returncode)


if __name__ == "__main__":
    main()
