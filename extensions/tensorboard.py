"""TensorBoard (an optional package): every metric of metrics.jsonl also as a TensorBoard scalar,
in out_dir/tensorboard, at its step. metrics.jsonl stays the record.

Where the core calls it: train_ppo.main (writer: rank 0 opens it at the start) and
train_ppo.log_step (write: each step's row).
Peers: none.
"""
import dataclasses
import os

from config import ConfigError


@dataclasses.dataclass
class Options:
    """This file's options, a part of config.Config: config.py runs this class and `check` alone,
    from this file's text, before torch loads (README, "Extensions")."""

    # ---- TensorBoard (tensorboard.py) ----
    # also write every metric to out_dir/tensorboard (needs the tensorboard package)
    tensorboard: bool = False


def check(cfg):
    """This file's refusals, one line each (config.validate runs it, before torch loads)."""
    import importlib.util
    if cfg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("tensorboard=true needs the tensorboard package: pip install tensorboard")


def writer(cfg):
    """Rank 0: TensorBoard's writer into out_dir/tensorboard (the package is optional: imported
    here, where a run that asked for it is known to have it)."""
    from torch.utils.tensorboard import SummaryWriter
    return SummaryWriter(os.path.join(cfg.out_dir, "tensorboard"))


def write(board, metrics, step):
    """Rank 0: one step's row of metrics.jsonl as scalars at `step`."""
    for name, value in metrics.items():
        board.add_scalar(name, value, step)
    board.flush()
