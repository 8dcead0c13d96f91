"""LoRA's memory, measured on CPU against bench/memory_model.py: what one rank holds when training
a random Llama of SmolLM2-135M's shape in full and under LoRA (rank 16, all 7 projections), in
fp32 (the CPU recipe) and bf16 (FSDP2 mixed precision, which runs on CPU too).

    python bench/lora_memory.py           # SmolLM2-135M's shape: ~3 min on 2 idle cores, 3.7 GB
    python bench/lora_memory.py --smoke   # a tiny shape, the four cases in one process: seconds

Four cases, (fp32, bf16) x (full, LoRA), each in a fresh process (this file with --worker) that
is a world of one (model_parallel.init_distributed in a plain process: FSDP2 over one rank), with
glibc's mmap threshold at 64 KiB as in bench/scale_memory.py (a freed tensor leaves RSS). Each runs
what train_ppo.py runs, minus the engine:
  load   train_ppo.build_models with advantage_estimator=grpo (no critic): the policy (under LoRA
         its base frozen in the compute dtype, fp32 adapters), AdamW over its trained parameters,
         and the reference snapshot (full training only; under LoRA the adapters are switched off)
  step   twice: train_ppo.score under no_grad (the old policy's and the reference's passes: the
         snapshot swapped in, which allocates the parked copy at the first swap, or the adapters
         off), then the update as train_ppo.py makes it, from model_parallel's calls: for each
         microbatch forward_policy and a backward (the gradients add up), then clip_grad_norm,
         the AdamW step, zero_grad(set_to_none). The loss is the mean NLL of the responses (the
         PPO loss holds the same: logprobs with their graph). 4 sequences of 8 + 120 tokens in
         two microbatches, as bench/scale_memory.py: memory_model's `grads` are alive across
         microbatches, which holds from the second one on (with one, the gradients would fill in
         only as the activations go)
Counted exactly (numel x element_size of the tensors the rank holds), against the terms of
memory_model.predict(shape, world=1, c, critic=False, lora_rank=16 or 0) of the same name:
  weights    the policy's parameters (local shards), after load
  grads      their .grad at the optimizer step (the frozen base has none)
  adam       every tensor of optimizer.state after the first step (with the fused AdamW's
             one-element `step` tensors, which the model leaves out: 4 bytes a tensor)
  reference  the snapshot's tensors + the parked copy, after a step (memory_model's reference +
             parked); none under LoRA
Peak, above the start (before the load), over load + both steps, against memory_model.predict(...,
on_cpu=True)["peak"], the training peak (weights + adam + grads + gathered + activations + logits)
plus the host terms (reference + parked), engine 0. The second step is the one the model
describes: AdamW's moments exist from the first step's end, so only the second step's passes
have them beside the activations (the peak after the first step is printed too). The peak is
RssAnon's, sampled (AnonPeak); VmHWM's is printed beside it, and differs where file pages move:
under bf16 the load maps the fp32 checkpoint (538 MB of file pages), which VmHWM counts.
Where the peak is (found by timing each phase's peak; not printed here): under LoRA at the end of
the last microbatch's forward, in the LM head (gathered, with its output), at this shape just above
the start of its backward; in full training at the start of its backward. What no term counts:
RssAnon's heap (Python objects, autograd's nodes, the allocator's slack), printed as `heap` (the
resident memory in no counted tensor when step 2's update begins: 21-47 MiB in docs/lora.md's
run), ~1% of a full peak, ~5% of a LoRA one: the model's peaks fall short of the measured ones
by about that much.
With --smoke the four cases share one process (an import costs ~9 s here): each peak then starts
from what the case before left, so the smoke peaks mean little; its counts are exact as ever.
Last line: RESULT optimizer_bytes_{lora,full}_{fp32,bf16}=... optimizer_ratio_{fp32,bf16}=... (LoRA
over full) model_bytes_{lora,full}_fp32=... (weights + grads) peak_gb_{lora,full}_{fp32,bf16}=...
counts_error_worst=... (the worst relative error of the model's weights, grads, adam and
reference terms, over the four cases) peak_error_worst=... (the same for the sampled peak:
predicted / measured - 1) heap_mib_worst=... (the largest heap).
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scale_memory import memory  # noqa: E402  (a /proc/self/status field, in bytes)

GB = 2**30
# SmolLM2-135M(-Instruct)'s shape (its config.json; bench/refit.py has the same), and a tiny one
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True)
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=1024, tie_word_embeddings=True)
LORA_RANK = 16
NAMES = {"peak": "peak (RssAnon, sampled)", "peak_hwm": "peak (VmHWM)"}
CASES = ("fp32-full", "fp32-lora", "bf16-full", "bf16-lora")
PROMPT, RESPONSE, SEQUENCES, MICRO = 8, 120, 4, 2  # two microbatches of 2 rows, as scale_memory's


class AnonPeak:
    """The peak of this process's anonymous resident memory (RssAnon: the heap and the mmap'd
    tensors, not the file-backed pages of libraries and of mmap'd checkpoints, which the kernel
    drops and reads again as other jobs press on memory, moving VmRSS by ~100 MB here), read every
    millisecond by a thread (a lower bound: a peak shorter than that can slip between two reads)."""

    def __init__(self):
        self.peak, self.running = memory("RssAnon"), True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while self.running:
            self.peak = max(self.peak, memory("RssAnon"))
            time.sleep(0.001)

    def read(self):
        return max(self.peak, memory("RssAnon"))

    def stop(self):
        self.running = False
        self.thread.join()


def nbytes(tensors):
    """Bytes of `tensors` (DTensors: this rank's shard), each counted once (a tied weight is one
    tensor; views into one flat buffer, as the snapshot's and FSDP2's, count each its own part)."""
    from torch.distributed.tensor import DTensor
    seen, total = set(), 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        if (t.data_ptr(), t.numel()) not in seen:
            seen.add((t.data_ptr(), t.numel()))
            total += t.numel() * t.element_size()
    return total


def make_checkpoint(shape, path):
    """A random Llama of `shape` (fp32 safetensors), written once."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    if not os.path.isfile(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        llama = LlamaConfig(**shape, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                            pad_token_id=2)
        AutoModelForCausalLM.from_config(llama, dtype=torch.float32).save_pretrained(path)


def run_case(case, path, out):
    """One case in this process: the counts and the peaks, in bytes."""
    import gc

    import torch

    import config
    import model_parallel as mp
    import train_ppo

    dtype, mode = case.split("-")
    _, world, _ = mp.init_distributed()
    mesh = mp.make_mesh(world, 1, 1, "cpu")
    cfg = config.Config(out_dir=os.path.join(out, case), model=path, dtype=dtype, advantage_estimator="grpo",
                        lora_rank=LORA_RANK if mode == "lora" else 0, lora_alpha=2.0 * LORA_RANK,
                        prompts_per_step=SEQUENCES // 2, samples_per_prompt=2, max_new_tokens=RESPONSE,
                        micro_batch_size=MICRO, num_minibatches=1, rollout_engine="hf")
    config.validate(cfg, world)
    config.resolve_auto(cfg, "cpu", None)
    generator = torch.Generator().manual_seed(0)
    vocab = mp.check_hf_dir(path, 1).vocab_size

    def tokens(n):
        return torch.randint(0, vocab, (n,), generator=generator).tolist()

    batch = train_ppo.make_batch([tokens(PROMPT) for _ in range(SEQUENCES)],
                                 [tokens(RESPONSE) for _ in range(SEQUENCES)], pad_id=0)
    num_tokens = batch.mask.sum()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    start, start_anon, sampler = memory("VmRSS"), memory("RssAnon"), AnonPeak()

    def peaks(key):  # the two peaks so far, above the start
        figures[key] = sampler.read() - start_anon
        figures[key + "_hwm"] = memory("VmHWM") - start

    figures = {}
    models = train_ppo.build_models(path, cfg, mesh)
    peaks("load_peak")
    policy, optimizer = models.parts["policy"].model, models.parts["policy"].optimizer
    figures["weights"] = nbytes(policy.parameters())
    figures["trained_params"] = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    for step in (1, 2):
        with torch.no_grad():  # step 4: the old policy's and the reference's passes
            train_ppo.no_grad_passes(models, batch, cfg, mesh)
        if step == 2:  # the update begins, no gradient alive: what RssAnon holds in no counted tensor
            counted = figures["weights"] + figures["adam"] + figures["reference"]
            figures["heap"] = memory("RssAnon") - start_anon - counted
        # the update, as train_ppo's makes it: the microbatches' gradients add up, then clip, step
        for first in range(0, SEQUENCES, MICRO):
            rows = list(range(first, first + MICRO))
            idx = torch.tensor(rows)
            lp, _ = mp.forward_policy(policy, batch.ids[idx], [batch.lens[i] for i in rows], mesh, cfg,
                                      unscored=batch.unscored)  # (MICRO, S)
            (-(lp * batch.mask[idx]).sum() / num_tokens).backward()  # the responses' mean NLL
        figures["grads"] = nbytes(p.grad for p in policy.parameters() if p.grad is not None)
        mp.clip_grad_norm(list(policy.parameters()), cfg.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 1:
            peaks("peak_step1")
            figures["adam"] = nbytes(t for state in optimizer.state.values() for t in state.values()
                                     if torch.is_tensor(t))
            # the reference's snapshot (functools.partial(swapped_weights, policy, snapshot)); none
            # under LoRA, whose reference is the policy with its adapters off
            held = models.reference.args[1:] if models.reference else ()
            snapshot = held[0] if held else {"weights": {}, "parked": {}}
            figures["reference"] = nbytes([*snapshot["weights"].values(), *snapshot["parked"].values()])
    peaks("peak")
    sampler.stop()
    return figures


def worker(cases, shape, path, out):
    """The cases, one after the other in this process; their figures to a JSON file in `out`."""
    import gc

    import torch.distributed as dist
    make_checkpoint(json.loads(shape), path)
    figures = {}
    for case in cases.split(","):
        figures[case] = run_case(case, path, out)
        gc.collect()  # (what the case held: the next starts from its own RSS)
    with open(os.path.join(out, f"figures-{cases}.json"), "w") as f:
        json.dump(figures, f)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny shape (a fast test runs this)")
    parser.add_argument("--dir", default=os.path.join(ROOT, "out", "bench_lora_memory"),
                        help="the checkpoint and the runs")
    parser.add_argument("--worker", nargs=4, metavar=("CASES", "SHAPE", "MODEL", "OUT"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker)
    import memory_model
    shape = TINY if args.smoke else SMOLLM2
    out = tempfile.mkdtemp() if args.smoke else args.dir
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "smoke" if args.smoke else "smollm2-135m-random")  # (the worker writes it)
    with socket.socket() as sock:  # a free port for the world of one (29500 may be another job's)
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "MALLOC_MMAP_THRESHOLD_": "65536", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    measured = {}
    for cases in [",".join(CASES)] if args.smoke else CASES:
        me = [os.path.abspath(__file__), "--worker", cases, json.dumps(shape), path, out]
        subprocess.run([sys.executable, *me], check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
        with open(os.path.join(out, f"figures-{cases}.json")) as f:
            measured.update(json.load(f))
    n = memory_model.sizes(shape)
    print(f"{'tiny' if args.smoke else 'SmolLM2-135M'} shape, random weights: {n['policy'] / 1e6:.1f}M "
          f"parameters (the model's count; {memory_model.adapter_params(shape, LORA_RANK) / 1e6:.2f}M in "
          f"LoRA r{LORA_RANK}'s adapters), one rank, {SEQUENCES} sequences of {PROMPT} + {RESPONSE} "
          f"tokens in microbatches of {MICRO}")
    print("| case | quantity | measured | memory_model | error |")
    print("|---|---|---|---|---|")
    fig, counts_errors, peak_errors = {}, [], []
    for case in CASES:
        got = measured[case]
        dtype, mode = case.split("-")
        want = memory_model.predict(shape, 1, c=4 if dtype == "fp32" else 2,
                                    tokens=MICRO * (PROMPT + RESPONSE), scored=MICRO * (RESPONSE + 1),
                                    critic=False, activation_checkpointing=False, on_cpu=True,
                                    lora_rank=LORA_RANK if mode == "lora" else 0)
        want["reference"] += want["parked"]  # the snapshot and the parked copy, counted together
        for key in ("weights", "grads", "adam", "reference", "peak", "peak_hwm"):
            error = want[key.replace("_hwm", "")] / got[key] - 1 if got[key] else (
                0.0 if not want[key] else float("inf"))
            if key != "peak_hwm":  # (VmHWM: beside it, not counted in the worst error)
                (peak_errors if key == "peak" else counts_errors).append(error)
            print(f"| {case} | {NAMES.get(key, key)} | {got[key] / 2**20:.1f} MiB "
                  f"| {want[key.replace('_hwm', '')] / 2**20:.1f} MiB | {error:+.2%} |")
        print(f"| {case} | (peak after step 1; after the load; VmHWM's) | {got['peak_step1'] / 2**20:.1f}; "
              f"{got['load_peak'] / 2**20:.1f}; {got['peak_step1_hwm'] / 2**20:.1f}; "
              f"{got['load_peak_hwm'] / 2**20:.1f} MiB | the peak's other terms: gathered "
              f"{want['gathered'] / 2**20:.1f}, activations {want['activations'] / 2**20:.1f}, logits "
              f"{want['logits'] / 2**20:.1f} MiB; heap (measured, in no term) "
              f"{got['heap'] / 2**20:.1f} MiB | |")
        fig[f"optimizer_bytes_{mode}_{dtype}"] = got["adam"]
        fig[f"peak_gb_{mode}_{dtype}"] = f"{got['peak'] / GB:.3f}"
        if dtype == "fp32":
            fig[f"model_bytes_{mode}_fp32"] = got["weights"] + got["grads"]
    for dtype in ("fp32", "bf16"):
        ratio = fig[f"optimizer_bytes_lora_{dtype}"] / fig[f"optimizer_bytes_full_{dtype}"]
        fig[f"optimizer_ratio_{dtype}"] = f"{ratio:.4f}"
    fig["counts_error_worst"] = f"{max(counts_errors, key=abs):+.4f}"
    fig["peak_error_worst"] = f"{max(peak_errors, key=abs):+.3f}"
    fig["heap_mib_worst"] = f"{max(measured[case]['heap'] for case in CASES) / 2**20:.0f}"
    print("RESULT " + " ".join(f"{key}={value}" for key, value in fig.items()))


if __name__ == "__main__":
    main()
