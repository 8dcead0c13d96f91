"""model_parallel.py against the plain single-process HF model.

Every mesh (dp, cp, tp), with packing on and off, must give the per-token logprobs, entropies
and values of `AutoModelForCausalLM.from_pretrained` run on one sequence at a time (eager
attention, no padding, no packing), and the same full gradients of a PPO-shaped loss:
    loss = sum over response tokens of (logprob * weight + value^2) / global response tokens.
One spawn per world size runs many cases, so the suite stays within a few minutes on 2 cores.
"""
import inspect
import os
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import Replicate, Shard
from transformers import AutoModelForCausalLM

import model_parallel as mp
from _dist import run_ranks
from conftest import LORA, hf_reference, lora_adapters, toy_batch, varlen_case
from extensions import lora
import config
from config import Config

TEMPERATURE = 0.8
LENS = [14, 12, 6, 5]  # global batch; with dp=2 rank 0 packs 2 rows, rank 1 packs 1 (+ a dummy)
PROMPT_LEN = 4  # response tokens: PROMPT_LEN .. len-1
SEED = 5


def _cfg(**overrides):
    # max 24 tokens per packed row: 14+12 do not fit together, so packing makes several rows
    fields = dict(packing=False, micro_batch_size=1, max_tokens_per_microbatch=24, logprob_chunk_size=0,
                  seed=SEED, dtype="fp32", attention="masked")
    return Config(**dict(fields, **overrides))


def _materialize(root, name):
    overrides = {
        "tiny-gemma3": dict(sliding_window=6),  # shorter than the rows: the local layers matter
        "tiny-llama-tied": dict(tie_word_embeddings=True),
        "tiny-qwen3-v263": dict(vocab_size=263),  # does not divide tp=2: shards of 132 and 131
    }.get(name, {})
    preset = name if name in mp.TINY_PRESETS else name.rsplit("-", 1)[0]  # tiny-llama-lora: tiny-llama
    return mp.materialize_tiny_model(preset, os.path.join(root, name), SEED, **overrides)


# the families every mesh checks; a new family's preset goes here (Gemma3: tp=1, its own cases)
FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"]
MODELS = FAMILIES + ["tiny-gemma3", "tiny-llama-tied", "tiny-qwen3-v263"]  # each with its HF reference
LORA_MODEL = "tiny-llama-lora"  # Llama with LoRA adapters; its reference is PEFT's LoRA (conftest)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Checkpoints and their single-process reference, computed once for every spawn."""
    root = str(tmp_path_factory.mktemp("models"))
    references = {}
    for name in MODELS:
        references[name] = hf_reference(_materialize(root, name), LENS, PROMPT_LEN, TEMPERATURE, SEED)
    path = _materialize(root, LORA_MODEL)
    adapters = lora_adapters(path, SEED)
    references[LORA_MODEL] = hf_reference(path, LENS, PROMPT_LEN, TEMPERATURE, SEED, adapters)
    references[LORA_MODEL]["adapters"] = adapters
    torch.save(references, os.path.join(root, "reference.pt"))
    return root


_REFERENCE = {}


def _check_case(root, name, mesh, cfg, label):
    """Distributed forward/backward on this rank's rows; compare with the reference."""
    path = _materialize(root, name)  # already written by the fixture: returns its path
    if not _REFERENCE:  # each rank reads the parent's reference once
        _REFERENCE.update(torch.load(os.path.join(root, "reference.pt")))
    ref = _REFERENCE[name]
    ids, mask, weights = toy_batch(LENS, PROMPT_LEN)
    dp_size, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    share = len(LENS) // dp_size
    mine = list(range(dp_rank * share, (dp_rank + 1) * share))  # this dp rank's global rows
    adapt = lora.add_adapters if cfg.lora_rank else None  # LoRA's adapters (extensions/lora.py)
    policy, critic = mp.load_policy(path, mesh, cfg, adapt=adapt), mp.load_critic(path, mesh, cfg)
    if cfg.lora_rank:  # the reference's adapters, not the initial ones (B = 0): each rank its shards
        _set_adapters(policy, ref["adapters"])
    if cfg.lora_rank and mesh["tp"].size() > 1:
        # A and B split as their base's TP plan, so that they add no collective of their own (any
        # split computes the same: DTensor would redistribute): colwise q_proj's B on its outputs,
        # rowwise o_proj's A on its inputs (the tp split: the last placement, under FSDP2 too)
        attn = policy.model.layers[0].self_attn
        splits = [p.placements[-1] for p in (attn.q_proj.lora_A, attn.q_proj.lora_B, attn.o_proj.lora_A,
                                             attn.o_proj.lora_B)]
        assert splits == [Replicate(), Shard(0), Shard(1), Replicate()], (label, splits)
    # cpu_offload runs FSDP2's CPU offload on CPU too (it moves nothing there, but its code runs):
    # every unit of both models must have it, or the case would test the plain path
    units = [m for model in (policy, critic) for m in model.modules()
             if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group]
    assert all(u._get_fsdp_state()._fsdp_param_group.fsdp_params[0].offload_to_cpu == cfg.cpu_offload
               for u in units), label
    n_tokens = mask.sum()  # global response tokens (every rank knows the whole batch here)
    seen, outputs = [], {}
    micros = mp.microbatches([LENS[i] for i in mine], cfg, mesh)
    for i, (rows, w) in enumerate(micros):
        for model in (policy, critic):  # ddp: all-reduce after the last microbatch only
            mp.sync_gradients(model, i == len(micros) - 1)
        idx = [mine[r] for r in rows]  # a dummy: weight 0
        lens = [LENS[i] for i in idx]
        # unscored: the LM head skips the prompt where it can (cp = 1, no packing, no SP)
        lp, ent = mp.forward_policy(policy, ids[idx], lens, mesh, replace(cfg, temperature=TEMPERATURE), True,
                                    unscored=PROMPT_LEN)
        values = mp.forward_critic(critic, ids[idx], lens, mesh, cfg)
        loss = ((lp * weights[idx] * mask[idx]).sum() + (values**2 * mask[idx]).sum()) / n_tokens
        (w * loss).backward()
        if w:  # (not a dummy)
            seen += idx
            # the LM head skips the prompt where positions are row positions: lp, ent are 0 there
            skipped = mesh["cp"].size() == 1 and not (cfg.packing or cfg.sequence_parallel)
            if skipped:
                assert not lp[:, :PROMPT_LEN].any() and not ent[:, :PROMPT_LEN].any(), label
            for name, got in (("lp", lp), ("ent", ent), ("values", values)):
                start = PROMPT_LEN if skipped and name != "values" else 0
                err = (got.detach() - ref[name][idx])[:, start:].abs().max().item()
                assert err <= 1e-5, f"{label}: {name} differs from HF by {err:.2e}"
                outputs[name, tuple(idx)] = got.detach()
    assert sorted(seen) == mine, f"{label}: microbatches covered {seen}, expected {mine}"
    for prefix, model in (("", policy), ("critic.", critic)):
        names = set()
        for name, param in model.named_parameters():
            if not param.requires_grad:  # LoRA's frozen base: no gradient, none in the reference
                assert param.grad is None, f"{label}: the frozen {name} got a gradient"
                continue
            grad = param.grad  # a DTensor shard under fsdp: gathered (collective); whole under ddp
            full = grad.full_tensor() if isinstance(grad, torch.distributed.tensor.DTensor) else grad
            outputs[prefix + name] = full
            want = ref["grads"][prefix + name]
            rel = ((full - want).norm() / want.norm().clamp(min=1e-12)).item()
            assert rel <= 1e-5, f"{label}: grad of {prefix}{name} off by {rel:.2e} relative"
            names.add(prefix + name)
        assert names == {n for n in ref["grads"] if n.startswith("critic.") == bool(prefix)}, label
    # the global grad norm counts every element once, whatever the mesh
    policy_grads = [g for n, g in ref["grads"].items() if not n.startswith("critic.")]
    want_norm = torch.stack([g.double().norm() for g in policy_grads]).norm().item()
    got_norm = mp.clip_grad_norm(list(policy.parameters()), max_norm=1e9)
    assert abs(got_norm / want_norm - 1) <= 1e-5, f"{label}: grad norm {got_norm} vs {want_norm}"
    return outputs


def _set_adapters(model, adapters):
    """Write the full `adapters` into the model's LoRA parameters, each rank its own shards."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in adapters:
                full = adapters[name]
                if isinstance(param, torch.distributed.tensor.DTensor):
                    full = torch.distributed.tensor.distribute_tensor(
                        full, param.device_mesh, param.placements, src_data_rank=None).to_local()
                mp._local(param).copy_(full)


def _equivalence_body(rank, world_size, root, cases, checks=()):
    """Each case with both attention paths: each against HF, and varlen against masked."""
    for (dp, cp, tp), names, packings, extra in cases:
        mesh = mp.make_mesh(world_size, tp, cp, "cpu")
        for name in names:
            for packing in packings:
                label = f"{name} dp{dp} cp{cp} tp{tp} packing={packing} {extra}"
                outputs = {}
                # LoRA changes no attention path: its cases run the masked one (time: make test)
                for kind in ("masked",) if name == LORA_MODEL else ("masked", "varlen"):
                    cfg = _cfg(packing=packing, attention=kind, **extra)
                    outputs[kind] = _check_case(root, name, mesh, cfg, f"{label} {kind}")
                if name == LORA_MODEL:
                    continue
                masked, varlen = outputs["masked"], outputs["varlen"]
                assert masked.keys() == varlen.keys()
                for key, want in masked.items():  # logprobs, entropies, values, full gradients
                    err = (varlen[key] - want).abs().max().item()
                    assert err <= 1e-5, f"{label}: varlen differs from masked in {key} by {err:.2e}"
    for check in checks:  # more tests that reuse this spawn (starting ranks is the slow part)
        globals()[check](root, world_size)


def _weights_check(root, world_size, data_parallel="fsdp", name="tiny-qwen3"):
    """Refit names/values, the reference swap, clipping and HF export: on 4 ranks FSDP x TP
    (dp2 tp2), on 2 ranks CP (cp2) under FSDP2 and under DDP (tied embeddings there: the swap
    copies the one shared tensor once)."""
    mesh = mp.make_mesh(world_size, 2 if world_size == 4 else 1, 2 if world_size == 2 else 1, "cpu")
    path = _materialize(root, name)
    cfg = _cfg(packing=True, data_parallel=data_parallel)
    policy = mp.load_policy(path, mesh, cfg)
    checkpoint = load_file(os.path.join(path, "model.safetensors"))
    full = dict(mp.iter_full_params(policy))
    assert full.keys() == checkpoint.keys()
    assert all(torch.equal(full[n], checkpoint[n]) for n in full), "loaded weights differ from the file"

    ids, mask, weights = toy_batch(LENS, PROMPT_LEN)
    at_t = replace(cfg, temperature=TEMPERATURE)
    forward = lambda: mp.forward_policy(policy, ids, LENS, mesh, at_t, False)[0]
    with torch.no_grad():
        lp_initial = forward()  # FSDP2 leaves the root gathered after this: snapshot must not care
    snapshot = mp.snapshot_weights(policy)
    (forward() * weights * mask).sum().backward()
    norm = mp.clip_grad_norm(list(policy.parameters()), max_norm=1e9)
    mp.clip_grad_norm(list(policy.parameters()), max_norm=norm / 2)  # halves every gradient
    assert abs(mp.clip_grad_norm(list(policy.parameters()), max_norm=1e9) / norm - 0.5) < 1e-5
    torch.optim.SGD(policy.parameters(), lr=0.5).step()
    grads = lambda: {n: mp._local(p.grad).clone() for n, p in policy.named_parameters()}  # noqa: E731
    policy.zero_grad(set_to_none=True)
    (forward() * weights * mask).sum().backward()
    grads_before = grads()  # at the trained weights, before any swap
    policy.zero_grad(set_to_none=True)
    with torch.no_grad():
        lp_trained = forward()
        assert (lp_trained - lp_initial).abs().max() > 1e-3, "the step should change the policy"
        for _ in range(2):  # twice: the snapshot itself must come through a swap intact
            with mp.swapped_weights(policy, snapshot):
                assert torch.equal(forward(), lp_initial), "reference forward must see the initial weights"
            assert torch.equal(forward(), lp_trained), "the live weights must come back exactly"
    # the same backward after the swaps: the same gradients (DDP's hooks still sum them over dp)
    (forward() * weights * mask).sum().backward()
    assert all(torch.equal(g, grads_before[n]) for n, g in grads().items()), "gradients changed after a swap"

    out = os.path.join(root, f"export{world_size}{data_parallel}")
    full = dict(mp.iter_full_params(policy))
    mp.save_hf(policy, out)
    mp.save_hf(policy, out + "-sharded", torch.bfloat16, shard_gb=0.5 / 1024)  # 0.5 MB files: several
    if torch.distributed.get_rank() == 0:
        reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
        assert all(torch.equal(reloaded[n], full[n]) for n in full), "export differs from the trained weights"
        config_text = open(os.path.join(out, "config.json")).read()
        assert '"ppo"' not in config_text, "our attention leaked into config"
        files = sorted(f for f in os.listdir(out + "-sharded") if f.endswith(".safetensors"))
        sizes = [os.path.getsize(os.path.join(out + "-sharded", f)) for f in files]
        assert len(files) > 2 and max(sizes) <= 2**19 + 8192, sizes  # at most 0.5 MB of tensors + the header
        sharded = AutoModelForCausalLM.from_pretrained(out + "-sharded")  # dtype "auto": as config.json says
        assert sharded.dtype == torch.bfloat16
        for n, p in sharded.state_dict().items():
            if n in full:
                assert torch.equal(p, full[n].to(torch.bfloat16)), n


def _weights_check_ddp(root, world_size):
    _weights_check(root, world_size, "ddp", "tiny-llama-tied")


def _refusals_check(root, world_size):
    mesh = mp.make_mesh(world_size, 2, 1, "cpu")
    with pytest.raises(ValueError, match="Gemma3 runs with tp_size=1"):
        mp.load_policy(_materialize(root, "tiny-gemma3"), mesh, _cfg())
    path = mp.materialize_tiny_model("tiny-llama", os.path.join(root, "one-kv-head"), SEED,
                                     num_key_value_heads=1)
    with pytest.raises(ValueError, match="tp_size=2 must divide num_key_value_heads=1"):
        mp.load_policy(path, mesh, _cfg())


def _microbatch_check(root, world_size):
    mesh = mp.make_mesh(world_size, 1, 1, "cpu")
    lens = [5, 9, 3, 7, 4]
    # first-fit decreasing into 12 tokens: 9 -> row 0, 7 -> row 1, 5 -> row 1, 4 -> row 2,
    # 3 -> row 0
    packed = mp.microbatches(lens, _cfg(packing=True, max_tokens_per_microbatch=12), mesh)
    assert packed == [([1, 2], 1.0), ([3, 0], 1.0), ([4], 1.0)]
    # unpacked: longest first, two at a time: 9 and 7, 5 and 4, then 3
    unpacked = mp.microbatches(lens, _cfg(micro_batch_size=2), mesh)
    assert unpacked == [([1, 3], 1.0), ([0, 4], 1.0), ([2], 1.0)]
    with pytest.raises(ValueError, match="max_tokens_per_microbatch=8"):
        mp.microbatches(lens, _cfg(packing=True, max_tokens_per_microbatch=8), mesh)
    # a complete checkpoint dir is reused, not rewritten
    path = _materialize(root, "tiny-llama")
    stamp = os.path.getmtime(os.path.join(path, "model.safetensors"))
    assert _materialize(root, "tiny-llama") == path
    assert os.path.getmtime(os.path.join(path, "model.safetensors")) == stamp


# The worked example of _varlen_index's and _layout's docstrings, every number written out by hand:
# cp=2, one packed row of T=8 tokens holding documents of 3 and 5 tokens, zigzag chunks of 2 tokens
# (rank 0 keeps chunks 0 and 3, rank 1 chunks 1 and 2).
EXAMPLE_KV_ROWS = [0, 1, 6, 7, 2, 3, 4, 5]  # rank 0's share, then rank 1's
EXAMPLE_VARLEN = {  # cp rank -> _varlen_index's output
    0: dict(cu_seqlens_q=[0, 2, 4], cu_seqlens_k=[0, 2, 7], max_seqlen_q=2, max_seqlen_k=5,
            kv_index=[0, 1, 5, 6, 7, 2, 3]),
    1: dict(cu_seqlens_q=[0, 1, 2, 4], cu_seqlens_k=[0, 3, 4, 7], max_seqlen_q=2, max_seqlen_k=3,
            kv_index=[0, 1, 4, 5, 5, 6, 7]),
}


def _as_lists(varlen_args):
    return {key: x.tolist() if isinstance(x, torch.Tensor) else x for key, x in varlen_args.items()}


def _layout_example_check(root, world_size):
    """_layout's worked example on the two cp ranks it describes: sequences a b c and d e f g h
    packed into one row, each rank's queries, positions and documents, and its varlen arguments."""
    mesh = mp.make_mesh(world_size, 1, 2, "cpu")  # cp = 2
    rank = mesh["cp"].get_local_rank()
    a, b, c, d, e, f, g, h = range(10, 18)
    pad = 257
    ids = torch.tensor([[a, b, c, pad, pad], [d, e, f, g, h]])  # (b, S) right-padded
    layout = mp._layout(ids, [3, 5], mesh, _cfg(packing=True, attention="varlen"))
    assert layout.ids.tolist() == [[a, b, c, d, e, f, g, h]]
    assert layout.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    assert layout.cu_seqlens.tolist() == [0, 3, 8]
    assert layout.kv_rows.tolist() == EXAMPLE_KV_ROWS
    assert layout.kv_docs.tolist() == [[0, 0, 1, 1, 0, 1, 1, 1]]
    inputs = layout.model_inputs()
    got = (layout.q_rows.tolist(), inputs["input_ids"].tolist(), inputs["position_ids"].tolist(),
           layout.q_docs.tolist())
    want = {0: ([0, 1, 6, 7], [[a, b, g, h]], [[0, 1, 3, 4]], [[0, 0, 1, 1]]),
            1: ([2, 3, 4, 5], [[c, d, e, f]], [[2, 0, 1, 2]], [[0, 1, 1, 1]])}[rank]
    assert got == want, f"rank {rank}: {got}"
    fields = EXAMPLE_VARLEN[rank].keys()
    assert _as_lists({key: getattr(layout, key) for key in fields}) == EXAMPLE_VARLEN[rank], rank


BOTH = (False, True)
CASES = {  # world size -> [((dp, cp, tp), models, packing values, config overrides)]
    1: [((1, 1, 1), FAMILIES, BOTH, {}),
        ((1, 1, 1), ["tiny-llama-tied"], (True,), dict(data_parallel="ddp")),  # one rank: a plain module
        ((1, 1, 1), [LORA_MODEL], BOTH, LORA)],
    2: [((2, 1, 1), FAMILIES + ["tiny-gemma3"], BOTH, {}),
        ((1, 1, 2), FAMILIES, BOTH, {}),
        ((1, 2, 1), FAMILIES, BOTH, {}),
        ((1, 2, 1), ["tiny-gemma3"], (True,), {}),  # sliding window + zigzag + packing
        ((1, 1, 2), ["tiny-qwen3"], (True,), dict(sequence_parallel=True)),
        ((1, 1, 2), ["tiny-llama-tied", "tiny-qwen3-v263"], (False,), {}),
        ((2, 1, 1), ["tiny-llama"], (True,), dict(activation_checkpointing=True, cpu_offload=True)),
        # DDP keeps whole replicas, whatever the family (every family ran under FSDP2 above): a
        # tied embedding (one shared tensor) and Gemma3's other architecture
        ((2, 1, 1), ["tiny-gemma3", "tiny-llama-tied"], BOTH, dict(data_parallel="ddp")),
        ((1, 2, 1), ["tiny-qwen3"], BOTH, dict(data_parallel="ddp")),
        # LoRA (the frozen base and the adapters in one FSDP2 unit; A and B split as their base
        # under TP) against PEFT's LoRA on one process; and under DDP, which skips frozen weights
        ((2, 1, 1), [LORA_MODEL], BOTH, LORA),
        ((1, 1, 2), [LORA_MODEL], BOTH, LORA),
        ((1, 2, 1), [LORA_MODEL], BOTH, LORA),
        ((2, 1, 1), [LORA_MODEL], (True,), dict(LORA, data_parallel="ddp"))],
    # every family's TP plan and attention already ran at tp=2 and cp=2 above: on 4 ranks, where
    # the axes combine, the two families with parts of their own (qwen3's q/k norms under TP,
    # mistral's window under CP)
    4: [((2, 1, 2), ["tiny-qwen3", "tiny-mistral"], BOTH, {}),
        ((1, 2, 2), ["tiny-qwen3", "tiny-mistral"], BOTH, {}),
        ((1, 2, 2), ["tiny-qwen2"], (True,), dict(sequence_parallel=True)),
        ((2, 1, 2), [LORA_MODEL], BOTH, LORA),
        ((1, 2, 2), [LORA_MODEL], BOTH, dict(LORA, sequence_parallel=True))],
}


CHECKS = {  # world size -> more checks run in the same spawn
    1: ["_microbatch_check"],
    2: ["_refusals_check", "_weights_check", "_weights_check_ddp", "_layout_example_check"],
    4: ["_weights_check"],
}


# 4 ranks: the slow tier
@pytest.mark.parametrize("world_size", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_matches_hf_every_family_and_mesh(root, world_size):
    run_ranks(_equivalence_body, world_size, root, CASES[world_size], CHECKS[world_size])


def test_varlen_reference_kernel_by_hand():
    """The CPU stand-in for flash_attn_varlen_func against softmax(q k^T / sqrt(d)) v written out
    per query: causal bottom-right (query j of Lq sees keys <= j + Lk - Lq), window, GQA."""
    q, k, v, cu_q, cu_k = varlen_case()
    for window in (-1, 3):
        got = mp.varlen_attention_reference(q, k, v, cu_q, cu_k, 10, 10, softmax_scale=0.2, causal=True,
                                            window_size=(window, 0))
        for seg in range(3):
            q0, q1, k0, k1 = cu_q[seg], cu_q[seg + 1], cu_k[seg], cu_k[seg + 1]
            for j in range(q1 - q0):
                at = j + (k1 - k0) - (q1 - q0)  # the query's position among its keys
                first = 0 if window < 0 else max(0, at - window)
                for h in range(4):
                    keys = k[k0 + first:k0 + at + 1, h // 2]  # (n, D)
                    vals = v[k0 + first:k0 + at + 1, h // 2]  # (n, D)
                    weights = torch.softmax(keys @ q[q0 + j, h] * 0.2, dim=0)  # (n,)
                    torch.testing.assert_close(got[q0 + j, h], weights @ vals, atol=1e-6, rtol=0)


def test_varlen_reference_calls_sdpa_in_4d_and_unmasked_where_it_can(monkeypatch):
    """SDPA's fused kernels take 4-D inputs only: a 3-D call with a mask runs the math kernel, an
    (H, Lq, Lk) fp32 score tensor kept for the backward. The reference must call it 4-D, and with
    no mask (is_causal) for a whole document without a window. Recorded on varlen_case's three
    segments (Lq = Lk, Lq < Lk, Lq = Lk), without and with a window."""
    q, k, v, cu_q, cu_k = varlen_case()
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(query, key, value, attn_mask=None, is_causal=False, **kwargs):
        calls.append((query.dim(), attn_mask is not None, is_causal))
        return sdpa(query, key, value, attn_mask=attn_mask, is_causal=is_causal, **kwargs)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    mp.varlen_attention_reference(q, k, v, cu_q, cu_k, 10, 10, softmax_scale=0.2)
    assert calls == [(4, False, True), (4, True, False), (4, False, True)], calls
    calls.clear()
    mp.varlen_attention_reference(q, k, v, cu_q, cu_k, 10, 10, softmax_scale=0.2,
                                  window_size=(3, 0))
    assert calls == [(4, True, False)] * 3, calls


def test_varlen_index_worked_example():
    """_varlen_index on its docstring's example (EXAMPLE_VARLEN, written out by hand), per cp rank;
    and with cp=1, where each document is one segment over its own keys."""
    for rank, want in EXAMPLE_VARLEN.items():
        got = mp._varlen_index([3, 5], 1, 8, 2, rank, torch.tensor(EXAMPLE_KV_ROWS))
        assert got["cu_seqlens_q"].dtype == got["cu_seqlens_k"].dtype == torch.int32  # flash-attn's
        assert _as_lists(got) == want, f"rank {rank}: {_as_lists(got)}"
    got = _as_lists(mp._varlen_index([3, 5], 1, 8, 1, 0, torch.arange(8)))
    assert got == dict(cu_seqlens_q=[0, 3, 8], cu_seqlens_k=[0, 3, 8], max_seqlen_q=5, max_seqlen_k=5,
                       kv_index=None)


def test_torch_varlen_wrapper_passes_window_and_gqa_as_each_torch_takes_them(monkeypatch):
    """torch_varlen_attention (the GPU kernel without flash-attn; run on a GPU by test_cuda.py)
    with CPU stand-ins for torch's varlen_attn: 2.11's signature has no enable_gqa (its kernel
    takes fewer KV heads as they are), 2.13's must be told enable_gqa=True when heads differ."""
    q, k, v, cu_q, cu_k = varlen_case()

    def torch_2_11(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        # causal, as torch reads it
        assert isinstance(window_size, tuple) and window_size[1] == 0, window_size
        return mp.varlen_attention_reference(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale,
                                             window_size=window_size)

    def torch_2_13(*args, enable_gqa=False, **kwargs):
        heads_differ = args[1].shape[1] != args[0].shape[1]  # k's heads vs q's
        assert enable_gqa == heads_differ, "enable_gqa must say whether heads differ"
        return torch_2_11(*args, **kwargs)

    for stand_in in (torch_2_11, torch_2_13):
        monkeypatch.setattr(mp, "varlen_attn", stand_in)
        monkeypatch.setattr(mp, "VARLEN_ARGS", inspect.signature(stand_in).parameters)  # as read at import
        for window in (-1, 3):
            args = (q, k, v, cu_q, cu_k, 10, 10)
            want = mp.varlen_attention_reference(*args, softmax_scale=0.2, window_size=(window, 0))
            got = mp.torch_varlen_attention(*args, softmax_scale=0.2, window_size=(window, 0))
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_attention_auto_never_puts_a_dense_mask_on_a_packed_gpu_row(monkeypatch):
    """config.resolve_auto's decision table, per device, kernel and packing (no GPU needed:
    model_parallel.gpu_kernel_name only reads which kernels exist): a flash kernel whenever bf16
    on CUDA has one (flash-attn's first, then torch's); on CUDA a packed row gets varlen even
    without one (the reference kernel, per document); masked SDPA only for padded rows, or on CPU
    for packed rows up to the mask limit."""
    def resolved(device_type, **fields):
        cfg = Config(**fields)
        gpu_kernel = mp.gpu_kernel_name() if device_type == "cuda" else None  # as model_parallel.setup asks
        kernel = config.resolve_auto(cfg, device_type, gpu_kernel)
        return cfg.dtype, cfg.attention, kernel

    flash, torch_kernel = "flash-attn varlen", "torch varlen_attn"
    reference = "reference varlen (one SDPA per document)"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (9, 0))  # an H100
    monkeypatch.setattr(mp, "flash_attn_varlen_func", lambda *args, **kwargs: None)
    for packing in (False, True):
        assert resolved("cuda", packing=packing) == ("bf16", "varlen", flash)
    # flash kernels need bf16
    assert resolved("cuda", data_parallel="ddp") == ("fp32", "masked", "masked SDPA")
    assert resolved("cuda", data_parallel="ddp", max_model_len=8192)[1] == "varlen"  # long unpacked rows
    assert resolved("cuda", data_parallel="ddp", packing=True) == ("fp32", "varlen", reference)
    assert resolved("cuda", attention="masked") == ("bf16", "masked", "masked SDPA")  # asked for: kept
    assert resolved("cpu") == resolved("cpu", packing=True) == ("fp32", "masked", "masked SDPA")
    assert resolved("cpu", packing=True, max_tokens_per_microbatch=8192) == ("fp32", "varlen", reference)
    # a 2048 x 8192 mask: within the limit
    assert resolved("cpu", packing=True, max_tokens_per_microbatch=8192, cp_size=4)[1] == "masked"
    assert resolved("cpu", max_model_len=8192) == ("fp32", "varlen", reference)  # unpacked rows of up to 8192
    monkeypatch.setattr(mp, "flash_attn_varlen_func", None)  # no flash-attn: torch's kernel, where it has one
    monkeypatch.setattr(mp, "VARLEN_ARGS", {"window_size": None})
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    for packing in (False, True):
        assert resolved("cuda", packing=packing) == ("bf16", "varlen", torch_kernel)
    # issue 28: a pre-Ampere GPU (a T4, 7.5): the build has the kernel, the device cannot run it
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (7, 5))
    assert resolved("cuda") == ("bf16", "masked", "masked SDPA")
    assert resolved("cuda", packing=True) == ("bf16", "varlen", reference)
    monkeypatch.setattr(mp, "flash_attn_varlen_func", lambda *args, **kwargs: None)
    assert resolved("cuda", packing=True) == ("bf16", "varlen", reference)  # nor flash-attn's
    monkeypatch.setattr(mp, "flash_attn_varlen_func", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (9, 0))
    # no kernel at all
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: False)
    assert resolved("cuda") == ("bf16", "masked", "masked SDPA")
    assert resolved("cuda", packing=True) == ("bf16", "varlen", reference)


def _masked_refusal_body(rank, world_size):
    """Unpacked rows longer than the limit (4097 tokens, padded to 4098: a multiple of 2cp*tp) are
    refused in the forward, before any mask is built."""
    mesh = mp.make_mesh(world_size, 1, 1, "cpu")
    cfg = _cfg()
    ids = torch.zeros(1, 4097, dtype=torch.long)
    refusal = r"attention=masked would build a dense 1x4098x4098 mask .* use attention=varlen"
    with pytest.raises(ValueError, match=refusal):
        mp._layout(ids, [4097], mesh, cfg)
    mp._layout(ids[:, :4096], [4096], mesh, cfg)  # at the limit: built


def test_masked_attention_refuses_a_row_above_the_limit():
    run_ranks(_masked_refusal_body, 1)


def _own_longest_row_body(rank, world_size):
    """Issue 28: an unpacked microbatch costs what it holds. Rows of 3 and 5 tokens from a batch
    whose longest row is 20 are laid out 6 wide (5, padded to a multiple of 2*cp*tp = 2), not 20,
    and come back 20 wide with zeros past each row's end; microbatches group the longest rows."""
    mesh = mp.make_mesh(world_size, 1, 1, "cpu")
    cfg = _cfg(micro_batch_size=2)
    ids = torch.randint(0, 200, (2, 20))
    layout = mp._layout(ids, [3, 5], mesh, cfg)
    assert layout.ids.shape == (2, 6)
    assert torch.equal(layout.ids[0, :3], ids[0, :3]) and torch.equal(layout.ids[1, :5], ids[1, :5])
    back = mp._unlayout(torch.ones(2, 6), layout, ids)
    assert back.shape == (2, 20) and back.sum(1).tolist() == [3.0, 5.0]
    # lengths 3, 9, 5, 7: the two longest (rows 1 and 3) together, then rows 2 and 0
    assert mp.microbatches([3, 9, 5, 7], cfg, mesh) == [([1, 3], 1.0), ([2, 0], 1.0)]


def test_a_microbatch_is_padded_to_its_own_longest_row():
    run_ranks(_own_longest_row_body, 1)


def test_grad_norm_is_exact_on_a_large_gradient():
    """One 28M-element gradient (the 135M model's tied embedding, whole under DDP) against the
    fp64 sum of squares: a single fp32 running sum over it drifts by ~3e-3, our row-wise norms by
    ~1e-7. No process group: a plain tensor is summed locally."""
    param = torch.nn.Parameter(torch.empty(49152, 576))
    param.grad = torch.randn(49152, 576, generator=torch.Generator().manual_seed(0)) * 1e-3
    want = param.grad.double().pow(2).sum().sqrt().item()
    got = mp.clip_grad_norm([param], max_norm=0)
    assert abs(got / want - 1) < 1e-6, f"grad norm {got} vs fp64 {want}"


def _fsdp_units_body(rank, world_size, root):
    """Which modules are FSDP2 units of their own: an untied policy's embedding, and its final norm
    with the head (one unit); a tied one keeps the shared tensor in the root; the critic's embedding
    too, beside its fp32 value head."""
    from torch.distributed.fsdp import FSDPModule
    mesh = mp.make_mesh(world_size, 1, 1, "cpu")
    untied = mp.load_policy(_materialize(root, "tiny-llama"), mesh, _cfg())
    assert isinstance(untied.model.embed_tokens, FSDPModule)
    assert isinstance(untied.lm_head, FSDPModule) and isinstance(untied.model.norm, FSDPModule)
    # the root holds no weight of its own any more: every parameter belongs to a smaller unit
    root_params = untied._get_fsdp_state()._fsdp_param_group
    assert root_params is None or not root_params.fsdp_params
    tied = mp.load_policy(_materialize(root, "tiny-llama-tied"), mesh, _cfg())
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert not isinstance(tied.model.embed_tokens, FSDPModule) and not isinstance(tied.lm_head, FSDPModule)
    critic = mp.load_critic(_materialize(root, "tiny-llama"), mesh, _cfg())
    assert isinstance(critic.model.embed_tokens, FSDPModule) and isinstance(critic.lm_head, FSDPModule)


def test_embedding_and_head_are_fsdp_units_of_their_own(root):
    """Issue 28: in one root unit, an untied 7B's embedding and head (1.09B parameters at tp=1) stay
    gathered through forward and backward, and reduce-scatter last with nothing to overlap."""
    run_ranks(_fsdp_units_body, 2, root)


def test_a_mask_never_meets_fewer_kv_heads_than_query_heads(monkeypatch):
    """On a GPU, SDPA given an explicit mask and fewer KV heads than query heads (enable_gqa) runs
    its math kernel, O(T^2) memory: flash attention refuses a mask, the memory-efficient kernel
    refuses grouped-query attention. Every SDPA call of the masked path and of the varlen stand-in
    (which an fp32 run on a GPU uses) is recorded: a mask always comes with as many KV heads as
    query heads. Their output is grouped-query causal attention written out by hand."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(query, key, value, attn_mask=None, **kwargs):
        calls.append((query.shape[-3], key.shape[-3], attn_mask is not None, kwargs.get("enable_gqa")))
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)
    monkeypatch.setattr(mp.F, "scaled_dot_product_attention", recording)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=g)  # (B, Hq, T, D)
    k, v = torch.randn(2, 2, 2, 6, 8, generator=g)  # (B, Hkv, T, D) each: query heads 0, 1 read KV head 0
    rows, docs = torch.arange(6), torch.zeros(2, 6, dtype=torch.long)
    layout = SimpleNamespace(q_rows=rows, kv_rows=rows, q_docs=docs, kv_docs=docs)
    masked = mp._masked_attention(q, k, v, 0.5, None, layout).transpose(1, 2)  # (B, Hq, T, D)
    scores = q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.5  # (B, Hq, T, T)
    future = torch.ones(6, 6, dtype=torch.bool).triu(1)  # (T, T)
    expected = scores.masked_fill(future, float("-inf")).softmax(-1) @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(masked, expected)
    cu = torch.tensor([0, 6, 12], dtype=torch.int32)  # the two rows as two segments
    flat = [x.transpose(1, 2).flatten(0, 1) for x in (q, k, v)]  # (B*T, H, D) each
    varlen = mp.varlen_attention_reference(*flat, cu, cu, 6, 6, softmax_scale=0.5)  # (B*T, Hq, D)
    torch.testing.assert_close(varlen.view(2, 6, 4, 8).transpose(1, 2), expected)
    # the masked path's call has its mask; the stand-in's two whole documents need none
    # (is_causal: test_varlen_reference_calls_sdpa_in_4d_and_unmasked_where_it_can)
    assert [masked for _, _, masked, _ in calls] == [True, False, False], calls
    assert all(hq == hkv and not gqa for hq, hkv, _, gqa in calls), calls
