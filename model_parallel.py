"""Everything about where tensors live: the (dp, cp, tp) mesh, loading an HF checkpoint into sharded modules
(FSDP2 + tensor parallel), context-parallel and packed attention, the critic, the reference-weight swap, the
global grad norm and HF export. train_ppo.py asks for "logprobs of these rows" and never sees a shard.

    torchrun --nproc_per_node=4 train_ppo.py --tp_size=2 --cp_size=1   # dp = 4 / (2*1) = 2

One forward, in order: rows -> (packed) layout -> this rank's zigzag share of the tokens -> HF model with our
attention function -> this rank's vocab shard of the logits -> logprobs.py.

Where the ideas come from (code and prose are our own):
1. FSDP2 per decoder layer then the root, one TP plan dict per family, the degree check: torchtitan (parallelize_llama).
2. Column/row-parallel linears: Megatron-LM (Shoeybi et al. 2019); sequence-parallel norms: Korthikanti et al. 2022.
3. Zigzag (load-balanced) CP, all-gathered K/V: Megatron-LM/TransformerEngine, ring-flash-attention (Liu et al. 2023).
4. First-fit-decreasing packing, block-diagonal attention: Krell et al. 2021; verl / NeMo-RL sequence packing."""
import contextlib
import copy
import datetime
import inspect
import json
import math
import os
import shutil
import struct
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed._composable.replicate import DDP, replicate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM

from config import masked_attention_error
from logprobs import cp_gather, shift_right, token_logprobs, unpack_packed, zigzag_positions

try:  # GPU only: flash-attn's varlen kernel skips the masked-out blocks of a packed row
    from flash_attn import flash_attn_varlen_func
except ImportError:
    flash_attn_varlen_func = None
try:  # GPU only, without flash-attn: PyTorch's own FlashAttention-2 varlen kernel
    from torch.nn.attention.varlen import varlen_attn
    VARLEN_ARGS = inspect.signature(varlen_attn).parameters  # window_size since torch 2.11, enable_gqa 2.13
except ImportError:
    varlen_attn, VARLEN_ARGS = None, {}


# -----------------------------------------------------------------------------
# Distributed set-up: one code path for `python train_ppo.py` (a world of one) and torchrun.

def init_distributed(timeout_s=1800):
    """(rank, world_size, device), initializing the process group once; a collective stuck past timeout_s raises."""
    device = torch.device("cpu")
    if torch.cuda.is_available():  # GPU only: pick this rank's GPU *before* NCCL starts, so its communicators
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))  # and buffers are not all on GPU 0
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                           ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
            os.environ.setdefault(key, value)  # what torchrun would set for one process
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo",  # gloo: CPU collectives
                                timeout=datetime.timedelta(seconds=timeout_s),  # a dead rank: torchrun stops the rest
                                device_id=device if device.type == "cuda" else None)
    return dist.get_rank(), dist.get_world_size(), device


def make_mesh(world_size, tp_size, cp_size, device_type):
    """Collective (every rank): the ("dp", "cp", "tp") mesh, tp innermost (neighbours share the fastest link), and
    `mesh.dp_cp`, dp x cp flattened for FSDP (cp ranks hold other tokens of the same rows: gradients summed too)."""
    dp_size = world_size // (tp_size * cp_size)
    if dp_size * cp_size * tp_size != world_size:
        raise ValueError(f"dp*cp*tp must equal the world size {world_size}: tp_size={tp_size} * "
                         f"cp_size={cp_size} does not divide it (dp would be {world_size / (tp_size * cp_size):g})")
    mesh = init_device_mesh(device_type, (dp_size, cp_size, tp_size), mesh_dim_names=("dp", "cp", "tp"))
    # kept on the mesh: torch deprecates slicing a flattened dim back out of the root; _flatten: private, as torchtitan
    mesh.dp_cp = mesh["dp", "cp"]._flatten("dp_cp")
    return mesh


def release_mesh(mesh):
    """Last call, after dist.destroy_process_group(): the mesh (in DTensor's cache) keeps its groups, whose threads
    would outlive Python and abort a finished run ("terminate called without an active exception"): join them now."""
    mesh._pg_registry.clear()  # private in torch 2.13; sliced meshes share the root's


def resolve_auto(cfg, device_type):
    """Replace "auto" in cfg.dtype and cfg.attention by what runs here; return the attention kernel's name. GPU: bf16,
    a flash varlen kernel (flash-attn's, else torch's); else exact fp32, masked SDPA. No dense mask for a packed GPU
    row (nor on CPU past config.MASK_LIMIT): (T/cp, T) scores a head, mostly across documents, cost O(T^2) memory
    (3.2 GB a layer at 8192 tokens, 1.5B), ~15x the FLOPs; without a flash kernel the reference goes doc by doc."""
    if cfg.dtype == "auto":
        cfg.dtype = "bf16" if device_type == "cuda" and cfg.data_parallel == "fsdp" else "fp32"
    cfg.export_dtype = cfg.dtype if cfg.export_dtype == "auto" else cfg.export_dtype
    kernel = gpu_varlen_kernel() if device_type == "cuda" and cfg.dtype == "bf16" else None
    if cfg.attention == "auto":
        longest = cfg.max_tokens_per_microbatch if cfg.packing else cfg.max_model_len  # a row's length at most
        dense_ok = not (cfg.packing and device_type == "cuda") and not masked_attention_error(longest, cfg.cp_size)
        cfg.attention = "varlen" if kernel or not dense_ok else "masked"
    names = {None: "reference varlen (one SDPA per document)", torch_varlen_attention: "torch varlen_attn"}
    return "masked SDPA" if cfg.attention == "masked" else names.get(kernel, "flash-attn varlen")


def _group(mesh, dim):
    return mesh[dim].get_group() if mesh[dim].size() > 1 else None  # None: logprobs.py skips it


def _device(mesh):
    return torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")


# -----------------------------------------------------------------------------
# Attention: one function for every layout, registered in AttentionInterface as "ppo", a name in no mask registry:
# the model builds no mask (it cannot know our packing or zigzag order); the layout comes in forward kwargs, untouched.

class _GatherSeq(torch.autograd.Function):
    """All-gather K or V over cp on dim 2 (sequence); backward reduce-scatters: a key's gradient sums every rank's."""

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


def varlen_attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale=None, causal=True, window_size=(-1, -1)):
    """flash-attn's `flash_attn_varlen_func` contract in plain PyTorch, the CPU stand-in. q: (total_q, Hq, D); k, v:
    (total_k, Hkv, D), Hkv dividing Hq (GQA); segment i: q[cu_seqlens_q[i]:...[i+1]] to k/v[cu_seqlens_k[i]:...[i+1]].
    Causal is bottom-right aligned (flash-attn >= 2.1): Lq queries over Lk >= Lq keys are the *last* Lq, query j at key
    position j + Lk - Lq. window_size=(left, right): keys at most `left` back, -1 = unlimited. max_seqlen_*: unused."""
    outs, bounds_q, bounds_k = [], cu_seqlens_q.tolist(), cu_seqlens_k.tolist()  # (on a GPU: a sync per call)
    for q0, q1, k0, k1 in zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:]):
        q_pos = torch.arange(q1 - q0, device=q.device)[:, None] + (k1 - k0) - (q1 - q0)  # (Lq, 1)
        k_pos = torch.arange(k1 - k0, device=q.device)[None, :]  # (1, Lk)
        visible = (k_pos <= q_pos) if causal else (k_pos >= 0) & (q_pos >= 0)  # (Lq, Lk)
        if window_size[0] >= 0:
            visible &= k_pos >= q_pos - window_size[0]
        if not causal and window_size[1] >= 0:
            visible &= k_pos <= q_pos + window_size[1]
        seg = F.scaled_dot_product_attention(q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1),
                                             v[k0:k1].transpose(0, 1), attn_mask=visible, scale=softmax_scale,
                                             enable_gqa=True)  # (Hq, Lq, D)
        outs.append(seg.transpose(0, 1))  # (Lq, Hq, D)
    return torch.cat(outs)  # (total_q, Hq, D)


def torch_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale=None, causal=True, window_size=(-1, -1)):
    """GPU only: the same contract through torch's varlen_attn. Its window (left, 0) is causal, bottom-right aligned
    like flash-attn's (tests/test_cuda.py checks); a tuple, as torch reads is_causal as `window_size == (-1, 0)`."""
    window = (window_size[0], 0) if causal else tuple(window_size)
    # GQA: torch 2.13 must be told (enable_gqa), 2.11 takes the fewer KV heads as is (H100: same as copying them)
    gqa = dict(enable_gqa=True) if "enable_gqa" in VARLEN_ARGS and k.shape[1] != q.shape[1] else {}
    return varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=softmax_scale,
                       window_size=window, **gqa)


def gpu_varlen_kernel():
    """flash-attn's kernel if installed, else torch's if this torch build has one, else None."""
    torch_has_it = "window_size" in VARLEN_ARGS and torch.backends.cuda.is_flash_attention_available()
    return flash_attn_varlen_func or (torch_varlen_attention if torch_has_it else None)


@dataclass
class Layout:
    """Where each token of this rank's rows sits, built once per forward (_layout) for every layer's attention and
    for _unlayout: B rows (one if packed) of T tokens, padded to a multiple of 2*cp*tp; this rank's queries: q_rows."""
    ids: torch.Tensor  # (B, T) every token of the rows
    positions: torch.Tensor  # (B, T) position ids (restarting at 0 in each packed sequence)
    seq_lens: torch.Tensor  # (b,) real tokens of each sequence
    cu_seqlens: torch.Tensor | None  # (documents + 1,) packed: sequence (and padding tail) boundaries; else None
    varlen: bool  # which kernel: varlen (the fields after docs) or masked SDPA (the four before)
    cp_group: dist.ProcessGroup | None  # K and V are all-gathered over it (None: cp = 1)
    q_rows: torch.Tensor  # (T/cp,) row positions of this rank's queries: its zigzag share
    kv_rows: torch.Tensor  # (T,) row positions of the keys: every cp share, in rank order (all-gathered)
    q_docs: torch.Tensor  # (B, T/cp) document of each query (0 throughout an unpacked row)
    kv_docs: torch.Tensor  # (B, T) document of each key
    cu_seqlens_q: torch.Tensor  # (segments + 1,) int32 boundaries of the query segments ...
    cu_seqlens_k: torch.Tensor  # (segments + 1,) ... and of their keys: flash-attn's varlen contract
    max_seqlen_q: int
    max_seqlen_k: int
    kv_index: torch.Tensor | None  # (total_k,) CP: where each segment's keys sit among the gathered keys

    def model_inputs(self):  # what HF's forward gets: this rank's tokens, and the layout for our attention
        return dict(input_ids=self.ids[:, self.q_rows], position_ids=self.positions[:, self.q_rows],
                    ppo_layout=self, use_cache=False)  # (B, T/cp) each


def _masked_attention(query, key, value, scaling, sliding_window, layout):
    """SDPA with an explicit (B, T/cp, T) mask: a key is visible if in the query's document and not in its future, in
    row positions (zigzag order is irrelevant once every token carries its index). O(T^2) memory; exact in fp32."""
    q_rows, kv_rows, q_docs, kv_docs = layout.q_rows, layout.kv_rows, layout.q_docs, layout.kv_docs
    mask = (q_docs[:, :, None] == kv_docs[:, None, :]) & (kv_rows[None, None, :] <= q_rows[None, :, None])  # (B, T/cp, T)
    if sliding_window:  # Gemma3 local layers: only the last `sliding_window` keys (HF's convention)
        mask &= kv_rows[None, None, :] > q_rows[None, :, None] - sliding_window  # (B, T/cp, T)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask[:, None], scale=scaling,
                                         enable_gqa=True)  # (B, Hq/tp, T/cp, D); GQA: KV heads not copied
    return out.transpose(1, 2)  # (B, T/cp, Hq/tp, D)


def _varlen_attention(query, key, value, scaling, sliding_window, layout):
    """The same attention through the varlen contract: (tokens, heads, dim), a causal segment per (row, zigzag chunk,
    document). CUDA bf16: a flash kernel, skipping masked blocks (flash-attn's or torch's); else the reference."""
    batch, heads, local_len, dim = query.shape  # query: (B, Hq/tp, T/cp, D)
    q = query.transpose(1, 2).reshape(batch * local_len, heads, dim)  # (B*T/cp, Hq/tp, D)
    k = key.transpose(1, 2).flatten(0, 1)  # (B*T, Hkv/tp, D)  (gathered order under CP)
    v = value.transpose(1, 2).flatten(0, 1)  # (B*T, Hkv/tp, D)
    if layout.kv_index is not None:  # CP: each segment's keys, from its document's start on
        k, v = k[layout.kv_index], v[layout.kv_index]  # (total_k, Hkv/tp, D)
    gpu_kernel = gpu_varlen_kernel() if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) else None
    kernel = gpu_kernel or varlen_attention_reference
    out = kernel(q, k, v, layout.cu_seqlens_q, layout.cu_seqlens_k, layout.max_seqlen_q,
                 layout.max_seqlen_k, softmax_scale=scaling, causal=True,
                 window_size=(sliding_window - 1, 0) if sliding_window else (-1, -1))  # (B*T/cp, Hq/tp, D)
    return out.view(batch, local_len, heads, dim)  # (B, T/cp, Hq/tp, D)


def ppo_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                  *, ppo_layout, **unused):  # query: (B, Hq/tp, T/cp, D), key/value: (B, Hkv/tp, T/cp, D)
    """Collective over cp (every cp rank, each layer): causal attention within each packed document, this rank's
    zigzag share of queries to every key; `ppo_layout` (a Layout) picks the kernel. No dropout (PPO runs without)."""
    if ppo_layout.cp_group is not None:  # all-gather CP (Llama 3's choice): K/V are small under GQA
        key = _GatherSeq.apply(key, ppo_layout.cp_group)  # (B, Hkv/tp, T, D)
        value = _GatherSeq.apply(value, ppo_layout.cp_group)  # (B, Hkv/tp, T, D)
    attend = _varlen_attention if ppo_layout.varlen else _masked_attention
    return attend(query, key, value, scaling, sliding_window, ppo_layout), None  # no attention weights


AttentionInterface.register("ppo", ppo_attention)


# -----------------------------------------------------------------------------
# Tensor-parallel plans (Megatron-LM via torchtitan). Colwise = split a Linear's output features: each rank computes
# some heads / MLP channels, no communication; rowwise = split its inputs, partial outputs summed (one all-reduce a
# block, or SP's reduce-scatter onto the sequence). Llama, Qwen2, Qwen3 share module names: one plan (Gemma3: tp=1).

def _tp_plan(family, sequence_parallel, critic):
    # the residual stream between blocks: all tokens on every tp rank, or (SP) S/tp each: norms, adds not repeated
    stream = Shard(1) if sequence_parallel else Replicate()
    plan = {
        # vocab rows split over tp: a rank embeds its own ids (0 elsewhere); partials summed (all-reduce/reduce-scatter)
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "model.layers.*.self_attn.q_proj": ColwiseParallel(),
        "model.layers.*.self_attn.k_proj": ColwiseParallel(),
        "model.layers.*.self_attn.v_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(output_layouts=stream),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(output_layouts=stream),
    }
    if family == "qwen3":
        plan.update({  # q/k norms see only this rank's heads (dim 2): marking that split sums their grads over tp
            "model.layers.*.self_attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            "model.layers.*.self_attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        })
    if sequence_parallel:
        plan.update({  # norms run on S/tp tokens; their replicated weights get gradients summed over tp
            "model.layers.*.input_layernorm": SequenceParallel(),
            "model.layers.*.post_attention_layernorm": SequenceParallel(),
            "model.norm": SequenceParallel(use_local_output=True),
            "model.layers.*.self_attn": PrepareModuleInput(  # attention, MLP need every token: tp all-gather
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()}, use_local_output=True),
            "model.layers.*.mlp": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True),
        })
    if critic:  # the value head is tiny and replicated over tp: it just needs every token
        plan["lm_head"] = PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),),
                                             use_local_output=True)
    else:  # vocab split: a (B, S, V/tp) shard to logprobs.py, a DTensor here (FSDP2 can't hook a to_local() view)
        plan["lm_head"] = ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False)
    return plan


# -----------------------------------------------------------------------------
# Loading: every rank builds on the meta device, shards (TP, then FSDP2), allocates and reads only its shards.

class CheckpointError(ValueError):
    """A model dir or training checkpoint that cannot be used: one line, exit 2."""


def _check_supported(config, tp_size):
    family = config.model_type
    if family not in ("llama", "qwen2", "qwen3", "gemma3_text"):
        raise CheckpointError(f"model_type {family!r} is not supported: llama, qwen2, qwen3, gemma3_text (tp=1)")
    if family == "gemma3_text" and tp_size > 1:
        raise CheckpointError("Gemma3 runs with tp_size=1 only (FSDP, CP and packing work): no TP plan for it here")
    for field in ("num_attention_heads", "num_key_value_heads"):
        if getattr(config, field) % tp_size:
            raise CheckpointError(f"tp_size={tp_size} must divide {field}={getattr(config, field)}: "
                                  f"each tp rank computes whole heads")


def check_hf_dir(path, tp_size):
    """Refuse (CheckpointError, one line) a model dir that loading would fail on: no or unreadable config.json, an
    unsupported family or tp split, missing or corrupt weights. Fast (config.json, safetensors headers), every rank."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise CheckpointError(f"model={path!r} is not an HF checkpoint dir (no config.json): give a dir "
                              f"written by save_pretrained, or a tiny preset (see --help)")
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path}/config.json cannot be read: {str(e).splitlines()[0]}") from None
    _check_supported(config, tp_size)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{path} has no *.safetensors weights (.bin files are not read here: "
                              f"re-save them with save_pretrained)")
    from safetensors import SafetensorError, safe_open
    for f in files:
        try:  # the header lists every tensor's byte range: a truncated file fails here
            safe_open(os.path.join(path, f), framework="pt")
        except SafetensorError as e:
            raise CheckpointError(f"{path}/{f} is corrupt ({e}): download or save it again") from None


class ValueHead(nn.Linear):
    """The critic's Linear(hidden, 1) as x @ w.T + b: F.linear's 3-D fused addmm gives a view FSDP2 can't hook."""

    def forward(self, hidden):  # (B, T/cp, hidden) -> (B, T/cp, 1)
        return F.linear(hidden, self.weight) + self.bias


def _build(path, mesh, cfg, critic):
    tp_size, config = mesh["tp"].size(), AutoConfig.from_pretrained(path)
    _check_supported(config, tp_size)
    if critic:
        config.final_logit_softcapping = None  # Gemma's logit softcap must not squash values
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="ppo", dtype=torch.float32)
        if critic:  # the critic is the same backbone with its "LM head" replaced by the value head
            model.lm_head = ValueHead(config.hidden_size, 1)
    tied = not critic and config.tie_word_embeddings
    if tp_size > 1:
        parallelize_module(model, mesh["tp"], _tp_plan(config.model_type, cfg.sequence_parallel, critic))
        if tied:  # TP gave each module its own DTensor copy: tie again (both are Shard(0) on vocab)
            model.lm_head.weight = model.model.embed_tokens.weight
    if cfg.activation_checkpointing:  # recompute each decoder layer in backward
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    device = _device(mesh)
    offload = device.type == "cuda" and cfg.cpu_offload  # GPU only: shards and AdamW's state in host memory
    if cfg.data_parallel == "fsdp":  # FSDP2 over dp*cp, per decoder layer (one all-gather in flight), then the root
        # (embeddings, norm, head); bf16: computed in bf16, gradients reduced in fp32 into AdamW's fp32 master weights
        compute = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cfg.dtype == "bf16"
                   else MixedPrecisionPolicy())
        # reshard_after_forward=False: layers stay gathered till backward or reshard() (no-grad microbatches reuse them)
        fsdp = dict(mesh=mesh.dp_cp, offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy(),
                    reshard_after_forward=cfg.reshard_after_forward)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=compute, **fsdp)
        if critic:  # own unit in fp32: FSDP2 casts its bf16 input up (else bf16 meets fp32 weights: matmul fails)
            fully_shard(model.lm_head, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32), **fsdp)
        fully_shard(model, mp_policy=compute, **fsdp)
        for module in model.modules():
            if isinstance(module, FSDPModule):  # each rank's loss is already its tokens' sum / the global token
                # count: gradients are summed over dp*cp, not averaged (force SUM: gloo has no PREMUL_SUM)
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
    elif mesh.dp_cp.size() > 1:  # ddp (on one rank: a plain module)
        # composable DDP (names unchanged; torchtitan's apply_ddp), built at the first forward: whole replicas, 25 MB
        # buckets of gradients (.grad views them) all-reduced during backward; on gloo 2-3x cheaper than FSDP2's
        # all-gather + reduce-scatter (bench/gloo_collectives.py)
        replicate(model, process_group=mesh.dp_cp.get_group(), forward_sync_buffers=False, gradient_as_bucket_view=True)
        model.register_comm_hook(mesh.dp_cp.get_group(), _sum_hook)  # summed, as FSDP2's above
    model.to_empty(device="cpu" if offload else device)  # only now is memory allocated: our shards
    # buffers made at construction (RoPE, Gemma's embedding scale), not in the checkpoint: HF's initializer redoes them
    for param in model.parameters():
        param._is_hf_initialized = True  # (and leaves the parameters alone)
    for module in model.modules():
        if module._non_persistent_buffers_set:
            model._init_weights(module)
        if offload:  # buffers are not FSDP's: they stay on the GPU
            module._buffers.update({n: b.to(device) for n, b in module._buffers.items() if b is not None})
    if tied and model.lm_head.weight is not model.model.embed_tokens.weight:  # to_empty gave each
        model.lm_head.weight = model.model.embed_tokens.weight  # its own tensor (not under FSDP2)
    model.train()  # no dropout in these families; train mode lets activation checkpointing act
    return model


def _sum_hook(group, bucket):  # a DDP comm hook: SUM over the group (DDP's default averages)
    return dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future().then(lambda f: f.value()[0])


def sync_gradients(model, sync):
    """DDP: all-reduce (everything accumulated) in the next backward only if `sync`: a minibatch's last microbatch."""
    if isinstance(model, DDP):
        model.set_requires_gradient_sync(sync)


def _load_weights(model, path, extra):
    """Collective (every rank): each reads only its shards' slices of the safetensors (DCP's HF reader, as torchtitan:
    mmap'd byte ranges, cast to the params' dtype); `extra`: full tensors the files lack (the value head)."""
    params = dict(model.named_parameters())  # a tied lm_head appears once, as embed_tokens, like in the file
    in_files = dcp.HuggingFaceStorageReader(path).read_metadata().state_dict_metadata  # names and shapes: headers only
    missing = [n for n in params if n not in in_files and n not in extra]
    if missing:
        raise ValueError(f"{path} has no tensor named {missing[0]} ({len(missing)} missing): not an HF checkpoint "
                         f"of a supported CausalLM?")
    dcp.load({n: p for n, p in params.items() if n not in extra}, storage_reader=dcp.HuggingFaceStorageReader(path))
    for name, full in extra.items():
        param = params[name]
        if isinstance(param, DTensor):  # our shard of the full tensor, cut locally as its placements say
            full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        with torch.no_grad():
            _local(param).copy_(full)
    return model


def load_policy(path, mesh, cfg):
    """Collective (every rank): the HF checkpoint at `path` as a sharded module (TP if tp > 1, FSDP2 over dp*cp)."""
    return _load_weights(_build(path, mesh, cfg, critic=False), path, extra={})


def load_critic(path, mesh, cfg):
    """Collective (every rank): the backbone at `path` + an fp32 Linear(hidden, 1) value head, the same on every
    rank: seeded, std 1/sqrt(hidden+1), zero bias (Ziegler et al. 2019, as summarize_from_feedback_details)."""
    model = _build(path, mesh, cfg, critic=True)
    hidden, generator = model.config.hidden_size, torch.Generator().manual_seed(cfg.seed)
    weight = torch.randn(1, hidden, generator=generator) / math.sqrt(hidden + 1)
    return _load_weights(model, path, extra={"lm_head.weight": weight, "lm_head.bias": torch.zeros(1)})


# -----------------------------------------------------------------------------
# Tiny presets: random-init models written as real HF checkpoint dirs (nothing is downloaded). head_dim 64 because
# vLLM's CPU attention refuses 16; vocab 262, padded past the toy tokenizer's 258 ids and not a multiple of 4.

_TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=262, max_position_embeddings=512,
             tie_word_embeddings=False, bos_token_id=256, eos_token_id=256, pad_token_id=257)
TINY_PRESETS = {
    "tiny-llama": dict(_TINY, model_type="llama"),
    "tiny-qwen2": dict(_TINY, model_type="qwen2"),  # q/k/v biases
    "tiny-qwen3": dict(_TINY, model_type="qwen3"),  # q/k RMSNorm per head
    # Gemma3 text: sliding-window layers, (1 + w) norms, scaled embedding; tp = 1 only
    "tiny-gemma3": dict(_TINY, model_type="gemma3_text", query_pre_attn_scalar=64, sliding_window=128),
}


def materialize_tiny_model(name, dir, seed, **overrides):
    """Write preset `name` (+ overrides, e.g. tie_word_embeddings=True) to dir/name; return that path. Rank 0 writes
    to a temp dir then renames it, so a dir with config.json is complete and a second call only waits at the barrier."""
    path = os.path.join(dir, name)
    rank = dist.get_rank() if dist.is_initialized() else 0  # also usable before init (scripts, tests)
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
# Forward: microbatches of rows -> this rank's tokens -> model -> this rank's head output -> per-token (b, S).

def microbatches(seq_lens, cfg, mesh):
    """Collective (every rank of dp): lists of row indices, as many on every dp rank ([]: a dummy run, weight 0, so
    collectives match). Packing: first-fit decreasing into max_tokens_per_microbatch rows; else micro_batch_size."""
    if cfg.packing:
        multiple = 2 * mesh["cp"].size() * mesh["tp"].size()
        capacity = cfg.max_tokens_per_microbatch // multiple * multiple  # room left after padding
        bins, room = [], []
        for i in sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i]):  # longest first
            if seq_lens[i] > capacity:
                raise ValueError(f"a sequence of {seq_lens[i]} tokens does not fit max_tokens_per_microbatch="
                                 f"{cfg.max_tokens_per_microbatch} (usable {capacity}: a multiple "
                                 f"of 2*cp*tp={multiple}); raise it")
            fit = next((k for k in range(len(bins)) if room[k] >= seq_lens[i]), len(bins))  # first bin with room
            if fit == len(bins):  # none: open a new one
                bins.append([])
                room.append(capacity)
            bins[fit].append(i)
            room[fit] -= seq_lens[i]
    else:
        size = cfg.micro_batch_size
        bins = [list(range(start, min(start + size, len(seq_lens)))) for start in range(0, len(seq_lens), size)]
    count = torch.tensor([len(bins)], device=_device(mesh))
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=mesh["dp"].get_group())  # collective over dp
    return bins + [[] for _ in range(int(count) - len(bins))]


def _varlen_index(doc_lens, num_rows, row_len, cp_size, cp_rank, kv_rows):
    """flash-attn's varlen arguments: a segment per (row, zigzag chunk, document) of this rank's queries in local order,
    keys from the document's start (bottom-right causal; Llama 3's, TE's all-gather CP). Python ints: no device sync."""
    doc_starts = [sum(doc_lens[:d]) for d in range(len(doc_lens))]
    chunk = row_len // (2 * cp_size)
    chunks = [(0, row_len)] if cp_size == 1 else [(c * chunk, (c + 1) * chunk) for c in (cp_rank, 2 * cp_size - 1 - cp_rank)]
    q_lens, k_spans = [], []  # k_spans: (row, first key, end) in row positions
    for row in range(num_rows):
        for lo, hi in chunks:
            for start, n in zip(doc_starts, doc_lens):
                first, end = max(lo, start), min(hi, start + n)
                if first < end:
                    q_lens.append(end - first)
                    k_spans.append((row, start, end))
    k_lens = [end - start for _, start, end in k_spans]
    kv_index = None  # cp = 1: the segments' keys are the keys, in order
    if cp_size > 1:  # the gathered keys are in rank order: natural position p sits at slot[p]
        slot = torch.empty_like(kv_rows)  # (T,)
        slot[kv_rows] = torch.arange(len(kv_rows), device=kv_rows.device)
        kv_index = torch.cat([row * row_len + slot[start:end] for row, start, end in k_spans])  # (total_k,)
    cu = lambda lens: F.pad(torch.tensor(lens).cumsum(0), (1, 0)).to(kv_rows.device, torch.int32)  # noqa: E731
    return dict(cu_seqlens_q=cu(q_lens), cu_seqlens_k=cu(k_lens), max_seqlen_q=max(q_lens),
                max_seqlen_k=max(k_lens), kv_index=kv_index)


def _layout(input_ids, seq_lens, mesh, cfg):
    """What this rank feeds the model for (b, S) right-padded rows, padded (or packed) to a multiple of 2*cp*tp: 2*cp
    equal zigzag chunks, split again over tp by SP. Pad tokens (id 0) follow every real token; no loss reads them."""
    cp_size, cp_rank = mesh["cp"].size(), mesh["cp"].get_local_rank()
    multiple, device = 2 * cp_size * mesh["tp"].size(), _device(mesh)
    input_ids = input_ids.to(device)  # (b, S)
    if cfg.packing:  # one row: the sequences back to back, the padding tail as a document of its own
        lens = [int(n) for n in seq_lens]
        tail = -sum(lens) % multiple
        ids = torch.cat([input_ids[k, :n] for k, n in enumerate(lens)] + [input_ids.new_zeros(tail)])[None]  # (1, T)
        doc_lens = lens + [tail] if tail else lens
        cu_seqlens = F.pad(torch.tensor(doc_lens, device=device).cumsum(0), (1, 0)).to(torch.int32)  # (n_docs+1,)
        docs = torch.repeat_interleave(torch.arange(len(doc_lens), device=device),
                                       torch.tensor(doc_lens, device=device))[None]  # (1, T)
        # position ids restart at 0 in each sequence: RoPE sees every sequence as if alone
        positions = torch.arange(ids.shape[1], device=device)[None] - cu_seqlens[docs]  # (1, T)
    else:
        ids = F.pad(input_ids, (0, -input_ids.shape[1] % multiple))  # (b, T)
        doc_lens, cu_seqlens = [ids.shape[1]], None  # one document per row
        docs = torch.zeros_like(ids)  # (b, T)
        positions = torch.arange(ids.shape[1], device=device).expand_as(ids)  # (b, T)
    q_rows = zigzag_positions(ids.shape[1], cp_size, cp_rank).to(device)  # (T/cp,) queries: zigzag chunks r, 2cp-1-r
    kv_rows = torch.cat([zigzag_positions(ids.shape[1], cp_size, r) for r in range(cp_size)]).to(device)  # (T,)
    if cfg.attention == "masked" and (error := masked_attention_error(ids.shape[1], cp_size)):
        raise ValueError(error)  # (unpacked rows: their length is known only now)
    return Layout(ids=ids, positions=positions, seq_lens=torch.as_tensor(seq_lens, device=device), cu_seqlens=cu_seqlens,
                  varlen=cfg.attention == "varlen", cp_group=_group(mesh, "cp"), q_rows=q_rows, kv_rows=kv_rows,
                  q_docs=docs[:, q_rows], kv_docs=docs[:, kv_rows],
                  **_varlen_index(doc_lens, ids.shape[0], ids.shape[1], cp_size, cp_rank, kv_rows))


def _unlayout(per_token, layout, like):
    """(B, T) per-token numbers back in the trainer's (b, S) right-padded rows, on `like`'s device."""
    seq_len = like.shape[1]
    if layout.cu_seqlens is None:  # zero past each row's end, as unpacking does
        valid = torch.arange(seq_len, device=per_token.device)[None] < layout.seq_lens[:, None]  # (b, S)
        return (per_token[:, :seq_len] * valid).to(like.device)  # (b, S)
    return unpack_packed(per_token, layout.cu_seqlens[: len(layout.seq_lens) + 1], seq_len).to(like.device)  # (b, S)


def forward_policy(model, input_ids, seq_lens, mesh, cfg, temperature=1.0, with_entropy=False, unscored=0):
    """Collective (every rank): logprobs (b, S) under pi(.)^(1/temperature) (+ entropy), 0 at position 0 (train_ppo.py).
    `unscored`: leading positions no loss reads (the shortest prompt); with no CP, SP or packing the head skips them."""
    layout = _layout(input_ids, seq_lens, mesh, cfg)
    plain_rows = mesh["cp"].size() == 1 and not (cfg.packing or cfg.sequence_parallel)  # positions = row positions
    skip = max(unscored - 1, 0) if plain_rows else 0  # logits at unscored-1 predict the first scored token
    logits = model(**layout.model_inputs(), logits_to_keep=layout.ids.shape[1] - skip).logits  # (B, T/cp - skip, V/tp)
    if isinstance(logits, DTensor):  # tp > 1: this rank's vocab shard, never gathered
        logits = logits.to_local()  # (B, T/cp, V/tp)
    # logits / the sampling temperature: pi/pi_old compares what the engine sampled from (NeMo-RL, verl)
    shards = dict(tp_group=_group(mesh, "tp"), cp_group=_group(mesh, "cp"), cu_seqlens=layout.cu_seqlens,
                  chunk_size=cfg.logprob_chunk_size, temperature=temperature)
    out = token_logprobs(logits, layout.ids[:, skip:], with_entropy=with_entropy, **shards)  # (B, T - skip)
    logprobs, entropy = out if with_entropy else (out, None)  # entropy (metric or bonus): the same softmax pass
    back = lambda x: None if x is None else _unlayout(F.pad(x, (skip, 0)), layout, input_ids)  # noqa: E731 (b, S)
    return back(logprobs), back(entropy)


def forward_critic(critic, input_ids, seq_lens, mesh, cfg):
    """Collective (every rank): values (b, S), right-shifted: values[:, i] = V(x_<i), 0 at each sequence's start."""
    layout = _layout(input_ids, seq_lens, mesh, cfg)
    values = critic(**layout.model_inputs()).logits[..., 0].float()  # (B, T/cp)
    values = cp_gather(values, _group(mesh, "cp"), dim=1)  # (B, T)  collective over cp, natural order
    values = shift_right(values, layout.cu_seqlens)  # (B, T)  the shift crosses zigzag chunks: after the gather
    return _unlayout(values, layout, input_ids)  # (b, S)


# -----------------------------------------------------------------------------
# Reference policy: the initial shards in host memory, swapped into the live module (one model, no second FSDP
# module to keep in sync); and AdamW's state, on the host while the engine generates.

def _local(param):
    return param.to_local() if isinstance(param, DTensor) else param  # this rank's shard


def reshard(model):
    """Back to shards: FSDP2 leaves the root gathered, full tensors, after a forward (backward needs them at once)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _host_copy(tensor, dtype=None):
    """A copy in host memory, pinned on a GPU machine (copies to and from the GPU go faster and async)."""
    out = torch.empty(tensor.shape, dtype=dtype or tensor.dtype, device="cpu", pin_memory=torch.cuda.is_available())
    return out.copy_(tensor, non_blocking=True)


def snapshot_weights(model, dtype=None):
    """The reference policy: this rank's shards copied once to the host in `dtype` (bf16: half the bytes, same math)."""
    reshard(model)
    return {"weights": {name: _host_copy(_local(p).detach(), dtype) for name, p in model.named_parameters()},
            "parked": {}}  # filled by swapped_weights


def _copy_into(model, weights):
    reshard(model)  # and the next forward gathers the shards we write now
    with torch.no_grad():
        for name, param in model.named_parameters():
            _local(param).copy_(weights[name], non_blocking=True)


@contextlib.contextmanager
def swapped_weights(model, snapshot):
    """`model` computes with the snapshot's weights in the block, the live ones back exactly after. Plain CPU tensors
    (DDP, one rank) trade storage with it; shards and GPU weights are copied, the live ones parked on the host."""
    reshard(model)  # a gathered FSDP2 module shows plain full tensors, not its shards
    params, weights, parked = dict(model.named_parameters()), snapshot["weights"], snapshot["parked"]
    same = lambda p, s: (p.device, p.shape, p.dtype) == (s.device, s.shape, s.dtype)  # noqa: E731
    if all(not isinstance(p, DTensor) and same(p, weights[n]) for n, p in params.items()):
        def enter():  # each tensor's storage goes to the other side; the Parameter objects stay
            for name, param in params.items():
                param.data, weights[name] = weights[name], param.data
        leave = enter
    else:
        def enter():
            for name, param in params.items():
                if name in parked:  # host memory from the first swap, reused: no allocation per step
                    parked[name].copy_(_local(param), non_blocking=True)
                else:
                    parked[name] = _host_copy(_local(param).detach())
            _copy_into(model, weights)
        leave = lambda: _copy_into(model, parked)  # noqa: E731
    enter()
    try:
        yield model
    finally:
        leave()


def move_optimizer_state(optimizer, device):
    """AdamW's two moments (8 bytes a parameter: twice the fp32 weights) to `device`: "cpu" (pinned host memory) while
    vLLM generates, the GPU before the update (NeMo-RL's offload_before/after_refit). DTensors keep their sharding."""
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                old = state[key]
                new = _host_copy(_local(old)) if torch.device(device).type == "cpu" else \
                    _local(old).to(device, non_blocking=True)
                state[key] = DTensor.from_local(new, old.device_mesh, old.placements, run_check=False, shape=old.shape,
                                                stride=old.stride()) if isinstance(old, DTensor) else new


# -----------------------------------------------------------------------------
# Global grad norm: sqrt of the sum of squares of every gradient element exactly once.

def clip_grad_norm(params, max_norm):
    """Collective (every rank): clip `params`' gradients in place to global L2 norm max_norm; return the prior norm.
    A DTensor's squares sum over its sharded mesh dims, not replicated ones (copies); a plain tensor is a full copy."""
    grads = [p.grad for p in params if p.grad is not None]
    by_groups = {}  # process groups to sum over -> sum of squares of the local elements
    for grad in grads:  # per-row norms summed: no squared copy; one fp32 sum of 28M drifts ~3e-3 (bench/ddp_update.py)
        sq = torch.linalg.vector_norm(_local(grad), dim=-1, dtype=torch.float32).square().sum()  # ()
        groups = ()
        if isinstance(grad, DTensor):
            if any(p.is_partial() for p in grad.placements):
                raise ValueError("a gradient is still a pending sum (Partial): call after backward completes")
            groups = tuple(grad.device_mesh.get_group(dim) for dim, p in enumerate(grad.placements)
                           if not p.is_replicate())  # Shard or FSDP-over-TP's _StridedShard: not a replica
            sq = sq.to(_device(grad.device_mesh))  # the collective's device (offloaded grads are on CPU)
        by_groups[groups] = by_groups.get(groups, 0) + sq
    for groups, sq in by_groups.items():  # the same order on every rank: parameters come in order
        for group in groups:
            dist.all_reduce(sq, group=group)  # collective: sum over the ranks holding other shards
    norm = torch.stack(list(by_groups.values())).sum().sqrt() if grads else torch.zeros(())
    if max_norm > 0:  # 0 = no clipping, only the norm
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # as torch.nn.utils.clip_grad_norm_
        scales = {_local(g).device: scale.to(_local(g).device) for g in grads}  # one copy per device
        for grad in grads:
            _local(grad).mul_(scales[_local(grad).device])
    return float(norm)


# -----------------------------------------------------------------------------
# Full weights: refit of the rollout engine and HF export.

def iter_full_params(model):
    """Collective (every rank, to the end): yield (name, full tensor) per parameter, one alive at a time, named as in
    the HF checkpoint (FSDP2 and TP keep module names; a tied lm_head appears once, as embed_tokens, as in the file)."""
    reshard(model)  # every rank sees the same sharded parameters, hence the same collectives
    for name, param in model.named_parameters():
        with torch.no_grad():  # all-gather over its mesh, on the mesh's device (an offloaded shard lives on CPU)
            full = param.to(_device(param.device_mesh)).full_tensor() if isinstance(param, DTensor) else param.detach()
        yield name, full


# A model dir's files besides config and weights, copied into an export as is (AutoTokenizer and vLLM read them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _safetensors_header(tensors, dtype):
    """Safetensors' prefix (shapes suffice): a little-endian u64 size, a JSON header of dtypes, shapes, byte ranges."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in tensors:
        nbytes = shape.numel() * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob


def save_hf(model, path, dtype=torch.float32, copy_from=None, extra_files=None, shard_gb=5.0):
    """Collective (every rank): an HF dir for from_pretrained and vLLM (config.json, `dtype` weights, safetensors files
    of <= shard_gb, else hub-style model-0000k-of-0000n + index.json), streamed: rank 0 writes each header, then each
    parameter as gathered (one full tensor at a time). copy_from: TOKENIZER_FILES' dir; extra_files: {name: text}."""
    master, tmp = dist.get_rank() == 0, path.rstrip("/") + ".tmp"  # written there, renamed: never half-written
    reshard(model)
    files, size = [[]], 0  # [(name, shape)] per file, in parameter order
    for name, param in model.named_parameters():
        nbytes = param.numel() * dtype.itemsize
        if files[-1] and size + nbytes > shard_gb * 2**30:
            files.append([])
            size = 0
        files[-1].append((name, param.shape))
        size += nbytes
    names = ["model.safetensors"] if len(files) == 1 else [f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
                                                            for k in range(len(files))]
    if master:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    full_params = iter_full_params(model)  # one all-gather per parameter, on every rank
    for file_name, tensors in zip(names, files):
        with open(os.path.join(tmp, file_name), "wb") if master else contextlib.nullcontext() as f:
            if master:
                f.write(_safetensors_header(tensors, dtype))
            for _ in tensors:
                full = next(full_params)[1]
                if master:
                    f.write(full.to(dtype).contiguous().view(torch.uint8).cpu().numpy())  # its raw bytes
    if master:
        if len(files) > 1:
            weight_map = {name: file_name for file_name, tensors in zip(names, files) for name, _ in tensors}
            total = sum(shape.numel() * dtype.itemsize for tensors in files for _, shape in tensors)
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
        config = copy.deepcopy(model.config)
        config.dtype = dtype  # vLLM and from_pretrained(dtype="auto") load it as written
        config.save_pretrained(tmp)
        for file_name, text in (extra_files or {}).items():
            with open(os.path.join(tmp, file_name), "w") as f:
                f.write(text)
        for file_name in TOKENIZER_FILES if copy_from else ():
            if os.path.isfile(os.path.join(copy_from, file_name)):
                shutil.copy(os.path.join(copy_from, file_name), tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    dist.barrier()
