"""DAPO's sampling side (Yu et al., 2025, "DAPO: an open-source LLM reinforcement learning system
at scale"): dynamic sampling (sec. 3.2) and overlong shaping (sec. 3.4). With clip_ratio_high
(clip-higher) and loss_agg_mode=token-mean, both of the core, they make DAPO's recipe
(configs/smollm2_dapo_cpu.toml; docs/losses.md).

Where the core calls it: rollout.rollouts, once the step's first round of prompts is drawn
(`shape`): more rounds while too few groups vary, then the step's batch, then the shaping. It
acts on the samples alone: a penalty goes into a sample's rule_reward (what it is trained on),
never into its task_score (what the metrics and the filter read), and a masked response gets a
loss_mask of 0s. The trainer reads those two keys of every sample whatever made them. A replay
trains on the dumped samples as they were kept and shaped.
Peers: none.
"""
import dataclasses

import torch

import rollout
from config import ConfigError


@dataclasses.dataclass
class Options:
    """This file's options, a part of config.Config: config.py runs this class and `check` alone,
    from this file's text, before torch loads (README, "Extensions")."""

    # ---- DAPO (dapo.py; Yu et al., 2025): with clip_ratio_high and token-mean, its recipe ----
    # dynamic sampling: a prompt group whose samples all got the same task score (the rule's,
    # before any shaping) has zero advantage: it is dropped, and more prompts are drawn, a round
    # of prompts_per_step at a time, until the step holds prompts_per_step groups. Made for grpo
    # and rloo: under gae the critic still gives such a group per-token advantages, and a
    # teacher's term still trains on it, so dropping it discards a signal there (allowed)
    dynamic_sampling: bool = False
    # rounds of a step at most (needs dynamic_sampling); after the last, the newest dropped groups
    # fill the batch (under grpo/rloo only their overlong penalties, if any, reach the surrogate;
    # dynamic_kept_fraction shows how many)
    dynamic_max_rounds: int = 4
    # overlong shaping: a response whose model tokens L pass max_new_tokens - this buffer gets
    # -overlong_penalty * (L - (max_new_tokens - buffer)) / buffer added to its reward, down to
    # -overlong_penalty (0 = off)
    overlong_buffer: int = 0
    # the overlong penalty's largest size (DAPO: 1; needs overlong_buffer > 0)
    overlong_penalty: float = 1.0
    # a response cut off by its token budget (ended "length") leaves the loss: its mask is 0
    overlong_mask: bool = False


def check(cfg):
    """This file's refusals, one line each (config.validate runs it, before torch loads: it may
    use ConfigError, os and json alone)."""
    if cfg.dynamic_max_rounds < 1:
        raise ConfigError(f"dynamic_max_rounds={cfg.dynamic_max_rounds} must be > 0")
    if cfg.dynamic_sampling and cfg.samples_per_prompt < 2:
        raise ConfigError("dynamic_sampling drops prompt groups whose samples all scored "
                                 "the same: a group of samples_per_prompt=1 always does; use "
                                 "samples_per_prompt >= 2")
    if cfg.overlong_buffer > cfg.max_new_tokens:
        raise ConfigError(f"overlong_buffer={cfg.overlong_buffer} is longer than "
                                 f"max_new_tokens={cfg.max_new_tokens}: use a buffer inside the "
                                 f"budget")


def idle(cfg):
    """This file's options that do nothing in this run, as (key, why): config.notes names those
    the user gave."""
    if cfg.replay_rollouts:  # the dumped samples train as they were dumped
        for key in ("dynamic_sampling", "dynamic_max_rounds", "overlong_buffer",
                    "overlong_penalty"):
            yield key, "does nothing with replay_rollouts (the dump's samples train as they are)"
    if not cfg.dynamic_sampling:
        yield "dynamic_max_rounds", "does nothing without dynamic_sampling"
    if not cfg.overlong_buffer:
        yield "overlong_penalty", "does nothing with overlong_buffer=0"


def shape(engine, task, cfg, step, start, every, generated):
    """Collective (every rank). The step's samples from its first round (`every`, {global index:
    sample}, of which this rank's engine generated `generated`): with dynamic_sampling, more
    rounds and the groups kept (dynamic_rounds), then overlong shaping. Returns (samples, prompts
    drawn, the rollout's metrics: rollout_samples, and dynamic sampling's)."""
    drawn, found = cfg.prompts_per_step, dict(rollout_samples=generated)
    if cfg.dynamic_sampling:
        every, drawn, found = dynamic_rounds(engine, task, cfg, step, start, every, generated)
    if cfg.overlong_buffer or cfg.overlong_mask:
        overlong_shaping(every.values(), cfg)
    return every, drawn, found


# Dynamic sampling (verl's filter_groups, OpenRLHF's --dynamic_filtering): a prompt group whose
# samples all scored the same has zero advantage under GRPO or RLOO and trains nothing, so more
# rounds of prompts are drawn until the step holds prompts_per_step groups that vary. It reads the
# task's own score (task_score, the rule's), never a shaped reward (an overlong penalty would make
# a group of equal answers look varied; NeMo-RL #2431) nor a reward model's (which varies in
# every group: it would keep them all). Every rank holds every sample (rollouts' all-gather), so
# every rank keeps the same groups.

def dynamic_rounds(engine, task, cfg, step, start, every, generated):
    """Collective (every rank). After the first round (`every`, the core's), more rounds of
    prompts_per_step prompts (rollout.draw_round) until the samples hold prompts_per_step groups
    that vary, or dynamic_max_rounds were drawn; then the step's batch (keep_groups). Returns
    (samples, prompts drawn, metrics: rollout_samples, dynamic_rounds and keep_groups')."""
    rounds = 1
    while rounds < cfg.dynamic_max_rounds and len(varied_groups(every, cfg)) < cfg.prompts_per_step:
        drawn, n = rollout.draw_round(engine, task, cfg, step, start, rounds * cfg.prompts_per_step)
        every = {**every, **drawn}
        generated += n
        rounds += 1
    every, metrics = keep_groups(every, cfg)
    return every, rounds * cfg.prompts_per_step, dict(metrics, rollout_samples=generated,
                                                      dynamic_rounds=rounds)


def varied_groups(every, cfg) -> list:
    """The prompt positions (index // samples_per_prompt) among `every` whose group's task scores
    are not all equal, in the order drawn."""
    K = cfg.samples_per_prompt
    scores = {}
    for j in sorted(every):
        scores.setdefault(j // K, set()).add(every[j]["task_score"])
    return [g for g, seen in scores.items() if len(seen) > 1]


def keep_groups(every, cfg):
    """The step's batch from its rounds: the first prompts_per_step varied groups, in the order
    drawn, re-indexed 0.. so that group g holds indices g*K .. g*K + K - 1, as the group
    estimators read them (a sample keeps its drawn index as `drawn`). After the last round with
    too few, the newest groups that did not vary fill the batch: a full batch keeps every size
    the config divided (dp, minibatches) and a run goes on, where verl raises; under GRPO or RLOO
    their task scores give them no advantage (only unequal overlong penalties would). Returns
    (samples, metrics): dynamic_kept_fraction, the varied groups over the groups drawn, and
    dynamic_filled_groups."""
    K, P = cfg.samples_per_prompt, cfg.prompts_per_step
    drawn = sorted({j // K for j in every})
    varied = varied_groups(every, cfg)
    kept = varied[:P]
    filled = [g for g in drawn if g not in varied][::-1][:P - len(kept)]  # the newest first
    samples = {}
    for i, g in enumerate(sorted(kept + filled)):
        for k in range(K):
            samples[i * K + k] = dict(every[g * K + k], index=i * K + k, drawn=g * K + k)
    metrics = dict(dynamic_kept_fraction=len(varied) / len(drawn),
                   dynamic_filled_groups=len(filled))
    return samples, metrics


def overlong_shaping(samples, cfg) -> None:
    """DAPO's length shaping (sec. 3.4), in place on each sample. Overlong penalty, with
    overlong_buffer B > 0: a response of L model tokens (an episode's observations are not
    counted) past max_new_tokens - B gets
        length_penalty = -overlong_penalty * min((L - (max_new_tokens - B)) / B, 1),
    added to its rule_reward (what it is trained on, with a reward model's score too:
    train_ppo.ppo_step), never to task_score (what the metrics and dynamic sampling read); the
    sample keeps it as length_penalty for the dump. As in DAPO's eq. 13 and verl, the penalty
    depends on the length alone: a response that stops inside the buffer pays its share too, one
    cut off at max_new_tokens pays it all (so does an episode of turns longer than one turn's
    budget). Overlong mask (DAPO's overlong filtering), with overlong_mask: a response cut off by
    its token budget (ended "length") gets a loss_mask of 0s: its tokens leave the loss and
    token-mean's count, while the seq-mean modes still count it among the minibatch's sequences
    (as verl's global batch size does); its reward still counts in its group's baseline."""
    for s in samples:
        if cfg.overlong_buffer:
            past = sum(s["action_mask"]) - (cfg.max_new_tokens - cfg.overlong_buffer)
            s["length_penalty"] = -cfg.overlong_penalty * min(max(past, 0) / cfg.overlong_buffer, 1)
            # summed in float32, the trainer's reward dtype (as a tensor sum of the two would be)
            s["rule_reward"] = (torch.tensor(s["task_score"]) + s["length_penalty"]).item()
        if cfg.overlong_mask and s["ended"] == "length":
            s["loss_mask"] = [0] * len(s["action_mask"])
