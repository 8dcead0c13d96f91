"""Held-out evaluation during a run: greedy accuracy on the task's held-out prompts (task.val,
e.g. gsm8k's val_prompts) every eval_every steps and after the last update, and pass@k.

Where the core calls it: train_ppo.main, around each step (before_step: the policy before the
step's update; after_step: after the last update, the exported policy's, as final_*), and
train_ppo.start_run (task_notes: a task without held-out prompts leaves the options idle). It
samples with the run's engine and the core's episode_runner (one turn, or episodes of turns), so a
tool task is evaluated as it is trained. Metrics: val_accuracy, val_pass@k (docs/metrics.md).
Peers: none.
"""
import dataclasses
import math

import torch.distributed as dist

import config
import rollout
from config import ConfigError


@dataclasses.dataclass
class Options:
    """This file's options, a part of config.Config: config.py runs this class and `check` alone,
    from this file's text, before torch loads (README, "Extensions")."""

    # ---- evaluation (evaluation.py) ----
    # greedy accuracy on the task's held-out prompts every N steps and after the last (0 =
    # never). Needs held-out prompts (gsm8k's val_prompts=FILE; the toy tasks have none) and an
    # engine (not under replay_rollouts)
    eval_every: int = 0
    # also pass@k for this k (0 = greedy only; needs eval_every): val_samples samples a prompt at
    # the training temperature, and the unbiased estimator of Chen et al. (2021)
    val_pass_k: int = 0
    val_samples: int = 8  # samples a prompt for pass@k (>= val_pass_k; needs val_pass_k > 0)


def check(cfg):
    """This file's refusals, one line each (config.validate runs it, before torch loads: it may
    use ConfigError, os and json alone)."""
    if cfg.val_samples < 1:
        raise ConfigError(f"val_samples={cfg.val_samples} must be > 0")
    if cfg.val_pass_k > cfg.val_samples:
        raise ConfigError(f"val_pass_k={cfg.val_pass_k} needs at least as many "
                                 f"val_samples (got {cfg.val_samples}): pass@k draws k of n "
                                 f"samples")
    if cfg.val_pass_k and not cfg.eval_every:
        raise ConfigError(f"val_pass_k={cfg.val_pass_k} is measured at each evaluation, "
                                 f"and eval_every=0 makes none: set eval_every=N (steps between "
                                 f"them)")


def idle(cfg):
    """This file's options that do nothing in this run, as (key, why): config.notes names those
    the user gave. A task without held-out prompts is known only once it is built: task_notes."""
    if cfg.replay_rollouts:
        for key in ("eval_every", "val_pass_k", "val_samples"):
            yield key, "does nothing with replay_rollouts (no engine to sample with)"
    if not cfg.val_pass_k:
        yield "val_samples", "does nothing with val_pass_k=0"


def task_notes(task, cfg):
    """Rank 0 prints a note for each evaluation setting the user gave that this task leaves idle:
    it has no held-out prompts (the toy tasks; gsm8k without val_prompts)."""
    for key in ("eval_every", "val_pass_k", "val_samples"):
        if key in cfg.given and not task.val and dist.get_rank() == 0:
            print(config.note_line(cfg, key, "does nothing: the task has no held-out prompts "
                                             "(gsm8k takes val_prompts=FILE)"), flush=True)


def before_step(engine, task, cfg, step):
    """Collective (every rank). validation's metrics before step `step`'s update, every
    eval_every steps; {} otherwise, or without an engine (a replay) or held-out prompts."""
    if engine is None or not task.val or step % cfg.eval_every:
        return {}
    return validation(engine, task, cfg)


def after_step(engine, task, cfg, step):
    """Collective (every rank). After the last step's update (the policy that is exported),
    validation's metrics named final_*; {} after any other step."""
    if engine is None or not task.val or step + 1 != cfg.steps:
        return {}
    return {f"final_{name}": value for name, value in validation(engine, task, cfg).items()}


def validation(engine, task, cfg) -> dict:
    """Collective (every rank): greedy accuracy on the held-out prompts (val_accuracy), and with
    val_pass_k = k pass@k (val_pass@k) from val_samples = n samples a prompt at the training
    temperature: per prompt with c of its n correct, the unbiased estimator of Chen et al.
    (2021, "Evaluating large language models trained on code"), 1 - C(n - c, k) / C(n, k), the
    chance that k samples drawn from the n without replacement hold a correct one.

    The prompts are split over the vLLM groups (rollout_tp_size consecutive ranks pass identical
    requests), the sums added. The samples' seeds are keyed (-1, the prompt, the sample): the same
    at every evaluation, and never a training step's. A bad observation stops every rank with one
    line (rollout.gather_or_stop)."""
    groups = dist.get_world_size() // cfg.rollout_tp_size
    first = dist.get_rank() // cfg.rollout_tp_size  # this group's prompts: first, first + groups..
    mine = task.val[first::groups]
    n = cfg.val_samples if cfg.val_pass_k else 0
    run = rollout.episode_runner(task, cfg)
    try:
        # greedy (no seeds), then n samples a prompt
        greedy = solved(task, run(engine, task, cfg, [task.encode(q) for q, _ in mine],
                                  [(0, 0, 0)] * len(mine), 0.0), mine)
        keys = [(-1, first + groups * i, k) for i in range(len(mine)) for k in range(n)]
        outs = run(engine, task, cfg, [task.encode(q) for q, _ in mine for _ in range(n)], keys,
                   cfg.temperature)
        correct = solved(task, outs, [item for item in mine for _ in range(n)])
        passed = sum(pass_at_k(n, sum(correct[i * n:(i + 1) * n]), cfg.val_pass_k)
                     for i in range(len(mine))) if n else 0.0
        sums = (sum(greedy), passed)
    except rollout.TaskError as e:
        sums = str(e)
    # every member of a vLLM group counted the same prompts: divide by the group size
    totals = [sum(column) / cfg.rollout_tp_size / len(task.val)
              for column in zip(*rollout.gather_or_stop(sums, "task error"))]
    out = {"val_accuracy": totals[0]}
    if n:
        out[f"val_pass@{cfg.val_pass_k}"] = totals[1]
    return out


def solved(task, outs, items) -> list:
    """Whether each episode of an episode runner solved its (prompt, answer) item: its reward
    reaches the task's solved_at (default 1.0). The reward reads the model's last turn, as in
    training (rollout.generate_share)."""
    at = getattr(task, "solved_at", 1.0)
    return [task.reward(task.decode(rollout.last_turn(ids, mask)), answer, ended) >= at
            for (ids, _, mask, _, ended), (_, answer) in zip(outs, items)]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with c of its n samples correct (Chen et al., 2021)."""
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)
