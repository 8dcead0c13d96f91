"""Refit leaves the engine computing with the trained weights; the critic's value head is
right-shifted. Both at dp=2 (FSDP2 over 2 gloo ranks), against plain single-process HF."""
import torch
from transformers import AutoModel

import model_parallel
import rollout
from config import Config
from _dist import run_ranks
from conftest import plain_logprobs

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
    model_parallel.move_optimizer_state(optimizer, "cpu")
    for key, before in moments.items():
        after = [s[key].to_local() for s in optimizer.state.values()]
        assert len(storages(after)) == 1 and all(torch.equal(a, b) for a, b in zip(after, before))


def test_host_copies_are_one_flat_buffer_a_set(tmp_path):
    """Issue 28: torch's caching host allocator rounds every pinned allocation up to a power of two
    (~1.9x the bytes at 7B when pinned shard by shard); one buffer a set pays the rounding once."""
    run_ranks(_flat_host_sets_body, 1, str(tmp_path))
