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
    gspo_clip_ratio: float = 3e-4  # GSPO's sequence ratio is kept in [1 - this, 1 + the next one]
    gspo_clip_ratio_high: float = 4e-4  # the paper's 3e-4 below and 4e-4 above


def check(cfg):
    """This file's refusals: none (config.validate runs it, as every extension's)."""


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
