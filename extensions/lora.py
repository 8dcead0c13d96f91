"""LoRA (Hu et al., 2021; docs/lora.md): the policy trains a low-rank adapter beside each target
projection, its base frozen in the compute dtype; the reference policy is the same module with its
adapters off; an engine that serves adapters (vLLM) is refit with them alone, a PEFT dir.

Where the core calls it: train_ppo.build_models (add_adapters, given to
model_parallel.load_policy, which calls it on the meta device after the TP plan and before
sharding; adapters_off, the reference), model_parallel.iter_full_params (merged weights for the HF
engine and the export) and _hf_params (no adapter in an HF checkpoint), rollout.VLLMEngine
(vllm_options), train_ppo.refit (the adapters alone: refit), train_ppo.export (save_adapter:
out_dir/adapter for peft), train_ppo.start_run (check_resume, check_device).
Peers: none. The SFT warm-up trains every weight (it stands in for pretraining); the critic is
trained in full.
"""
import contextlib
import dataclasses
import json
import math
import os
import shutil
import typing

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import model_parallel
import rollout
from config import ConfigError


@dataclasses.dataclass
class Options:
    """This file's options, a part of config.Config: config.py runs this class and `check` alone,
    from this file's text, before torch loads (README, "Extensions")."""

    # ---- LoRA (lora.py; docs/lora.md) ----
    # LoRA (Hu et al., 2021): train a low-rank adapter beside each target projection, W x +
    # (lora_alpha / lora_rank) B(A x), the policy's other weights frozen in the compute dtype (no
    # fp32 master copy, no AdamW moments). 0 = off: every weight is trained. The critic is trained
    # in full either way (lora.py)
    lora_rank: int = 0
    # the adapters' scale is lora_alpha / lora_rank: keep it a power of two (16 / 8 = 2), and the
    # engine's bf16 copy of B, which vLLM scales at load, rounds as the trainer's does
    lora_alpha: float = 16.0
    # the projections that get adapters, by module name (default: every attention and MLP one)
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"

    # (not options: no type) the projections LoRA may adapt: every Linear of a decoder layer in
    # the supported families; the largest adapter rank vLLM serves (vllm/config/lora.py,
    # MaxLoRARanks; tests/test_lora.py reads it there, so an upgrade that moves it fails a test)
    TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    VLLM_MAX_RANK = 512


def check(cfg):
    """This file's refusals, one line each (config.validate runs it, before torch loads: it may
    use ConfigError, os and json alone)."""
    # the adapters' scale is lora_alpha / lora_rank: at 0 they would add nothing and learn nothing
    if cfg.lora_rank and not cfg.lora_alpha > 0:
        raise ConfigError(f"lora_alpha={cfg.lora_alpha:g} scales the adapters by "
                                 f"lora_alpha / lora_rank = 0: they would train nothing; use "
                                 f"lora_alpha > 0 (often 2 * lora_rank = {2 * cfg.lora_rank})")
    if cfg.lora_rank and not set(cfg.lora_targets.split(",")) <= set(Options.TARGETS):
        raise ConfigError(f"lora_targets={cfg.lora_targets!r} names a module with no "
                                 f"adapter here: a comma-separated subset of "
                                 f"{','.join(Options.TARGETS)}")
    if cfg.rollout_engine == "vllm" and cfg.lora_rank > Options.VLLM_MAX_RANK:
        raise ConfigError(f"lora_rank={cfg.lora_rank} is above the largest rank vLLM "
                                 f"serves ({Options.VLLM_MAX_RANK}): use a smaller lora_rank, or "
                                 f"rollout_engine=hf")


def idle(cfg):
    """This file's options that do nothing in this run, as (key, why): config.notes names those
    the user gave."""
    if not cfg.lora_rank:
        for key in ("lora_alpha", "lora_targets"):
            yield key, "does nothing with lora_rank=0 (no adapters)"


def check_device(cfg, device_type):
    """Once the device is known (the dtype resolved): vLLM keeps adapters in the model's dtype,
    and its GPU LoRA kernels take fp16 or bf16 only (vllm/lora/ops/triton_ops/lora_shrink_op.py
    asserts both; its CPU kernels take fp32). ConfigError, one line."""
    gpu_vllm = cfg.rollout_engine == "vllm" and device_type == "cuda"
    if gpu_vllm and rollout.engine_dtype(cfg) == torch.float32:
        raise ConfigError(f"lora_rank={cfg.lora_rank} with rollout_engine=vllm on CUDA "
                                 f"needs dtype=bf16 (vLLM's GPU LoRA kernels take no fp32; "
                                 f"data_parallel=ddp is fp32): use data_parallel=fsdp and "
                                 f"dtype=bf16 (or engine_dtype=bf16), or rollout_engine=hf")


def check_resume(path, cfg):
    """A checkpoint (save_checkpoint's dir at `path`) resumes as it was saved: under LoRA it holds
    the adapters alone, without LoRA every weight. CheckpointError naming both settings."""
    saved = saved_rank(path)
    if saved != cfg.lora_rank:
        raise model_parallel.CheckpointError(
            f"{path} was saved with lora_rank={saved}, this run has lora_rank={cfg.lora_rank}: "
            f"resume it with --lora_rank={saved}, or give a fresh out_dir")


def saved_rank(path):
    """The policy's LoRA rank in a save_checkpoint dir (0: every weight was saved), read from DCP's
    metadata, before any model is loaded: lora_A is (rank, in_features)."""
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    ranks = [meta.size[0] for key, meta in saved.items()
             if key.startswith("policy.") and key.endswith(".lora_A")]
    return ranks[0] if ranks else 0


# LoRA (Hu et al., 2021): each target projection keeps its weight W frozen and gains a trained
# low-rank path, y = W x + s B(A x), A (r, in) and B (out, r) in fp32, s = lora_alpha / lora_rank.
# B starts at zero, so training starts from the base exactly; A from PEFT's default init (kaiming
# uniform with a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))), drawn whole from the seed, so that every
# mesh starts from the same adapters. The base is stored in the compute dtype: no fp32 master, no
# AdamW moments, no gradient (train_ppo.py's optimizer gets the adapters alone). The reference
# policy is this module with its adapters switched off (adapters_off): no copy of any weight.
# The critic is trained in full: its value head starts from nothing (or from a reward model's
# score head) and must move the features under it, and with LoRA memory matters GRPO or RLOO need
# no critic at all. A fork that wants DoRA adds a magnitude vector here and in the merge below;
# another rank per module is a per-name lookup in add_adapters.
#
# Under TP, A and B are split to agree with their base's plan, so that the adapter adds no
# collective of its own: a colwise base (W split on its outputs, dim 0) gets a whole A and B
# split on its outputs too, so B(A x) comes out split as W x does; a rowwise base (W split on its
# inputs, dim 1) gets A split on its inputs, so A x is a partial sum like W x, and a whole B: the
# two partial sums are added, then summed over tp by the base's one all-reduce.

class LoRALinear(torch.nn.Linear):
    """A Linear with a low-rank adapter beside its frozen weight (the section's comment). The
    adapters compute in the base's dtype (FSDP2 casts them to bf16 under the bf16 recipe).
    adapters_on=False: the base alone, the reference policy (adapters_off sets it on one
    model's modules for a block)."""
    adapters_on = True

    def forward(self, x):
        out = F.linear(x, self.weight, self.bias)
        if not self.adapters_on:
            return out
        return out + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.lora_scale

    def merged_weight(self, weight, dtype=None):
        """Collective over the module's mesh: the full W + s B A (`weight`: this module's W), in
        `dtype` (None: W's), summed in fp32 from the gathered base and adapters, then cast: a new
        tensor, the base itself is never written (a merge and unmerge in place, in bf16, would
        round the frozen weights: ms-swift #10154). model_parallel.iter_full_params calls it for
        the HF engine's refit and the export."""
        gathered = model_parallel._gathered
        delta = gathered(self.lora_B) @ gathered(self.lora_A) * self.lora_scale  # fp32
        return (gathered(weight).float() + delta).to(dtype or weight.dtype)


ADAPTERS = (".lora_A", ".lora_B")  # the adapters' parameter names end so (not in an HF checkpoint)


def add_adapters(model, cfg):
    """Turn each Linear named in cfg.lora_targets into a LoRALinear with adapters on the meta device
    (model_parallel._build calls it after the TP plan: their splits follow their base's, the
    section's comment), and freeze every other parameter. Returns {name: full tensor} of the
    initial adapters, which _load_weights puts in their place."""
    model.requires_grad_(False)
    rank, targets = cfg.lora_rank, cfg.lora_targets.split(",")
    for name, module in model.named_modules():
        if type(module) is not torch.nn.Linear or name.rsplit(".", 1)[-1] not in targets:
            continue
        module.__class__ = LoRALinear
        module.lora_scale = cfg.lora_alpha / rank
        out_features, in_features = module.weight.shape  # the full shape, also of a DTensor
        # A keeps the base's split of the inputs (rowwise), B the split of the outputs (colwise)
        for leaf, shape, dim in (("lora_A", (rank, in_features), 1),
                                 ("lora_B", (out_features, rank), 0)):
            tensor = torch.empty(shape, device="meta")  # fp32, whatever the base's dtype
            if isinstance(module.weight, DTensor):
                split = [Shard(dim) if p == Shard(dim) else Replicate()
                         for p in module.weight.placements]
                tensor = distribute_tensor(tensor, module.weight.device_mesh, split)
            module.register_parameter(leaf, torch.nn.Parameter(tensor))
    return _adapter_init(model, cfg.seed)


def _adapter_init(model, seed):
    """{name: full tensor} of the initial adapters, the same on every rank and mesh (the section's
    comment): A ~ U(-1/sqrt(in), 1/sqrt(in)), B = 0."""
    generator = torch.Generator().manual_seed(seed)
    init = {}
    for name, param in model.named_parameters():
        if name.endswith(".lora_A"):
            init[name] = ((torch.rand(param.shape, generator=generator) * 2 - 1)
                          / math.sqrt(param.shape[1]))
        elif name.endswith(".lora_B"):
            init[name] = torch.zeros(param.shape)
    return init


@contextlib.contextmanager
def adapters_off(model):
    """Within the block `model` computes as its frozen base: the reference policy under LoRA
    (train_ppo.build_models). Its own adapters alone are switched off, no other model's."""
    adapted = [module for module in model.modules() if isinstance(module, LoRALinear)]
    for module in adapted:
        module.adapters_on = False
    try:
        yield model
    finally:
        for module in adapted:
            module.adapters_on = True


@torch.no_grad()  # (around each step of the generator)
def iter_adapters(model, dtype=torch.float32):
    """Collective (every rank, to the end): yield (name, full tensor) per LoRA adapter (lora_A,
    lora_B of each target), in `dtype`, cast before the all-gather."""
    model_parallel.reshard(model)
    for name, param in model.named_parameters():
        if name.endswith(ADAPTERS):
            yield name, model_parallel._gathered(param, dtype)


def save_adapter(model, path, cfg, base_dir, dtype=torch.float32):
    """Collective (every rank): the LoRA adapters as a PEFT adapter dir, which
    peft.PeftModel.from_pretrained loads over the base at base_dir and vLLM serves (a LoRARequest):
    adapter_config.json and adapter_model.safetensors, tensors named as PEFT names them
    (base_model.model.<module>.lora_A.weight), in `dtype`. Written to a temp dir and renamed.
    Returns the tensors' bytes."""
    tensors = {f"base_model.model.{name}.weight": full.cpu().contiguous()
               for name, full in iter_adapters(model, dtype)}
    if dist.get_rank() == 0:
        tmp = path.rstrip("/") + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"))
        # (vLLM reads r, lora_alpha and target_modules; scale = lora_alpha / r, as here)
        peft_config = dict(peft_type="LORA", task_type="CAUSAL_LM", r=cfg.lora_rank,
                           lora_alpha=cfg.lora_alpha, target_modules=cfg.lora_targets.split(","),
                           lora_dropout=0.0, bias="none", fan_in_fan_out=False,
                           base_model_name_or_path=os.path.abspath(base_dir))
        with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
            json.dump(peft_config, f, indent=1)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    dist.barrier()
    return sum(t.numel() * t.element_size() for t in tensors.values())


# Refit under LoRA, with an engine that serves adapters (vLLM; the HF engine gets merged weights
# from the core's refit): the adapters alone, a PEFT dir in out_dir that the engine reloads in
# place, 1-5% of the bytes, and no bf16 rounding of W + s B A (a merged bf16 refit drifted,
# NeMo-RL #3696).

def refit(engine, policy, cfg):
    """Collective (every rank). The policy's adapters into the engine (train_ppo.refit's, for an
    engine that serves adapters), as a PEFT dir out_dir/refit_adapter in the engine's dtype;
    returns the refit's metrics."""
    path = os.path.join(cfg.out_dir, "refit_adapter")
    nbytes = save_adapter(policy, path, cfg, cfg.model, engine.dtype)
    engine.load_adapter(path)
    return {"refit_bytes": nbytes}


def vllm_options(cfg, on_gpu):
    """vLLM's LLM(...) arguments for serving adapters beside the base (its punica kernels; on CPU
    punica_cpu.py). vLLM takes ranks from a fixed set: the smallest that holds ours."""
    from vllm.config.lora import MaxLoRARanks  # a Literal of the ranks vLLM accepts
    ranks = typing.get_args(MaxLoRARanks)
    options = dict(enable_lora=True, max_loras=1,
                   max_lora_rank=min(r for r in ranks if r >= cfg.lora_rank))
    # GPU only: every request carries the adapter, so one set of CUDA graphs, with LoRA (vLLM's
    # default captures a second set without it: twice the start-up)
    if on_gpu:
        options.update(compilation_config=dict(cudagraph_specialize_lora=False))
    return options


def load_adapter(engine, path):
    """LoRA's refit of a VLLMEngine, its method load_adapter(path) (rollout.VLLMEngine binds it when
    it serves adapters): serve the PEFT adapter dir at `path` (save_adapter) from the next generate
    on. vLLM caches an adapter by its id: a request of a known id is served from
    the cache, the dir unread, and would sample the old policy (a stale refit). add_lora with
    load_inplace=True reads the dir into that slot now, once; each generate then passes the
    plain request (load_inplace on every request would read the dir at every decode step).
    Every request carries it: vLLM 0.32 serves a request without one, batched with adapted
    ones, with the adapter of the last slot."""
    from vllm.lora.request import LoRARequest
    engine.wake_up(["weights", "kv_cache"])  # GPU only: the base, kept in host memory by sleep()
    with rollout._trainer_state_kept():
        engine.llm.llm_engine.add_lora(LoRARequest("policy", 1, path, load_inplace=True))
    engine.lora_request = LoRARequest("policy", 1, path)
    # cached KV blocks were computed by the old adapters (the cache keys on the name and path)
    rollout.reset_prefix_cache(engine.llm)
