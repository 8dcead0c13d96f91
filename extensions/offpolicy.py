"""The off-policy correction (docs/losses.md): the engine samples from pi_engine, not from the
trainer's pi_old (another dtype, other kernels), so every token's policy loss is weighed by its
importance weight pi_old / pi_engine, truncated or masked, and may be rejected, as verl 0.9.1's
rollout_corr_helper weighs it (compute_rollout_correction_weights and
compute_rollout_rejection_mask) at the token and sequence levels; the geometric level is SkyRL's
(verl has none). Also engine_dtype: a bf16 engine under an fp32 trainer makes the
mismatch a GPU has real on a CPU.

Where the core calls it: train_ppo.ppo_step, in the passes without grad (`weigh`: every token's
weight into batch.weight, which the policy loss multiplies into the surrogate, and the weights'
metrics); rollout.engine_dtype (the engine's dtype). The mismatch itself (logprob_mismatch,
mismatch_k1, mismatch_k3, ...) is the core's metric, logged in every run.
Peers: distill.py's reward form weighs its surrogate by the same batch.weight.
"""
import dataclasses
import json
import math
import os
from typing import Literal

import torch

import train_ppo
from config import ConfigError


@dataclasses.dataclass
class Options:
    """This file's options, a part of config.Config: config.py runs this class and `check` alone,
    from this file's text, before torch loads (README, "Extensions")."""

    # ---- off-policy correction (offpolicy.py; docs/losses.md) ----
    # The engine samples from pi_engine, not from the trainer's pi_old (another dtype, other
    # kernels): per token, log pi_old - log pi_engine says by how much. Needs old_logprobs=trainer.

    # the engine's dtype: auto = the compute dtype. bf16 under an fp32 trainer is the GPU's
    # mismatch (a bf16 engine sampling for fp32 master weights) made real on a CPU
    engine_dtype: Literal["auto", "bf16", "fp32"] = "auto"
    # an importance weight pi_old / pi_engine on each token's policy loss, at the level of the
    # token, the sequence (the product of its tokens' ratios) or geometric (their geometric mean,
    # exp of the mean log ratio); off = none
    offpolicy_is: Literal["off", "token", "sequence", "geometric"] = "off"
    # truncate: a weight above offpolicy_is_bound counts as the bound (TIS, Yao et al. 2025).
    # mask: a weight outside [offpolicy_is_lower, offpolicy_is_bound] counts 0 (IcePop at the
    # token level; SkyRL's geometric mask is [0.99, 1.01])
    offpolicy_is_mode: Literal["truncate", "mask"] = "truncate"
    offpolicy_is_bound: float = 2.0  # the weight's upper bound (verl's rollout_is_threshold)
    offpolicy_is_lower: float = 0.5  # mask: the lower bound
    # reject (weight 0) tokens or whole sequences whose divergence from the engine passes
    # offpolicy_reject_bound: token_k1/k2/k3 judge each token; seq_sum_, seq_mean_ (k1, k2, k3)
    # and seq_max_ (k2 and k3 only, as verl's options) a whole sequence by its tokens' sum, mean
    # or max (verl's rollout_rs). With lr = log pi_old/pi_engine
    # and r = e^lr: k1 = -lr, k2 = lr^2 / 2, k3 = r - 1 - lr. Needs old_logprobs=trainer
    offpolicy_reject: Literal[
        "off", "token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
        "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3"] = "off"
    # the rejection's bound, with no default that works (0 = unset: every rejection refuses it):
    # for k2 and k3 the largest divergence kept (e.g. 0.01); for k1 a ratio B > 1 (e.g. 2), a
    # token or sequence kept while exp(k1) lies within [1/B, B]
    offpolicy_reject_bound: float = 0.0


def check(cfg):
    """This file's refusals, one line each (config.validate runs it, before torch loads: it may
    use ConfigError, os and json alone)."""
    correcting = cfg.offpolicy_is != "off" or cfg.offpolicy_reject != "off"
    if not cfg.offpolicy_is_bound > 0:
        raise ConfigError(f"offpolicy_is_bound={cfg.offpolicy_is_bound} must be > 0")
    if cfg.old_logprobs == "engine" and correcting:
        raise ConfigError("the off-policy correction weighs pi_old / pi_engine, which "
                                 "old_logprobs=engine makes 1: use old_logprobs=trainer, or "
                                 "offpolicy_is=off and offpolicy_reject=off")
    masking = cfg.offpolicy_is != "off" and cfg.offpolicy_is_mode == "mask"
    if masking and not cfg.offpolicy_is_lower < cfg.offpolicy_is_bound:
        raise ConfigError(f"offpolicy_is_lower={cfg.offpolicy_is_lower:g} must be below "
                                 f"offpolicy_is_bound={cfg.offpolicy_is_bound:g}: the weights "
                                 f"kept lie between them")
    # k1's bound is a ratio B, kept within [1/B, B]; k2's and k3's a divergence, >= 0
    least = 1.0 if cfg.offpolicy_reject.endswith("k1") else 0.0
    if cfg.offpolicy_reject != "off" and not cfg.offpolicy_reject_bound > least:
        raise ConfigError(f"offpolicy_reject={cfg.offpolicy_reject} needs "
                                 f"offpolicy_reject_bound > {least:g} (k1: a ratio B, kept within "
                                 f"[1/B, B], e.g. 2; k2, k3: the largest divergence kept, e.g. "
                                 f"0.01)")
    # a run resumed that had tis_cap (which this file's options replaced) would silently go on
    # without its correction: its config.json beside ckpt/ (resume=OUT/ckpt/step_N)
    run_dir = os.path.dirname(os.path.dirname(os.path.normpath(cfg.resume)))
    saved = os.path.join(cfg.out_dir if cfg.resume == "auto" else run_dir, "config.json")
    if cfg.resume and os.path.isfile(saved) and cfg.offpolicy_is == "off":
        with open(saved) as f:
            cap = json.load(f).get("tis_cap")
        if cap:
            raise ConfigError(f"{saved} ran with tis_cap={cap:g}, which was replaced: resume "
                              f"with offpolicy_is=token offpolicy_is_bound={cap:g}")


def idle(cfg):
    """This file's options that do nothing in this run, as (key, why): config.notes names those
    the user gave."""
    if cfg.offpolicy_is == "off":
        for key in ("offpolicy_is_mode", "offpolicy_is_bound", "offpolicy_is_lower"):
            yield key, "does nothing with offpolicy_is=off"
    elif cfg.offpolicy_is_mode == "truncate":
        yield "offpolicy_is_lower", "does nothing with offpolicy_is_mode=truncate (mask's bound)"
    if cfg.offpolicy_reject == "off":
        yield "offpolicy_reject_bound", "does nothing with offpolicy_reject=off"
    if cfg.replay_rollouts:
        yield "engine_dtype", "does nothing with replay_rollouts (no engine)"
    elif cfg.engine_dtype == "bf16" and cfg.old_logprobs == "engine":
        # a note, not a refusal: an uncorrected bf16 engine is a run worth measuring (what the
        # correction is for); but nothing in this run can weigh its mismatch
        yield "engine_dtype", ("with old_logprobs=engine: the bf16 engine's logprobs are pi_old, "
                               "so its mismatch stays in the ratio, and no correction can weigh "
                               "it (offpolicy_is needs old_logprobs=trainer)")


def engine_dtype(cfg) -> torch.dtype:
    """The engine's dtype engine_dtype names (rollout.engine_dtype reads it where it is set)."""
    return torch.bfloat16 if cfg.engine_dtype == "bf16" else torch.float32


@torch.no_grad()
def weigh(batch, cfg, mesh):
    """Collective over dp. The correction in the passes without grad (train_ppo.ppo_step): every
    token's weight (offpolicy_weights; ppo_step multiplies batch.weight by it), and its metrics
    (docs/metrics.md): the response tokens of weight 0 (masked or rejected) over all, the
    sequences with any such token over all, and the weights' effective sample size,
    (sum w)^2 / (n sum w^2) (Kish). Returns
    (the weights (b, S), the metrics)."""
    weight = offpolicy_weights(batch, slice(None), cfg)  # (b, S)
    # summed over dp, one host read
    masked, seqs, w, w_sq, n_tok, n_seq = train_ppo.dp_sum(shares(batch, weight), mesh).tolist()
    n_tok = max(n_tok, 1.0)  # overlong_mask may take every response out of the loss
    metrics = dict(offpolicy_token_masked=masked / n_tok, offpolicy_seq_masked=seqs / n_seq,
                   offpolicy_ess=w ** 2 / max(n_tok * w_sq, 1e-12))
    return weight, metrics


def shares(batch, weight):
    """This rank's sums for the correction's metrics, (6,) float64: the response tokens of weight
    0 (masked or rejected), the sequences with any such token, the sums of the weights and of
    their squares over response tokens, the response tokens and the sequences."""
    mask = batch.mask  # (b, S)
    zero = (weight == 0) & mask.bool()  # (b, S)
    sequences = torch.tensor(len(batch.lens), device=mask.device)
    return torch.stack([v.double() for v in (
        zero.sum(), zero.any(-1).sum(), train_ppo.masked_sum(weight, mask),
        train_ppo.masked_sum(weight ** 2, mask), mask.sum(), sequences)])


def offpolicy_weights(batch, idx, cfg):
    """The off-policy correction's weight of each token of the rows idx, (rows, S): the
    importance weight (importance_weights) times the rejection's keep (rejection_mask), 0 outside
    the mask. A token of weight 0 stays in the loss's normalizers (num_tokens counts it): a
    correction that rejects much trains a smaller step, not a renormalized one. verl drops a
    rejected token from its response_mask instead (the normalizer, and the critic's loss too),
    while its IcePop mask keeps it, as here."""
    log_ratio = batch.old_lp[idx] - batch.engine_lp[idx]  # (rows, S) log pi_old / pi_engine
    mask = batch.mask[idx]  # (rows, S)
    weight = mask.clone()  # (rows, S)
    if cfg.offpolicy_is != "off":
        weight = importance_weights(log_ratio, mask, cfg)
    if cfg.offpolicy_reject != "off":
        weight = weight * rejection_mask(log_ratio, mask, cfg)
    return weight


def importance_weights(log_ratio, mask, cfg):
    """pi_old / pi_engine per token (B, S), at the level offpolicy_is says: each token's own
    (token), its sequence's product (sequence: unbiased for the sequence, and its variance grows
    with the length), or their geometric mean (geometric: exp of the mean log ratio, as GSPO's
    ratio; SkyRL's geometric mask). Then truncated at offpolicy_is_bound (TIS: Yao et al., "Your
    efficient RL framework secretly brings you off-policy RL training", 2025), or masked to 0
    outside [offpolicy_is_lower, offpolicy_is_bound] (IcePop, MiniMax-M1's report). The log
    ratio is clamped to +-20 before exp, as verl's (ratio_from_log)."""
    if cfg.offpolicy_is == "token":
        weight = train_ppo.ratio_from_log(log_ratio)  # (B, S)
    else:
        per_seq = train_ppo.masked_sum(log_ratio, mask, -1)  # (B,) the log of the product
        if cfg.offpolicy_is == "geometric":
            per_seq = per_seq / mask.sum(-1).clamp(min=1)  # (B,) the mean log ratio
        weight = train_ppo.ratio_from_log(per_seq)[:, None].expand_as(log_ratio)  # (B, S)
    weight = torch.where(mask.bool(), weight, 0.0)  # (B, S)
    if cfg.offpolicy_is_mode == "truncate":
        return weight.clamp(max=cfg.offpolicy_is_bound)
    inside = (weight >= cfg.offpolicy_is_lower) & (weight <= cfg.offpolicy_is_bound)
    return torch.where(inside, weight, 0.0)


def rejection_mask(log_ratio, mask, cfg):
    """1 on the tokens the rejection keeps, 0 on the rest and outside the mask (B, S), as verl's
    rollout_rs. Per token the divergence of pi_old from pi_engine, with lr = log pi_old / pi_engine
    clamped to +-20: k1 = -lr, k2 = lr^2 / 2, k3 = e^lr - 1 - lr (estimates of KL(pi_engine ||
    pi_old) from the engine's samples); token_kN judges each token by its own, seq_sum_kN,
    seq_mean_kN and seq_max_kN a whole sequence by the sum, mean or max of its tokens'. Kept: k2
    and k3 at most offpolicy_reject_bound; k1 (a log ratio, either sign) within [-log B, log B]
    for B = offpolicy_reject_bound (verl's k1 bounds are [1/B, B] on the ratio by default)."""
    level, estimator = cfg.offpolicy_reject.rsplit("_", 1)  # e.g. ("seq_mean", "k3")
    log_ratio = log_ratio.clamp(-20.0, 20.0)  # (B, S)
    if estimator == "k1":
        div = -log_ratio
    elif estimator == "k2":
        div = 0.5 * log_ratio ** 2
    else:
        div = torch.expm1(log_ratio) - log_ratio  # (B, S)
    if level == "seq_sum":
        div = train_ppo.masked_sum(div, mask, -1)[:, None]  # (B, 1)
    elif level == "seq_mean":
        div = train_ppo.masked_sum(div, mask, -1) / mask.sum(-1).clamp(min=1)  # (B,)
        div = div[:, None]  # (B, 1)
    elif level == "seq_max":
        div = torch.where(mask.bool(), div, -math.inf).amax(-1, keepdim=True)  # (B, 1)
    bound = cfg.offpolicy_reject_bound
    if estimator == "k1":
        keep = div.abs() <= math.log(bound)
    else:
        keep = div <= bound
    return (keep & mask.bool()).to(mask.dtype)  # (B, S)
