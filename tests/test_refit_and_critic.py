"""Refit leaves the engine computing with the trained weights; the critic's value head is
right-shifted. Both at dp=2 (FSDP2 over 2 gloo ranks), against plain single-process HF."""
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from transformers import AutoModel

import model_parallel
import rollout
from config import Config
from _dist import run_ranks
from conftest import plain_logprobs
from extensions import optimizer_offload

IDS = [[51, 43, 57, 61, 49, 50, 256, 257], [50, 43, 50, 61, 52, 256, 257, 257]]  # "3+9=12", "2+2=4"
LENS = [7, 6]
REAL = torch.arange(8)[None, :] < torch.tensor(LENS)[:, None]  # (B, S) not padding


class RecordingEngine(rollout.HFEngine):
    """The HF engine, noting the size of every bucket it is handed."""
    def load_weights(self, named_tensors):
        self.buckets.append(sum(t.numel() * t.element_size() for _, t in named_tensors))
        super().load_weights(named_tensors)


def _refit_body(rank, world_size, tmp):
    cfg = Config(out_dir=tmp, micro_batch_size=2)
    mesh = model_parallel.make_mesh(world_size, 1, 1, "cpu")
    path = model_parallel.materialize_tiny_model("tiny-llama", tmp, seed=3)
    policy = model_parallel.load_policy(path, mesh, cfg)
    engine = RecordingEngine(path, torch.device("cpu"), stop_ids=[256])
    engine.buckets = []
    ids = torch.tensor(IDS)
    # one optimizer step on a loss, so that the trained weights differ from the engine's
    lp, _ = model_parallel.forward_policy(policy, ids, LENS, mesh, cfg)
    (-lp.sum()).backward()
    torch.optim.AdamW(policy.parameters(), lr=1e-2).step()
    with torch.no_grad():
        trained, _ = model_parallel.forward_policy(policy, ids, LENS, mesh, cfg)  # (B, S)
        before = plain_logprobs(engine.model(ids).logits.float(), ids)  # (B, S) the engine's unsharded model
        assert (before - trained)[REAL].abs().max() > 1e-2, "the update should have changed logprobs"
        stats = rollout.refit(engine, model_parallel.iter_full_params(policy), bucket_mb=1)
        after = plain_logprobs(engine.model(ids).logits.float(), ids)
    torch.testing.assert_close(after[REAL], trained[REAL], atol=1e-5, rtol=1e-5)
    # buckets stay within the limit, except a single tensor larger than the limit on its own
    largest_param = max(p.numel() * 4 for p in engine.model.parameters())
    assert len(engine.buckets) > 1
    assert max(engine.buckets) <= max(2**20, largest_param)
    assert stats["refit_bytes"] == sum(p.numel() * 4 for p in engine.model.parameters())


def test_refit_engine_equals_trained_policy_dp2(tmp_path):
    run_ranks(_refit_body, 2, str(tmp_path))


def _critic_body(rank, world_size, tmp):
    cfg = Config(out_dir=tmp, seed=5)
    mesh = model_parallel.make_mesh(world_size, 1, 1, "cpu")
    path = model_parallel.materialize_tiny_model("tiny-qwen2", tmp, seed=4)
    critic = model_parallel.load_critic(path, mesh, cfg)
    head = {n: p.full_tensor() for n, p in critic.named_parameters() if "lm_head" in n}
    ids = torch.tensor(IDS)
    with torch.no_grad():
        values = model_parallel.forward_critic(critic, ids, LENS, mesh, cfg)  # (B, S)
        hidden = AutoModel.from_pretrained(path).float()(ids).last_hidden_state  # (B, S, H)
    expected = hidden @ head["lm_head.weight"][0] + head["lm_head.bias"][0]  # (B, S) head at each h_t
    # V(x_<i) comes from the hidden state *before* token i: values[:, i] = head(h[:, i-1])
    real = REAL[:, 1:]
    torch.testing.assert_close(values[:, 1:][real], expected[:, :-1][real], atol=1e-5, rtol=1e-5)
    assert torch.all(values[:, 0] == 0)
    # and not from the hidden state at i (the unshifted, wrong, convention)
    assert (values[:, 1:] - expected[:, 1:])[real].abs().max() > 1e-3


def test_critic_values_are_right_shifted_dp2(tmp_path):
    run_ranks(_critic_body, 2, str(tmp_path))


def _gather_dtype_body(rank, world_size, tmp):
    """Every all-gather that iter_full_params runs, recorded at the functional collective DTensor
    calls: its input's dtype and the bytes it delivers."""
    from torch.distributed import _functional_collectives as funcol
    mesh = model_parallel.make_mesh(world_size, 1, 1, "cpu")
    path = model_parallel.materialize_tiny_model("tiny-llama", tmp, seed=3)
    policy = model_parallel.load_policy(path, mesh, Config(out_dir=tmp))  # fp32 master weights
    seen = []
    original = funcol.all_gather_single

    def recording(tensor, *args, **kwargs):
        out = original(tensor, *args, **kwargs)
        seen.append((tensor.dtype, out.numel() * out.element_size()))
        return out
    funcol.all_gather_single = recording
    try:
        full = dict(model_parallel.iter_full_params(policy, torch.bfloat16))
    finally:
        funcol.all_gather_single = original
    elements = sum(t.numel() for t in full.values())
    assert len(seen) == len(full) and {dtype for dtype, _ in seen} == {torch.bfloat16}, seen[:3]
    # 2 bytes an element: half what gathering the fp32 master weights, then casting, moved
    assert sum(nbytes for _, nbytes in seen) == 2 * elements
    assert all(t.dtype == torch.bfloat16 for t in full.values())


def test_refit_gathers_in_the_engines_dtype_not_the_master_weights(tmp_path):
    """Issue 28: a bf16 engine (or export) from fp32 FSDP2 shards at dp2: each shard is cast before
    its all-gather, so the gathers move bf16, half the bytes."""
    run_ranks(_gather_dtype_body, 2, str(tmp_path))


def _flat_host_sets_body(rank, world_size, tmp):
    """Each host-memory set is one flat buffer: the reference snapshot, the live shards parked
    during the reference pass, and each of AdamW's offloaded moments (views into one storage
    each), and the copies hold what they copied."""
    mesh = model_parallel.make_mesh(world_size, 1, 1, "cpu")
    path = model_parallel.materialize_tiny_model("tiny-llama", tmp, seed=3)
    policy = model_parallel.load_policy(path, mesh, Config(out_dir=tmp))  # FSDP2: DTensor shards

    def storages(tensors):
        return {t.untyped_storage().data_ptr() for t in tensors}
    live = {n: p.to_local().clone() for n, p in policy.named_parameters()}
    snapshot = model_parallel.snapshot_weights(policy, torch.bfloat16)
    assert len(storages(snapshot["weights"].values())) == 1
    # in bf16, and what it holds is each live shard cast (not only the right dtype)
    assert all(torch.equal(snapshot["weights"][n], live[n].to(torch.bfloat16)) for n in live)
    assert all(snapshot["weights"][n].dtype == torch.bfloat16 for n in live)
    with model_parallel.swapped_weights(policy, snapshot):
        pass
    assert len(storages(snapshot["parked"].values())) == 1 and len(snapshot["parked"]) == len(live)
    for n, p in policy.named_parameters():
        assert torch.equal(snapshot["parked"][n], live[n]) and torch.equal(p.to_local(), live[n])
    ids = torch.tensor(IDS)
    lp, _ = model_parallel.forward_policy(policy, ids, LENS, mesh, Config())
    (-lp.sum()).backward()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    optimizer.step()
    states = list(optimizer.state.values())
    moments = {k: [s[k].to_local().clone() for s in states] for k in ("exp_avg", "exp_avg_sq")}
    optimizer_offload.move_optimizer_state(optimizer, "host")
    for key, before in moments.items():
        after = [s[key].to_local() for s in optimizer.state.values()]
        assert len(storages(after)) == 1 and all(torch.equal(a, b) for a, b in zip(after, before))


def test_host_copies_are_one_flat_buffer_a_set(tmp_path):
    """Issue 28: torch's caching host allocator rounds every pinned allocation up to a power of two
    (~1.9x the bytes at 7B when pinned shard by shard); one buffer a set pays the rounding once."""
    run_ranks(_flat_host_sets_body, 1, str(tmp_path))


def _copies_into_host_buffers(record):
    """record() under a recorder of every Tensor.copy_; returns [(destination, non_blocking)]."""
    class Copies(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if getattr(func, "__name__", "") == "copy_":
                seen.append((args[0], bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))))
            return func(*args, **kwargs)
    seen = []
    with Copies():
        record()
    return seen


def _offload_on_a_gpu_mesh_body(rank, world_size, tmp):
    """The GPU's behaviour, swapped in: DTensor.from_local moves a local tensor to its mesh's
    device type when the two differ (torch/distributed/tensor/_api.py), so on a CUDA mesh a host
    copy wrapped with it is copied straight back to the GPU. Here every from_local copies its input
    (what a move to another device is); the CPU mesh alone would let a wrapped host copy pass."""
    real_from_local = DTensor.from_local
    DTensor.from_local = staticmethod(lambda local, *a, **k: real_from_local(local.clone(), *a, **k))
    mesh = model_parallel.make_mesh(world_size, 1, 1, "cpu")
    path = model_parallel.materialize_tiny_model("tiny-llama", tmp, seed=3)
    policy = model_parallel.load_policy(path, mesh, Config(out_dir=tmp))
    lp, _ = model_parallel.forward_policy(policy, torch.tensor(IDS), LENS, mesh, Config())
    (-lp.sum()).backward()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    optimizer.step()
    saved = get_optimizer_state_dict(policy, optimizer)  # the checkpoint's view of the state
    states = optimizer.state.values()
    moments = {k: [s[k].to_local().clone() for s in states] for k in ("exp_avg", "exp_avg_sq")}
    copies = _copies_into_host_buffers(lambda: optimizer_offload.move_optimizer_state(optimizer, "host"))
    for key, before in moments.items():
        states = [s[key] for s in optimizer.state.values()]
        # still DTensors of the policy's mesh, whose local shards are views of one host buffer
        assert all(isinstance(s, DTensor) and s.device_mesh is states[0].device_mesh for s in states)
        buffers = {s.to_local().untyped_storage().data_ptr() for s in states}
        assert len(buffers) == 1, f"{key}: {len(buffers)} storages: the state is not the host buffer"
        assert all(torch.equal(s.to_local(), b) for s, b in zip(states, before))
        # every copy into the host buffer was blocking: its bytes are there when it returns
        into = [blocking for dest, blocking in copies if dest.untyped_storage().data_ptr() in buffers]
        assert len(into) == len(states) and not any(into), f"{key}: a host copy made with non_blocking=True"
    # a checkpoint taken while the moments are out holds the same tensors
    offloaded = get_optimizer_state_dict(policy, optimizer)["state"]
    for name, state in saved["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(offloaded[name][key].to_local(), state[key].to_local()), (name, key)
    optimizer.step()  # AdamW takes the moved states
    DTensor.from_local = real_from_local


def test_offloaded_moments_are_the_host_buffer_on_a_gpu_mesh(tmp_path):
    """Issue 34: offload_optimizer freed nothing on an H200 (93,422,080 bytes allocated before and
    after): each host copy was wrapped with DTensor.from_local, which on a CUDA mesh copies it back
    to the GPU. With from_local's GPU behaviour swapped in, the offloaded state must still be the
    host buffer (each moment one flat buffer), hold the same numbers, be written by blocking
    copies, and read as the same checkpoint."""
    run_ranks(_offload_on_a_gpu_mesh_body, 1, str(tmp_path))
