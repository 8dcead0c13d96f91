"""Everything about where tensors live: the (dp, cp, tp) mesh, loading an HF checkpoint into
sharded modules (FSDP2 + tensor parallel), context-parallel and packed attention, the critic, the
reference-weight swap, the global grad norm and HF export. train_ppo.py asks for "logprobs of these
rows" and never sees a shard.

    torchrun --nproc_per_node=4 train_ppo.py --tp_size=2 --cp_size=1   # dp = 4 / (2*1) = 2

One forward, in order: rows -> (packed) layout -> this rank's zigzag share of the tokens -> HF model
with our attention function -> this rank's vocab shard of the logits -> logprobs.py.

Sections, in order: first what one PPO step calls, in the order it calls it (the forward:
microbatches, the Layout of this rank's tokens that every layer reads and _layout that builds it,
our attention function; the reference's weight swap and DDP's gradient sync; the global grad
norm; full weights for the refit; last the critic's pass, which GRPO and RLOO skip). Then, after
the banner "Beyond one step", what a first reading skips: distributed set-up; CP's attention and
the varlen kernels; model families and their tiny presets; tensor-parallel plans; loading (build,
shard, allocate, read); the reward model's forward; the reference policy's snapshot; the HF
export. (LoRA's adapters and the optimizer's offload live in extensions/.)

Where the ideas come from (code and prose are our own):
1. FSDP2 per decoder layer then the root, one TP plan dict per family, the degree check naming every
   factor: torchtitan (parallelize_llama).
2. Column/row-parallel linears with one all-reduce per block: Megatron-LM (Shoeybi et al. 2019);
   sequence-parallel norms: Korthikanti et al. 2022, "Reducing activation recomputation".
3. Zigzag (load-balanced) context parallelism with all-gathered K/V: Megatron-LM/TransformerEngine
   CP and the zigzag ring attention of ring-flash-attention (Liu et al. 2023).
4. First-fit-decreasing packing with block-diagonal attention: Krell et al. 2021, "Efficient
   sequence packing without cross-contamination"; verl / NeMo-RL sequence packing."""
import contextlib
import copy
import datetime
import inspect
import itertools
import json
import math
import os
import shutil
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch.distributed._composable.replicate import DDP, replicate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy,
                                    OffloadPolicy, fully_shard)
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM

from config import flash_runs, masked_attention_error, resolve_auto
from extensions import lora  # the one extension this module names (extensions/, README)
from logprobs import gather_shifted, token_logprobs, zigzag_positions

# GPU only: flash-attn's varlen kernel skips the masked-out blocks of a packed row
try:
    from flash_attn import flash_attn_varlen_func
except ImportError:
    flash_attn_varlen_func = None
# GPU only, without flash-attn: PyTorch's own FlashAttention-2 varlen kernel
try:
    from torch.nn.attention.varlen import varlen_attn
    # window_size since 2.11, enable_gqa 2.13
    VARLEN_ARGS = inspect.signature(varlen_attn).parameters
except ImportError:
    varlen_attn, VARLEN_ARGS = None, {}


# -----------------------------------------------------------------------------
# What one PPO step calls here, in the order it first calls it: the forward (microbatches, this
# rank's tokens laid out by _layout, the model, whose attention is ppo_attention, the head, and
# per-token numbers in the trainer's rows), the reference pass (swapped_weights), DDP's gradient
# sync, the global grad-norm clip, the refit's full weights, and last the critic's pass (GAE
# only). What a first reading skips (the mesh's set-up, CP's attention and the varlen kernels, the
# model families, TP plans, loading, the reference's snapshot, the HF export) comes after the
# banner "Beyond one step".


# Layout: where this rank's tokens sit, which every layer's attention reads (ppo_attention, below;
# _layout builds it). First, as a reader meets it in the forward.

@dataclass
class Layout:
    """Where each token of this rank's rows sits: built once per forward (_layout) for every layer's
    attention and for _unlayout. B rows (one if packed) of T tokens, padded to a multiple of
    2*cp*tp; this rank's queries are the tokens at q_rows (its zigzag share), its keys all T."""
    ids: torch.Tensor  # (B, T) every token of the rows
    positions: torch.Tensor  # (B, T) restarting at 0 in each packed sequence
    seq_lens: torch.Tensor  # (b,) real tokens of each sequence
    # packed: (documents + 1,) boundaries of the sequences (and of the padding tail); else None
    cu_seqlens: torch.Tensor | None
    # the varlen kernel, chosen once per forward for every layer (_varlen_kernel); None: masked SDPA
    kernel: object
    cp_group: dist.ProcessGroup | None  # K, V all-gathered over it (None: cp=1)
    # masked SDPA reads these four: each query's and key's row position and document
    q_rows: torch.Tensor  # (T/cp,) this rank's zigzag share
    kv_rows: torch.Tensor  # (T,) every share, in rank order (gathered)
    q_docs: torch.Tensor  # (B, T/cp) 0 throughout an unpacked row
    kv_docs: torch.Tensor  # (B, T)
    # the varlen kernels read these five, flash-attn's contract (see _varlen_index); None under
    # masked SDPA, which reads none of them
    cu_seqlens_q: torch.Tensor | None = None  # (segments + 1,) int32 query boundaries
    cu_seqlens_k: torch.Tensor | None = None  # (segments + 1,) int32 key boundaries
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None
    kv_index: torch.Tensor | None = None  # (total_k,) CP: keys among the gathered

    def model_inputs(self):
        """What HF's forward gets: this rank's tokens, and the layout for our attention function."""
        return dict(input_ids=self.ids[:, self.q_rows], position_ids=self.positions[:, self.q_rows],
                    ppo_layout=self, use_cache=False)  # (B, T/cp) each


# -----------------------------------------------------------------------------
# Forward: microbatches of rows -> this rank's tokens (_layout, beside the attention below) ->
# model -> this rank's head output -> per-token numbers in the trainer's (b, S) rows.

def microbatches(seq_lens, cfg, mesh):
    """Collective (every rank of dp): (rows, loss weight) of each microbatch, rows indexing
    seq_lens, the same count on every dp rank: a rank with fewer runs dummies, row 0 again at
    weight 0 (it changes nothing), so that FSDP's or DDP's collectives still match. Packing:
    first-fit decreasing into rows of at most max_tokens_per_microbatch tokens; else
    micro_batch_size rows at a time, longest first, so that each microbatch is padded to its own
    longest row (_layout trims to it), not to the longest of the whole batch. Which rows share a
    microbatch changes no loss: every loss is a sum over rows divided by global counts."""
    if cfg.packing:
        multiple = 2 * mesh["cp"].size() * mesh["tp"].size()
        capacity = cfg.max_tokens_per_microbatch // multiple * multiple  # room left after padding
        bins, room = [], []
        for i in sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i]):  # longest first
            if seq_lens[i] > capacity:
                raise ValueError(f"a sequence of {seq_lens[i]} tokens does not fit "
                                 f"max_tokens_per_microbatch={cfg.max_tokens_per_microbatch} "
                                 f"(usable {capacity}: a multiple of 2*cp*tp={multiple}); raise it")
            # the first bin with room, else a new one
            fit = next((k for k in range(len(bins)) if room[k] >= seq_lens[i]), len(bins))
            if fit == len(bins):
                bins.append([])
                room.append(capacity)
            bins[fit].append(i)
            room[fit] -= seq_lens[i]
    else:
        size = cfg.micro_batch_size
        by_length = sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i])
        bins = [by_length[start:start + size] for start in range(0, len(seq_lens), size)]
    count = torch.tensor([len(bins)], device=_device(mesh))
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=mesh["dp"].get_group())  # collective over dp
    return [(rows, 1.0) for rows in bins] + [([0], 0.0)] * (int(count) - len(bins))


def to_device(values, device):
    """torch.tensor(values) on `device`, without making the host wait: a copy from pageable memory
    waits for every kernel queued before it, one from pinned memory with non_blocking does not."""
    host = torch.tensor(values)
    if device.type == "cuda":  # GPU only
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _device(mesh):
    """This rank's device on `mesh`: its GPU, or the CPU."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _group(mesh, dim):
    """The process group of one mesh dim; None for a dim of size 1 (logprobs.py then skips it)."""
    return mesh[dim].get_group() if mesh[dim].size() > 1 else None


def forward_policy(model, input_ids, seq_lens, mesh, cfg, with_entropy=False, unscored=0):
    """Collective (every rank): per-token logprobs (b, S) under pi(.)^(1/T), T = cfg.temperature
    (the engine's sampling temperature), and the entropy if asked (else None), aligned as in
    train_ppo.py's docstring (0 at position 0). Four steps: the rows' layout (this rank's
    tokens), the model (this rank's vocab shard of the logits at its positions), token_logprobs
    (gathered over tp and cp), and back into the rows. Packing, CP and TP stay inside.
    `unscored`: leading positions that no loss reads in any row, which the LM head may skip
    (_skipped_by_lm_head: an optimization; 0 is the plain pass)."""
    layout = _layout(input_ids, seq_lens, mesh, cfg)
    skip = _skipped_by_lm_head(unscored, mesh, cfg)
    # (B, T/cp - skip, V/tp): logits_to_keep counts positions from the end
    logits = model(**layout.model_inputs(), logits_to_keep=layout.ids.shape[1] - skip).logits
    if isinstance(logits, DTensor):  # tp > 1: this rank's vocab shard, never gathered
        logits = logits.to_local()  # (B, T/cp - skip, V/tp)
    # the logits are divided by the sampling temperature: pi/pi_old compares the distributions the
    # engine sampled from (as NeMo-RL and verl do)
    shards = dict(tp_group=_group(mesh, "tp"), cp_group=_group(mesh, "cp"),
                  cu_seqlens=layout.cu_seqlens, chunk_size=cfg.logprob_chunk_size,
                  temperature=cfg.temperature)
    # the entropy (a metric, or the bonus with its gradient) from the logprobs' own softmax pass
    out = token_logprobs(logits, layout.ids[:, skip:],
                         with_entropy=with_entropy, **shards)  # (B, T - skip)
    per_token = out if with_entropy else (out, None)
    # back in the trainer's (b, S) rows, 0 at the skipped positions
    return tuple(None if x is None else _unlayout(F.pad(x, (skip, 0)), layout, input_ids)
                 for x in per_token)


# -----------------------------------------------------------------------------
# Attention: one function for every layout, registered with transformers' AttentionInterface as
# "ppo" and selected by name at load time. "ppo" is in no mask registry, so the model builds no
# mask of its own (it could not know our packing or zigzag order); the layout reaches us as forward
# kwargs, which transformers 5.x hands down to this function untouched.

def _layout(input_ids, seq_lens, mesh, cfg):
    """What this rank feeds the model for (b, S) right-padded rows with seq_lens real tokens. Rows
    (or the packed row) are padded to a multiple of 2*cp*tp: zigzag needs 2*cp equal chunks and
    sequence parallel splits each cp share again over tp. Pad tokens (id 0) come after every real
    token they could disturb and no loss reads them.

    A worked example (_varlen_index's, checked by tests/test_model_parallel.py): packing, cp=2,
    tp=1, two sequences a b c and d e f g h. They pack into one row of T=8 tokens (a multiple of
    2*cp*tp=4: no padding tail; else the tail would be a document of its own):

        ids        a b c d e f g h         cu_seqlens = [0 3 8]
        positions  0 1 2 0 1 2 3 4         (RoPE sees each sequence as if alone)
        docs       0 0 0 1 1 1 1 1
        rank 0:  q_rows = [0 1 6 7]: the model gets a b g h at positions 0 1 3 4, q_docs [0 0 1 1]
        rank 1:  q_rows = [2 3 4 5]: the model gets c d e f at positions 2 0 1 2, q_docs [0 1 1 1]
        both:    kv_rows = [0 1 6 7 2 3 4 5], kv_docs = [0 0 1 1 0 1 1 1]"""
    cp_size, cp_rank = mesh["cp"].size(), mesh["cp"].get_local_rank()
    multiple = 2 * cp_size * mesh["tp"].size()
    device = _device(mesh)
    # Every index below is made on the device or copied there without a host sync (to_device):
    # the host keeps queueing the GPU's work. The rows' own longest, not the (b, S) batch's: a
    # short microbatch costs what it holds.
    input_ids = input_ids[:, :max(seq_lens)].to(device)  # (b, S')
    if cfg.packing:
        # one row: the sequences back to back, the padding tail as a document of its own
        lens = [int(n) for n in seq_lens]
        tail = -sum(lens) % multiple
        pieces = [input_ids[k, :n] for k, n in enumerate(lens)] + [input_ids.new_zeros(tail)]
        ids = torch.cat(pieces)[None]  # (1, T)
        doc_lens = lens + [tail] if tail else lens
        lengths = to_device(doc_lens, device)  # (docs,)
        cu_seqlens = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)  # (docs + 1,)
        # its output size given: no sync
        docs = torch.repeat_interleave(torch.arange(len(doc_lens), device=device), lengths,
                                       output_size=ids.shape[1])[None]  # (1, T)
        # position ids restart at 0 in each sequence: RoPE sees every sequence as if alone
        positions = torch.arange(ids.shape[1], device=device)[None] - cu_seqlens[docs]  # (1, T)
    else:
        ids = F.pad(input_ids, (0, -input_ids.shape[1] % multiple))  # (b, T)
        doc_lens = [ids.shape[1]]  # one document per row
        cu_seqlens = None
        docs = torch.zeros_like(ids)  # (b, T)
        positions = torch.arange(ids.shape[1], device=device).expand_as(ids)  # (b, T)
    # queries: this rank's zigzag share (chunks r, 2cp-1-r); keys: every share, all-gathered in
    # rank order
    q_rows = zigzag_positions(ids.shape[1], cp_size, cp_rank, device)  # (T/cp,)
    kv_rows = torch.cat([zigzag_positions(ids.shape[1], cp_size, r, device)
                         for r in range(cp_size)])  # (T,)
    # the varlen kernel (_varlen_kernel, with _varlen_index below the banner "Beyond one step"),
    # or None: masked SDPA, refused past MASK_LIMIT (unpacked rows: their length is known only
    # now; config.validate refused the worst case)
    kernel = _varlen_kernel(cfg, device) if cfg.attention == "varlen" else None
    error = masked_attention_error(ids.shape[1], cp_size, ids.shape[0])
    if kernel is None and error:
        raise ValueError(error)
    layout = Layout(ids=ids, positions=positions, seq_lens=to_device(list(seq_lens), device),
                    cu_seqlens=cu_seqlens, kernel=kernel, cp_group=_group(mesh, "cp"),
                    q_rows=q_rows, kv_rows=kv_rows, q_docs=docs[:, q_rows],
                    kv_docs=docs[:, kv_rows])
    if kernel is None:  # masked SDPA: the rows and documents above are all it reads
        return layout
    varlen = _varlen_index(doc_lens, ids.shape[0], ids.shape[1], cp_size, cp_rank, kv_rows)
    return replace(layout, **varlen)


def _skipped_by_lm_head(unscored, mesh, cfg):
    """How many leading positions the LM head skips in forward_policy. `unscored`: the positions
    that no loss reads in any row (the shortest prompt); the logits at unscored - 1 predict the
    first scored token, so the head need not run before it (docs/performance.md: the no-grad phase
    11.9 -> 10.5 s). Only where a rank's positions are its rows' (cp=1, no packing, no SP);
    elsewhere 0, the plain pass."""
    plain_rows = mesh["cp"].size() == 1 and not (cfg.packing or cfg.sequence_parallel)
    return max(unscored - 1, 0) if plain_rows else 0


def ppo_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                  sliding_window=None, *, ppo_layout, **unused):
    """Collective over cp (every cp rank, each layer): causal attention within each packed document,
    over this rank's zigzag share of queries and every key. query: (B, Hq/tp, T/cp, D); key, value:
    (B, Hkv/tp, T/cp, D). `ppo_layout` (a Layout, built once per forward by _layout) says which
    kernel and holds its index tensors. `sliding_window`: passed by HF for windowed layers (None
    elsewhere). Dropout is not supported (PPO runs without); attention_mask is None ("ppo" builds
    none)."""
    # all-gather CP (Llama 3's choice): K and V are small under GQA
    if ppo_layout.cp_group is not None:
        key = _GatherSeq.apply(key, ppo_layout.cp_group)  # (B, Hkv/tp, T, D)
        value = _GatherSeq.apply(value, ppo_layout.cp_group)  # (B, Hkv/tp, T, D)
    attend = _masked_attention if ppo_layout.kernel is None else _varlen_attention
    return (attend(query, key, value, scaling, sliding_window, ppo_layout),
            None)  # no attention weights


AttentionInterface.register("ppo", ppo_attention)


def _masked_attention(query, key, value, scaling, sliding_window, layout):
    """SDPA with an explicit (B, T/cp, T) mask: a key is visible if it is in the query's document
    and not in its future, counted in row positions (zigzag order is irrelevant once every token
    carries its index). O(T^2) memory per row; exact in fp32."""
    q_rows, kv_rows, q_docs, kv_docs = layout.q_rows, layout.kv_rows, layout.q_docs, layout.kv_docs
    same_doc = q_docs[:, :, None] == kv_docs[:, None, :]  # (B, T/cp, T)
    not_future = kv_rows[None, None, :] <= q_rows[None, :, None]  # (1, T/cp, T)
    mask = same_doc & not_future  # (B, T/cp, T)
    if sliding_window:
        # only the last `sliding_window` keys, the query's own included: HF's convention
        # (masking_utils.sliding_window_overlay, kv_idx > q_idx - sliding_window) for Gemma3's
        # local layers and every Mistral layer
        mask &= kv_rows[None, None, :] > q_rows[None, :, None] - sliding_window  # (B, T/cp, T)
    out = masked_sdpa(query, key, value, mask[:, None], scaling)  # (B, Hq/tp, T/cp, D)
    return out.transpose(1, 2)  # (B, T/cp, Hq/tp, D)


def masked_sdpa(query, key, value, mask, scale, is_causal=False):
    """SDPA with an explicit mask. query: (..., Hq, Lq, D); key, value: (..., Hkv, Lk, D), Hkv
    dividing Hq (grouped-query attention). Each KV head is copied out to its Hq/Hkv query heads
    first: on a GPU, flash attention refuses an explicit mask and the memory-efficient kernel
    refuses fewer KV heads than query heads, so a mask with enable_gqa=True runs the math kernel,
    O(Lq * Lk) memory a head (torch's sdp_utils). transformers copies them for the same reason
    (integrations/sdpa_attention.py). The copy is O(Lk) a head, the kernel's saving O(Lq * Lk).
    mask=None with is_causal=True: causal attention with no mask, which flash accepts."""
    groups = query.shape[-3] // key.shape[-3]
    key = key.repeat_interleave(groups, -3)  # (..., Hq, Lk, D)
    value = value.repeat_interleave(groups, -3)  # (..., Hq, Lk, D)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                          is_causal=is_causal)


def _unlayout(per_token, layout, like):
    """(B, T) per-token numbers back in the trainer's (b, S) right-padded rows, on `like`'s
    device."""
    seq_len = like.shape[1]
    if layout.cu_seqlens is None:  # zero past each row's end, as unpacking does
        # the layout was trimmed to the rows' longest, then padded: back to the batch's width
        per_token = F.pad(per_token[:, :seq_len],
                          (0, seq_len - min(seq_len, per_token.shape[1])))  # (b, S)
        valid = (torch.arange(seq_len, device=per_token.device)[None]
                 < layout.seq_lens[:, None])  # (b, S)
        return (per_token * valid).to(like.device)  # (b, S)
    sequences = layout.cu_seqlens[: len(layout.seq_lens) + 1]  # (b + 1,) without the padding tail
    return unpack_packed(per_token, sequences, seq_len).to(like.device)  # (b, S)


# -----------------------------------------------------------------------------
# The reference pass: the initial policy's shards in host memory (snapshot_weights keeps them,
# after the banner "Beyond one step"), swapped into the live module for the reference forward and
# back (one model in memory, no second FSDP module to shard and keep in sync).

def _local(param):
    return param.to_local() if isinstance(param, DTensor) else param  # this rank's shard


def reshard(model):
    """Back to sharded parameters. FSDP2 leaves the root gathered after a forward (its parameters
    are needed again at once in backward), and while gathered the module holds the full tensors."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _host_copies(tensors, dtype=None):
    """Copies of `tensors` (all of one dtype) in host memory, in `dtype` (default theirs), as views
    into one flat buffer, pinned on a GPU machine (copies to and from the GPU go faster and
    asynchronously).
    One buffer a set, not one a tensor: torch's caching host allocator rounds every pinned
    allocation up to a power of two, which per shard came to ~1.9x the bytes at 7B over 8 GPUs;
    per set the rounding is paid once (bench/memory_model.py counts it)."""
    dtype = dtype or tensors[0].dtype
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device="cpu",
                       pin_memory=torch.cuda.is_available())  # (elements of the whole set,)
    views = flat.split([t.numel() for t in tensors])  # one view of the buffer a tensor
    # blocking copies: from a GPU, non_blocking=True returns before the bytes have landed, and the
    # host may read these at once (a checkpoint of offloaded moments)
    return [view.view(t.shape).copy_(t) for view, t in zip(views, tensors)]


@contextlib.contextmanager
def swapped_weights(model, snapshot):
    """Within the block, `model` computes with the snapshot's weights; afterwards the live weights
    are back exactly. The live shards are parked meanwhile in host memory allocated at the first
    swap and reused (no allocation per step): three copies of the rank's shards a swap (out, in,
    back), on every mesh alike. (Plain CPU tensors, as under data_parallel=ddp, could trade
    storage with the snapshot instead, 0.33 s faster a swap at 135M in fp32: one path for every
    mesh is kept instead.)"""
    # a gathered FSDP2 module shows plain full tensors, not its shards
    reshard(model)
    live = {name: _local(param).detach() for name, param in model.named_parameters()}
    weights, parked = snapshot["weights"], snapshot["parked"]
    if not parked:  # host memory allocated at the first swap, then reused
        parked.update(zip(live, _host_copies(list(live.values()))))
    else:
        for name, tensor in live.items():
            parked[name].copy_(tensor)  # blocking, as in _host_copies
    _copy_into(model, weights)
    try:
        yield model
    finally:
        _copy_into(model, parked)


def _copy_into(model, weights):
    reshard(model)  # and the next forward gathers the shards we write now
    with torch.no_grad():
        for name, param in model.named_parameters():
            _local(param).copy_(weights[name], non_blocking=True)


def sync_gradients(model, sync):
    """DDP: all-reduce in the next backward only if `sync` (a minibatch's last microbatch): each
    all-reduce sums all gradients accumulated so far. (FSDP2 reduces each backward's own.)"""
    if isinstance(model, DDP):
        model.set_requires_gradient_sync(sync)


# -----------------------------------------------------------------------------
# Global grad norm: sqrt of the sum of squares of every gradient element exactly once.

def clip_grad_norm(params, max_norm):
    """Collective (every rank): clip the gradients of `params` in place to a global L2 norm of
    max_norm; return the norm before clipping, a 0-dim tensor. A DTensor's local squares are
    summed over the mesh dims it is sharded on, never over those it is replicated on (that would
    count the copies); a plain tensor is a full copy on every rank. Works for any mix of meshes
    (FSDP only, FSDP x TP, the value head)."""
    grads = [p.grad for p in params if p.grad is not None]
    # process groups to sum over -> sum of squares of the local elements
    by_groups = {}
    for grad in grads:
        # per row, then summed: one pass, no squared copy; a single fp32 running sum over a whole
        # 28M-element gradient would drift by ~3e-3 (bench/ddp_update.py)
        sq = torch.linalg.vector_norm(_local(grad), dim=-1,
                                      dtype=torch.float32).square().sum()  # ()
        groups = ()
        if isinstance(grad, DTensor):
            if any(p.is_partial() for p in grad.placements):
                raise ValueError("a gradient is still a pending sum (Partial): "
                                 "call after backward completes")
            # Shard or FSDP-over-TP's _StridedShard: any split that is not a replica
            groups = tuple(grad.device_mesh.get_group(dim) for dim, p in enumerate(grad.placements)
                           if not p.is_replicate())
            sq = sq.to(_device(grad.device_mesh))  # the collective's device (offloaded grads: CPU)
        by_groups[groups] = by_groups.get(groups, 0) + sq
    # the same order on every rank: parameters come in order
    for groups, sq in by_groups.items():
        for group in groups:
            dist.all_reduce(sq, group=group)  # collective: the other shards'
    norm = torch.stack(list(by_groups.values())).sum().sqrt() if grads else torch.zeros(())
    if max_norm > 0:  # 0 = no clipping, only the norm
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # as torch.nn.utils.clip_grad_norm_
        scales = {_local(g).device: scale.to(_local(g).device)
                  for g in grads}  # one copy per device
        for grad in grads:
            _local(grad).mul_(scales[_local(grad).device])
    return norm  # () on the device: the caller reads it when it must (the NaN check), once


# -----------------------------------------------------------------------------
# Full weights: refit of the rollout engine and HF export.

def _gathered(param, dtype=None):
    """Collective over the param's mesh: its full tensor in `dtype` (None: its own), cast before the
    all-gather (half the bytes for bf16)."""
    if isinstance(param, DTensor):
        # the mesh's device (an offloaded shard lives on CPU); the cast keeps the placements
        return param.to(_device(param.device_mesh)).to(dtype or param.dtype).full_tensor()
    return param.detach().to(dtype or param.dtype)


def _hf_params(model):
    """(name, parameter) of what an HF checkpoint of the model holds: every parameter but an
    extension's adapters."""
    params = list(model.named_parameters())
    params = [(name, p) for name, p in params if not name.endswith(lora.ADAPTERS)]  # (lora.py)
    return params


def iter_full_params(model, dtype=None):
    """Collective (every rank, to the end): yield (name, full tensor) per parameter, named as in the
    HF checkpoint (FSDP2 and TP keep module names; a tied lm_head appears once, as embed_tokens,
    like in the file), in `dtype` (None: the parameter's). One full tensor alive at a time. Each
    shard is cast *before* the all-gather: a bf16 engine or export receives half the bytes of the
    fp32 master weights (7B: ~15 GB a rank a refit, not ~30), and no fp32 full tensor is ever
    built. Under LoRA a target's weight arrives merged, W + s B A (lora.py)."""
    # every rank sees the same sharded parameters, hence the same collectives
    reshard(model)
    modules = dict(model.named_modules())
    for name, param in _hf_params(model):
        module = modules[name.rpartition(".")[0]]
        gather = _gathered  # the parameter's full tensor
        if isinstance(module, lora.LoRALinear) and name.endswith(".weight"):  # (lora.py)
            gather = module.merged_weight
        with torch.no_grad():
            full = gather(param, dtype)
        yield name, full


# -----------------------------------------------------------------------------
# The critic's pass (gae only: last in this section, which GRPO and RLOO skip): the same forward
# with the value head where the LM head was, right-shifted.

def forward_critic(critic, input_ids, seq_lens, mesh, cfg, shift=True):
    """Collective (every rank): values (b, S), right-shifted: values[:, i] = V(x_<i) =
    head(hidden[:, i-1]), 0 at position 0 (and at packed sequence starts, which see no earlier token
    of their own). shift=False: forward_reward_model's unshifted read."""
    layout = _layout(input_ids, seq_lens, mesh, cfg)
    # the one-output head stands where lm_head was (_on_meta): HF returns its output as `.logits`
    values = critic(**layout.model_inputs()).logits[..., 0].float()  # (B, T/cp)
    # collective over cp, natural order; the shift crosses zigzag chunks: after the gather
    values = gather_shifted(values, _group(mesh, "cp"), layout.cu_seqlens, shift)  # (B, T)
    return _unlayout(values, layout, input_ids)  # (b, S)


class ValueHead(torch.nn.Linear):
    """The critic's Linear(hidden, 1), computed as x @ w.T + b in two ops: F.linear's fused addmm
    on 3-D input returns a view, and FSDP2 warns about (and cannot hook in-place ops on) views."""

    def forward(self, hidden):  # (B, T/cp, hidden) -> (B, T/cp, 1)
        return F.linear(hidden, self.weight) + self.bias


# -----------------------------------------------------------------------------
# Beyond one step: what a first reading skips.

# -----------------------------------------------------------------------------
# Distributed set-up: one code path for `python train_ppo.py` (a world of one) and torchrun.

def init_distributed(timeout_s=1800, rollout_ranks=0):
    """(rank, world_size, device), initializing the default process group once. A collective that
    waits more than timeout_s raises instead of blocking forever (a dead or stuck rank); when a rank
    dies, torchrun also stops the others (SIGTERM, then SIGKILL after 30 s). With rollout_ranks,
    the default group is this rank's side of the world (async_rollout.py)."""
    device = torch.device("cpu")
    if torch.cuda.is_available():
        # GPU only: pick this rank's GPU *before* NCCL starts, so that its communicators and
        # buffers are not all created on GPU 0
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                           ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
            os.environ.setdefault(key, value)  # what torchrun would set for one process
        # gloo also on GPU machines, for the few collectives on host tensors
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        side = {}  # the whole world's default group, unless the last ranks only generate
        if rollout_ranks:  # (async_rollout.py)
            side = async_rollout.split_world(rollout_ranks, backend, timeout_s)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None, **side)
    return dist.get_rank(), dist.get_world_size(), device


def make_mesh(world_size, tp_size, cp_size, device_type):
    """Collective (every rank): the ("dp", "cp", "tp") mesh, tp innermost (neighbouring ranks share
    the fastest link), plus `mesh.dp_cp`, the dp x cp ranks flattened into one dim for FSDP to shard
    over: cp ranks hold other tokens of the same rows, so their gradients are summed like dp's.
    tp_size * cp_size must divide the world: config.validate refuses other sizes, in one line,
    before torch is imported (tests/test_config.py)."""
    dp_size = world_size // (tp_size * cp_size)
    mesh = init_device_mesh(device_type, (dp_size, cp_size, tp_size),
                            mesh_dim_names=("dp", "cp", "tp"))
    # kept on the mesh object (torch deprecates slicing a flattened dim back out of the root mesh);
    # _flatten is private in torch 2.13, the way torchtitan builds its FSDP mesh
    mesh.dp_cp = mesh["dp", "cp"]._flatten("dp_cp")
    return mesh


def setup(cfg):
    """Collective (every rank): what the run needs before it loads a model. The process group
    (init_distributed), the (dp, cp, tp) mesh (make_mesh), the policy's model dir with every dir
    the run loads checked (checked_model_dir; CheckpointError), and cfg's "auto" options resolved
    for this device and its kernels (config.resolve_auto). Returns (device, mesh, model dir, the
    attention kernel's name)."""
    if cfg.rollout_ranks:  # this rank's side of the world (async_rollout.py)
        init_distributed(cfg.collective_timeout_s, cfg.rollout_ranks)
    _, world_size, device = init_distributed(cfg.collective_timeout_s)
    mesh = make_mesh(world_size, cfg.tp_size, cfg.cp_size, device.type)
    model_dir = checked_model_dir(cfg)
    gpu_kernel = gpu_kernel_name() if device.type == "cuda" else None
    return device, mesh, model_dir, resolve_auto(cfg, device.type, gpu_kernel)


def release_mesh(mesh):
    """Last call of a run, after dist.destroy_process_group(), which leaves the groups held by the
    mesh (itself held by DTensor's cache): their threads would outlive Python's shutdown and could
    abort a finished run ("terminate called without an active exception"). Dropping them joins the
    threads now."""
    # _pg_registry: private in torch 2.13; sliced meshes share the root's
    mesh._pg_registry.clear()


# -----------------------------------------------------------------------------
# The attention's other paths: CP's all-gather of K and V (its backward reduce-scatters their
# gradients), and the varlen kernels (flash-attn's or torch's on a GPU, a PyTorch stand-in on
# CPU) with the packed rows' unpacking.

class _GatherSeq(torch.autograd.Function):
    """All-gather K or V over cp along the sequence dim (2). Backward reduce-scatters: every cp
    rank's queries attended to every rank's keys, so a key's gradient is the sum over ranks."""

    @staticmethod
    def forward(ctx, x, group):  # x: (B, H, S/cp, D)
        ctx.group = group
        local = x.movedim(2, 0).contiguous()  # (S/cp, B, H, D): collectives concatenate on dim 0
        out = local.new_empty((local.shape[0] * dist.get_world_size(group), *local.shape[1:]))
        dist.all_gather_into_tensor(out, local, group=group)  # (S, B, H, D), cp ranks in rank order
        return out.movedim(0, 2)  # (B, H, S, D)

    @staticmethod
    def backward(ctx, grad):  # grad: (B, H, S, D)
        full = grad.movedim(2, 0).contiguous()  # (S, B, H, D)
        out = full.new_empty((full.shape[0] // dist.get_world_size(ctx.group), *full.shape[1:]))
        dist.reduce_scatter_tensor(out, full, group=ctx.group)  # (S/cp, B, H, D) summed over cp
        return out.movedim(0, 2), None  # (B, H, S/cp, D)


def _varlen_kernel(cfg, device):
    """The layout's varlen kernel (attention=varlen), once per forward: where config.flash_runs
    (CUDA, bf16) a flash kernel (it never looks at the masked-out blocks), flash-attn's if
    installed, else torch's; else the reference, one SDPA per document."""
    flash = gpu_varlen_kernel() if flash_runs(device.type, cfg.dtype) else None
    return flash or varlen_attention_reference


def _varlen_index(doc_lens, num_rows, row_len, cp_size, cp_rank, kv_rows):
    """flash-attn's varlen arguments for this rank's queries: one segment per (row, zigzag chunk,
    document) overlap, in the queries' local order. Each segment's keys run from its document's
    start to its last query (bottom-right causal: the all-gather CP of Llama 3 and
    TransformerEngine). Built on the host from Python ints: no device sync in any layer. kv_rows:
    the row position of each gathered key (Layout.kv_rows).

    A worked example (tests/test_model_parallel.py checks every number): cp=2, one packed row of
    T=8 tokens holding documents of 3 and 5 tokens, cut into 2*cp=4 zigzag chunks of 2 tokens:

        row position   0 1 2 3 4 5 6 7
        document       0 0 0 1 1 1 1 1
        chunk          0 0 1 1 2 2 3 3     rank 0 keeps chunks 0 and 3, rank 1 chunks 1 and 2
        kv_rows = [0 1 6 7 2 3 4 5]        the keys as gathered: rank 0's share, then rank 1's

    Rank 1 (q_rows = [2 3 4 5]): its chunks cut the documents into three segments

        segment  (row, chunk, document)  queries (rows)  keys (rows)  keys' slots in kv_rows
        0        (0, 1, 0)               2               0 1 2        0 1 4
        1        (0, 1, 1)               3               3            5
        2        (0, 2, 1)               4 5             3 4 5        5 6 7

        cu_seqlens_q = [0 1 2 4], cu_seqlens_k = [0 3 4 7], max_seqlen_q = 2, max_seqlen_k = 3,
        kv_index = [0 1 4 5 5 6 7]         the slots, segment after segment (+ row * T)

    Segment 2's queries are the last 2 of its 3 keys (bottom-right): row 4 sees 3 4, row 5 sees
    3 4 5. Segments 1 and 2 both read key 3: keys may repeat across segments, queries never do.
    Rank 0 (q_rows = [0 1 6 7]) has two segments, (0, 0, 0) with keys 0 1 and (0, 3, 1) with keys
    3..7: cu_seqlens_q = [0 2 4], cu_seqlens_k = [0 2 7], max_seqlen_q = 2, max_seqlen_k = 5,
    kv_index = [0 1 5 6 7 2 3]. With cp=1 a segment is a whole document and kv_index is None."""
    doc_starts = [sum(doc_lens[:d]) for d in range(len(doc_lens))]
    chunk = row_len // (2 * cp_size)
    if cp_size == 1:
        chunks = [(0, row_len)]
    else:  # zigzag: chunk r, then 2cp-1-r
        chunks = [(c * chunk, (c + 1) * chunk) for c in (cp_rank, 2 * cp_size - 1 - cp_rank)]
    q_lens = []  # the queries of each segment
    # (row, first key, end) of each segment's keys, in row positions
    k_spans = []
    for row in range(num_rows):
        for lo, hi in chunks:
            for start, n in zip(doc_starts, doc_lens):
                first, end = max(lo, start), min(hi, start + n)
                if first < end:
                    q_lens.append(end - first)
                    k_spans.append((row, start, end))
    k_lens = [end - start for _, start, end in k_spans]
    kv_index = None  # cp = 1: the segments' keys are the keys, in order
    # the gathered keys are in rank order: row position p sits at slot[p] (kv_rows is a permutation
    # of the row positions; its argsort is the inverse permutation)
    if cp_size > 1:
        slot = kv_rows.argsort()  # (T,)
        kv_index = torch.cat([row * row_len + slot[start:end]
                              for row, start, end in k_spans])  # (total_k,)

    def boundaries(lens):  # segment lengths -> (segments + 1,) int32 offsets
        return to_device([0, *itertools.accumulate(lens)], kv_rows.device).to(torch.int32)

    return dict(cu_seqlens_q=boundaries(q_lens), cu_seqlens_k=boundaries(k_lens),
                max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens), kv_index=kv_index)


def _varlen_attention(query, key, value, scaling, sliding_window, layout):
    """The same attention through the varlen contract: tokens flattened to (tokens, heads, dim), one
    causal segment per (row, zigzag chunk, document), through the layout's kernel
    (_varlen_kernel)."""
    batch, heads, local_len, dim = query.shape  # query: (B, Hq/tp, T/cp, D)
    q = query.transpose(1, 2).reshape(batch * local_len, heads, dim)  # (B*T/cp, Hq/tp, D)
    k = key.transpose(1, 2).flatten(0, 1)  # (B*T, Hkv/tp, D)  (gathered order under CP)
    v = value.transpose(1, 2).flatten(0, 1)  # (B*T, Hkv/tp, D)
    if layout.kv_index is not None:  # CP: each segment's keys
        k = k[layout.kv_index]  # (total_k, Hkv/tp, D)
        v = v[layout.kv_index]  # (total_k, Hkv/tp, D)
    # flash-attn's left window counts the keys before the query's own: HF's `sliding_window` keys,
    # the query's included, are sliding_window - 1 back (the masked path's convention)
    window = (sliding_window - 1, 0) if sliding_window else (-1, -1)
    out = layout.kernel(q, k, v, layout.cu_seqlens_q, layout.cu_seqlens_k, layout.max_seqlen_q,
                 layout.max_seqlen_k, softmax_scale=scaling, causal=True,
                 window_size=window)  # (B*T/cp, Hq/tp, D)
    return out.view(batch, local_len, heads, dim)  # (B, T/cp, Hq/tp, D)


def varlen_attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale=None, causal=True, window_size=(-1, -1)):
    """flash-attn's `flash_attn_varlen_func` contract in plain PyTorch: the CPU stand-in for the GPU
    kernel. q: (total_q, Hq, D); k, v: (total_k, Hkv, D), Hkv dividing Hq (grouped-query attention).
    Segment i is q[cu_seqlens_q[i]:cu_seqlens_q[i+1]] attending to k/v[cu_seqlens_k[i]:...[i+1]].

    Causal is bottom-right aligned (flash-attn >= 2.1): a segment with Lq queries and Lk >= Lq keys
    holds the *last* Lq queries, so query j sits at key position j + Lk - Lq. window_size=(left,
    right): keys at most `left` positions back, -1 = unlimited. max_seqlen_*: the kernel sizes its
    grid with them; unused here. Returns (total_q, Hq, D).

    Each segment goes to SDPA as a 4-D (1, H, L, D) batch: SDPA's fused kernels take 4-D inputs
    only, and a 3-D call with a mask runs the math kernel, which keeps an (H, Lq, Lk) fp32 score
    tensor for the backward (3.2 GB a layer for one 8k-token document at 12 heads). A whole
    document (Lq = Lk) with no window needs no mask at all: is_causal lets a GPU pick its flash or
    memory-efficient kernel, O(L) memory."""
    outs = []
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()  # (on a GPU: a sync per call)
    unwindowed = window_size[0] < 0 and (causal or window_size[1] < 0)
    for q0, q1, k0, k1 in zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:]):
        q_seg = q[q0:q1].transpose(0, 1)[None]  # (1, Hq, Lq, D)
        k_seg = k[k0:k1].transpose(0, 1)[None]  # (1, Hkv, Lk, D)
        v_seg = v[k0:k1].transpose(0, 1)[None]  # (1, Hkv, Lk, D)
        if unwindowed and (not causal or q1 - q0 == k1 - k0):
            # SDPA's is_causal is top-left aligned, the same as bottom-right when Lq = Lk
            seg = masked_sdpa(q_seg, k_seg, v_seg, None, softmax_scale, is_causal=causal)
        else:
            seg = masked_sdpa(q_seg, k_seg, v_seg, _visible(q1 - q0, k1 - k0, causal, window_size,
                                                            q.device), softmax_scale)
        outs.append(seg[0].transpose(0, 1))  # (Lq, Hq, D)
    return torch.cat(outs)  # (total_q, Hq, D)


def _visible(q_len, k_len, causal, window_size, device):
    """The (Lq, Lk) mask of one varlen segment: causal bottom-right aligned, then the window."""
    q_pos = torch.arange(q_len, device=device)[:, None] + k_len - q_len  # (Lq, 1)
    k_pos = torch.arange(k_len, device=device)[None, :]  # (1, Lk)
    visible = (k_pos <= q_pos) if causal else (k_pos >= 0) & (q_pos >= 0)  # (Lq, Lk)
    if window_size[0] >= 0:
        visible &= k_pos >= q_pos - window_size[0]
    if not causal and window_size[1] >= 0:
        visible &= k_pos <= q_pos + window_size[1]
    return visible


def torch_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale=None, causal=True, window_size=(-1, -1)):
    """GPU only: the same contract through torch's varlen_attn. Its window (left, 0) is causal,
    bottom-right aligned like flash-attn's (tests/test_cuda.py checks it against the stand-in); it
    must be a tuple: torch reads is_causal as `window_size == (-1, 0)`."""
    window = (window_size[0], 0) if causal else tuple(window_size)
    # GQA: the kernel serves each KV head to its query heads; torch 2.13 asks to be told so, 2.11
    # takes the fewer KV heads as they are (measured on an H100: identical to copying them)
    gqa = dict(enable_gqa=True) if "enable_gqa" in VARLEN_ARGS and k.shape[1] != q.shape[1] else {}
    return varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       scale=softmax_scale, window_size=window, **gqa)


def gpu_varlen_kernel():
    """flash-attn's kernel if installed, else torch's if this torch build has one, else None.
    Both FlashAttention-2 kernels need an Ampere or newer GPU (compute capability 8.0); on an older
    one (V100, T4) the build-time flag still says yes and the first forward fails, so the device
    itself is asked."""
    if torch.cuda.get_device_capability() < (8, 0):
        return None
    torch_has_it = ("window_size" in VARLEN_ARGS
                    and torch.backends.cuda.is_flash_attention_available())
    return flash_attn_varlen_func or (torch_varlen_attention if torch_has_it else None)


def gpu_kernel_name():
    """The name of gpu_varlen_kernel()'s kernel, None if there is none (config.resolve_auto)."""
    kernel = gpu_varlen_kernel()
    return {None: None,
            torch_varlen_attention: "torch varlen_attn"}.get(kernel, "flash-attn varlen")


def unpack_packed(packed, cu_seqlens, seq_len):
    """(1, T) packed row -> (n, seq_len): sequence k at row k, left-aligned, zero-padded.
    Pure indexing, so it is differentiable and works for ids, logprobs and masks alike."""
    starts = cu_seqlens[:-1].long().to(packed.device)  # (n,)
    lengths = cu_seqlens[1:].long().to(packed.device) - starts  # (n,)
    # checked on the device (no host read): on a GPU a device-side assert
    torch._assert_async(lengths.max() <= seq_len,
                        f"a packed sequence is longer than seq_len={seq_len}")
    offsets = torch.arange(seq_len, device=packed.device)  # (S,)
    valid = offsets[None, :] < lengths[:, None]  # (n, S)
    index = (starts[:, None] + offsets[None, :]).clamp(max=packed.shape[1] - 1)  # (n, S)
    return packed[0][index].masked_fill(~valid, 0)  # (n, S)


# -----------------------------------------------------------------------------
# Model families: the HF architectures (config.json's "model_type") that load here, and a tiny
# preset of each. What differs between them, as far as this file is concerned:
#   llama        the plain decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP
#   qwen2        + q/k/v biases (split with their weights by the same TP plan)
#   qwen3        + an RMSNorm per head on q and k (two TP plan entries of its own)
#   mistral      + a sliding window on every layer (HF passes `sliding_window` to ppo_attention)
#   gemma3_text  local (sliding-window) and global layers, (1 + w) norms, a scaled embedding, a
#                final logit softcap (the critic drops it); no TP plan here: tp_size=1 only
# The first four name their modules as Llama does, so one TP plan serves them.
#
# Adding a family: its model_type in FAMILIES; in _tp_plan an entry for each module whose name or
# split differs from Llama's (or a tp_size=1 refusal in check_hf_dir, as Gemma3's); a tiny
# preset below; its preset in the FAMILIES list of tests/test_model_parallel.py, which compares it
# with the plain HF model on every mesh. A new attention variant must reach ppo_attention as an
# argument HF passes (as `sliding_window` does), or it is silently ignored.

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")


# Tiny presets: random-init models written as real HF checkpoint dirs (nothing is downloaded).
# head_dim 64 because vLLM's CPU attention refuses 16; vocab 262 > the toy tokenizer's 258 ids and
# not a multiple of 4, like real checkpoints whose embedding rows are padded.
_TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=262, max_position_embeddings=512,
             tie_word_embeddings=False, bos_token_id=256, eos_token_id=256, pad_token_id=257)


TINY_PRESETS = {
    "tiny-llama": dict(_TINY, model_type="llama"),
    "tiny-qwen2": dict(_TINY, model_type="qwen2"),  # q/k/v biases
    "tiny-qwen3": dict(_TINY, model_type="qwen3"),  # q/k RMSNorm per head
    # a window of 8 tokens, shorter than most rows (the tests' reach 14): the mask matters
    "tiny-mistral": dict(_TINY, model_type="mistral", sliding_window=8),
    # Gemma3 text: sliding-window layers, (1 + w) norms, scaled embedding; tp = 1 only
    "tiny-gemma3": dict(_TINY, model_type="gemma3_text", query_pre_attn_scalar=64,
                        sliding_window=128),
}


def materialize_tiny_model(name, dir, seed, **overrides):
    """Write preset `name` (+ overrides, e.g. tie_word_embeddings=True) to dir/name; return that
    path. Rank 0 writes to a temp dir then renames it, so a dir with config.json is complete and a
    second call only waits at the barrier."""
    path = os.path.join(dir, name)
    # also usable before init (scripts, tests)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 and not os.path.isfile(os.path.join(path, "config.json")):
        fields = dict(TINY_PRESETS[name], **overrides)
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        with torch.random.fork_rng():  # seeded init without disturbing the caller's RNG
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(path + ".tmp")
        os.replace(path + ".tmp", path)
    if dist.is_initialized():
        dist.barrier()  # the others wait until rank 0's checkpoint is complete
    return path


# -----------------------------------------------------------------------------
# Tensor-parallel plans (Megatron-LM via torchtitan). Colwise = split a Linear's output features
# (weight dim 0), so each rank computes some heads / some MLP channels with no communication;
# rowwise = split its input features (weight dim 1), each rank's partial output is summed (one
# all-reduce per block, or a reduce-scatter onto the sequence dim with SP). Llama, Qwen2, Qwen3 and
# Mistral share module names, so one plan serves the four; Gemma3 is refused for tp > 1.

def _tp_plan(model, sequence_parallel):
    """{module name pattern: how parallelize_module splits it} for the model's family, SP and head
    (a critic's ValueHead or an LM head)."""
    # layout of the residual stream between blocks: the full sequence on every tp rank, or (SP)
    # each tp rank holds S/tp of the tokens, so norms and residual adds are not repeated
    stream = Shard(1) if sequence_parallel else Replicate()
    plan = {
        # rows of the vocab split over tp: a rank looks up the ids it owns (zero elsewhere) and
        # the partial embeddings are summed (all-reduce, or reduce-scatter over the sequence)
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "model.layers.*.self_attn.q_proj": ColwiseParallel(),  # this rank's query heads
        "model.layers.*.self_attn.k_proj": ColwiseParallel(),  # the KV heads they read
        "model.layers.*.self_attn.v_proj": ColwiseParallel(),  # (tp divides the KV heads)
        "model.layers.*.self_attn.o_proj": RowwiseParallel(output_layouts=stream),  # heads summed
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),  # this rank's MLP channels
        "model.layers.*.mlp.up_proj": ColwiseParallel(),  # the same channels
        "model.layers.*.mlp.down_proj": RowwiseParallel(output_layouts=stream),  # channels summed
    }
    if model.config.model_type == "qwen3":
        # per-head q/k norms see only this rank's heads (dim 2 of (B, S, H/tp, D)); marking
        # that split (SP's style on the head dim) makes the replicated weight's gradient a sum
        # over tp
        plan["model.layers.*.self_attn.q_norm"] = SequenceParallel(
            sequence_dim=2, use_local_output=True)
        plan["model.layers.*.self_attn.k_norm"] = SequenceParallel(
            sequence_dim=2, use_local_output=True)
    if sequence_parallel:
        # norms run on S/tp tokens; their replicated weights get gradients summed over tp
        plan["model.layers.*.input_layernorm"] = SequenceParallel()
        plan["model.layers.*.post_attention_layernorm"] = SequenceParallel()
        plan["model.norm"] = SequenceParallel(use_local_output=True)
        # attention and MLP need every token: one all-gather over tp at each block's entry
        plan["model.layers.*.self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()}, use_local_output=True)
        plan["model.layers.*.mlp"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)
    if isinstance(model.get_output_embeddings(), ValueHead):
        # the value head is tiny and replicated over tp: it just needs every token
        plan["lm_head"] = PrepareModuleInput(
            input_layouts=(stream,), desired_input_layouts=(Replicate(),), use_local_output=True)
    else:
        # vocab split over tp; forward_policy hands each rank's (B, S, V/tp) shard to logprobs.py
        # (left a DTensor here: to_local() is a view, and FSDP2 cannot hook a module output that
        # is one)
        plan["lm_head"] = ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1),
                                          use_local_output=False)
    return plan


# -----------------------------------------------------------------------------
# Loading: every rank builds the model on the meta device (no memory), shards it (TP, then FSDP2
# or DDP), allocates only its shards, and reads only those from the checkpoint's files.

class CheckpointError(ValueError):
    """A model dir or training checkpoint that cannot be used: one line, exit 2."""


def check_hf_dir(path, tp_size):
    """Refuse (CheckpointError, one line) a model dir that loading would fail on later: no dir, no
    or unreadable config.json, a family without a plan here, a tp split that cuts a head, missing
    or corrupt weights. Reads only config.json and the safetensors headers: fast, on every rank.
    Returns the HF config it read (_build builds from it)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise CheckpointError(f"model={path!r} is not an HF checkpoint dir (no config.json): "
                              f"give a dir written by save_pretrained, or a tiny preset "
                              f"(see --help)")
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path}/config.json cannot be read: "
                              f"{str(e).splitlines()[0]}") from None
    family = config.model_type
    if family not in FAMILIES:
        raise CheckpointError(f"model_type {family!r} is not supported: {', '.join(FAMILIES)} "
                              f"(gemma3_text: tp_size=1 only)")
    if family == "gemma3_text" and tp_size > 1:
        raise CheckpointError("Gemma3 runs with tp_size=1 only (FSDP, CP and packing work): "
                              "no TP plan for it here")
    for field in ("num_attention_heads", "num_key_value_heads"):
        if getattr(config, field) % tp_size:
            raise CheckpointError(f"tp_size={tp_size} must divide "
                                  f"{field}={getattr(config, field)}: "
                                  f"each tp rank computes whole heads")
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{path} has no *.safetensors weights (.bin files are not read here: "
                              f"re-save them with save_pretrained)")
    for f in files:
        # the header lists every tensor's byte range: a truncated file fails here
        try:
            safe_open(os.path.join(path, f), framework="pt")
        except SafetensorError as e:
            raise CheckpointError(f"{path}/{f} is corrupt ({e}): "
                                  f"download or save it again") from None
    return config


def checked_model_dir(cfg):
    """The policy's HF checkpoint dir (a tiny preset is written as one first), once every dir the
    run loads has passed check_hf_dir and a reward model has a one-label score head; else
    CheckpointError."""
    preset = cfg.model in TINY_PRESETS  # written as a real HF checkpoint dir first
    model_dir = materialize_tiny_model(cfg.model, cfg.out_dir, cfg.seed) if preset else cfg.model
    for path in (model_dir, cfg.critic_model, cfg.reward_model):
        if path:  # no critic_model: the critic starts from the policy's checkpoint
            check_hf_dir(path, cfg.tp_size)
    if cfg.reward_model and score_head(cfg.reward_model) is None:
        raise CheckpointError(f"reward_model={cfg.reward_model!r} has no one-label score head: "
                              f"give a *ForSequenceClassification checkpoint with num_labels=1 "
                              f"(scripts/train_reward_model.py)")
    return model_dir


def _build(path, mesh, cfg, critic, frozen=False, adapt=None):
    """The architecture at `path` as this rank's sharded module, with its shards allocated but not
    yet read (_load_weights fills them). The steps, in order: build on the meta device, split over
    tp, adapt, shard (FSDP2) or replicate (DDP) over dp x cp, allocate, tie the embeddings again.
    `frozen` (a reward model: no optimizer) keeps no fp32 master copy, being stored in its compute
    dtype (bf16 under the bf16 recipe; its value head stays fp32), and under FSDP2 its shards
    live in host memory between its passes (FSDP2's CPU offload gathers them onto the GPU for its
    one pass a step): it would otherwise hold GPU memory through generation and the update.
    `adapt(model, cfg)`: an extension's change on the meta device, after the TP plan, whose splits
    it can follow (lora.add_adapters: trained adapters beside a frozen base, stored as a frozen
    model is); it returns the full tensors of what it added. Returns (model, those tensors)."""
    tp_size = mesh["tp"].size()
    config = check_hf_dir(path, tp_size)  # (a library caller's dir is refused here too)
    frozen_base = frozen or adapt is not None
    stored = torch.bfloat16 if frozen_base and cfg.dtype == "bf16" else torch.float32
    model = _on_meta(config, critic, stored)
    tied = not critic and config.tie_word_embeddings
    if tp_size > 1:
        parallelize_module(model, mesh["tp"], _tp_plan(model, cfg.sequence_parallel))
        # TP gave each module its own DTensor copy (both Shard(0) on vocab): tie again
        if tied:
            _tie_embeddings(model)
    added = {} if adapt is None else adapt(model, cfg)  # after the TP plan
    if cfg.activation_checkpointing:  # recompute each decoder layer in backward
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    offload = cfg.data_parallel == "fsdp" and (cfg.cpu_offload or frozen)
    if cfg.data_parallel == "fsdp":
        _shard_fsdp(model, mesh.dp_cp, cfg, offload, frozen)
    elif mesh.dp_cp.size() > 1:  # ddp (on one rank: a plain module)
        _replicate_ddp(model, mesh.dp_cp.get_group())
    _allocate(model, _device(mesh), offload)
    # to_empty gave each its own tensor (not under FSDP2): tie again
    if tied:
        _tie_embeddings(model)
    # no dropout in these families; train mode lets activation checkpointing act
    model.train()
    return model, added


def _on_meta(config, critic, dtype):
    """The model on the meta device, in `dtype`: shapes only, no memory and no init (the checkpoint
    fills it). The critic is the same backbone with its "LM head" replaced by the value head (fp32,
    whatever the backbone's dtype)."""
    if critic:
        config.final_logit_softcapping = None  # Gemma's logit softcap must not squash values
    with torch.device("meta"):
        # attn_implementation="ppo": every layer calls ppo_attention (registered above)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="ppo", dtype=dtype)
        if critic:
            # lm_head, whatever its name
            model.set_output_embeddings(ValueHead(config.hidden_size, 1))
    return model


def _tie_embeddings(model):
    """The LM head shares the embedding's weight, as a tied checkpoint stores it (once). HF's own
    accessors find both, whatever the family calls them."""
    model.get_output_embeddings().weight = model.get_input_embeddings().weight  # (a no-op if tied)


def _shard_fsdp(model, mesh, cfg, offload, frozen):
    """FSDP2 over `mesh` (dp x cp): the embedding, each decoder layer (one all-gather in flight at a
    time), the final norm with the head, then the root (torchtitan's units). In one root unit, an
    untied 7B's embedding and head (1.09B parameters at tp=1) would stay gathered through forward
    and backward, and their 4.4 GB fp32 reduce-scatter would come last, with nothing to overlap it.
    A tied head shares the embedding's tensor: the two stay one unit, the root. dtype=bf16 (the
    GPU recipe, on any device): parameters are all-gathered and computed in bf16, gradients
    reduced in fp32 into fp32 master weights, which AdamW updates. `offload` keeps the shards (and
    AdamW's state) in host memory, pinned on a GPU machine (on CPU the same code runs, moving
    nothing)."""
    compute = MixedPrecisionPolicy()  # fp32: FSDP2 casts nothing
    if cfg.dtype == "bf16":
        compute = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # reshard_after_forward=False: a gathered layer stays gathered until its backward (or, in
    # no-grad passes, until the next explicit reshard: every microbatch of a pass reuses it)
    host = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    # A frozen model (a reward model) stays gathered through its one pass of every microbatch and
    # is resharded after it (train_ppo.score): resharding after each microbatch's forward would
    # copy every offloaded shard from host to GPU again in the next
    fsdp = dict(mesh=mesh, offload_policy=host if offload else OffloadPolicy(),
                reshard_after_forward=cfg.reshard_after_forward and not frozen)
    # the units, found by what HF says they are (no family's module names): the embedding and the
    # head (get_*_embeddings), each decoder layer (its class is in _no_split_modules, the blocks
    # that accelerate keeps whole), and the final norm, which Llama's families call `norm` (one
    # that is named otherwise stays in the root unit: one vector)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    norm = getattr(model.base_model, "norm", None)
    tied = head.weight is embed.weight
    if not tied:
        fully_shard(embed, mp_policy=compute, **fsdp)
    for layer in [m for m in model.modules() if type(m).__name__ in model._no_split_modules]:
        fully_shard(layer, mp_policy=compute, **fsdp)
    if isinstance(head, ValueHead):  # a critic's
        # the value head is its own unit with an fp32 param_dtype: FSDP2 casts its bf16 input up
        # to fp32 (without the cast, bf16 hidden states meet fp32 weights and matmul fails)
        fully_shard(head, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32), **fsdp)
    elif not tied:
        fully_shard([head] if norm is None else [norm, head], mp_policy=compute, **fsdp)
    fully_shard(model, mp_policy=compute, **fsdp)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # each rank's loss is already a sum over its tokens / the global token count, so
            # gradients are summed over dp*cp, not averaged (force SUM: gloo has no PREMUL_SUM)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def _replicate_ddp(model, group):
    """DDP over `group` (dp x cp) in torch's composable form (module names unchanged; torchtitan's
    apply_ddp): whole replicas, gradients in 25 MB buckets (.grad then views them: no copy back
    out) all-reduced while earlier layers still compute. On gloo FSDP2's all-gather +
    reduce-scatter cost 2-3x one all-reduce (bench/gloo_collectives.py). DDP itself is built at
    the first forward, after the weights are loaded."""
    replicate(model, process_group=group, forward_sync_buffers=False, gradient_as_bucket_view=True)
    model.register_comm_hook(group, _sum_hook)  # summed, as FSDP2's are


def _sum_hook(group, bucket):
    """A DDP comm hook: SUM over the group (DDP's default averages)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda f: f.value()[0])


def _allocate(model, device, offload):
    """Allocate this rank's shards (uninitialized: _load_weights fills them), and compute the
    buffers that no checkpoint holds. `offload`: the shards in host memory, the buffers on the
    GPU."""
    model.to_empty(device="cpu" if offload else device)  # only now is memory allocated
    # buffers computed at construction (RoPE frequencies, Gemma's embedding scale) are not in the
    # checkpoint: transformers' own initializer recomputes them; parameters are marked done, so
    # that it leaves them alone
    for param in model.parameters():
        param._is_hf_initialized = True
    for module in model.modules():
        if module._non_persistent_buffers_set:
            model._init_weights(module)
        if offload:  # buffers are not FSDP's: they stay on the GPU
            module._buffers.update({n: b.to(device)
                                    for n, b in module._buffers.items() if b is not None})


def _load_weights(model, path, extra):
    """Collective (every rank): each rank reads only the slices its shards cover from the
    checkpoint's safetensors files (torch.distributed.checkpoint's HF reader: byte ranges of mmap'd
    files, cast to the parameters' dtype), as torchtitan loads HF weights; no rank holds a full
    model. `extra`: full tensors for what the files lack (the value head). Returns the model."""
    # a tied lm_head appears once, as embed_tokens, as in the file
    params = dict(model.named_parameters())
    # names and shapes, from the files' headers only
    in_files = dcp.HuggingFaceStorageReader(path).read_metadata().state_dict_metadata
    missing = [n for n in params if n not in in_files and n not in extra]
    if missing:
        raise ValueError(f"{path} has no tensor named {missing[0]} ({len(missing)} missing): "
                         f"not an HF checkpoint of a supported CausalLM?")
    from_files = {n: p for n, p in params.items() if n not in extra}
    dcp.load(from_files, storage_reader=dcp.HuggingFaceStorageReader(path))
    for name, full in extra.items():
        param = params[name]
        # a DTensor: our shard of the full tensor, cut locally as its placements say
        if isinstance(param, DTensor):
            full = distribute_tensor(full, param.device_mesh, param.placements,
                                     src_data_rank=None).to_local()
        with torch.no_grad():
            _local(param).copy_(full)
    return model


def load_policy(path, mesh, cfg, frozen=False, adapt=None):
    """Collective (every rank): the HF checkpoint at `path` as a sharded module (TP plan if tp > 1,
    FSDP2 or DDP over dp*cp), changed by `adapt` if given (_build's: lora.add_adapters, the
    policy's fresh adapters). frozen (on-policy distillation's teacher): no gradient, stored in
    its compute dtype and under FSDP2 kept in host memory between its passes (_build's `frozen`,
    as the reward model)."""
    model, added = _build(path, mesh, cfg, critic=False, frozen=frozen, adapt=adapt)
    model = _load_weights(model, path, extra=added)
    return model.requires_grad_(False) if frozen else model


def score_head(path):
    """The score head (1, hidden) of a `*ForSequenceClassification` checkpoint with one label (a
    reward model), or None. It is small: every rank reads it whole."""
    for name in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
        with safe_open(os.path.join(path, name), framework="pt") as f:
            if "score.weight" in f.keys():
                weight = f.get_tensor("score.weight").float()
                return weight if weight.shape[0] == 1 else None
    return None


def load_critic(path, mesh, cfg, frozen=False):
    """Collective (every rank): the backbone of the checkpoint at `path` + an fp32 Linear(hidden, 1)
    value head, identical on every rank. From a reward model (a sequence-classification checkpoint),
    the head is its score head: the critic starts from the reward model, OpenRLHF's default, and
    predicts the reward from its first step. Else the head is initialized from the seed with std
    1/sqrt(hidden+1) and zero bias (Ziegler et al. 2019's value head, as in
    summarize_from_feedback_details)."""
    model, _ = _build(path, mesh, cfg, critic=True, frozen=frozen)
    weight = score_head(path)
    if weight is None:
        hidden = model.config.hidden_size
        generator = torch.Generator().manual_seed(cfg.seed)
        weight = torch.randn(1, hidden, generator=generator) / math.sqrt(hidden + 1)
    head = next(name for name, module in model.named_modules()
                if module is model.get_output_embeddings())
    # (HF's score heads have no bias: 0 reads the same)
    return _load_weights(model, path,
                         extra={f"{head}.weight": weight, f"{head}.bias": torch.zeros(1)})


def load_reward_model(path, mesh, cfg):
    """Collective (every rank): a reward model, `*ForSequenceClassification` with one label, sharded
    on the training mesh as the policy is (TP plan, FSDP2, CP, packing) and frozen: no optimizer, no
    gradient; it scores in the no-grad phase (forward_reward_model). Stored in bf16 under
    the bf16 recipe and kept in host memory between its passes (_build's `frozen`)."""
    return load_critic(path, mesh, cfg, frozen=True).requires_grad_(False)  # (returns the module)


def forward_reward_model(reward_model, input_ids, seq_lens, mesh, cfg):
    """Collective (every rank): a reward model's output at each position, unshifted:
    out[:, i] = head(hidden[:, i]), the score of the sequence x_<=i (the trainer reads it at each
    sequence's last token). A reward model is a critic's backbone + one-output head (its score
    head: load_reward_model), read without the critic's shift."""
    return forward_critic(reward_model, input_ids, seq_lens, mesh, cfg, shift=False)


# -----------------------------------------------------------------------------
# The reference policy's snapshot (the initial policy's shards in host memory, for the reference
# pass's swap).

def snapshot_weights(model, dtype=None):
    """The reference policy: this rank's shard of every parameter, copied once to host memory, in
    `dtype` (default: the parameters'). The bf16 recipe keeps bf16: half the bytes of fp32, and the
    forward casts the weights to bf16 anyway, so the reference computes exactly the same."""
    reshard(model)
    names, params = zip(*model.named_parameters())
    weights = dict(zip(names, _host_copies([_local(p).detach() for p in params], dtype)))
    return {"weights": weights, "parked": {}}  # parked: filled by swapped_weights


# What a model dir holds besides config and weights, copied into an export as it is (AutoTokenizer,
# vLLM's tokenizer and its default sampling settings read these).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "generation_config.json")


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _safetensors_header(tensors, dtype):
    """The safetensors layout's prefix: an 8-byte little-endian size, then a JSON header of each
    tensor's dtype, shape and byte range in the data that follows (padded to 8 bytes). Shapes
    suffice to write it."""
    header = {"__metadata__": {"format": "pt"}}
    offset = 0  # bytes of the tensors before this one
    for name, shape in tensors:
        nbytes = shape.numel() * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    return len(blob).to_bytes(8, "little") + blob


def save_hf(model, path, dtype=torch.float32, copy_from=None, shard_gb=5.0):
    """Collective (every rank): write an HF checkpoint dir loadable by from_pretrained and vLLM:
    config.json and the weights in `dtype`, in safetensors files of at most shard_gb (several: the
    hub's model-0000k-of-0000n.safetensors + model.safetensors.index.json). Streamed: rank 0 writes
    each file's header first, then appends every parameter as it is gathered, so no rank holds more
    than one full tensor beyond its shards. copy_from: a model dir whose TOKENIZER_FILES are copied
    in. Written to a temp dir and renamed: `path` is never half-written."""
    master = dist.get_rank() == 0
    tmp = path.rstrip("/") + ".tmp"
    reshard(model)
    files = [[]]  # [(name, shape)] per file, in parameter order
    size = 0  # bytes in the last file so far
    for name, param in _hf_params(model):
        nbytes = param.numel() * dtype.itemsize
        if files[-1] and size + nbytes > shard_gb * 2**30:
            files.append([])
            size = 0
        files[-1].append((name, param.shape))
        size += nbytes
    # one file, or the hub's names for a sharded checkpoint
    names = [f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))]
    names = names if len(names) > 1 else ["model.safetensors"]
    if master:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    full_params = iter_full_params(model, dtype)  # one all-gather per parameter, on every rank
    for file_name, tensors in zip(names, files):
        with open(os.path.join(tmp, file_name), "wb") if master else contextlib.nullcontext() as f:
            if master:
                f.write(_safetensors_header(tensors, dtype))
            for _, full in itertools.islice(full_params, len(tensors)):  # this file's parameters
                if master:
                    f.write(full.contiguous().view(torch.uint8).cpu().numpy())  # its raw bytes
    if master:
        if len(files) > 1:
            weight_map = {name: file_name for file_name, tensors in zip(names, files)
                          for name, _ in tensors}
            total = sum(shape.numel() * dtype.itemsize for tensors in files for _, shape in tensors)
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map},
                          f, indent=1)
        config = copy.deepcopy(model.config)
        # vLLM and from_pretrained(dtype="auto") load it as written
        config.dtype = dtype
        config.save_pretrained(tmp)
        if copy_from:
            for file_name in TOKENIZER_FILES:
                if os.path.isfile(os.path.join(copy_from, file_name)):
                    shutil.copy(os.path.join(copy_from, file_name), tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    dist.barrier()


# The one extension that acts before the process group exists (it splits the world), imported last:
# it imports this module.
from extensions import async_rollout  # noqa: E402
