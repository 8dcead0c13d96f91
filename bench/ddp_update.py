"""Two per-step overheads of the data_parallel=ddp update, each before and after its change,
measured in the same run (2 processes over gloo, 1 thread each, as bench/peer_trl.py's ours_2p).

    .venv/bin/python bench/ddp_update.py          # ~3 min on a quiet 2-core machine
    .venv/bin/python bench/ddp_update.py --smoke  # a 2-layer 64-wide model, one timed call each:
                                                  # seconds

1. DDP's gradient buckets. By default DDP copies every gradient into its 25 MB buckets before the
   all-reduce and the result back out; with gradient_as_bucket_view=True the .grad tensors then
   view the buckets and the copy back out is gone (the copy in stays: zero_grad(set_to_none=True)
   drops the views, and autograd makes fresh gradients the next backward). Timed: forward +
   backward + grad norm + fused AdamW step of a Llama of the 135M model's shape cut to 10 layers
   (63.7M parameters, tied embeddings), 4 rows of 130 tokens per rank, gradients summed by the
   trainer's SUM comm hook; the two variants alternate, median of 7 after one warm-up each.
   (A third, the reference swap trading storage instead of copying for plain CPU tensors, 0.333 s
   against 0.0006 s a swap at 135M, was measured here, and taken out again in issue 34: one copy
   path that every mesh runs, for the code budget.)
2. The squares of the global grad norm. Before: grad.pow(2).sum(), which writes a squared copy of
   every gradient; after: model_parallel.clip_grad_norm itself (max_norm=0: the norm only), the
   squared norms of each gradient's rows, summed, in one pass. Same 135M shapes, median of 5.
   Also the error against fp64 on the largest tensor (the 28M-element embedding): of
   clip_grad_norm, and of one vector_norm over the whole tensor, which on CPU runs a single fp32
   sum and drifts (why the norms are taken per row).

Last line: RESULT ddp_step_copy_s=... ddp_step_view_s=... norm_pow_sum_s=... norm_rows_s=...
(rank 0's clock; seconds per call) norm_rows_rel_err=...
norm_whole_rel_err=... (relative error of the sum of squares). Figures: docs/performance.md.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

# the Llama of the DDP step (part 1) and the model whose parameter shapes part 2 uses:
# the 135M model (hidden 576, 30 layers, MLP 1536, 9 heads / 3 KV heads of 64, vocab 49,152, tied)
FULL = dict(hidden=576, mlp=1536, heads=9, kv_heads=3, vocab=49152, ddp_layers=10, shape_layers=30, rows=4,
            tokens=130, steps=8, reps=5)
SMOKE = dict(hidden=64, mlp=128, heads=2, kv_heads=1, vocab=512, ddp_layers=2, shape_layers=2, rows=2,
             tokens=16, steps=2, reps=1)


def llama_shapes(s):
    """Every parameter shape of a tied Llama: embedding, then per layer q, o, k, v, gate, up, down,
    2 norms."""
    head_dim, layers = s["hidden"] // s["heads"], s["shape_layers"]
    kv = s["kv_heads"] * head_dim
    return ([(s["vocab"], s["hidden"])]
            + [(s["hidden"], s["hidden"])] * 2 * layers + [(kv, s["hidden"])] * 2 * layers
            + [(s["mlp"], s["hidden"])] * 2 * layers + [(s["hidden"], s["mlp"])] * layers
            + [(s["hidden"],)] * (2 * layers + 1))


def median_time(fn, reps):
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def worker(s):
    import torch
    import torch.distributed as dist
    from torch.distributed._composable.replicate import replicate
    from transformers import AutoModelForCausalLM, LlamaConfig

    import model_parallel as mp
    dist.init_process_group("gloo")
    torch.manual_seed(0)

    config = LlamaConfig(hidden_size=s["hidden"], intermediate_size=s["mlp"],
                         num_hidden_layers=s["ddp_layers"], num_attention_heads=s["heads"],
                         num_key_value_heads=s["kv_heads"], vocab_size=s["vocab"], tie_word_embeddings=True)
    ids = torch.randint(0, config.vocab_size, (s["rows"], s["tokens"]))
    steps = {}
    for view in (False, True):
        model = AutoModelForCausalLM.from_config(config)
        # as model_parallel._build does, except the bucket-view flag under test
        replicate(model, process_group=dist.group.WORLD, forward_sync_buffers=False,
                  gradient_as_bucket_view=view)
        model.register_comm_hook(dist.group.WORLD, mp._sum_hook)  # the trainer's SUM
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

        def step(model=model, optimizer=optimizer):
            model(input_ids=ids, labels=ids).loss.backward()
            mp.clip_grad_norm(list(model.parameters()), 1.0)  # the trainer's
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            dist.barrier()
        steps[view] = step
    times = {False: [], True: []}
    for it in range(s["steps"]):  # alternate the variants: load on a shared machine hits both alike
        for view in ((False, True) if it % 2 else (True, False)):
            dist.barrier()
            start = time.perf_counter()
            steps[view]()
            if it:  # the first of each is warm-up
                times[view].append(time.perf_counter() - start)
    figures = dict(ddp_step_copy_s=statistics.median(times[False]),
                   ddp_step_view_s=statistics.median(times[True]))
    if dist.get_rank() == 0:  # the single-process parts, on rank 0 while rank 1 waits
        # "after": the trainer's own functions on a module of plain CPU parameters (as under ddp)
        holder = torch.nn.Module()
        for i, shape in enumerate(llama_shapes(s)):
            holder.register_parameter(f"p{i}", torch.nn.Parameter(torch.randn(shape)))
            holder.get_parameter(f"p{i}").grad = torch.randn(shape) * 1e-3
        params = list(holder.parameters())
        reps = s["reps"]
        figures.update(
            norm_pow_sum_s=median_time(lambda: sum(p.grad.float().pow(2).sum() for p in params), reps),
            norm_rows_s=median_time(lambda: mp.clip_grad_norm(params, max_norm=0), reps))
        emb = params[0]  # the largest tensor: the embedding (28M elements at 135M)
        n_model, n_emb = sum(p.numel() for p in params) / 1e6, emb.numel() / 1e6
        exact = emb.grad.double().pow(2).sum().item()
        whole = torch.linalg.vector_norm(emb.grad, dtype=torch.float32).square().item()
        figures.update(norm_rows_rel_err=abs(mp.clip_grad_norm([emb], max_norm=0) ** 2 / exact - 1),
                       norm_whole_rel_err=abs(whole / exact - 1))
        print(f"DDP step ({s['ddp_layers']}-layer Llama, {s['rows']} x {s['tokens']} tokens per rank): "
              f"bucket copies {figures['ddp_step_copy_s']:.2f} s, "
              f"bucket views {figures['ddp_step_view_s']:.2f} s")
        print(f"grad-norm squares, {n_model:.1f}M fp32: pow(2).sum() {figures['norm_pow_sum_s']:.3f} s, "
              f"per-row norms {figures['norm_rows_s']:.3f} s; "
              f"error vs fp64 on {n_emb:.1f}M elements: per row {figures['norm_rows_rel_err']:.1e}, "
              f"one vector_norm {figures['norm_whole_rel_err']:.1e}")
        print("RESULT " + " ".join(f"{k}={v:.1e}" if k.endswith("_err") else f"{k}={v:.4f}"
                                   for k, v in figures.items()))
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny model, one timed call each (a fast test runs this)")
    args = parser.parse_args()
    if os.environ.get("PPO_DDP_BENCH_WORKER"):  # a rank, started by torchrun below
        return worker(SMOKE if args.smoke else FULL)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, PPO_DDP_BENCH_WORKER="1")
    cmd = [torchrun, "--standalone", "--nproc_per_node=2", os.path.abspath(__file__)]  # a free port
    sys.exit(subprocess.run(cmd + (["--smoke"] if args.smoke else []), env=env).returncode)


if __name__ == "__main__":
    main()
