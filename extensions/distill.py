"""On-policy distillation (docs/distillation.md): a frozen teacher, an HF causal LM with the
policy's tokenizer, sharded like the policy, scores the student's own tokens; the per-token
reverse KL, log pi(x_t) - log pi_teacher(x_t), trains the student beside the task (or alone), in
one of verl 0.9.1's two forms (verl/trainer/distillation/losses.py): as a per-token reward through
the clipped surrogate, or as a loss.

Where the core calls it: train_ppo.start_run (check_teacher: its tokenizer against the policy's),
train_ppo.build_models (load_teacher), train_ppo.ppo_step in the passes without grad
(teacher_pass: the teacher's logprobs into batch.extra, and their metrics) and
train_ppo.policy_loss_terms (loss_terms: the distill_loss term; without the task's
policy_loss when distill_task=false).
Peers: the reward form weighs its surrogate by batch.weight, as the task's is (offpolicy.py's
correction, when on).
"""
import dataclasses
import os
from typing import Literal

import torch
from transformers import AutoConfig, AutoTokenizer

import model_parallel
import train_ppo
from config import ConfigError


@dataclasses.dataclass
class Options:
    """This file's options, a part of config.Config: config.py runs this class and `check` alone,
    from this file's text, before torch loads (README, "Extensions")."""

    # ---- on-policy distillation (distill.py; docs/distillation.md) ----
    # a teacher, an HF causal LM with the policy's tokenizer, frozen and sharded like the policy;
    # its logprobs of the student's own tokens give a per-token reverse KL, log pi(x_t) -
    # log pi_teacher(x_t). "" = no teacher
    teacher: str = ""
    # how that KL trains the student (verl 0.9.1's two forms): reward = each token's advantage is
    # minus distill_estimator's estimate at pi_old (k1: -(log pi_old - log pi_teacher)), discount
    # 0, through the clipped surrogate (Thinking Machines' form, verl's use_policy_gradient);
    # loss = distill_estimator's estimate at the current pi per token, through loss_agg_mode
    # (verl's default form). Needs a teacher
    distill_form: Literal["reward", "loss"] = "reward"
    # the per-token estimate: k1 = log ratio, k2 = (log ratio)^2 / 2, k3 = (r - 1) - log r; the
    # loss form refuses k1 (its gradient does not depend on the teacher)
    distill_estimator: Literal["k1", "k2", "k3"] = "k1"
    # the distillation term's weight beside the task's policy loss (verl: distillation_loss_coef)
    distill_coef: float = 1.0
    # false = pure distillation: the task's reward trains nothing (needs grpo or rloo: no critic
    # for a reward no loss reads)
    distill_task: bool = True
    # each token's estimate is clamped to +-this (verl's loss_max_clamp; 0 = no clamp)
    distill_clamp: float = 10.0


def check(cfg):
    """This file's refusals, one line each (config.validate runs it, before torch loads: it may
    use ConfigError, os and json alone)."""
    # verl refuses it too: d/dtheta of log pi - log pi_teacher does not involve the teacher
    if cfg.teacher and cfg.distill_form == "loss" and cfg.distill_estimator == "k1":
        raise ConfigError("distill_form=loss with distill_estimator=k1 trains nothing "
                                 "toward the teacher (the gradient of log pi - log pi_teacher is "
                                 "the teacher-free grad log pi): use distill_estimator=k3 or k2, "
                                 "or distill_form=reward")
    if not cfg.teacher and not cfg.distill_task:
        raise ConfigError("distill_task=false needs a teacher: without one nothing would "
                                 "train (give teacher=DIR, or distill_task=true)")
    if cfg.teacher and not cfg.distill_task and cfg.advantage_estimator == "gae":
        raise ConfigError("distill_task=false (pure distillation) with "
                                 "advantage_estimator=gae would train a critic on a reward no "
                                 "loss reads: use grpo or rloo")
    if cfg.teacher and not os.path.isdir(cfg.teacher):
        raise ConfigError(f"teacher={cfg.teacher!r} is not a directory: give an HF causal "
                                 f"LM checkpoint dir with the policy's tokenizer")


def idle(cfg):
    """This file's options that do nothing in this run, as (key, why): config.notes names those
    the user gave."""
    if not cfg.teacher:
        for key in ("distill_form", "distill_estimator", "distill_coef", "distill_task",
                    "distill_clamp"):
            yield key, "does nothing without a teacher (teacher=DIR)"


def check_teacher(cfg, model_dir):
    """Refuse (CheckpointError, one line) a teacher whose token ids would not mean the policy's
    tokens (the policy's checkpoint: model_dir): another tokenizer (its whole vocabulary, token ->
    id, compared; a dir without one uses the task's own, as the toy tasks do), or an id the
    tokenizer makes beyond its embedding. The embedding's rows may differ from the policy's
    (models pad their vocabulary). Also what check_hf_dir refuses (a missing dir, heads that tp
    would cut)."""
    teacher, error = cfg.teacher, model_parallel.CheckpointError
    try:
        hf_config = model_parallel.check_hf_dir(teacher, cfg.tp_size)
    except error as e:
        raise error(f"teacher: {e}") from None
    vocab = _tokenizer_vocab(model_dir)
    if _tokenizer_vocab(teacher) != vocab:
        raise error(f"teacher={teacher} has another tokenizer than the policy's ({model_dir}): its "
                    f"token ids would mean other tokens; distil from a teacher of the same "
                    f"tokenizer")
    # the ids the tokenizer makes; a dir without one: the policy's rows bound the task's ids
    ids = max(vocab.values()) + 1 if vocab else AutoConfig.from_pretrained(model_dir).vocab_size
    if hf_config.vocab_size < ids:
        raise error(f"teacher={teacher} has {hf_config.vocab_size} embedding rows, fewer than the "
                    f"{ids} ids of the policy's tokenizer")


def _tokenizer_vocab(path):
    """{token: id} of the tokenizer saved in `path`, None if it holds none."""
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if not any(os.path.isfile(os.path.join(path, name)) for name in names):
        return None
    return AutoTokenizer.from_pretrained(path).get_vocab()


def load_teacher(cfg, mesh):
    """Collective (every rank): the teacher, sharded like the policy and frozen: no adapters, no
    gradient, stored in its compute dtype and under FSDP2 kept in host memory between its passes
    (model_parallel.load_policy's `frozen`, as the reward model is)."""
    return model_parallel.load_policy(cfg.teacher, mesh, cfg, frozen=True)


@torch.no_grad()
def teacher_pass(teacher, batch, cfg, mesh):
    """Collective over the mesh. The teacher's logprobs of the student's tokens into
    batch.extra["teacher_lp"] (teacher_logprobs), and distillation's metrics (docs/metrics.md):
    the reverse KL to the teacher (k1 and k3) of the sampling policy, and the teacher's logprob
    of the student's tokens, means over the step's response tokens. Returns (the batch, the
    metrics)."""
    teacher_lp = teacher_logprobs(teacher, batch, cfg, mesh)  # (b, S)
    batch = dataclasses.replace(batch, extra={**batch.extra, "teacher_lp": teacher_lp})
    sums = torch.stack([v.double() for v in shares(batch, teacher_lp)]
                       + [batch.mask.sum().double()])
    k1, k3, teacher_logprob, n_tok = train_ppo.dp_sum(sums, mesh).tolist()  # one host read
    n_tok = max(n_tok, 1.0)  # overlong_mask may take every response out of the loss
    return batch, dict(distill_kl_k1=k1 / n_tok, distill_kl_k3=k3 / n_tok,
                       teacher_logprob=teacher_logprob / n_tok)


def teacher_logprobs(teacher, batch, cfg, mesh):
    """Collective over the mesh. The teacher's logprob of each of the student's tokens (b, S),
    without grad, as the reference's pass is made: forward_policy at the temperature the student
    sampled at (cfg.temperature), so that the reverse KL compares the distribution each token was
    drawn from with the teacher's at that temperature (slime #2085: a teacher scored at T = 1 or
    0 against a student sampled at T biases every token's KL). Resharded after its pass, as the
    reward model is."""
    teacher_lp, _ = train_ppo.forward_batch(model_parallel.forward_policy, teacher, batch, cfg,
                                            mesh, unscored=batch.unscored)
    model_parallel.reshard(teacher)
    return teacher_lp


def shares(batch, teacher):
    """This rank's sums for distillation's metrics: the reverse KL to the teacher (k1 and k3) of
    the sampling policy, and the teacher's logprob of the student's tokens."""
    mask = batch.mask  # (b, S), as teacher
    masked_sum, kl_penalty = train_ppo.masked_sum, train_ppo.kl_penalty
    return (masked_sum(kl_penalty(batch.old_lp, teacher, "k1"), mask),
            masked_sum(kl_penalty(batch.old_lp, teacher, "k3"), mask),
            masked_sum(teacher, mask))


def loss_terms(terms, lp, batch, idx, aggregate, cfg):
    """The policy's loss terms (train_ppo.policy_loss_terms') with distillation's: distill_loss
    added, and with distill_task=false the task's policy_loss taken away (pure distillation)."""
    terms = dict(terms, distill_loss=distill_loss(lp, batch, idx, aggregate, cfg,
                                                  batch.weight[idx]))
    if not cfg.distill_task:
        del terms["policy_loss"]
    return terms


def distill_loss(lp, batch, idx, aggregate, cfg, weight=1.0):
    """On-policy distillation's term of the policy loss on the batch rows idx, one of verl
    0.9.1's two forms (verl/trainer/distillation/losses.py), times distill_coef. Per token
    d_t = distill_estimator's estimate of KL(student || teacher) from log pi_t - log pi_teacher_t
    (train_ppo.kl_penalty), clamped to +-distill_clamp (verl's loss_max_clamp):

      reward  A_t = -d_t of the sampling policy pi_old: each token's own negative KL is its
              advantage (a per-token reward with discount 0, no return summed over later
              tokens), through the clipped token surrogate (train_ppo.policy_loss, times
              `weight`, batch.weight: the off-policy correction's, as verl's
              rollout_is_weights): Thinking Machines' form. pi_old, where verl takes the current
              pi detached: the reward is fixed when the sample is scored, as the task's is, so
              the clip measures the policy's move from the one that earned it (the two agree in
              an update's first minibatch, where pi = pi_old).
      loss    d_t of the current pi, with its gradient, made one number by `aggregate`
              (loss_agg_mode). check refuses k1 here, as verl does: d/dtheta of log pi -
              log pi_teacher is grad log pi, which does not involve the teacher.

    The reward form's surrogate is the token one, in clip_ratio's range, whatever
    policy_loss_mode is (under gspo the task's term alone takes the sequence's ratio).

    The task's signal mixes in as verl mixes it, a sum of losses: policy_loss + distill_coef *
    this (prime-rl mixes the advantages instead; under clipping the two differ)."""
    mask, teacher = batch.mask[idx], batch.extra["teacher_lp"][idx]  # (rows, S) each
    if cfg.distill_form == "reward":
        old = batch.old_lp[idx]  # (rows, S)
        advantages = -_clamped(train_ppo.kl_penalty(old, teacher, cfg.distill_estimator), cfg)
        clip = (cfg.clip_ratio, cfg.clip_ratio_high or None)
        per_token, _ = train_ppo.policy_loss(lp - old, advantages, clip,
                                             cfg.clip_ratio_c)  # (rows, S)
        per_token = per_token * weight
    else:
        per_token = _clamped(train_ppo.kl_penalty(lp, teacher, cfg.distill_estimator),
                             cfg)  # (rows, S)
    return cfg.distill_coef * aggregate(per_token, mask)


def _clamped(per_token, cfg):
    """Each token's estimate clamped to +-distill_clamp (0: as it is)."""
    if not cfg.distill_clamp:
        return per_token
    return per_token.clamp(-cfg.distill_clamp, cfg.distill_clamp)
