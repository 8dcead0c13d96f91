"""Memory at scale, measured on CPU: what one rank holds while loading, exporting and training
random Llamas of 318M and 418M parameters at 1 and 2 ranks, against bench/memory_model.py.

    python bench/scale_memory.py            # ~15 min on 2 cores, up to ~17 GB of memory
    python bench/scale_memory.py --smoke    # tiny models: the same code in seconds

Each (model, world size) runs in fresh torchrun workers (this file with --worker), which measure
three phases one after the other, each from a reset peak (/proc/self/clear_refs) as the peak
resident set (VmHWM) minus the resident set (VmRSS) when the phase began:
  load    model_parallel.load_policy: build on the meta device, each rank reads its own shards
  export  model_parallel.save_hf: streamed, one gathered tensor at a time
  step    train_ppo.main, 2 PPO steps (GAE, critic, HF engine, 4 sequences of 8 + 120 tokens),
          against memory_model.predict(on_cpu=True): the training peak plus the host terms and
          the HF engine's fp32 copy of the model, all in one memory on CPU
glibc serves every block of 64 KiB or more with mmap (MALLOC_MMAP_THRESHOLD_), so a freed tensor
leaves RSS, as a GPU caching allocator's memory does after empty_cache: RSS follows live tensors.
Last line: RESULT load_peak_dp2_over_dp1 (the largest rank's load at 2 ranks over the load at 1),
export_peak_over_model (rank 0's export over the model's fp32 bytes) and the memory model's
worst relative error over the four steps.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
GB = 2**30
# Llama shapes (head_dim 64, 2 query heads per KV head): width 1024, 20 and 28 layers
SHAPES = {"318M": dict(hidden_size=1024, num_hidden_layers=20, intermediate_size=3072, num_attention_heads=16,
                       num_key_value_heads=8, vocab_size=32000),
          "418M": dict(hidden_size=1024, num_hidden_layers=28, intermediate_size=3072, num_attention_heads=16,
                       num_key_value_heads=8, vocab_size=32000)}
SMOKE = {"tiny": dict(hidden_size=256, num_hidden_layers=2, intermediate_size=512, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=4096)}
PROMPT, RESPONSE, SEQUENCES = 8, 120, 4


def memory(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def measured(phase):
    """Run phase(); its peak resident memory above what was resident when it began."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    start = memory("VmRSS")
    phase()
    return memory("VmHWM") - start


def worker(path, out):
    import gc

    import torch.distributed as dist

    import config
    import model_parallel as mp
    import rollout
    import train_ppo

    class FixedLength(rollout.ToyTask):  # no EOS: every response is RESPONSE tokens long
        eos_id = None

        def encode(self, prompt):
            return (self.tok.encode(prompt) * PROMPT)[:PROMPT]

    rank, world, _ = mp.init_distributed()
    mesh = mp.make_mesh(world, 1, 1, "cpu")
    cfg = config.Config(out_dir=os.path.join(out, f"run{world}"), model=path, steps=2,
                        prompts_per_step=SEQUENCES // 2, samples_per_prompt=2, max_new_tokens=RESPONSE,
                        micro_batch_size=SEQUENCES // 2 // world,
                        rollout_engine="hf", export_hf=False, plot_every=0, save_every=0)
    config.validate(cfg, world)
    held = {}
    figures = dict(load=measured(lambda: held.update(policy=mp.load_policy(path, mesh, cfg))))
    figures["export"] = measured(lambda: mp.save_hf(held["policy"], os.path.join(out, f"export{world}")))
    held.clear()
    gc.collect()
    # keep the process group: the gather below needs it
    rollout.HFEngine.shutdown = lambda self: None
    figures["step"] = measured(lambda: train_ppo.main(cfg, FixedLength(cfg.seed)))
    every = [None] * world
    dist.all_gather_object(every, figures)
    if rank == 0:
        with open(os.path.join(out, f"figures{world}.json"), "w") as f:
            json.dump(every, f)
    dist.destroy_process_group()


def make_checkpoint(shape, path):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    if not os.path.isfile(os.path.join(path, "config.json")):
        fields = dict(shape, head_dim=64, tie_word_embeddings=False, max_position_embeddings=512,
                      bos_token_id=256, eos_token_id=256, pad_token_id=257)
        torch.manual_seed(0)
        llama = LlamaConfig(**fields)
        AutoModelForCausalLM.from_config(llama, dtype=torch.float32).save_pretrained(path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny models (a fast test runs this)")
    parser.add_argument("--dir", default=os.path.join(ROOT, "out", "bench_scale"),
                        help="checkpoints and runs")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker)
    import memory_model
    shapes = SMOKE if args.smoke else SHAPES
    out_root = tempfile.mkdtemp() if args.smoke else args.dir
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "MALLOC_MMAP_THRESHOLD_": "65536"}
    rows, errors, loads, exports = [], [], {}, []
    for name, shape in shapes.items():
        path = os.path.join(out_root, name)
        make_checkpoint(shape, path)
        model_bytes = 4 * memory_model.sizes(shape)["policy"]
        for world in (1, 2):
            out = os.path.join(out_root, f"{name}-runs")
            subprocess.run([os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone",
                            f"--nproc_per_node={world}", __file__, "--worker", path, out],
                           check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
            with open(os.path.join(out, f"figures{world}.json")) as f:
                ranks = json.load(f)
            loads[name, world] = max(r["load"] for r in ranks)
            exports.append(ranks[0]["export"] / model_bytes)
            micro = SEQUENCES // 2 // world  # sequences per microbatch: two microbatches on every rank
            want = memory_model.predict(shape, world, c=4, tokens=micro * (PROMPT + RESPONSE),
                                        scored=micro * (RESPONSE + 1), activation_checkpointing=False,
                                        engine=model_bytes, on_cpu=True)["peak"]
            got = max(r["step"] for r in ranks)
            errors.append(want / got - 1)
            rows.append(f"| {name} | {world} | {loads[name, world] / GB:.2f} GB "
                        f"| {ranks[0]['export'] / GB:.2f} GB | {got / GB:.2f} GB | {want / GB:.2f} GB "
                        f"| {want / got - 1:+.1%} |")
    print("| model | ranks | load (largest rank) | export (rank 0) | step peak, measured | predicted "
          "| error |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    load_ratio = max(loads[name, 2] / loads[name, 1] for name in shapes)
    print(f"RESULT load_peak_dp2_over_dp1={load_ratio:.3f} export_peak_over_model={max(exports):.3f} "
          f"model_worst_error={max(errors, key=abs):+.3f}")


if __name__ == "__main__":
    main()
