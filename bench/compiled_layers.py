"""Would torch.compile make our CPU step faster? Eager against compiled decoder layers, one thread.

    .venv/bin/python bench/compiled_layers.py          # ~2 min (the compile is most of it)
    .venv/bin/python bench/compiled_layers.py --smoke  # one 64-wide layer, 2 x 16 tokens, 1 repeat:
                                                       # the same compile path (~25 s cold, ~8 s
                                                       # with inductor's cache warm)

bench/peer_trl.py's 2-process step spends two thirds of its update and ~77% of its no-grad passes in
`aten::mm` (docs/performance.md); the rest is mostly element-wise work (RMSNorm, RoPE, SiLU x up,
residual adds) that inductor could fuse into fewer passes over memory. This script measures
what fusing would buy, at the shapes one rank sees there: the 135M Llama's layers (hidden 576,
MLP 1536, 9 heads / 3 KV heads), 8 rows of 130 tokens, one thread (as each of 2 ranks on 2
cores has), `--layers` decoder layers (default 4) and the embedding, no LM head. Each layer is
compiled on its own (`layer.compile()`, torchtitan's way: per block); the first call of each
(compile) is left out, then the median of 5.

Last line: RESULT eager_step_s=... compiled_step_s=... eager_nograd_s=... compiled_nograd_s=...
step_speedup=... nograd_speedup=...   (step = forward + backward; speedup = eager / compiled)
"""
import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig


def timed(fn, repeats):
    fn()  # warm-up (and, compiled, the compile)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="a tiny layer, 1 repeat (a fast test runs this)")
    args = p.parse_args()
    torch.set_num_threads(1)
    # --smoke: the same code at the smallest shapes, compiled by torch.compile's aot_eager backend
    # (dynamo and AOTAutograd traced as with inductor, no kernels generated: inductor's code
    # generation was 30 s of the smoke's 40 on 2 cores)
    backend = "aot_eager" if args.smoke else "inductor"
    if args.smoke:
        args.layers, args.repeats, rows, tokens = 1, 1, 2, 16
        shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                     vocab_size=256)
    else:
        rows, tokens = 8, 130  # one rank's microbatch
        shape = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                     vocab_size=49152)
    config = LlamaConfig(**shape, num_hidden_layers=args.layers, tie_word_embeddings=True,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (rows, tokens))
    figures = {}
    for mode in ("eager", "compiled"):
        model = AutoModelForCausalLM.from_config(config).model  # the decoder, no LM head
        if mode == "compiled":
            for layer in model.layers:
                layer.compile(backend=backend)

        def step():
            model(input_ids=ids).last_hidden_state.pow(2).mean().backward()

        def nograd():
            with torch.no_grad():
                model(input_ids=ids)

        figures[f"{mode}_step_s"] = timed(step, args.repeats)
        figures[f"{mode}_nograd_s"] = timed(nograd, args.repeats)
        print(f"{mode}: forward + backward {figures[f'{mode}_step_s']:.3f} s, "
              f"no-grad forward {figures[f'{mode}_nograd_s']:.3f} s", flush=True)
    figures["step_speedup"] = figures["eager_step_s"] / figures["compiled_step_s"]
    figures["nograd_speedup"] = figures["eager_nograd_s"] / figures["compiled_nograd_s"]
    print("RESULT " + " ".join(f"{k}={v:.4f}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
