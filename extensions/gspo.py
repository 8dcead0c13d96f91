"""GSPO (Zheng et al., 2025, "Group Sequence Policy Optimization"): the policy's ratio is the
sequence's, not the token's, clipped in a range of its own (docs/losses.md).

Where the core calls it: train_ppo.policy_loss_terms, with policy_loss_mode=gspo: the log ratio
that train_ppo.policy_loss clips becomes each token's sequence ratio (sequence_log_ratio), in
[1 - gspo_clip_ratio, 1 + gspo_clip_ratio_high]. GSPO averages over sequences: pair it with
loss_agg_mode=seq-mean-token-mean.
Peers: none.
"""
import dataclasses
from typing import Literal

import train_ppo


@dataclasses.dataclass
class Options:
    """This file's options, a part of config.Config: config.py runs this class and `check` alone,
    from this file's text, before torch loads (README, "Extensions")."""

    # ---- GSPO (gspo.py) ----
    # the policy's objective (docs/losses.md): ppo clips each token's ratio pi/pi_old; gspo clips
    # each sequence's (Zheng et al., 2025: the geometric mean of its tokens' ratios), in a range of
    # its own, as narrow as the paper's: a sequence's ratio stays much nearer 1 than a token's.
    # GSPO averages over sequences: pair it with loss_agg_mode=seq-mean-token-mean.
    policy_loss_mode: Literal["ppo", "gspo"] = "ppo"
    # gspo only: the sequence ratio is kept in [1 - gspo_clip_ratio, 1 + gspo_clip_ratio_high]
    # (the paper's 3e-4 below and 4e-4 above); clip_ratio and clip_ratio_high, the token's range,
    # then clip no task term
    gspo_clip_ratio: float = 3e-4
    # gspo only: the upper side of that range alone (1 + this), as clip_ratio_high is the token's
    gspo_clip_ratio_high: float = 4e-4


def check(cfg):
    """This file's refusals: none (config.validate runs it, as every extension's)."""


def idle(cfg):
    """This file's options, and the core's they replace, that do nothing in this run, as (key,
    why): config.notes names those the user gave."""
    if cfg.policy_loss_mode == "ppo":
        for key in ("gspo_clip_ratio", "gspo_clip_ratio_high"):
            yield key, "does nothing with policy_loss_mode=ppo"
    else:  # the token clip range is left to distillation's reward form (distill.py), if any
        for key in ("clip_ratio", "clip_ratio_high"):
            yield key, ("clips no task term with policy_loss_mode=gspo (gspo_clip_ratio and "
                        "gspo_clip_ratio_high do), only a teacher's reward-form term")


def sequence_log_ratio(logprobs, old_logprobs, mask):
    """GSPO's log ratio on each token (B, S), for train_ppo.policy_loss to clip: every token of a
    sequence gets the sequence's ratio, clipped as one,
        s_b = exp((1/L_b) sum_t m log(pi/pi_old)),
    written as the paper's GSPO-token (eq. 13): on token t, the value log s_b, with the gradient
    of log pi_t alone (log s_b - log pi_t detached + log pi_t). With seq-mean-token-mean the
    gradient is GSPO's: A_b s_b (1/L_b) sum_t grad log pi_t per unclipped sequence. A row is one
    whole sequence wherever this runs (cp gathers rows; packed rows are unpacked before any loss),
    so the mean holds under every mesh. `mask`: (B, S), the response mask."""
    log_ratio = logprobs - old_logprobs  # (B, S)
    per_seq = (train_ppo.masked_sum(log_ratio, mask, -1)
               / mask.sum(-1).clamp(min=1))  # (B,)
    return per_seq.detach()[:, None] + logprobs - logprobs.detach()  # (B, S)
