"""PPO for a Hugging Face causal LM on a PyTorch device mesh. Launch:

    # CPU demo, 2 processes (what `make demo` runs):
    torchrun --nproc_per_node=2 train_ppo.py --config configs/demo_cpu.toml
    # one node of 8 GPUs: 4 data-parallel replicas, tensor parallel 2 inside each:
    torchrun --nproc_per_node=8 train_ppo.py --config FILE --tp_size=2
    # 2 nodes (run on each, same --rdzv_endpoint):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 \
        train_ppo.py --config FILE
    # restarts in place and going on without a lost node (docs/nodes.md; Slurm there too):
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=1:2 --max-restarts=3 ... \
        train_ppo.py --config FILE --save_every=20
    # every option with its default and doc:
    python train_ppo.py --help

The algorithm is PPO with a learned critic and GAE, as used for RLHF by InstructGPT
(Ouyang et al., 2022) and documented in "The N+ implementation details of RLHF with PPO"
(Huang et al., 2024). One step, in the order of ppo_step() below:
  1. draw the next prompts (shuffled epochs, the same on every rank); the ranks generate the
     step's samples in equal shares (rollout.generated_by)
  2. rollout: the engine samples responses and returns its own logprob of each token; every
     rank gets every sample, and takes its rows for the update (balanced_split: each
     minibatch dealt to dp ranks with even token sums)
  3. reward: the task's rule-based score per sequence (rollout scores each sample as it ends),
     or a learned reward model's (its own pass without grad, reward_model_scores); step 5 puts
     it on the sequence's last response token
  4. forward passes without grad: old policy logprobs (or the engine's), reference logprobs
     (under LoRA: the policy with its adapters off), values
  5. per-token reward = score - kl_coef * KL(policy || reference)
  6. GAE -> advantages and returns; advantages whitened over the whole global batch
  7. ppo_epochs x minibatches x microbatches of clipped policy and value losses (the critic's
     alone in its first critic_warmup_steps steps)
  8. global grad-norm clip, AdamW step (policy and critic each have their own)
  9. refit: the new policy weights are streamed into the rollout engine (under LoRA with vLLM:
     the adapters alone); the step's samples dumped with the reward trained on (in the background)
 10. metrics, plot; a checkpoint every save_every steps (resume=auto continues)
advantage_estimator="grpo" or "rloo" swaps steps 4-6 for rewards against the prompt's group and
drops the critic (docs/losses.md).

How one row lines up. Every (b, S) tensor in this file follows one convention: position i holds
everything about the action "emit token x_i given x_<i". A model's logits at position i predict
x_{i+1}, so the logprob of x_i comes from the logits at i-1, and the value of the state before
x_i from the critic's head on the hidden state at i-1 (the right shift that NeMo-RL, verl,
OpenRLHF and TRL all use). Prompt "2+3=", response "5<eos>":

    position i            0     1     2     3     4            5
    token x_i             2     +     3     =     5            <eos>
    response mask         0     0     0     0     1            1
    logprobs[i]           0     .     .     .     logits[3]    logits[4]    (log pi(x_i | x_<i))
    values[i]             0     .     .     .     head(h[3])   head(h[4])   (V of the state x_<i)
    rewards[i]            0     0     0     0     -kl_coef*kl  score - kl_coef*kl

('.' = computed, or 0 where the LM head skips the prompt: never in a loss.) Position 0 has no
prediction and holds 0, as does every packed sequence start; losses and statistics see the mask.
In a multi-turn episode (docs/multiturn.md) the response holds model turns and observations (a
tool's output) between them: the mask is 0 on an observation's tokens, which are context, not
actions, so they are in no loss or statistic, and GAE steps over them (compute_gae).

Deviations from the paper's PPO, on purpose:
  1. the minibatch split is fixed across epochs (no reshuffle), so that it does not depend on
     the mesh and every mesh trains on the same minibatches;
  2. the KL penalty uses a fixed kl_coef (no adaptive KL controller);
  3. the reward is a task's rule (as in RLVR / GSM8K) unless reward_model names a learned one
     (InstructGPT's form, make rlhf-demo); rewards are not normalized.
Deliberately left out: pretraining-loss mixing (PPO-ptx), reward normalization.
"""
import gc
import json
import functools
import math
import os
import re
import resource
import shutil
import signal
import sys
import time
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple, Optional

import config

# Fail fast: a bad config is refused here, in a fraction of a second, before torch and
# transformers are imported (10 s and more). torchrun sets WORLD_SIZE.
if __name__ == "__main__":
    CFG = config.load(sys.argv[1:], world_size=int(os.environ.get("WORLD_SIZE", "1")))
    # the extensions import this module as `train_ppo`: the running script, not a second copy
    sys.modules["train_ppo"] = sys.modules["__main__"]

import torch  # noqa: E402  (after the config check, on purpose)
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict)

import model_parallel  # noqa: E402
import rollout  # noqa: E402
# the extensions this module calls, by name where each acts (extensions/, README's "Extensions")
from extensions import async_rollout  # noqa: E402
from extensions import distill  # noqa: E402
from extensions import evaluation  # noqa: E402
from extensions import gspo  # noqa: E402
from extensions import lora  # noqa: E402
from extensions import multiturn  # noqa: E402
from extensions import optimizer_offload  # noqa: E402
from extensions import offpolicy  # noqa: E402
from extensions import tensorboard  # noqa: E402


# -----------------------------------------------------------------------------
# One PPO step, read front to back: ppo_step, then every function it calls, in the order it first
# calls them (steps 1-10 of the module docstring). The PPO math among them (kl_penalty,
# compute_gae, masked_whiten, policy_loss, aggregate_loss, value_loss) is small pure functions on
# (B, S) tensors in the alignment above, importable by tests and readers: `mask` is 1 on response
# tokens; the losses are per token, and aggregate_loss makes one number of each, dividing by
# counts of the *global* minibatch (its response tokens, its sequences), so neither dp, cp,
# packing nor the microbatch size changes them. What a first reading skips (the variants, the
# set-up and the loop of steps, the run's plumbing, checkpoints) comes after the banner "Beyond
# one step".

@dataclass
class Batch:
    """This rank's sequences as right-padded (b, S) tensors, in the alignment of the module
    docstring. training_batch makes it with the rows, their rewards and the task's scores; each
    later phase returns the values it computes and ppo_step names every field it sets
    (dataclasses.replace): no_grad_passes()'s of step 4 (and the weights an extension computes),
    compute_advantages()'s of steps 5-6; `extra` is the extensions' own (distill.teacher_pass
    puts its teacher's logprobs there). A field the
    step has set is None only where the run has no such thing (values and returns without a
    critic; entropy with old_logprobs=engine or log_entropy=false)."""
    ids: torch.Tensor  # (b, S) prompt + response token ids, pad_id after the end
    mask: torch.Tensor  # (b, S) 1 on the response tokens in the loss (each sample's loss_mask)
    engine_lp: torch.Tensor  # (b, S) the engine's logprob of each response token
    lens: list  # b ints: prompt + response tokens of each row
    unscored: int  # the shortest prompt: leading positions that no row scores
    # (b, S) each token's weight in the policy loss: 1, or an extension's (offpolicy.py)
    weight: torch.Tensor
    index: Optional[list] = None  # b ints: each row's global sample index
    task_score: Optional[torch.Tensor] = None  # (b,) the task's rule-based score of each row
    # (b,) what each row is trained on: its sample's rule_reward (the task's score, plus any
    # shaping an extension adds), or with a reward model that model's score in the task's place
    reward: Optional[torch.Tensor] = None
    old_lp: Optional[torch.Tensor] = None  # (b, S) policy that sampled, as the trainer computes it
    ref_lp: Optional[torch.Tensor] = None  # (b, S) reference (initial) policy; None at kl_coef 0
    entropy: Optional[torch.Tensor] = None  # (b, S) of the policy's next-token distribution
    values: Optional[torch.Tensor] = None  # (b, S) critic before the update (gae only)
    advantages: Optional[torch.Tensor] = None  # (b, S)
    returns: Optional[torch.Tensor] = None  # (b, S) value targets (gae only)
    # (b, S) tensors an extension computes without grad and reads in the loss, by name
    # (distill.py's teacher_lp)
    extra: dict = field(default_factory=dict)


def ppo_step(progress, models, engine, task, cfg, mesh):
    """Collective (every rank). One PPO step, phases 1-10 of the module docstring in order, each
    handing what it computed to the next; `progress` holds the steps done and the prompt stream's
    position (main advances both after the step). Returns the step's metrics, the names of the
    loss terms the update reported (in its order) and the number of prompts the step drew."""
    step = progress["step"]
    metrics = {"step": step}  # and each phase's wall time (timed)
    with timed(metrics, "time_step_s"):
        with timed(metrics, "time_rollout_s"):  # 1-2. prompts, rollout (and the task's scores)
            start = progress["prompts_drawn"]  # the prompt stream's position
            every, drawn, found = rollout.rollouts(engine, task, cfg, step, start)
            metrics.update(found)  # samples generated, prompts drawn
            metrics.update(rollout.episode_metrics(every.values()))  # length, turns, endings
            batch = training_batch(every, cfg, mesh, task.pad_id, mesh.device_type)
        # 3-6. the reward, forward passes, advantages
        with timed(metrics, "time_logprobs_s"), torch.no_grad():
            reward = batch.reward  # 3. the samples' own: the task's rule (and any shaping)
            if models.reward_model is not None:  # or a learned reward model's score for the rule
                reward = reward_model_scores(models.reward_model, batch, cfg, mesh)  # (b,)
            old_lp, entropy, ref_lp, values = no_grad_passes(models, batch, cfg, mesh)  # 4.
            batch = replace(batch, reward=reward, old_lp=old_lp, entropy=entropy, ref_lp=ref_lp,
                            values=values)
            # the extensions' work without grad, and its metrics: distillation fills its own
            # entry of batch.extra; the correction's weights multiply batch.weight
            if cfg.teacher:  # on-policy distillation: the teacher's logprobs (distill.py)
                batch, found = distill.teacher_pass(models.extra["teacher"], batch, cfg, mesh)
                metrics.update(found)
            if cfg.offpolicy_is != "off" or cfg.offpolicy_reject != "off":  # (offpolicy.py)
                weight, found = offpolicy.weigh(batch, cfg, mesh)  # each token's weight
                batch = replace(batch, weight=batch.weight * weight)
                metrics.update(found)
            all_rewards = global_rewards(batch, len(every), mesh)  # (N,)
            advantages, returns = compute_advantages(batch, all_rewards, cfg, mesh)  # 5-6.
            batch = replace(batch, advantages=advantages, returns=returns)
        with timed(metrics, "time_update_s"):  # 7-8. PPO epochs over fixed minibatches
            sums = update(models.parts, batch, cfg, mesh,
                          train_policy=step >= cfg.critic_warmup_steps)
            # (on a GPU the memory in use: the caching allocator still holds the update's peak)
            metrics["mem_used_gb"] = memory_used_gb()
        with timed(metrics, "time_refit_s"):  # 9. push the policy into the engine (a collective)
            # also after skipped updates: rollout.rollouts put the engine to sleep (on GPU its
            # weights dropped), and refit wakes it
            if engine is not None:
                metrics.update(refit(engine, models.parts["policy"].model, cfg))
        rollout.dump_rollouts(every, all_rewards, cfg, step)  # rank 0, in the background
        named = step_metrics(batch, sums, cfg, mesh)  # 10. one all-reduce, then named means
    metrics.update(named, tokens_per_s=named["tokens"] / metrics["time_step_s"])
    return metrics, list(sums.losses), drawn


@contextmanager
def timed(times, name):
    """times[name] = wall seconds of the block (after the GPU's queued work is done)."""
    start = time.time()
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # GPU only: kernels run asynchronously
    times[name] = time.time() - start


def training_batch(every, cfg, mesh, pad_id, device):
    """This rank's rows of the step's samples (`every`: {global index: sample}) for steps 3-8, as a
    Batch on `device`: its part of each global minibatch (balanced_split; the cp x tp ranks of a
    dp slice get the same rows), with what every sample carries: its tokens in the loss
    (loss_mask), the reward it is trained on (rule_reward) and the task's score."""
    lengths = [len(every[j]["prompt_ids"]) + len(every[j]["response_ids"])
               for j in range(len(every))]
    per_rank = len(every) // cfg.num_minibatches // mesh["dp"].size()  # rows of a minibatch
    # Padded rows: a microbatch is padded to its longest row, so rows of like length should share
    # one; balanced_split deals neighbours in length order together, in chunks of half a
    # microbatch (whole ones would leave too few pieces to even the token sums out;
    # bench/packing.py measures it). The gcd makes the chunk divide the rank's share: each rank
    # gets whole chunks. Packed rows hold any mix of lengths: single rows.
    chunk = 1 if cfg.packing else math.gcd(per_rank, max(1, cfg.micro_batch_size // 2))
    split = balanced_split(lengths, cfg.num_minibatches, mesh["dp"].size(), chunk)
    index = split[mesh["dp"].get_local_rank()]
    samples = [every[j] for j in index]
    batch = make_batch([s["prompt_ids"] for s in samples], [s["response_ids"] for s in samples],
                       pad_id, [s["engine_logprobs"] for s in samples], device,
                       [s["loss_mask"] for s in samples])
    task_score = torch.tensor([s["task_score"] for s in samples], device=device)  # (b,)
    reward = torch.tensor([s["rule_reward"] for s in samples], device=device)  # (b,)
    return replace(batch, index=index, task_score=task_score, reward=reward)


def balanced_split(lengths, num_minibatches, dp_size, chunk=1):
    """The update's split of the step's samples over dp ranks: per rank, its global indices,
    minibatch-major (a rank's rows m * per_rank .. (m + 1) * per_rank - 1 are its share of
    minibatch m: update() slices them so). Global minibatch m stays the contiguous block m of the
    samples on every mesh (so the losses are the same on any mesh), and each block is dealt out in
    equal numbers of sequences with token sums as even as possible (verl's balance_batch has the
    same aim): contiguous slices would put one rank's share of long responses on one GPU while the
    others wait at the next gradient reduction.

    Sorted by length, the block is cut into chunks of `chunk` neighbours (training_batch says which
    size). The chunks go longest first to the rank with the fewest tokens that still has room
    (greedy longest-processing-time, Graham 1969); then the heaviest and the lightest rank swap
    chunks while a swap narrows their gap. `lengths`: prompt + response tokens of every sample,
    the same list on every rank, hence the same split. `chunk` must divide a rank's share of a
    minibatch."""
    per_minibatch = len(lengths) // num_minibatches
    per_rank = per_minibatch // dp_size
    split = [[] for _ in range(dp_size)]

    def tokens(c):
        return sum(lengths[j] for j in c)
    for m in range(num_minibatches):
        block = sorted(range(m * per_minibatch, (m + 1) * per_minibatch), key=lambda j: -lengths[j])
        chunks = [block[i:i + chunk] for i in range(0, per_minibatch, chunk)]  # longest first
        parts, load = [[] for _ in range(dp_size)], [0] * dp_size  # each rank's chunks and tokens
        for c in chunks:
            r = min((r for r in range(dp_size) if len(parts[r]) < per_rank // chunk),
                    key=lambda r: load[r])
            parts[r].append(c)
            load[r] += tokens(c)
        # each swap moves d tokens (0 < d < gap) from the heaviest to the lightest rank: the sum of
        # squared loads falls every time, so this ends
        while True:
            hi = max(range(dp_size), key=lambda r: load[r])
            lo = min(range(dp_size), key=lambda r: load[r])
            gap = load[hi] - load[lo]
            swaps = [(a, b) for a in parts[hi] for b in parts[lo]
                     if 0 < tokens(a) - tokens(b) < gap]
            if not swaps:
                break
            a, b = min(swaps, key=lambda ab: abs(gap - 2 * (tokens(ab[0]) - tokens(ab[1]))))
            parts[hi][parts[hi].index(a)] = b
            parts[lo][parts[lo].index(b)] = a
            load[hi] += tokens(b) - tokens(a)
            load[lo] += tokens(a) - tokens(b)
        for r in range(dp_size):
            split[r] += sorted(j for c in parts[r] for j in c)
    return split


def make_batch(prompts, responses, pad_id, engine_logprobs=None, device="cpu", action_masks=None):
    """A Batch on `device` from token id lists (prompt i, response i, its engine logprobs, its
    action mask: 1 on the model's tokens, 0 on an episode's observations, which are context and
    out of every loss and statistic; None: all the model's). On a GPU the whole step then stays
    there: nothing goes back to the CPU in the update."""
    lens = [len(p) + len(r) for p, r in zip(prompts, responses)]
    ids = torch.full((len(lens), max(lens)), pad_id, dtype=torch.long)  # (b, S)
    mask, engine_lp = torch.zeros(ids.shape), torch.zeros(ids.shape)  # (b, S) each
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, :lens[i]] = torch.tensor(p + r)
        mask[i, len(p):lens[i]] = 1 if action_masks is None else torch.tensor(action_masks[i])
        if engine_logprobs is not None:
            engine_lp[i, len(p):lens[i]] = torch.tensor(engine_logprobs[i], dtype=torch.float32)
    return Batch(ids.to(device), mask.to(device), engine_lp.to(device), lens,
                 min(map(len, prompts)), weight=torch.ones(ids.shape, device=device))


def no_grad_passes(models, batch, cfg, mesh):
    """Collective over the mesh. Step 4, the passes without grad (ppo_step runs steps 3-6 under
    no_grad), as (old_lp, entropy, ref_lp, values), each (b, S) or None: the old policy's
    logprobs and entropy (or the engine's logprobs), the reference's logprobs (the policy
    computing as the reference: models.reference; no pass at kl_coef 0, where nothing reads
    them), and the critic's values."""
    policy = models.parts["policy"].model
    # old_logprobs=engine: the engine's logprobs stand for pi_old, one policy forward fewer
    old_lp, entropy = batch.engine_lp, None
    if cfg.old_logprobs == "trainer":  # pi_old as the trainer computes it
        old_lp, entropy = forward_batch(model_parallel.forward_policy, policy, batch, cfg, mesh,
                                        with_entropy=cfg.log_entropy, unscored=batch.unscored)
    ref_lp = None
    if models.reference is not None:  # the same module, as the initial policy (build_models)
        with models.reference():
            ref_lp, _ = forward_batch(model_parallel.forward_policy, policy, batch, cfg, mesh,
                                      unscored=batch.unscored)
    values = None
    if "critic" in models.parts:
        critic = models.parts["critic"].model
        (values,) = forward_batch(model_parallel.forward_critic, critic, batch, cfg, mesh)
        values = values * batch.mask  # (b, S)
    return old_lp, entropy, ref_lp, values


def forward_batch(forward, model, batch, cfg, mesh, **kwargs):
    """Collective over the mesh. `forward(model, ids, lens, mesh, cfg, **kwargs)` (a tensor or a
    tuple of (rows, S) tensors) over every microbatch (micro_rows), dummies included; full (b, S)
    tensors in row order (packing reorders rows)."""
    outs = None
    for idx, lens, weight in micro_rows(range(len(batch.lens)), batch, cfg, mesh):
        result = forward(model, batch.ids[idx], lens, mesh, cfg, **kwargs)
        result = result if isinstance(result, tuple) else (result,)
        if outs is None:
            outs = [None if r is None else r.new_zeros(batch.ids.shape) for r in result]
        for out, r in zip(outs, result):
            if weight and out is not None:
                out[idx] = r  # (rows, S); a dummy's output is dropped (weight 0)
    return outs


def micro_rows(rows, batch, cfg, mesh):
    """Collective over dp. The microbatches of the batch rows `rows` (model_parallel.microbatches:
    packed or padded, the same count on every dp rank) as a list of (idx, lens, weight): the rows'
    indices as a device tensor (copied without a host sync), their lengths, and the weight of
    their loss, 0 for a dummy (a rank with fewer microbatches runs rows[0] again, so that FSDP's
    or DDP's collectives still match): a dummy's outputs are dropped, its loss counts 0 times."""
    micros = model_parallel.microbatches([batch.lens[i] for i in rows], cfg, mesh)
    out = []
    for micro, weight in micros:  # each microbatch as positions in `rows`
        idx = [rows[j] for j in micro]  # batch row indices
        lens = [batch.lens[k] for k in idx]
        out.append((model_parallel.to_device(idx, batch.ids.device), lens, weight))
    return out


def global_rewards(batch, n, mesh):
    """Collective over dp. Every sample's reward by global index, (n,) for the step's n samples:
    each dp rank has its rows' (batch.reward); GRPO's and RLOO's groups may span dp ranks. Each
    sample is one dp rank's: a sum over dp of each rank's rewards at its indices, zeros
    elsewhere, puts every reward in its place (exactly: one number and zeros)."""
    rewards = torch.zeros(n, dtype=torch.float64, device=batch.reward.device)  # (N,)
    rewards[batch.index] = batch.reward.double()
    return dp_sum(rewards, mesh).float()


def dp_sum(tensor, mesh):
    """Collective over dp. In-place sum over the dp ranks (each holds a share of the global
    batch)."""
    dist.all_reduce(tensor, group=mesh["dp"].get_group())
    return tensor


def compute_advantages(batch, all_rewards, cfg, mesh):
    """Collective over dp (the whitening). Steps 5-6: (advantages, returns), each (b, S).
    gae: per-token reward = -kl_coef * KL at every response token, + the sequence's reward on the
    last one; GAE; whitened over the global batch. grpo, rloo: the reward against its prompt
    group's (`all_rewards`, (N,): group_advantages) on every response token, and no returns
    (their KL is a loss term instead, in policy_loss_terms)."""
    if cfg.advantage_estimator != "gae":  # critic-free: group_advantages, after "Beyond one step"
        mine = group_advantages(all_rewards, cfg)[batch.index]  # (N,) -> (b,)
        return mine[:, None] * batch.mask, None  # (b, S)
    # (b, S); at kl_coef 0 no reference pass ran, and no penalty
    kl = 0.0 if batch.ref_lp is None else kl_penalty(batch.old_lp, batch.ref_lp, cfg.kl_estimator)
    rewards = -cfg.kl_coef * kl * batch.mask  # (b, S)
    last = torch.tensor(batch.lens) - 1  # (b,) each row's last response token
    rewards[torch.arange(len(batch.lens)), last] += batch.reward
    advantages, returns = compute_gae(rewards, batch.values, batch.mask, cfg.gamma, cfg.lam)
    if cfg.whiten_advantages:
        advantages = masked_whiten(advantages, batch.mask, group=mesh["dp"].get_group())
    return advantages, returns


def group_advantages(all_rewards, cfg):
    """The critic-free estimators: every sample's advantage (N,) from the whole batch's rewards
    (N,), prompt-major (a prompt's group may be split across dp ranks; compute_advantages puts
    each on its response tokens). A new estimator is one more branch here, and its name in
    config.Config.advantage_estimator's Literal."""
    if cfg.advantage_estimator == "grpo":
        return grpo_advantages(all_rewards, cfg.samples_per_prompt, cfg.grpo_norm_by_std)
    return rloo_advantages(all_rewards, cfg.samples_per_prompt)


def grpo_advantages(scores, group_size, norm_by_std=True, eps=1e-4):
    """GRPO's outcome-supervised advantage (Shao et al., 2024, DeepSeekMath, sec. 4.1.2): each
    response's score minus the mean of its prompt's group of `group_size` responses, divided
    by the group's (unbiased) std; groups with equal scores get 0. scores: (N,) for the
    *global* batch, prompt-major (response j belongs to prompt j // group_size).
    norm_by_std=False is Dr. GRPO's (Liu et al., 2025): the mean is subtracted, nothing divided,
    so a group that is nearly always right (small std) is not weighted up."""
    groups = scores.view(-1, group_size)  # (N/K, K)
    centred = groups - groups.mean(1, keepdim=True)  # (N/K, K)
    if norm_by_std:
        centred = centred / (groups.std(1, keepdim=True) + eps)  # (N/K, K)
    return centred.view(-1)  # (N,)


def kl_penalty(logprobs, ref_logprobs, kind="k1"):
    """Per-token estimate of KL(pi || pi_ref) from the sampled token (Schulman, "Approximating KL
    divergence", 2020). k1 = log(pi/pi_ref): unbiased, can be negative per token.
    k3 = (r - 1) - log r with r = pi_ref/pi: unbiased, always >= 0, lower variance; clamped to
    <= 10 as verl's low_var_kl, since one collapsed token (log r = 88) would give e^88 = inf.
    k2 = (log r)^2 / 2: biased, >= 0 (distillation's loss form may take it)."""
    log_ratio = logprobs - ref_logprobs  # (B, S)
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio ** 2
    if kind == "k3":
        # the input clamp keeps exp (and its gradient, 0 past the clamp) finite
        log_ratio = log_ratio.clamp(-20.0, 20.0)  # (B, S)
        return (torch.expm1(-log_ratio) + log_ratio).clamp(max=10.0)  # (B, S) = (r - 1) - log r
    raise ValueError(f"unknown KL estimator {kind!r}")


def masked_sum(x, mask, dim=None):
    """The sum of x where mask is 1 (dim=None: over everything). Selected, not multiplied: an
    inf outside the mask (exp of an observation token's log-ratio) must not make 0 * inf = NaN."""
    return torch.where(mask.bool(), x, 0.0).sum(dim)


def compute_gae(rewards, values, mask, gamma, lam):
    """Generalized advantage estimation (Schulman et al., 2016, eq. 16), right to left:
        delta_t = r_t + gamma * V_next(t) - V_t,   A_t = delta_t + gamma * lam * A_next(t)
    where next(t) is the next *action* of the row, the next position with mask 1: positions
    outside the mask (the prompt, padding, or an episode's observation, such as a tool's output)
    are skipped. In a multi-turn episode the state after turn k's last token t is the state
    before turn k+1's first token t', whose value the critic reads from the hidden state at
    t' - 1, the observation's end: V_next(t) = V_t', with the observation as its context. After
    the last action the episode ends (V_next = 0, A_next = 0). Returns (advantages, returns) with
    returns = A + V, both 0 outside the mask."""
    B, S = rewards.shape
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)  # (B,)
    next_adv = torch.zeros_like(next_value)  # (B,)
    advantages = torch.zeros_like(values)  # (B, S)
    for t in reversed(range(S)):
        is_response = mask[:, t].bool()  # (B,)
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # (B,)
        adv = delta + gamma * lam * next_adv  # (B,)
        advantages[:, t] = torch.where(is_response, adv, 0.0)
        next_value = torch.where(is_response, values[:, t], next_value)  # carried across gaps
        next_adv = torch.where(is_response, adv, next_adv)
    returns = (advantages + values) * mask  # (B, S)
    return advantages, returns


def masked_whiten(x, mask, group=None, eps=1e-8):
    """Collective over `group` (dp). (x - mean) / std over the masked tokens of the *global*
    batch (sum, sum of squares and count all-reduced over the group), never per rank.
    Unbiased, as TRL's masked_whiten."""
    stats = torch.stack([masked_sum(x, mask), masked_sum(x * x, mask), mask.sum()]).double()
    if group is not None:
        dist.all_reduce(stats, group=group)
    total, total_sq, n = stats
    mean = total / n.clamp(min=1)  # a batch may have no token in the loss (overlong_mask)
    var = (total_sq - n * mean * mean) / (n - 1).clamp(min=1)
    return ((x - mean) * torch.rsqrt(var + eps)).to(x.dtype) * mask


def value_loss(values, old_values, returns, value_clip):
    """Clipped value loss (PPO2 baselines; "N+ details" #9), per token (B, S):
        v_clip = V_old + clip(V - V_old, -c, c),  loss_t = 0.5 * max((V - R)^2, (v_clip - R)^2)
    value_clip = 0 turns the clipping off (plain 0.5 * (V - R)^2)."""
    loss = (values - returns) ** 2  # (B, S)
    if value_clip > 0:
        v_clipped = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
        loss = torch.maximum(loss, (v_clipped - returns) ** 2)  # (B, S)
    return 0.5 * loss


def update(parts, batch, cfg, mesh, train_policy=True):
    """Collective over the mesh. Steps 7-8: ppo_epochs passes over the step's fixed minibatches,
    one optimizer step per minibatch and trained model (train_minibatch), then the LR schedules.
    train_policy=False (the critic's warm-up steps) updates the critic alone. Returns UpdateSums
    (a named tuple, in the set-up's section beside Models and Part); `skipped_updates` counts the
    optimizer steps skipped for a NaN/inf loss or norm."""
    per_minibatch = len(batch.lens) // cfg.num_minibatches  # rows of each minibatch on this rank
    # the models this update trains: the critic alone in its warm-up
    trained = [name for name in parts if name != "policy" or train_policy]
    sums = UpdateSums(Counter(), Counter(), Counter())
    on_device = nullcontext()
    if cfg.offload_optimizer:  # AdamW's state here for the update alone (optimizer_offload.py)
        on_device = optimizer_offload.state_on_device(parts, batch.ids.device)
    with on_device:
        for epoch in range(cfg.ppo_epochs):
            for first in range(0, len(batch.lens), per_minibatch):
                rows = range(first, first + per_minibatch)
                for name in trained:
                    losses, clipped, norm, stepped = train_minibatch(name, parts[name], rows,
                                                                     batch, cfg, mesh)
                    sums.losses.update(losses)
                    sums.counts.update(clipped_tokens=clipped)
                    # the norm and the skip are global already: the same on every rank
                    sums.norms["grad_norm" if name == "policy" else f"{name}_grad_norm"] += norm
                    sums.norms["skipped_updates"] += int(not stepped)
    for name in trained:  # (a policy not trained keeps its LR warm-up)
        parts[name].schedule.step()
    return sums


def train_minibatch(name, part, rows, batch, cfg, mesh):
    """Collective over the mesh. One optimizer step of the model `name` ("policy" or "critic") on
    the batch rows `rows` (a range), this rank's share of a global minibatch: a forward and a
    backward per microbatch (their gradients add up), the global grad-norm clip, the step. The
    policy's loss is the sum of policy_loss_terms, the critic's the clipped value loss. Returns
    ({loss term: its value}, this rank's tokens the surrogate clipped, the grad norm, whether it
    stepped)."""
    # the loss's normalizers: counts over the whole global minibatch (num_tokens: its response
    # tokens), before any microbatch runs, so that no mesh changes the loss (docs/losses.md)
    # (a slice: no host copy; at least 1: overlong_mask may leave a minibatch no token)
    num_tokens = dp_sum(batch.mask[rows.start:rows.stop].sum(), mesh).clamp(min=1)
    aggregate = functools.partial(aggregate_loss, mode=cfg.loss_agg_mode, num_tokens=num_tokens,
                                  num_seqs=len(rows) * mesh["dp"].size(),  # sequences
                                  norm=cfg.loss_agg_norm or cfg.max_new_tokens)
    losses, clipped = Counter(), 0  # {loss term: its sum over the microbatches}
    micros = micro_rows(rows, batch, cfg, mesh)
    for i, (idx, lens, weight) in enumerate(micros):  # weight: 0 for a dummy (micro_rows)
        # DDP all-reduces the gradients in the last microbatch's backward only, and decides at
        # the forward (FSDP2 reduces every backward's shards; tp and cp need nothing)
        model_parallel.sync_gradients(part.model, sync=i == len(micros) - 1)
        if name == "policy":
            lp, entropy = model_parallel.forward_policy(part.model, batch.ids[idx], lens, mesh,
                                                        cfg, with_entropy=cfg.entropy_coef > 0,
                                                        unscored=batch.unscored)
            # the function's name, looked up now: a fork's replacement is what trains
            terms, tokens = policy_loss_terms(lp, entropy, batch, idx, aggregate, cfg)
            clipped = clipped + weight * tokens
        else:  # the critic
            values = model_parallel.forward_critic(part.model, batch.ids[idx], lens, mesh, cfg)
            per_token = value_loss(values, batch.values[idx], batch.returns[idx], cfg.value_clip)
            terms = {"value_loss": aggregate(per_token, batch.mask[idx])}
        (weight * sum(terms.values())).backward()  # a dummy's weight is 0
        losses.update({term: weight * loss.detach() for term, loss in terms.items()})
    norm = model_parallel.clip_grad_norm(list(part.model.parameters()), cfg.max_grad_norm)
    stepped = step_optimizer(part.optimizer, norm, losses, mesh)
    return losses, clipped, norm, stepped


def policy_loss_terms(lp, entropy, batch, idx, aggregate, cfg):
    """The policy's loss on the batch rows `idx`, as named terms: train_minibatch minimizes
    their sum, and step_metrics logs each under its name (a mean over the step's optimizer steps).

      policy_loss     the clipped surrogate (policy_loss), each token weighted by batch.weight (1,
                      or an extension's: offpolicy.py's correction)
      entropy_loss    -entropy_coef * entropy, if entropy_coef > 0 (train_minibatch then computes
                      the entropy: an entropy bonus, negative, so minimizing the loss raises it)
      kl_loss         kl_coef * KL(pi || pi_ref), k3, for the critic-free estimators (grpo,
                      rloo) if kl_coef > 0 (gae puts the KL in the reward instead)

    and what an extension adds or replaces (distill.py's distill_loss; gspo.py's ratio).
    `lp`, `entropy`: (rows, S) of the current policy on batch.ids[idx] (entropy: None unless
    entropy_coef > 0). `aggregate(per_token, mask)` makes each (rows, S) loss one number, as
    loss_agg_mode says, with the global minibatch's counts (aggregate_loss): the shares of dp
    ranks and microbatches add up. Returns (terms, tokens the surrogate clipped: clip_frac).

    A fork adds a term by wrapping this function; train_minibatch looks it up at each call, so
    the term is trained and logged:

        base = train_ppo.policy_loss_terms

        def with_ratio_penalty(lp, entropy, batch, idx, aggregate, cfg):
            terms, clipped = base(lp, entropy, batch, idx, aggregate, cfg)
            drift = (lp - batch.old_lp[idx]) ** 2  # (rows, S)
            terms["ratio_penalty"] = 0.1 * aggregate(drift, batch.mask[idx])
            return terms, clipped

        train_ppo.policy_loss_terms = with_ratio_penalty

    Every rank must return the same names in the same order (their sums are all-reduced as one
    tensor: step_metrics)."""
    mask, old_lp = batch.mask[idx], batch.old_lp[idx]  # (rows, S) each
    log_ratio = lp - old_lp  # (rows, S) log pi / pi_old
    clip = (cfg.clip_ratio, cfg.clip_ratio_high or None)
    if cfg.policy_loss_mode == "gspo":  # the sequence's ratio, in a clip range of its own (gspo.py)
        log_ratio = gspo.sequence_log_ratio(lp, old_lp, mask)  # (rows, S)
        clip = (cfg.gspo_clip_ratio, cfg.gspo_clip_ratio_high)
    surrogate, clipped = policy_loss(log_ratio, batch.advantages[idx], clip,
                                     cfg.clip_ratio_c)  # (rows, S) each
    terms = {"policy_loss": aggregate(surrogate * batch.weight[idx], mask)}
    if entropy is not None:
        # minus: maximizing the entropy is minimizing this term
        terms["entropy_loss"] = -cfg.entropy_coef * aggregate(entropy, mask)
    if cfg.advantage_estimator != "gae" and batch.ref_lp is not None:
        # DeepSeekMath eq. 3-4: beta * KL(pi || pi_ref) in the loss, k3 on the current policy.
        # Like the surrogate, it is a token mean over the global minibatch (DAPO, Yu et al. 2025;
        # Dr. GRPO, Liu et al. 2025), not eq. 3's mean over responses of per-response means,
        # which weights a short response's tokens more than a long one's.
        kl = kl_penalty(lp, batch.ref_lp[idx], "k3")  # (rows, S)
        terms["kl_loss"] = cfg.kl_coef * aggregate(kl, mask)
    if cfg.teacher:  # on-policy distillation's term, beside the task's or alone (distill.py)
        terms = distill.loss_terms(terms, lp, batch, idx, aggregate, cfg)
    return terms, masked_sum(clipped.float(), mask).detach()


def policy_loss(log_ratio, advantages, clip, clip_ratio_c=0.0):
    """Clipped surrogate (Schulman et al., 2017, eq. 7), per token, as a loss to minimize, from
    each token's log ratio log(pi / pi_old):
        ratio = pi / pi_old,  loss_t = max(-A_t * ratio, -A_t * clip(ratio, 1-eps_lo, 1+eps_hi))
    clip = (eps_lo, eps_hi) (eps_hi None: eps_lo), or one number for both. An upper bound above
    the lower is DAPO's clip-higher (Yu et al., 2025): a rare token with A > 0 may grow further
    per update.
    Dual clip (Ye et al., 2020, "Mastering complex control in MOBA games"; verl's clip_ratio_c),
    if clip_ratio_c = c > 1: where A_t < 0 the loss is also capped at -A_t * c, so a token whose
    ratio has exploded cannot dominate the update. Returns (the per-token loss, which tokens were
    clipped either way), both (B, S): aggregate_loss makes the loss one number. (gspo.py passes a
    sequence's log ratio on each of its tokens instead.)"""
    clip_ratio, clip_ratio_high = clip if isinstance(clip, tuple) else (clip, None)
    clip_ratio_high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    ratio = ratio_from_log(log_ratio)  # (B, S)
    unclipped = -advantages * ratio  # (B, S)
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio_high)  # (B, S)
    per_token = torch.maximum(unclipped, clipped)  # (B, S) the pessimistic bound
    is_clipped = clipped > unclipped  # (B, S) no gradient through the ratio
    if clip_ratio_c > 0:
        dual = (advantages < 0) & (per_token > -advantages * clip_ratio_c)  # (B, S)
        per_token = torch.where(dual, -advantages * clip_ratio_c, per_token)  # (B, S)
        is_clipped |= dual
    return per_token, is_clipped


def ratio_from_log(log_ratio):
    """exp of a log-ratio clamped to +-20 (as verl does): one wild token must not make inf/NaN."""
    return torch.exp(log_ratio.clamp(-20.0, 20.0))


def aggregate_loss(per_token, mask, mode="token-mean", num_tokens=None, num_seqs=None, norm=1.0):
    """One number from a per-token loss (B, S) and its response mask, as `loss_agg_mode` says
    (docs/losses.md compares the modes; the names are verl's, core_algos.agg_loss):

        token-mean               sum_b sum_t m l / N_tok              every token weighs the same
        seq-mean-token-sum       sum_b (sum_t m l) / N_seq
        seq-mean-token-mean      sum_b (sum_t m l / L_b) / N_seq      every response the same
        seq-mean-token-sum-norm  sum_b (sum_t m l) / (N_seq * norm)   Dr. GRPO (Liu et al., 2025)

    with L_b = sum_t m[b, t], the length of response b. N_tok and N_seq are the response tokens
    and the sequences of the *global* minibatch, so that the shares which dp ranks and
    microbatches compute add up to the single-process number (default: this (B, S)'s own, as one
    process with one microbatch sees it). L_b needs no count across ranks: a cp rank sees whole
    rows (the logprobs are gathered over cp) and packed rows are unpacked before any loss. The
    last mode divides each token sum by a constant (Dr. GRPO's code: max_new_tokens), then
    averages over responses."""
    # masked_sum selects, not multiplies: GSPO's log pi - (log pi).detach() is NaN where a trainer
    # logprob on an observation is -inf, and NaN * 0 is NaN
    if mode == "token-mean":
        return masked_sum(per_token, mask) / (mask.sum() if num_tokens is None else num_tokens)
    per_seq = masked_sum(per_token, mask, -1)  # (B,) each response's token sum
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1)  # (B,) its token mean
    elif mode == "seq-mean-token-sum-norm":
        per_seq = per_seq / norm  # (B,)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"unknown loss_agg_mode {mode!r}")
    return per_seq.sum() / (mask.shape[0] if num_seqs is None else num_seqs)


def step_optimizer(optimizer, norm, loss_sums, mesh):
    """Collective over dp. A minibatch's optimizer step, after its microbatches' backwards (their
    gradients added up) and the clip of the global grad norm (`norm`, before clipping): step,
    unless the norm or the loss on some dp rank is NaN/inf (`loss_sums`: {name: the minibatch's
    sum of each loss term}): then skip, weights and AdamW state untouched, as Megatron-LM does.
    Returns whether the step was taken.

    The sums stay on the device: no microbatch reads one back (on a GPU each read would wait for
    the queued kernels, and the host could not queue the next microbatch ahead). An optimizer
    step reads two numbers: the microbatch count (microbatches) and the NaN flag."""
    sums = list(loss_sums.values())
    # the loss is the sum of its terms: finite where each term's sum is
    finite = torch.stack([norm.to(sums[0].device), *sums]).isfinite().all().float()
    dist.all_reduce(finite, op=dist.ReduceOp.MIN, group=mesh["dp"].get_group())
    stepped = bool(finite.item())  # the optimizer step's host read: step or skip, on every rank
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return stepped


def lr_factor(step, warmup_steps):
    """The LR schedule's factor after `step` optimizer steps: linear up to 1 over warmup_steps (in
    PPO steps), then 1 (build_models gives it to each model's LambdaLR)."""
    return min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0


def memory_used_gb():
    """GPU: memory in use by any allocator (mem_get_info: vLLM's sleeping pool, back with the
    driver, would still count in max_memory_allocated). CPU: the peak resident set (ru_maxrss,
    KiB on Linux)."""
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        return (total - free) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def refit(engine, policy, cfg):
    """Collective (every rank). Step 9: the policy into the engine, every weight in buckets
    (rollout.refit), each gathered in the engine's dtype (iter_full_params); returns the refit's
    metrics. An engine that serves adapters beside the base (vLLM under LoRA) gets them alone."""
    if engine.serves_adapters:  # (lora.py)
        return lora.refit(engine, policy, cfg)
    if cfg.rollout_ranks:  # to the rollout ranks, over the bridge (async_rollout.py)
        return engine.send(policy)
    return rollout.refit(engine, model_parallel.iter_full_params(policy, engine.dtype),
                         cfg.refit_bucket_mb)


@torch.no_grad()
def step_metrics(batch, sums, cfg, mesh):
    """Collective over dp. The step's named numbers (every key: docs/metrics.md) from this rank's
    rows and the sums of its update (UpdateSums). Every rank's shares of the
    global sums below are all-reduced together, in one tensor, and read back once; then each
    metric is divided out next to the sums it needs. Every loss term and grad norm the update
    reported is logged under its own name, as a mean over the step's optimizer steps. (Every rank
    reports the same names in the same order: their sums travel in one tensor.)"""
    losses, counts, norms = sums
    mask, reward = batch.mask, batch.reward  # (b, S), (b,)
    log_ratio = batch.old_lp - batch.engine_lp  # (b, S) log pi_old / pi_engine
    shares = dict(tokens=mask.sum(), sequences=len(batch.lens), all_tokens=sum(batch.lens),
                  reward=reward.sum(), reward_sq=(reward ** 2).sum(),
                  logprob_mismatch=masked_sum(log_ratio.abs(), mask),
                  token_mult_prob_error=masked_sum(torch.exp(log_ratio.abs()), mask),
                  # KL(pi_engine || pi_old) estimated from the engine's samples, k1 and k3 (verl's)
                  mismatch_k1=masked_sum(-log_ratio, mask),
                  mismatch_k3=masked_sum(torch.expm1(log_ratio) - log_ratio, mask),
                  # the task's rule, beside what was trained on (a reward model's, a shaping's)
                  task_score=batch.task_score.sum())
    if batch.ref_lp is not None:  # none at kl_coef 0
        shares["kl"] = masked_sum(kl_penalty(batch.old_lp, batch.ref_lp, cfg.kl_estimator), mask)
    if batch.entropy is not None:  # none with old_logprobs=engine or log_entropy=false
        shares["entropy"] = masked_sum(batch.entropy, mask)
    if batch.returns is not None:  # for the explained variance 1 - Var(R - V) / Var(R)
        err = (batch.returns - batch.values) * mask  # (b, S)
        shares.update(ret=batch.returns.sum(), ret_sq=(batch.returns ** 2).sum(), err=err.sum(),
                      err_sq=(err ** 2).sum())
    # the loss terms last, in the order the update reported them, under names of their own: a
    # fork's term may be called anything ("kl", "tokens")
    shares.update(counts)
    shares.update({f"loss {name}": term for name, term in losses.items()})

    def column(numbers):  # numbers and device scalars -> one (n,) float64 tensor on the device
        return torch.stack([torch.as_tensor(v, dtype=torch.float64, device=mask.device)
                            for v in numbers])
    # the shares summed over dp; the norms are global already: one host read for everything
    values = torch.cat([dp_sum(column(shares.values()), mesh), column(norms.values())]).tolist()
    s = dict(zip([*shares, *norms], values))
    # the loss's tokens: at least 1, as overlong_mask may take every response out of the loss
    n_tok, n_seq = max(s["tokens"], 1.0), s["sequences"]

    def variance(name, n):  # E[x^2] - E[x]^2 from the sums of x and of x^2 over n
        return s[name + "_sq"] / n - (s[name] / n) ** 2
    m = dict(reward_mean=s["reward"] / n_seq,
             reward_std=math.sqrt(max(variance("reward", n_seq), 0.0)),
             # each epoch's update sees all n_tok tokens again
             clip_frac=s.get("clipped_tokens", 0.0) / (n_tok * cfg.ppo_epochs),
             skipped_updates=int(s.get("skipped_updates", 0)))
    # means over response tokens (PER_TOKEN, below: the engine's mismatch, and what a run may
    # lack: the KL to the reference, the entropy); per sequence the task's rule
    per = {**dict.fromkeys(PER_TOKEN, n_tok), "task_score": n_seq}
    m.update({name: s[name] / n for name, n in per.items() if name in s})
    if "ret" in s:
        m["value_explained_var"] = 1 - variance("err", n_tok) / max(variance("ret", n_tok), 1e-12)
    updates = cfg.ppo_epochs * cfg.num_minibatches  # optimizer steps of each trained model
    m.update({name: s[f"loss {name}"] / updates for name in losses})
    m.update({name: s[name] / updates for name in norms if name != "skipped_updates"})
    m["tokens"] = int(s["all_tokens"])  # prompt + response tokens of the global batch
    return m


# The metrics that are means over the step's response tokens (step_metrics): the engine's
# mismatch with the trainer's pi_old (mean |log ratio|, mean exp |log ratio|, KL(pi_engine ||
# pi_old) as k1 and k3), and the ones a run may lack.
PER_TOKEN = ("logprob_mismatch", "token_mult_prob_error", "mismatch_k1", "mismatch_k3", "kl",
             "entropy")


# -----------------------------------------------------------------------------
# Beyond one step: what a first reading skips. First what the step calls when the config asks for
# it: RLOO's advantages (compute_advantages) and a learned reward model's pass (ppo_step).

def rloo_advantages(scores, group_size):
    """REINFORCE leave-one-out (Ahmadian et al., 2024, "Back to Basics"; Kool et al., 2019): each
    response's baseline is the mean score of the *other* responses to its prompt,
        A_i = s_i - (sum_j s_j - s_i) / (K - 1)  =  K / (K - 1) * (s_i - mean_j s_j),
    unbiased because a response's own score is not in its baseline. scores: (N,), prompt-major,
    as grpo_advantages."""
    groups = scores.view(-1, group_size)  # (N/K, K)
    others = (groups.sum(1, keepdim=True) - groups) / (group_size - 1)  # (N/K, K)
    return (groups - others).view(-1)  # (N,)


def reward_model_scores(reward_model, batch, cfg, mesh):
    """Collective over the mesh. Step 3 with a learned reward model, under no_grad: its score of
    each sequence (b,), its output at the sequence's last token (forward_reward_model: an
    unshifted read, unlike the critic's), which replaces the task's as the reward (what shaping
    the samples' rule_reward carries stays: batch.reward - batch.task_score). The task's stay in
    batch.task_score, logged beside it: the reward model's opinion and the truth side by side,
    where reward hacking shows."""
    (outputs,) = forward_batch(model_parallel.forward_reward_model, reward_model, batch, cfg, mesh)
    # not gathered through the update and generation (reshard_after_forward=false keeps every
    # unit gathered after a pass)
    model_parallel.reshard(reward_model)
    last = torch.tensor(batch.lens, device=outputs.device) - 1  # (b,) each row's last token
    return outputs[torch.arange(len(batch.lens)), last] + (batch.reward - batch.task_score)


# -----------------------------------------------------------------------------
# Set-up and the loop of steps: distributed, inputs checked, models loaded (after an optional SFT
# warm-up); main runs ppo_step once a step.

def print0(*args):
    if dist.get_rank() == 0:  # rank 0 alone prints (and writes files)
        print(*args, flush=True)


def rank0_decides(value):
    """Collective (every rank): rank 0's `value`, on every rank. What the run reads from a shared
    file system (the checkpoint to resume, whether the SFT dir is done) is decided once: a node
    whose directory listing lags would pick another step, and the collectives that follow would
    not match (a hang, or a crash in the checkpoint reader)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Models(NamedTuple):
    """Every model of the run: the trained ones as {name: Part} (the policy, and the critic with
    gae); the reference, a function whose context makes the policy compute as the initial policy
    (None at kl_coef 0, where nothing reads it); the reward model (or None); and the frozen models
    an extension loads, by name (distill.py's teacher)."""
    parts: dict
    reference: Optional[Callable]
    reward_model: Optional[torch.nn.Module]
    extra: Optional[dict] = None


class UpdateSums(NamedTuple):
    """What update() returns for step_metrics, each {name: sum over the step's optimizer steps}."""
    losses: Counter  # every loss term, this rank's share, in the order reported
    counts: Counter  # clipped_tokens, this rank's share
    norms: Counter  # each model's grad norm and skipped_updates: global already


class Part(NamedTuple):
    """A trained model with its AdamW and LR schedule: what a checkpoint holds of it."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler


def main(cfg, task=None):
    """Train with PPO. `task`: any task (rollout.ToyTask's contract; default: the config's)."""
    cfg.task = cfg.task if task is None else type(task).__name__  # config.json names a fork's task
    if cfg.rollout_ranks and async_rollout.generates_only(cfg):  # (async_rollout.py)
        return async_rollout.serve(cfg, task)  # this rank samples, the others train
    device, mesh, model_dir, resume_dir, task = start_run(cfg, task)
    if cfg.sft_steps:
        model_dir = sft_warmup(model_dir, task, cfg, mesh)
    models = build_models(model_dir, cfg, mesh)
    # the prompt stream: the SFT warm-up drew its first sft_steps * sft_batch_size prompts, PPO goes
    # on from there (a checkpoint saves the position)
    progress = {"step": 0, "prompts_drawn": cfg.sft_steps * cfg.sft_batch_size}
    if resume_dir:
        progress = load_checkpoint(resume_dir, models.parts)
    if resume_dir and cfg.offload_optimizer:  # the moments to host memory (optimizer_offload.py)
        optimizer_offload.to_host(models.parts)
    start_step = progress["step"]
    engine = run_engine(cfg, model_dir, device, task, progress)
    announce(engine, models, cfg, resume_dir, start_step)
    start_metrics_log(cfg, start_step)
    board = None  # a copy of each row as TensorBoard's scalars (tensorboard.py)
    if cfg.tensorboard and dist.get_rank() == 0:
        board = tensorboard.writer(cfg)
    stop_requested = install_stop_handler(device)
    t_start = time.time()
    bad_steps = 0  # steps in a row with a skipped update
    stopped = False
    for step in range(start_step, cfg.steps):
        evaluated = {}
        if cfg.eval_every:  # held-out accuracy, before the step's update (evaluation.py)
            evaluated = evaluation.before_step(engine, task, cfg, step)
        metrics, loss_names, drawn = ppo_step(progress, models, engine, task, cfg, mesh)
        if cfg.eval_every:  # and after the last update: the exported policy's
            evaluated.update(evaluation.after_step(engine, task, cfg, step))
        metrics.update(evaluated)
        log_step(metrics, loss_names, cfg, t_start, start_step, board)
        bad_steps = bad_steps + 1 if metrics["skipped_updates"] else 0
        if cfg.max_skipped_steps and bad_steps >= cfg.max_skipped_steps:
            print0(f"stopping: {bad_steps} steps in a row skipped updates "
                   "(NaN/inf loss or grad norm): lower lr or check the rewards")
            sys.exit(1)
        # the stream advances by the prompts the step drew
        progress.update(step=step + 1, prompts_drawn=progress["prompts_drawn"] + drawn)
        stopped = stop_requested()  # collective: the same answer on every rank
        save_after_step(cfg, models, engine, progress, stopped)
        if stopped:
            print0(f"stopped by a signal after step {step + 1}: checkpoint saved; "
                   "--resume=auto goes on")
            break
    if cfg.export_hf and not stopped:  # (not after a stop signal: the run is not done)
        export(models.parts["policy"].model, cfg, model_dir)
    finish_run(cfg, engine, mesh, t_start)


def start_run(cfg, task):
    """Collective (every rank). The process group, the (dp, cp, tp) mesh and the policy's model dir
    (model_parallel.setup: every model dir is checked, a tiny preset written as a real HF
    checkpoint, the "auto" options resolved); rank 0 makes out_dir and saves the resolved config
    there; the checkpoint to resume from and the task (None: the config's). Bad input is refused
    here, before any heavy work: one line, exit 2. Returns (device, mesh, model_dir, resume_dir,
    task)."""
    try:
        device, mesh, model_dir, kernel = model_parallel.setup(cfg)
        if cfg.lora_rank:  # (lora.py)
            lora.check_device(cfg, device.type)
        if cfg.teacher:  # a teacher's ids must mean the policy's tokens (distill.py)
            distill.check_teacher(cfg, model_dir)
        task = rollout.make_task(cfg, model_dir) if task is None else task
        if cfg.eval_every:  # a task without held-out prompts leaves it idle (evaluation.py)
            evaluation.task_notes(task, cfg)
        if "max_turns" in cfg.given:  # so does a task without turns (multiturn.py)
            multiturn.task_notes(task, cfg)
        # a run of episodes of turns: Dr. GRPO's constant (multiturn.py)
        if rollout.episode_runner(task, cfg) is multiturn.run_episodes:
            multiturn.setup(cfg)
        if dist.get_rank() == 0:
            os.makedirs(os.path.join(cfg.out_dir, "rollouts"), exist_ok=True)
            config.save(cfg, os.path.join(cfg.out_dir, "config.json"))
        resume_dir = find_checkpoint(cfg.resume, cfg.out_dir)
        if torchrun_restarted(device):  # the run's newest checkpoint, whatever resume says
            resume_dir = find_checkpoint("auto", cfg.out_dir) or resume_dir
            print0(f"torchrun restarted the workers: going on from {resume_dir or 'the start'}")
        resume_dir = rank0_decides(resume_dir)
        if resume_dir:  # a LoRA checkpoint resumes as LoRA, a full one in full (lora.py)
            lora.check_resume(resume_dir, cfg)
    except (rollout.TaskError, model_parallel.CheckpointError) as e:
        print0(f"input error: {e}")
        sys.exit(2)
    except config.ConfigError as e:
        print0(f"config error: {e}")
        sys.exit(2)
    print0(f"mesh dp={mesh['dp'].size()} cp={cfg.cp_size} tp={cfg.tp_size} "
           f"on {dist.get_world_size()} x {device.type}, {cfg.dtype}, "
           f"{'packed' if cfg.packing else 'padded'} rows, attention: {kernel}, "
           f"{cfg.advantage_estimator}, {cfg.rollout_engine} engine, "
           f"{cfg.prompts_per_step}x{cfg.samples_per_prompt} samples a step")
    return device, mesh, model_dir, resume_dir, task


def run_engine(cfg, model_dir, device, task, progress):
    """Collective (every rank). The run's engine: none for a replay or a run with no step left;
    under rollout_ranks the trainer's stand-in (rollout.make_engine), and the rollout ranks told
    where to start, whatever is left (async_rollout.py)."""
    generates = cfg.steps > progress["step"] and not cfg.replay_rollouts  # (a replay needs none)
    engine = rollout.make_engine(cfg, model_dir, device, task.eos_id) if generates else None
    if cfg.rollout_ranks:  # where the rollout ranks start (async_rollout.py)
        async_rollout.start(cfg, model_dir, progress)
    return engine


def torchrun_restarted(device):
    """Collective (every rank). Whether torchrun restarted this run's workers: after a worker's
    failure (--max-restarts) or a change of nodes (--nnodes=MIN:MAX). Any rank's count decides:
    an agent that restarts its workers because a node left or joined counts no restart
    (torch.distributed.elastic's agent), so rank 0's own count may be 0. (On the device: NCCL's
    collectives take GPU tensors.)"""
    count = torch.tensor(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return count.item() > 0


def announce(engine, models, cfg, resume_dir, start_step):
    """Collective (every rank). The engine (None: a replay, or no step left to run), refit from the
    resumed policy if the run goes on from a checkpoint (it loaded model_dir); the run's second
    line says how it starts, the engine's dtype and which model runner vLLM picked (in
    config.json too)."""
    started = (f"resumed from {resume_dir}: step {start_step + 1} next" if resume_dir
               else "fresh start")
    runner = getattr(engine, "runner", None)  # vLLM's model runner: in the log and config.json
    started = f"{started}, vLLM's {runner} model runner" if runner else started
    dtype = str(getattr(engine, "dtype", "")).removeprefix("torch.")  # offpolicy.py may set it
    print0(f"{started}, the engine in {dtype}" if engine is not None else started)
    if runner and dist.get_rank() == 0:
        config.save(cfg, os.path.join(cfg.out_dir, "config.json"), vllm_model_runner=runner)
    if engine is not None and start_step:  # the engine loaded model_dir: give it the resumed policy
        refit(engine, models.parts["policy"].model, cfg)


def sft_warmup(model_dir, task, cfg, mesh):
    """Collective (every rank). Supervised warm-up on the task's reference answers, the usual
    first stage of RLHF, kept short on purpose: PPO should start from a policy that knows the
    format and is right sometimes. Saved as out_dir/sft (reused when present); returns that dir.
    It trains every weight, also under LoRA (lora.py): it stands in for the pretraining and
    instruction tuning that a toy model lacks, and LoRA then adapts its result in PPO (adapters
    on a random model learn nothing: make demo with lora_rank=8 and a LoRA warm-up stayed at
    reward 0.04)."""
    sft_dir = os.path.join(cfg.out_dir, "sft")
    if rank0_decides(os.path.isfile(os.path.join(sft_dir, "config.json"))):
        return sft_dir
    policy = model_parallel.load_policy(model_dir, mesh, cfg)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.sft_lr, weight_decay=0.0, fused=True)
    plain = replace(cfg, temperature=1.0)  # the answers' likelihood under the model itself
    for it in range(cfg.sft_steps):
        prompts, answers, masks = rollout.sft_examples(task, cfg, it, mesh["dp"].get_local_rank(),
                                                       mesh["dp"].size())
        # the mask: the model's tokens of each answer (a tool's output in a trace is not trained on)
        batch = make_batch(prompts, answers, task.pad_id, device=mesh.device_type,
                           action_masks=masks)
        num_tokens = dp_sum(batch.mask.sum(), mesh)  # global answer tokens
        loss_sum = Counter()
        micros = micro_rows(range(len(prompts)), batch, cfg, mesh)
        for i, (idx, lens, weight) in enumerate(micros):
            # DDP's gradient all-reduce in the last backward (as train_minibatch)
            model_parallel.sync_gradients(policy, sync=i == len(micros) - 1)
            lp, _ = model_parallel.forward_policy(policy, batch.ids[idx], lens, mesh, plain)
            # the answers' mean negative log-likelihood
            nll = -masked_sum(lp, batch.mask[idx]) / num_tokens
            (weight * nll).backward()
            loss_sum.update(sft_loss=weight * nll.detach())
        norm = model_parallel.clip_grad_norm(list(policy.parameters()), cfg.max_grad_norm)
        step_optimizer(optimizer, norm, loss_sum, mesh)
        if it % 10 == 0 or it == cfg.sft_steps - 1:
            print0(f"sft {it + 1}/{cfg.sft_steps}")
    # + the tokenizer and generation_config (the stop ids) of model_dir
    model_parallel.save_hf(policy, sft_dir, copy_from=model_dir)
    return sft_dir


def build_models(model_dir, cfg, mesh):
    """Collective (every rank). {name: (model, AdamW, LR schedule)} for the policy and (gae only)
    the critic, which is what a checkpoint holds; the reference policy (a context in which the
    policy computes as it began: its initial shards swapped in); the reward model if any (frozen:
    no optimizer, not checkpointed); and the frozen models an extension loads."""
    adapt = None
    if cfg.lora_rank:  # LoRA: adapters beside the frozen base, added before sharding (lora.py)
        adapt = lora.add_adapters
    policy = model_parallel.load_policy(model_dir, mesh, cfg, adapt=adapt)
    reference = None  # (at kl_coef 0 nothing reads a reference: none is kept)
    if cfg.lora_rank and cfg.kl_coef > 0:  # under LoRA the base: the adapters off (lora.py)
        reference = functools.partial(lora.adapters_off, policy)
    if reference is None and cfg.kl_coef > 0:
        snapshot = model_parallel.snapshot_weights(
            policy, torch.bfloat16 if cfg.dtype == "bf16" else None)
        reference = functools.partial(model_parallel.swapped_weights, policy, snapshot)

    def part(model, lr):
        # fused: one kernel over every parameter (torch's default on CPU is a per-tensor loop,
        # 20x slower here); the same math, in a different order of float operations
        # (under LoRA the adapters alone: the frozen base gets no moments)
        trained = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=cfg.weight_decay, fused=True)
        warmup = functools.partial(lr_factor, warmup_steps=cfg.warmup_steps)
        return Part(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, warmup))

    parts = {"policy": part(policy, cfg.lr)}
    if cfg.advantage_estimator == "gae":  # GRPO has no critic: none is loaded, trained or saved
        critic = model_parallel.load_critic(cfg.critic_model or model_dir, mesh, cfg)
        parts["critic"] = part(critic, cfg.critic_lr)
    reward_model = (model_parallel.load_reward_model(cfg.reward_model, mesh, cfg)
                    if cfg.reward_model else None)
    extra = {}
    if cfg.teacher:  # on-policy distillation's teacher, sharded like the policy (distill.py)
        extra["teacher"] = distill.load_teacher(cfg, mesh)
    return Models(parts, reference, reward_model, extra)


# -----------------------------------------------------------------------------
# Run plumbing, after the step it serves: the console line and metrics log, the plot, the stop
# signal; the run's end.

def log_step(metrics, loss_names, cfg, t_start, start_step, board):
    """Rank 0: append the step's row to metrics.jsonl (and TensorBoard's scalars), print one line,
    redraw the plot. `loss_names`: the loss terms the update reported, in its order; the console
    line and the plot show those and no others."""
    if dist.get_rank() != 0:
        return
    step = metrics["step"]
    path = os.path.join(cfg.out_dir, "metrics.jsonl")
    with open(path, "a") as f:
        f.write(json.dumps(metrics) + "\n")
    if board is not None:  # a copy: metrics.jsonl stays the record (tensorboard.py)
        tensorboard.write(board, metrics, step)
    elapsed = time.time() - t_start
    eta = elapsed / (step + 1 - start_step) * (cfg.steps - step - 1)
    fields = [f"step {step + 1}/{cfg.steps}", f"reward {metrics['reward_mean']:.3f}",
              f"kl {metrics['kl']:.4f}" if "kl" in metrics else "kl -"]
    fields += [f"{name} {metrics[name]:+.4f}" for name in loss_names]
    fields += [f"len {metrics['response_len_mean']:.1f}", f"{metrics['time_step_s']:.1f}s/step",
               f"elapsed {elapsed:.0f}s", f"eta {eta:.0f}s"]
    print(" | ".join(fields), flush=True)
    if cfg.plot_every and ((step + 1) % cfg.plot_every == 0 or step + 1 == cfg.steps):
        plot_curves(path, os.path.join(cfg.out_dir, "curves.png"), loss_names)


def plot_curves(metrics_path, png_path, loss_names):
    """Rank 0: reward, KL and each loss term in `loss_names` against step, a panel each, from
    metrics.jsonl. A curve skips the rows without its key (a run resumed with another set)."""
    import matplotlib
    matplotlib.use("Agg")  # no display on a training node
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in open(metrics_path)]
    keys = ["reward_mean", "kl", *loss_names]
    n_rows = math.ceil(len(keys) / 2)
    fig, axes = plt.subplots(n_rows, 2, figsize=(9, 3 * n_rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        having = [r for r in rows if key in r]
        ax.plot([r["step"] for r in having], [r[key] for r in having])
        ax.set(title=key, xlabel="step")
    for ax in axes.flat[len(keys):]:  # an odd number of panels
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(png_path + ".tmp.png")
    plt.close(fig)
    os.replace(png_path + ".tmp.png", png_path)


def install_stop_handler(device):
    """SIGTERM (preemption) or Ctrl-C: finish the step, save, exit 0. A second signal kills.
    Returns stop_requested(): collective (every rank calls it); True once any rank got a signal."""
    got = [0.0]

    def handler(signum, frame):
        got[0] = 1.0
        signal.signal(signum, signal.SIG_DFL)  # the next one kills

    def stop_requested():
        flag = torch.tensor(got, device=device)  # ranks may get the signal at different steps
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    return stop_requested


def start_metrics_log(cfg, start_step):
    """Rank 0: a fresh run starts a fresh metrics.jsonl, a resumed one keeps the rows before its
    step."""
    path = os.path.join(cfg.out_dir, "metrics.jsonl")
    if dist.get_rank() != 0:
        return
    kept = []
    if os.path.exists(path):  # read before open(path, "w") empties the file
        kept = [line for line in open(path) if json.loads(line)["step"] < start_step]
    with open(path, "w") as f:
        f.writelines(kept)


def finish_run(cfg, engine, mesh, t_start):
    """Collective (every rank). The end of a run: the summary line, then the data side (the last
    rollout dumps on disk, the engine and the process group let go: rollout.close) and the mesh."""
    dist.barrier()
    if dist.get_rank() == 0:
        print(summary(cfg, time.time() - t_start), flush=True)
    rollout.close(engine)
    model_parallel.release_mesh(mesh)


def summary(cfg, seconds):
    """The run's last line (rank 0): steps, time, reward at the start and at the end (means of
    the first and the last 5 steps), with a reward model the task's rule the same way, validation
    accuracy first -> last (and the best), and where the run wrote what."""
    rows = [json.loads(line) for line in open(os.path.join(cfg.out_dir, "metrics.jsonl"))]

    def first_last(key):
        """The means of the first and the last 5 rows that have `key`."""
        values = [r[key] for r in rows if key in r]
        return sum(values[:5]) / len(values[:5]), sum(values[-5:]) / len(values[-5:])
    text = f"done: {len(rows)} steps in {seconds / 60:.1f} min"
    if rows:  # (none with steps=0: the SFT warm-up alone)
        text += " | reward {:.3f} (first 5 steps) -> {:.3f} (last 5)".format(
            *first_last("reward_mean"))
    if rows and cfg.reward_model:  # the reward model's score above, the truth here
        text += " | task_score {:.3f} -> {:.3f}".format(*first_last("task_score"))
    val = [r[k] for r in rows for k in ("val_accuracy", "final_val_accuracy") if k in r]
    if val:
        text += f" | val_accuracy {val[0]:.3f} -> {val[-1]:.3f} (best {max(val):.3f})"
    # what is in out_dir now (hf/: the policy, for transformers and vLLM; ckpt/: resume=auto's)
    names = sorted(n for n in os.listdir(cfg.out_dir)
                   if not n.startswith(".") and not n.endswith(".tmp"))
    wrote = [name + ("/" if os.path.isdir(os.path.join(cfg.out_dir, name)) else "")
             for name in names]
    return f"{text} | in {cfg.out_dir}: {', '.join(wrote)}"


# -----------------------------------------------------------------------------
# Training checkpoints (torchtitan's recipe): torch.distributed.checkpoint (DCP) writes one file
# per rank with each shard's global offsets, and reads back whatever pieces the loading mesh's
# shards need. get_state_dict/set_state_dict name everything by the plain module FQN, so a
# checkpoint saved at dp=2 loads at tp=2 (or dp=1, cp=2, ...). Beside it, every rank saves its
# small trainer state (progress, LR schedulers, RNG states) with torch.save.
# `parts` is {name: Part}, the same names when saving and loading.

def _complete_steps(root):
    """The N of every complete root/step_N, in increasing order."""
    names = os.listdir(root) if os.path.isdir(root) else []
    matches = [re.fullmatch(r"step_(\d+)", name) for name in names]
    return sorted(int(m[1]) for m in matches
                  if m and config.is_checkpoint(os.path.join(root, m[0])))


def find_checkpoint(resume, out_dir):
    """The checkpoint dir to resume from, or None for a fresh run. resume="auto": the newest
    complete out_dir/ckpt/step_N (None if there is none yet: the same command line starts and
    restarts a preemptible job); a path: that dir (config.validate refused it unless complete)."""
    if resume == "auto":
        steps = _complete_steps(os.path.join(out_dir, "ckpt"))
        return os.path.join(out_dir, "ckpt", f"step_{steps[-1]}") if steps else None
    return resume or None


# A model's trained parameters alone: under LoRA the frozen base is not saved (every run loads it
# from the model dir), only the adapters, a few MB. (strict=False: the frozen keys are missing by
# design; the trained ones cannot be, dcp.load refuses a checkpoint that lacks one.)
TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True, strict=False)


def _sharded_state(parts, optimizers):
    """{name: model state, and name_optimizer: optimizer state for each name in `optimizers`},
    DTensor shards named by FQN. An optimizer that has not stepped (the policy's, in the critic's
    warm-up) has no state to save: asked for one, get_optimizer_state_dict would create it (a
    step at lr 0, AdamW's moments allocated on the GPU while vLLM is awake), and the policy's
    first real update would then be bias-corrected as AdamW's second."""
    state = {}
    for name, part in parts.items():
        model_parallel.reshard(part.model)  # the registered parameters must be the sharded ones
        state[name] = get_model_state_dict(part.model, options=TRAINED_ONLY)
        if name in optimizers:
            state[name + "_optimizer"] = get_optimizer_state_dict(part.model, part.optimizer)
    return state


def save_after_step(cfg, models, engine, progress, stopped):
    """Collective (every rank), after each step (`progress`: the steps done). With save_every, a
    checkpoint every save_every steps and after the last; a stopped run saves too, so that
    resume=auto goes on from there."""
    done = progress["step"]
    periodic = cfg.save_every and (done % cfg.save_every == 0 or done == cfg.steps)
    if not (stopped or periodic):
        return
    if cfg.rollout_ranks:  # with the batches sampled ahead (async_rollout.py)
        progress["in_flight"] = engine.in_flight(done)
    save_checkpoint(os.path.join(cfg.out_dir, "ckpt"), models.parts, cfg.keep_checkpoints,
                    progress)


def save_checkpoint(root, parts, keep, progress):
    """Collective (every rank). Save parts, the trainer's counters `progress` ({"step": steps
    done, ...}) and every RNG state as root/step_N. Written to step_N.tmp and renamed once every
    rank is done, so a dir named step_N is always complete (resume ignores .tmp dirs); then only
    the newest `keep` remain (0 = all)."""
    rank = dist.get_rank()
    path = os.path.join(root, f"step_{progress['step']}")
    if rank == 0:
        shutil.rmtree(path + ".tmp", ignore_errors=True)  # left by a run killed while saving
        os.makedirs(path + ".tmp")
    dist.barrier()
    stepped = [name for name, part in parts.items() if part.optimizer.state]
    # collective; files fsynced
    dcp.save(_sharded_state(parts, stepped), checkpoint_id=path + ".tmp")
    trainer_state = dict(progress=progress, rng=rollout.rng_states(),
                         schedulers={name: part.schedule.state_dict()
                                     for name, part in parts.items()})
    torch.save(trainer_state, os.path.join(path + ".tmp", f"trainer_state_rank{rank}.pt"))
    dist.barrier()  # every rank's files are written
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.replace(path + ".tmp", path)  # atomic on one file system
        if keep:
            for old in _complete_steps(root)[:-keep]:
                shutil.rmtree(os.path.join(root, f"step_{old}"))
        for name in os.listdir(root):  # saves that were killed before their rename
            if name.endswith(".tmp"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    dist.barrier()
    return path


def export(policy, cfg, model_dir):
    """Collective (every rank): the trained policy as an HF checkpoint dir, out_dir/hf, in
    export_dtype, with the tokenizer files and generation_config of model_dir (under LoRA the
    adapters merged), and under LoRA the adapters alone too, out_dir/adapter, for peft over the
    base (lora.py)."""
    dtype = torch.bfloat16 if cfg.export_dtype == "bf16" else torch.float32
    model_parallel.save_hf(policy, os.path.join(cfg.out_dir, "hf"), dtype, copy_from=model_dir)
    if cfg.lora_rank:
        lora.save_adapter(policy, os.path.join(cfg.out_dir, "adapter"), cfg, model_dir)


def load_checkpoint(path, parts):
    """Collective (every rank). Load a save_checkpoint dir into parts (on any mesh) and this
    rank's RNG states; return the saved `progress` dict. A rank the saving run did not have
    takes rank 0's RNG states. AdamW's moments are created on the trainer's device
    (optimizer_offload.py moves them to host memory next, if it is on)."""
    # the optimizers the saving run had stepped, as its files name them
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    stepped = [name for name in parts if any(key.startswith(name + "_optimizer.") for key in saved)]
    state = _sharded_state(parts, stepped)
    dcp.load(state, checkpoint_id=path)  # collective: each rank reads the pieces its shards cover
    state_file = os.path.join(path, f"trainer_state_rank{dist.get_rank()}.pt")
    if not os.path.isfile(state_file):  # a rank the saving run did not have
        state_file = os.path.join(path, "trainer_state_rank0.pt")
    # tensors and plain numbers only (rollout.rng_states): weights_only runs no code. dcp.load
    # above does read the checkpoint's metadata with pickle: a checkpoint is trusted input
    trainer_state = torch.load(state_file, weights_only=True)
    rollout.set_rng_states(trainer_state["rng"])
    for name, part in parts.items():
        set_model_state_dict(part.model, state[name], options=TRAINED_ONLY)
        part.schedule.load_state_dict(trainer_state["schedulers"][name])
        if name in stepped:
            set_optimizer_state_dict(part.model, part.optimizer, state[name + "_optimizer"])
    return trainer_state["progress"]


if __name__ == "__main__":
    main(CFG)
    gc.collect()  # the models held process groups in reference cycles: free them now (release_mesh)
