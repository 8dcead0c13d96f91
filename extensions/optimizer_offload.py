"""Optimizer offload (GPU memory): AdamW's two moments, 8 bytes a parameter (twice the fp32
weights), wait in pinned host memory while the engine generates and come back to the trainer's
device for the update, as NeMo-RL's offload_before_refit / offload_after_refit.

Where the core calls it: train_ppo.update (state_on_device, around the update's epochs) and
train_ppo.main (to_host, after a checkpoint's load).
Peers: none. FSDP2's cpu_offload (a core option) keeps the state in host memory already.
"""
import contextlib
import dataclasses

from torch.distributed.tensor import DTensor

import model_parallel
from config import ConfigError


@dataclasses.dataclass
class Options:
    """This file's options, a part of config.Config: config.py runs this class and `check` alone,
    from this file's text, before torch loads (README, "Extensions")."""

    # ---- optimizer offload (optimizer_offload.py) ----
    # AdamW's state goes to pinned host memory while the engine generates, and back for the update
    # (saves GPU memory)
    offload_optimizer: bool = False


def check(cfg):
    """This file's refusals, one line each (config.validate runs it, before torch loads)."""
    # FSDP2's CPU offload keeps parameters, gradients and hence AdamW's moments on the host
    # already; moving the moments to the GPU for the update would meet CPU gradients there
    if cfg.offload_optimizer and cfg.cpu_offload:
        raise ConfigError("offload_optimizer=true with cpu_offload=true: cpu_offload already keeps "
                          "AdamW's state in host memory; set offload_optimizer=false")


@contextlib.contextmanager
def state_on_device(parts, device):
    """Within the block (train_ppo.update) AdamW's state of each part is on `device`; before and
    after, in host memory, where the engine generates meanwhile."""
    for part in parts.values():
        move_optimizer_state(part.optimizer, device)
    try:
        yield
    finally:
        to_host(parts)


def to_host(parts):
    """AdamW's state of each part to host memory: after the update, and after a checkpoint's load
    (train_ppo.main), which creates the moments on the trainer's device: else they would sit on
    the GPU through vLLM's start and the first generation, whose room offloading made."""
    for part in parts.values():
        move_optimizer_state(part.optimizer, "host")


def move_optimizer_state(optimizer, device):
    """AdamW's two moments (8 bytes a parameter: twice the fp32 weights) to `device`: "host" (pinned
    host memory) while vLLM generates, the trainer's device again before the update, as NeMo-RL's
    offload_before_refit / offload_after_refit. Sharded (DTensor) states stay DTensors of their
    mesh, with their local shard where it now lives, as FSDP2's CPU offload keeps its parameters:
    a checkpoint saved meanwhile is the same checkpoint. In host memory each moment is one flat
    buffer (model_parallel._host_copies)."""
    local = model_parallel._local  # a DTensor's shard on this rank (a plain tensor: itself)
    states = [state for state in optimizer.state.values() if "exp_avg" in state]
    for key in ("exp_avg", "exp_avg_sq"):
        olds = [state[key] for state in states]
        if not olds:
            continue
        if device == "host":
            news = model_parallel._host_copies([local(old) for old in olds])
        else:
            # copy: a tensor of its own also where the trainer's device is the CPU
            news = [local(old).to(device, non_blocking=True, copy=True) for old in olds]
        for state, old, new in zip(states, olds, news):
            if isinstance(old, DTensor):
                # the moved shard, wrapped as the old one was. Not DTensor.from_local: on a CUDA
                # mesh it moves a host tensor back to the GPU (that made offloading free nothing).
                # The constructor (private in torch 2.13) wraps it where it is, as FSDP2 wraps its
                # CPU-offloaded shards (fsdp/_fully_shard/_fsdp_common._from_local_no_grad)
                new = DTensor(new, old._spec, requires_grad=False)
            state[key] = new
