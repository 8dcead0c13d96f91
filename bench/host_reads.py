"""Host reads of one PPO update: how often the CPU waits for the device.

    .venv/bin/python bench/host_reads.py            # padded and packed, 2 and 8 microbatches
    .venv/bin/python bench/host_reads.py --smoke    # the same (it is seconds already)

On a GPU the CPU queues kernels ahead of the device; every read of a device tensor into Python
(`.item()`, `float()`, `int()`, `bool()`, `.tolist()`, `.cpu()`) makes it wait until the queue
is drained, and so does indexing with a Python list (its index is copied from pageable host
memory, a synchronous copy). Reads per optimizer step are a constant cost (the NaN check needs
one); reads per microbatch grow with the batch and keep the GPU idle between microbatches.

This counts them on CPU with a TorchFunctionMode recorder (tests/conftest.HostReads) around one
call of train_ppo.update: one process, tiny-llama, policy and critic, one global minibatch of 8
rows of 9-16 tokens, split into 2 and then 8 microbatches (micro_batch_size 4 and 1; packed:
max_tokens_per_microbatch 64 and 16). Every kind is counted on any tensor (on CPU they are all
host tensors): the count itself is what must not grow with the microbatches. DeviceMesh's
reads of its own rank layout (a CPU tensor on every machine) are not counted.
Last line: RESULT padded_2=N padded_8=N packed_2=N packed_8=N
"""
import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]


def count_update_reads(packing, micro, tmp):
    """Host reads of one train_ppo.update with `micro` microbatches (one process, gloo)."""
    import torch

    import config
    import model_parallel
    import train_ppo
    from conftest import HostReads

    knob = dict(max_tokens_per_microbatch=64 if micro == 2 else 16) if packing else \
        dict(micro_batch_size=8 // micro)
    cfg = config.Config(prompts_per_step=4, samples_per_prompt=2, num_minibatches=1, packing=packing,
                        out_dir=tmp, **knob)
    model_parallel.init_distributed()
    mesh = model_parallel.make_mesh(1, 1, 1, "cpu")
    path = model_parallel.materialize_tiny_model("tiny-llama", tmp, seed=1)
    parts = train_ppo.build_models(path, cfg, mesh).parts
    gen = torch.Generator().manual_seed(0)
    lens = [9, 16, 9, 12, 10, 14, 10, 11]
    prompts = [[1, 2, 3, 4]] * 8
    responses = [torch.randint(0, 256, (n - 4,), generator=gen).tolist() for n in lens]
    batch = train_ppo.make_batch(prompts, responses, pad_id=257)
    batch.old_lp = batch.ref_lp = batch.engine_lp
    batch.values = batch.returns = torch.zeros(batch.mask.shape)
    batch.advantages = torch.randn(batch.mask.shape, generator=gen) * batch.mask
    with HostReads() as reads:
        train_ppo.update(parts, batch, cfg, mesh)
    got = len(model_parallel.microbatches(lens, cfg, mesh))
    assert got == micro, (packing, micro, got)
    return reads.count


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true", help="the same run (it takes seconds)")
    p.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29531"))
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        for packing in (False, True):
            for micro in (2, 8):
                name = f"{'packed' if packing else 'padded'}_{micro}"
                figures[name] = count_update_reads(packing, micro, tmp)
    for key, value in figures.items():
        print(f"{key:10s} {value} host reads in one update")
    print("RESULT " + " ".join(f"{k}={v}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
