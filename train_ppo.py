"""PPO for a Hugging Face causal LM on a PyTorch device mesh. Launch:

    torchrun --nproc_per_node=2 train_ppo.py --config configs/demo_cpu.toml  # CPU demo, 2 processes (`make demo`)
    torchrun --nproc_per_node=8 train_ppo.py --config FILE --tp_size=2  # 1 node, 8 GPUs: 4 dp replicas x tp 2
    # 2 nodes (run on each, same --rdzv_endpoint):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 train_ppo.py --config FILE
    python train_ppo.py --help  # every option with its default and doc

The algorithm is PPO with a learned critic and GAE, as used for RLHF by InstructGPT (Ouyang et al., 2022) and
documented in "The N+ implementation details of RLHF with PPO" (Huang et al., 2024). One step, in main()'s order:
  1. draw the next prompts (shuffled epochs, the same on every rank); each data-parallel (dp) rank keeps its slice,
     which the slice's tp x cp ranks generate in equal shares
  2. rollout: the engine samples responses and returns its own logprob of each token
  3. reward: a rule-based score per sequence, placed on its last response token
  4. forward passes without grad: old policy logprobs (or the engine's), reference logprobs, values
  5. per-token reward = score - kl_coef * KL(policy || reference)
  6. GAE -> advantages and returns; advantages whitened over the whole global batch
  7. ppo_epochs x minibatches x microbatches of clipped policy and value losses
  8. global grad-norm clip, AdamW step (policy and critic each have their own)
  9. refit: the new policy weights are streamed into the rollout engine
 10. metrics, rollout dump, plot; a checkpoint every save_every steps (resume=auto continues)
advantage_estimator="grpo" swaps steps 4-6 for group-normalized scores and drops the critic.

How one row lines up. Every (b, S) tensor in this file follows one convention: position i holds everything about the
action "emit token x_i given x_<i". A model's logits at position i predict x_{i+1}, so the logprob of x_i comes from
the logits at i-1, and the value of the state before x_i from the critic's head on the hidden state at i-1 (the right
shift that NeMo-RL, verl, OpenRLHF and TRL all use). Prompt "2+3=", response "5<eos>":

    position i            0     1     2     3     4            5
    token x_i             2     +     3     =     5            <eos>
    response mask         0     0     0     0     1            1
    logprobs[i]           0     .     .     .     logits[3]    logits[4]    (log pi(x_i | x_<i))
    values[i]             0     .     .     .     head(h[3])   head(h[4])   (V of the state x_<i)
    rewards[i]            0     0     0     0     -kl_coef*kl  score - kl_coef*kl

('.' = computed, or 0 where the LM head skips the prompt: never in a loss.) Position 0 has no prediction and holds 0,
as does every packed sequence start; losses and statistics see the mask.

Deviations from the paper's PPO, on purpose:
  1. the minibatch split is fixed across epochs (no reshuffle), so that every mesh trains on the same minibatches;
  2. the KL penalty uses a fixed kl_coef (no adaptive KL controller);
  3. there is no reward model: the toy task's reward is a rule (as in RLVR / GSM8K).
Deliberately left out: pretraining-loss mixing (PPO-ptx), reward normalization.
"""
import gc
import json
import math
import os
import re
import shutil
import signal
import sys
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import config

# Fail fast: a bad config is refused here, in a fraction of a second, before importing torch and transformers (10+ s).
if __name__ == "__main__":
    CFG = config.load(sys.argv[1:], world_size=int(os.environ.get("WORLD_SIZE", "1")))  # torchrun sets WORLD_SIZE

import torch  # noqa: E402  (after the config check, on purpose)
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from transformers import AutoConfig  # noqa: E402

import model_parallel  # noqa: E402
import rollout  # noqa: E402


# -----------------------------------------------------------------------------
# PPO math: small pure functions for tests and readers, on (B, S) tensors aligned as above; `mask` is 1 on response
# tokens. Losses: token sums / `num_tokens`, the global minibatch's response tokens, independent of dp and microbatches.

def masked_sum(x, mask):
    return (x * mask).sum()


def ratio_from_log(log_ratio):
    """exp of a log-ratio clamped to +-20 (as verl does): one wild token must not make inf/NaN."""
    return torch.exp(log_ratio.clamp(-20.0, 20.0))


def kl_penalty(logprobs, ref_logprobs, kind="k1"):
    """Per-token estimate of KL(pi || pi_ref) from the sampled token (Schulman, "Approximating KL divergence", 2020).
    k1 = log(pi/pi_ref): unbiased, can be negative per token. k3 = (r - 1) - log r, r = pi_ref/pi: unbiased, >= 0,
    lower variance; clamped to <= 10 as verl's low_var_kl: one collapsed token (log r = 88) would give e^88 = inf."""
    log_ratio = logprobs - ref_logprobs  # (B, S)
    if kind == "k1":
        return log_ratio
    if kind == "k3":  # the input clamp keeps exp (and its gradient, 0 past the clamp) finite
        log_ratio = log_ratio.clamp(-20.0, 20.0)  # (B, S)
        return (torch.expm1(-log_ratio) + log_ratio).clamp(max=10.0)  # (B, S) = (r - 1) - log r
    raise ValueError(f"unknown KL estimator {kind!r}")


def compute_gae(rewards, values, mask, gamma, lam):
    """Generalized advantage estimation (Schulman et al., 2016, eq. 16), right to left:
        delta_t = r_t + gamma * V_next - V_t,   A_t = delta_t + gamma * lam * A_next
    where "next" is the next *response* token of the row: positions outside the mask (the prompt, padding, or a gap
    such as a tool's output) are skipped, and after the last response token the episode ends (V_next = 0, A_next = 0).
    Returns (advantages, returns) with returns = A + V, both 0 outside the mask."""
    B, S = rewards.shape
    next_value = next_adv = torch.zeros(B, dtype=values.dtype, device=values.device)  # (B,) each
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


def grpo_advantages(scores, group_size, eps=1e-4):
    """GRPO's outcome-supervised advantage (Shao et al., 2024, DeepSeekMath, sec. 4.1.2): each response's score minus
    the mean of its prompt's group of `group_size` responses, divided by the group's (unbiased) std; equal scores get
    0. scores: (N,) for the *global* batch, prompt-major (response j belongs to prompt j // group_size)."""
    groups = scores.view(-1, group_size)  # (N/K, K)
    normalized = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + eps)  # (N/K, K)
    return normalized.view(-1)  # (N,)


def masked_whiten(x, mask, group=None, eps=1e-8):
    """Collective over `group` (dp). (x - mean) / std over the masked tokens of the *global* batch (sum,
    sum of squares and count all-reduced over the group), never per rank. Unbiased, as TRL's masked_whiten."""
    stats = torch.stack([masked_sum(x, mask), masked_sum(x * x, mask), mask.sum()]).double()
    if group is not None:
        dist.all_reduce(stats, group=group)
    total, total_sq, n = stats
    mean = total / n
    var = (total_sq - n * mean * mean) / (n - 1).clamp(min=1)
    return ((x - mean) * torch.rsqrt(var + eps)).to(x.dtype) * mask


def policy_loss(logprobs, old_logprobs, advantages, mask, clip_ratio, num_tokens=None, tis_weight=None,
                clip_ratio_c=0.0):
    """Clipped surrogate (Schulman et al., 2017, eq. 7), as a loss to minimize:
        ratio = pi / pi_old,  loss_t = max(-A_t * ratio, -A_t * clip(ratio, 1-eps, 1+eps))
    Dual clip (Ye et al., 2020, "Mastering complex control in MOBA games"; verl's clip_ratio_c) if clip_ratio_c = c > 1:
    where A_t < 0 the loss is also capped at -A_t * c: no token whose ratio exploded can dominate. `tis_weight` (B, S),
    optional: truncated importance weights (engine/trainer mismatch). Returns (loss, tokens clipped either way)."""
    num_tokens = mask.sum() if num_tokens is None else num_tokens
    ratio = ratio_from_log(logprobs - old_logprobs)  # (B, S)
    unclipped = -advantages * ratio  # (B, S)
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio)  # (B, S)
    per_token = torch.maximum(unclipped, clipped)  # (B, S) the pessimistic bound
    is_clipped = clipped > unclipped  # (B, S) no gradient through the ratio
    if clip_ratio_c > 0:
        dual = (advantages < 0) & (per_token > -advantages * clip_ratio_c)  # (B, S)
        per_token = torch.where(dual, -advantages * clip_ratio_c, per_token)  # (B, S)
        is_clipped |= dual
    if tis_weight is not None:
        per_token = per_token * tis_weight
    return masked_sum(per_token, mask) / num_tokens, masked_sum(is_clipped.float(), mask).detach()


def value_loss(values, old_values, returns, mask, value_clip, num_tokens=None):
    """Clipped value loss (PPO2 baselines; "N+ details" #9); value_clip = 0 turns it off (plain 0.5 * (V - R)^2):
        v_clip = V_old + clip(V - V_old, -c, c),  loss_t = 0.5 * max((V - R)^2, (v_clip - R)^2)"""
    num_tokens = mask.sum() if num_tokens is None else num_tokens
    loss = (values - returns) ** 2  # (B, S)
    if value_clip > 0:
        v_clipped = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
        loss = torch.maximum(loss, (v_clipped - returns) ** 2)  # (B, S)
    return 0.5 * masked_sum(loss, mask) / num_tokens


# -----------------------------------------------------------------------------
# Plumbing: which samples a rank owns, batches as tensors, microbatches, statistics.

def print0(*args):
    if dist.get_rank() == 0:  # rank 0 alone prints (and writes files)
        print(*args, flush=True)


def dp_sum(tensor, mesh):
    """Collective over dp. In-place sum over the dp ranks (each holds a share of the global batch)."""
    dist.all_reduce(tensor, group=mesh["dp"].get_group())
    return tensor


def local_indices(global_batch, num_minibatches, dp_size, dp_rank):
    """Global sample indices of this dp rank, minibatch-major. Global minibatch m is the contiguous block [m*M, (m+1)*M)
    of the step's samples on every mesh; rank r keeps its r-th slice of each block: membership does not depend on dp."""
    per_minibatch = global_batch // num_minibatches
    per_rank = per_minibatch // dp_size
    return [m * per_minibatch + dp_rank * per_rank + i for m in range(num_minibatches) for i in range(per_rank)]


def samples_of(cfg, mesh, rank=None):
    """Global sample indices of a rank's dp slice (default: this rank's)."""
    dp_rank = mesh["dp"].get_local_rank() if rank is None else int((mesh.mesh == rank).nonzero()[0, 0])
    return local_indices(cfg.global_batch_size, cfg.num_minibatches, mesh["dp"].size(), dp_rank)


@dataclass
class Batch:
    """This rank's sequences as right-padded (b, S) tensors, aligned as above; steps 4-6 fill in the Optional fields."""
    ids: torch.Tensor  # (b, S) prompt + response token ids, pad_id after the end
    mask: torch.Tensor  # (b, S) 1 on response tokens
    engine_lp: torch.Tensor  # (b, S) the engine's logprob of each response token
    lens: list  # b ints: prompt + response tokens of each row
    unscored: int  # the shortest prompt: leading positions that no row scores
    old_lp: Optional[torch.Tensor] = None  # (b, S) policy that sampled, as the trainer computes it
    ref_lp: Optional[torch.Tensor] = None  # (b, S) reference (initial) policy
    entropy: Optional[torch.Tensor] = None  # (b, S) of the policy's next-token distribution
    values: Optional[torch.Tensor] = None  # (b, S) critic before the update (gae only)
    advantages: Optional[torch.Tensor] = None  # (b, S)
    returns: Optional[torch.Tensor] = None  # (b, S) value targets (gae only)
    tis: Optional[torch.Tensor] = None  # (b, S) truncated importance weights


def make_batch(prompts, responses, pad_id, engine_logprobs=None, device="cpu"):
    """A Batch on `device`, where the whole step then stays, from token id lists (prompt i, response i, logprobs)."""
    lens = [len(p) + len(r) for p, r in zip(prompts, responses)]
    ids = torch.full((len(lens), max(lens)), pad_id, dtype=torch.long)  # (b, S)
    mask, engine_lp = torch.zeros(ids.shape), torch.zeros(ids.shape)  # (b, S) each
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, :lens[i]] = torch.tensor(p + r)
        mask[i, len(p):lens[i]] = 1
        if engine_logprobs is not None:
            engine_lp[i, len(p):lens[i]] = torch.tensor(engine_logprobs[i], dtype=torch.float32)
    return Batch(ids.to(device), mask.to(device), engine_lp.to(device), lens, min(map(len, prompts)))


def micro_rows(micro, rows):
    """Rows of a microbatch (indices into `rows`), weight; [] is a dummy matching dp's collectives: a row, weight 0."""
    return ([rows[i] for i in micro], 1.0) if micro else ([rows[0]], 0.0)


class StepStats:
    """Named sums for a step's metrics: `add` this rank's share (dp-summed in totals), `add_global` a global number."""

    def __init__(self, device):
        self.shares, self.globals, self.device = Counter(), Counter(), device  # Counter.update adds

    def add(self, **shares):
        self.shares.update({name: float(value) for name, value in shares.items()})

    def add_global(self, **values):
        self.globals.update({name: float(value) for name, value in values.items()})

    def totals(self, mesh):
        """Every sum over the global batch: one all-reduce for all of them (collective over dp)."""
        names = sorted(self.shares)  # on the trainer's device, as every collective's tensor (NCCL)
        summed = dp_sum(torch.tensor([self.shares[n] for n in names], dtype=torch.float64, device=self.device), mesh)
        return dict(zip(names, summed.tolist()), **self.globals)


def memory_used_gb():
    """GPU: memory used by any allocator (mem_get_info, not vLLM's sleeping pool). CPU: peak RSS (ru_maxrss, KiB)."""
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        return (total - free) / 2**30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


@contextmanager
def timed(times, name):
    """times[name] = wall seconds of the block (after the GPU's queued work is done)."""
    start = time.time()
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # GPU only: kernels run asynchronously
    times[name] = time.time() - start


# -----------------------------------------------------------------------------
# Set-up: distributed, inputs checked, models loaded (after an optional SFT warm-up).

def prepare_inputs(cfg, task):
    """Model dir (tiny presets become real HF checkpoints), checkpoint to resume, task. Bad input: one line, exit 2."""
    model_dir = cfg.model
    if model_dir in model_parallel.TINY_PRESETS:
        model_dir = model_parallel.materialize_tiny_model(cfg.model, cfg.out_dir, cfg.seed)
    try:
        for path in filter(None, (model_dir, cfg.critic_model)):
            model_parallel.check_hf_dir(path, cfg.tp_size)
        resume_dir = find_checkpoint(cfg.resume, cfg.out_dir)
        if task is None:
            task = rollout.make_task(cfg, model_dir, AutoConfig.from_pretrained(model_dir).vocab_size)
    except (rollout.TaskError, model_parallel.CheckpointError) as e:
        print0(f"input error: {e}")
        sys.exit(2)
    return model_dir, resume_dir, task


def sft_warmup(model_dir, task, cfg, mesh):
    """Collective (every rank). A short supervised warm-up on the task's reference answers (RLHF's usual first stage):
    PPO should start from a policy that knows the format and is sometimes right. Returns out_dir/sft (kept, reused)."""
    sft_dir = os.path.join(cfg.out_dir, "sft")
    if os.path.isfile(os.path.join(sft_dir, "config.json")):
        return sft_dir
    policy = model_parallel.load_policy(model_dir, mesh, cfg)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.sft_lr, weight_decay=0.0, fused=True)
    per_rank = cfg.sft_batch_size // mesh["dp"].size()
    for it in range(cfg.sft_steps):
        pairs = task.prompts(it * cfg.sft_batch_size, cfg.sft_batch_size)  # the start of the prompt stream
        mine = pairs[mesh["dp"].get_local_rank() * per_rank:][:per_rank]
        batch = make_batch([task.encode(p) for p, _ in mine], [task.target(a) for _, a in mine], task.pad_id,
                           device=mesh.device_type)
        num_tokens = dp_sum(batch.mask.sum(), mesh)  # global answer tokens

        def nll(idx):  # mean negative log-likelihood of the answers
            lp, _ = model_parallel.forward_policy(policy, batch.ids[idx], [batch.lens[i] for i in idx], mesh, cfg)
            return -masked_sum(lp, batch.mask[idx]) / num_tokens, {}
        minibatch_update(policy, optimizer, nll, list(range(len(mine))), batch, cfg, mesh)
        if it % 10 == 0 or it == cfg.sft_steps - 1:
            print0(f"sft {it + 1}/{cfg.sft_steps}")
    model_parallel.save_hf(policy, sft_dir, copy_from=model_dir)  # + tokenizer, generation_config (stop ids)
    return sft_dir


def build_models(model_dir, cfg, mesh):
    """Collective (every rank). {name: (model, AdamW, LR schedule)} for the policy and (gae only) the critic, the
    content of a checkpoint; and the reference policy: a copy of the policy's initial shards."""
    policy = model_parallel.load_policy(model_dir, mesh, cfg)
    reference = model_parallel.snapshot_weights(policy, torch.bfloat16 if cfg.dtype == "bf16" else None)
    models = {"policy": (policy, cfg.lr)}
    if cfg.advantage_estimator == "gae":  # GRPO has no critic: none is loaded, trained or saved
        models["critic"] = (model_parallel.load_critic(cfg.critic_model or model_dir, mesh, cfg), cfg.critic_lr)
    parts = {}
    for name, (model, lr) in models.items():
        # fused: one kernel for all parameters, 20x faster here on CPU than the default loop; float ops in another order
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.weight_decay, fused=True)
        warmup = lambda step: min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0  # noqa: E731
        parts[name] = (model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, warmup))
    return parts, reference


# -----------------------------------------------------------------------------
# Steps 1-3: prompts, rollout, reward.

def generated_by(cfg, mesh, rank):
    """Global indices of the samples `rank` generates: its dp slice split (not repeated) in equal tp x cp shares."""
    members = mesh.mesh[int((mesh.mesh == rank).nonzero()[0, 0])].flatten().tolist()  # its dp slice's ranks
    slice_, mine, k = samples_of(cfg, mesh, rank), members.index(rank), len(members)
    return slice_[mine * len(slice_) // k:(mine + 1) * len(slice_) // k]


def generate(engine, task, cfg, step, start, mesh):
    """Collective over each vLLM group. Draw the step's prompts (from position `start` of the task's stream); sample and
    score this rank's share of the responses. A vLLM tensor-parallel group (rollout_tp_size consecutive ranks) must get
    identical requests: it generates all its members' shares; each keeps its own. Returns (samples, count generated)."""
    rank, K, prompts = dist.get_rank(), cfg.samples_per_prompt, task.prompts(start, cfg.prompts_per_step)
    group = range(rank - rank % cfg.rollout_tp_size, rank - rank % cfg.rollout_tp_size + cfg.rollout_tp_size)
    wanted = sorted({j for member in group for j in generated_by(cfg, mesh, member)})
    prompt_ids = [task.encode(p) for p, _ in prompts]  # (chat template applied)
    seeds = [rollout.sample_seed(cfg.seed, step, j // K, j % K) for j in wanted]
    outs = engine.generate([prompt_ids[j // K] for j in wanted], seeds, cfg.max_new_tokens, cfg.temperature) \
        if wanted else []  # (none wanted: the slice has fewer samples than tp x cp ranks)
    by_index, samples = dict(zip(wanted, outs)), []
    for j in generated_by(cfg, mesh, rank):
        (response, lps), (prompt, answer) = by_index[j], prompts[j // K]
        text, finished = task.decode(response), rollout.finished(response, engine.stop_ids)
        samples.append(dict(index=j, prompt=prompt, response=text, answer=answer, prompt_ids=prompt_ids[j // K],
                            response_ids=response, engine_logprobs=lps, finished=finished,
                            reward=task.reward(text, answer, finished)))
    return samples, len(wanted)


def rollouts(engine, task, cfg, step, start, mesh):
    """Collective (every rank). This rank's dp slice of samples, all rewards by global index, and how many samples this
    rank's engine generated. Each sample is drawn once, by the rank it is generated_by (vLLM is not bit-identical across
    GPUs: tp x cp ranks must not mix copies); one all-gather hands each rank its slice, rank 0 all (for the dump)."""
    if cfg.replay_rollouts:
        dumped = rollout.load_rollouts(os.path.join(cfg.replay_rollouts, f"step_{step}.jsonl"))
        mine, generated = [dumped[j] for j in generated_by(cfg, mesh, dist.get_rank())], 0
    else:
        mine, generated = generate(engine, task, cfg, step, start, mesh)
        engine.sleep()  # GPU: vLLM frees its memory for training
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)  # collective: every rank's share on every rank
    every = {s["index"]: s for share in gathered for s in share}
    if dist.get_rank() == 0:
        rollout.dump_rollouts(os.path.join(cfg.out_dir, "rollouts", f"step_{step}.jsonl"), list(every.values()))
    samples = [every[j] for j in samples_of(cfg, mesh)]
    return samples, [every[j]["reward"] for j in range(cfg.global_batch_size)], generated


# -----------------------------------------------------------------------------
# Steps 4-6: no-grad forward passes, per-token rewards, advantages.

def forward_batch(forward, model, batch, cfg, mesh, **kwargs):
    """Collective over the mesh. `forward(model, ids, lens, mesh, cfg, **kwargs)` (a tensor or a tuple of (rows, S)
    tensors) over every microbatch, dummies included; full (b, S) tensors in row order (packing reorders rows)."""
    outs = None
    for micro in model_parallel.microbatches(batch.lens, cfg, mesh):
        idx, _ = micro_rows(micro, list(range(len(batch.lens))))
        result = forward(model, batch.ids[idx], [batch.lens[i] for i in idx], mesh, cfg, **kwargs)
        result = result if isinstance(result, tuple) else (result,)
        if outs is None:
            outs = [None if r is None else r.new_zeros(batch.ids.shape) for r in result]
        for out, r in zip(outs, result):
            if micro and out is not None:
                out[idx] = r  # (rows, S); a dummy's output is dropped
    return outs


@torch.no_grad()
def score(policy, reference, critic, batch, cfg, mesh):
    """Collective over the mesh. Step 4: the old policy's logprobs and entropy (or the engine's logprobs), the
    reference's logprobs (the initial weights swapped into the same module), and the critic's values."""
    batch.old_lp, batch.entropy = batch.engine_lp, None  # old_logprobs=engine: one policy forward fewer
    if cfg.old_logprobs == "trainer":  # pi_old as the trainer computes it, whatever the engine computed
        batch.old_lp, batch.entropy = forward_batch(model_parallel.forward_policy, policy, batch, cfg, mesh,
                                                    temperature=cfg.temperature, with_entropy=cfg.log_entropy,
                                                    unscored=batch.unscored)
    with model_parallel.swapped_weights(policy, reference):
        batch.ref_lp, _ = forward_batch(model_parallel.forward_policy, policy, batch, cfg, mesh,
                                        temperature=cfg.temperature, unscored=batch.unscored)
    if critic is not None:
        (values,) = forward_batch(model_parallel.forward_critic, critic, batch, cfg, mesh)
        batch.values = values * batch.mask  # (b, S)


@torch.no_grad()
def compute_advantages(batch, scores, all_scores, cfg, mesh):
    """Collective over dp (whitening). Steps 5-6. gae: reward -kl_coef * KL per response token, + the score on the last;
    GAE; whitened over the global batch. grpo: the group-normalized score on every response token (KL: a loss term)."""
    rows, last = torch.arange(len(batch.lens)), torch.tensor(batch.lens) - 1  # (b,), (b,)
    if cfg.advantage_estimator == "grpo":
        group_adv = grpo_advantages(torch.tensor(all_scores), cfg.samples_per_prompt)[samples_of(cfg, mesh)]  # (b,)
        batch.advantages = group_adv.to(batch.mask.device)[:, None] * batch.mask  # (b, S)
    else:
        rewards = -cfg.kl_coef * kl_penalty(batch.old_lp, batch.ref_lp, cfg.kl_estimator) * batch.mask  # (b, S)
        rewards[rows, last] += scores
        batch.advantages, batch.returns = compute_gae(rewards, batch.values, batch.mask, cfg.gamma, cfg.lam)
        if cfg.whiten_advantages:
            batch.advantages = masked_whiten(batch.advantages, batch.mask, group=mesh["dp"].get_group())
    # Truncated importance sampling (Yao et al., "Your efficient RL framework secretly brings you off-policy RL
    # training", 2025): the engine sampled from pi_engine, not the trainer's pi_old; weight min(pi_old/pi_engine, cap).
    batch.tis = torch.clamp(ratio_from_log(batch.old_lp - batch.engine_lp), max=cfg.tis_cap) * batch.mask


# -----------------------------------------------------------------------------
# Steps 7-8: the update, one optimizer step per minibatch and model.

def minibatch_update(model, optimizer, loss_fn, rows, batch, cfg, mesh, stats=None, norm_name="grad_norm"):
    """Collective over the mesh. Forward + backward of `loss_fn(batch rows) -> (loss, {name: number})` over the
    microbatches of `rows`, clip the global grad norm and step, unless the norm or loss on some dp rank is NaN/inf: then
    skip, weights and AdamW state untouched (as Megatron-LM). The numbers (weighted), norm and skip go to `stats`."""
    loss_share, sums = 0.0, Counter()
    micros = model_parallel.microbatches([batch.lens[i] for i in rows], cfg, mesh)
    for i, micro in enumerate(micros):
        model_parallel.sync_gradients(model, sync=i == len(micros) - 1)
        idx, weight = micro_rows(micro, rows)
        loss, parts = loss_fn(idx)
        (weight * loss).backward()
        loss_share += weight * float(loss.detach())
        sums.update({name: weight * float(value) for name, value in parts.items()})
    norm = model_parallel.clip_grad_norm(list(model.parameters()), cfg.max_grad_norm)
    finite = torch.tensor([float(math.isfinite(norm) and math.isfinite(loss_share))], device=batch.ids.device)
    dist.all_reduce(finite, op=dist.ReduceOp.MIN, group=mesh["dp"].get_group())
    if finite.item():
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if stats is not None:
        stats.add(**sums)
        stats.add_global(**{norm_name: norm}, skipped_updates=not finite.item())


def update(parts, batch, cfg, mesh, stats, device):
    """Collective over the mesh. Steps 7-8 on the fixed minibatches, then LR schedules; returns memory use (~peak)."""
    for _, optimizer, _ in parts.values() if cfg.offload_optimizer else ():  # AdamW's state back from host memory
        model_parallel.move_optimizer_state(optimizer, device)
    per_minibatch = cfg.global_batch_size // cfg.num_minibatches // mesh["dp"].size()  # rows per rank
    for epoch in range(cfg.ppo_epochs):
        for first in range(0, cfg.num_minibatches * per_minibatch, per_minibatch):
            rows = list(range(first, first + per_minibatch))
            num_tokens = dp_sum(batch.mask[rows].sum(), mesh)  # global response tokens
            update_policy(*parts["policy"][:2], batch, rows, num_tokens, cfg, mesh, stats)
            if "critic" in parts:
                update_critic(*parts["critic"][:2], batch, rows, num_tokens, cfg, mesh, stats)
    for _, _, schedule in parts.values():
        schedule.step()
    used = memory_used_gb()
    for _, optimizer, _ in parts.values() if cfg.offload_optimizer else ():  # and out: the engine gets the room
        model_parallel.move_optimizer_state(optimizer, "cpu")
    return used


def update_policy(policy, optimizer, batch, rows, num_tokens, cfg, mesh, stats):
    """Collective over the mesh. One minibatch of the clipped surrogate (+ entropy bonus; + GRPO's KL loss)."""
    def loss_fn(idx):
        lp, entropy = model_parallel.forward_policy(policy, batch.ids[idx], [batch.lens[i] for i in idx], mesh, cfg,
                                                    temperature=cfg.temperature, with_entropy=cfg.entropy_coef > 0,
                                                    unscored=batch.unscored)
        mask = batch.mask[idx]
        pg_loss, n_clipped = policy_loss(lp, batch.old_lp[idx], batch.advantages[idx], mask, cfg.clip_ratio,
                                         num_tokens, batch.tis[idx] if cfg.tis_cap else None, cfg.clip_ratio_c)
        loss, parts = pg_loss, dict(policy_loss=pg_loss.detach(), clipped_tokens=n_clipped)
        if cfg.entropy_coef > 0:  # a bonus: maximize entropy
            bonus = cfg.entropy_coef * masked_sum(entropy, mask) / num_tokens
            loss, parts["entropy_bonus"] = loss - bonus, bonus.detach()
        if cfg.advantage_estimator == "grpo":
            # DeepSeekMath eq. 3-4: beta * KL(pi || pi_ref), k3, in the loss; a token mean over the global minibatch as
            # DAPO (Yu et al. 2025), Dr. GRPO (Liu et al. 2025), not eq. 3's mean of per-response means (favours short)
            kl = cfg.kl_coef * masked_sum(kl_penalty(lp, batch.ref_lp[idx], "k3"), mask) / num_tokens
            loss, parts["kl_loss"] = loss + kl, kl.detach()
        return loss, parts
    minibatch_update(policy, optimizer, loss_fn, rows, batch, cfg, mesh, stats)


def update_critic(critic, optimizer, batch, rows, num_tokens, cfg, mesh, stats):
    """Collective over the mesh. One minibatch of the clipped value loss."""
    def loss_fn(idx):
        values = model_parallel.forward_critic(critic, batch.ids[idx], [batch.lens[i] for i in idx], mesh, cfg)
        loss = value_loss(values, batch.values[idx], batch.returns[idx], batch.mask[idx], cfg.value_clip, num_tokens)
        return loss, {"value_loss": loss.detach()}
    minibatch_update(critic, optimizer, loss_fn, rows, batch, cfg, mesh, stats, "critic_grad_norm")


# -----------------------------------------------------------------------------
# Step 10: metrics, plot, checkpoints.

def batch_stats(batch, scores, cfg, stats):
    """This rank's shares of the per-token and per-sequence sums that the metrics need."""
    mask, kl = batch.mask, kl_penalty(batch.old_lp, batch.ref_lp, cfg.kl_estimator)  # kl: (b, S)
    mismatch = (batch.old_lp - batch.engine_lp).abs()  # (b, S)
    if batch.entropy is not None:  # none with old_logprobs=engine or log_entropy=false
        stats.add(entropy=masked_sum(batch.entropy, mask))
    stats.add(tokens=mask.sum(), kl=masked_sum(kl, mask), mismatch=masked_sum(mismatch, mask),
              mult_prob_error=masked_sum(torch.exp(mismatch), mask), sequences=len(batch.lens),
              all_tokens=sum(batch.lens), reward=scores.sum(), reward_sq=(scores ** 2).sum())
    if batch.returns is not None:  # explained variance = 1 - Var(R - V) / Var(R), over response tokens
        err = (batch.returns - batch.values) * mask  # (b, S)
        stats.add(ret=batch.returns.sum(), ret_sq=(batch.returns ** 2).sum(), err=err.sum(), err_sq=(err ** 2).sum())


def step_metrics(sums, cfg):
    """Named means from the global sums (see README, "What is logged")."""
    n_tok, n_seq, n_updates = sums["tokens"], sums["sequences"], cfg.ppo_epochs * cfg.num_minibatches
    reward_mean = sums["reward"] / n_seq
    m = dict(reward_mean=reward_mean, reward_std=math.sqrt(max(sums["reward_sq"] / n_seq - reward_mean ** 2, 0.0)),
             kl=sums["kl"] / n_tok, response_len_mean=n_tok / n_seq,
             logprob_mismatch=sums["mismatch"] / n_tok, token_mult_prob_error=sums["mult_prob_error"] / n_tok,
             clip_frac=sums["clipped_tokens"] / (n_tok * cfg.ppo_epochs), skipped_updates=int(sums["skipped_updates"]))
    if "entropy" in sums:
        m["entropy"] = sums["entropy"] / n_tok
    for name in ("policy_loss", "entropy_bonus", "kl_loss", "value_loss", "grad_norm", "critic_grad_norm"):
        if name in sums:
            m[name] = sums[name] / n_updates
    if "ret" in sums:
        var_ret = sums["ret_sq"] / n_tok - (sums["ret"] / n_tok) ** 2
        var_err = sums["err_sq"] / n_tok - (sums["err"] / n_tok) ** 2
        m["value_explained_var"] = 1 - var_err / max(var_ret, 1e-12)
    return m


def log_step(step, metrics, cfg, t_start, start_step, tensorboard):
    """Append the row to metrics.jsonl (and TensorBoard's scalars), print one line, redraw the plot (rank 0)."""
    if dist.get_rank() != 0:
        return
    with open(os.path.join(cfg.out_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(metrics) + "\n")
    for name, value in metrics.items() if tensorboard else ():  # metrics.jsonl stays the record
        tensorboard.add_scalar(name, value, step)
    if tensorboard:
        tensorboard.flush()
    elapsed = time.time() - t_start
    eta = elapsed / (step + 1 - start_step) * (cfg.steps - step - 1)
    loss = f"vf {metrics['value_loss']:.4f}" if "value_loss" in metrics else f"kl_loss {metrics['kl_loss']:.4f}"
    print(f"step {step + 1}/{cfg.steps} | reward {metrics['reward_mean']:.3f} | kl {metrics['kl']:.4f} | "
          f"pg {metrics['policy_loss']:+.4f} | {loss} | len {metrics['response_len_mean']:.1f} | "
          f"{metrics['time_step_s']:.1f}s/step | elapsed {elapsed:.0f}s | eta {eta:.0f}s", flush=True)
    if cfg.plot_every and ((step + 1) % cfg.plot_every == 0 or step + 1 == cfg.steps):
        plot_curves(os.path.join(cfg.out_dir, "metrics.jsonl"), os.path.join(cfg.out_dir, "curves.png"))


def plot_curves(metrics_path, png_path):
    """reward, KL and the two losses against step, from metrics.jsonl (rank 0)."""
    import matplotlib
    matplotlib.use("Agg")  # no display on a training node
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in open(metrics_path)]
    keys = ("reward_mean", "kl", "policy_loss", "value_loss" if "value_loss" in rows[0] else "kl_loss")
    fig, axes = plt.subplots(2, 2, figsize=(9, 6))
    for ax, key in zip(axes.flat, keys):
        ax.plot([r["step"] for r in rows], [r[key] for r in rows])
        ax.set(title=key, xlabel="step")
    fig.tight_layout()
    fig.savefig(png_path + ".tmp.png")
    plt.close(fig)
    os.replace(png_path + ".tmp.png", png_path)


def summary(cfg, seconds, stopped):
    """The run's last line (rank 0): steps, time, first and last reward, first and last val_accuracy, files written."""
    rows = [json.loads(line) for line in open(os.path.join(cfg.out_dir, "metrics.jsonl"))]
    first, last = (sum(r["reward_mean"] for r in part) / max(len(part), 1) for part in (rows[:5], rows[-5:]))
    val = [r[k] for r in rows for k in ("val_accuracy", "final_val_accuracy") if k in r]
    wrote = [f"metrics.jsonl{', curves.png' * bool(cfg.plot_every)}", "rollouts/"] + ["tensorboard/"] * cfg.tensorboard
    wrote += [f"ckpt/step_{steps[-1]}"] if (steps := _complete_steps(os.path.join(cfg.out_dir, "ckpt"))) else []
    wrote += ["hf/ (the policy, for transformers and vLLM)"] if cfg.export_hf and not stopped else []
    val_text = f" | val_accuracy {val[0]:.3f} -> {val[-1]:.3f} (best {max(val):.3f})" if val else ""
    return (f"done: {len(rows)} steps in {seconds / 60:.1f} min | reward {first:.3f} (first 5 steps) -> {last:.3f} "
            f"(last 5){val_text} | in {cfg.out_dir}: {', '.join(wrote)}")


def tensorboard_writer(cfg):
    """TensorBoard's writer into out_dir/tensorboard on rank 0 with tensorboard=true, else None."""
    if not (cfg.tensorboard and dist.get_rank() == 0):
        return None
    from torch.utils.tensorboard import SummaryWriter  # here: the package is optional (config checks it)
    return SummaryWriter(os.path.join(cfg.out_dir, "tensorboard"))


def install_stop_handler(device):
    """SIGTERM (preemption) or Ctrl-C: finish the step, save, exit 0. A second signal kills.
    Returns stop_requested(): collective (every rank calls it); True once any rank got a signal."""
    got = [0.0]

    def handler(signum, frame):
        got[0] = 1.0
        signal.signal(signum, signal.SIG_DFL)
    def stop_requested():
        flag = torch.tensor(got, device=device)  # ranks may get the signal at different steps
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    return stop_requested


def start_metrics_log(cfg, start_step):
    """A fresh run starts a fresh metrics.jsonl; a resumed one keeps the rows before its step."""
    path = os.path.join(cfg.out_dir, "metrics.jsonl")
    if dist.get_rank() == 0 and os.path.exists(path):
        kept = [line for line in open(path) if json.loads(line)["step"] < start_step]  # (read before "w" truncates)
        open(path, "w").writelines(kept)


# -----------------------------------------------------------------------------
# Training checkpoints (torchtitan's recipe): DCP writes one file per rank with each shard's global offsets and reads
# back what the loading mesh needs; get/set_state_dict name all by module FQN, so a dp=2 checkpoint loads at tp=2. Each
# rank torch.saves its trainer state beside it (progress, schedulers, RNGs). `parts`: {name: (model, optimizer, LR)}.

def _is_complete(path):
    """Complete: renamed from .tmp, with DCP's .metadata (written last, by rank 0) and rank 0's trainer state in it."""
    return (not path.rstrip("/").endswith(".tmp") and os.path.isfile(os.path.join(path, ".metadata"))
            and os.path.isfile(os.path.join(path, "trainer_state_rank0.pt")))


def _complete_steps(root):
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(int(m[1]) for m in map(re.compile(r"step_(\d+)").fullmatch, names)
                  if m and _is_complete(os.path.join(root, m[0])))


def find_checkpoint(resume, out_dir):
    """The checkpoint dir to resume from, or None (fresh run). resume="auto": the newest complete out_dir/ckpt/step_N
    (None if none yet: one command line starts and restarts a preemptible job); a path: that dir, if complete."""
    if resume == "auto":
        steps = _complete_steps(os.path.join(out_dir, "ckpt"))
        return os.path.join(out_dir, "ckpt", f"step_{steps[-1]}") if steps else None
    if resume and not _is_complete(resume):
        raise model_parallel.CheckpointError(f"resume={resume!r} is not a complete checkpoint (a step_N dir with "
                                             ".metadata and trainer_state_rank0.pt): give out_dir/ckpt/step_N, "
                                             "or resume=auto")
    return resume or None


def _sharded_state(parts):
    """{name: model state, name_optimizer: optimizer state}, DTensor shards named by FQN."""
    state = {}
    for name, (model, optimizer, _) in parts.items():
        model_parallel.reshard(model)  # the registered parameters must be the sharded ones
        state[name], state[name + "_optimizer"] = get_state_dict(model, optimizer)
    return state


def save_checkpoint(root, parts, keep, progress):
    """Collective (every rank). Save parts, counters `progress` ({"step": steps done, ...}), RNG states in root/step_N
    via step_N.tmp, renamed once all ranks are done: step_N is always complete. Keeps the newest `keep` (0: all)."""
    rank, path = dist.get_rank(), os.path.join(root, f"step_{progress['step']}")
    if rank == 0:
        shutil.rmtree(path + ".tmp", ignore_errors=True)  # left by a run killed while saving
        os.makedirs(path + ".tmp")
    dist.barrier()
    dcp.save(_sharded_state(parts), checkpoint_id=path + ".tmp")  # collective; files fsynced
    trainer_state = dict(progress=progress, rng=rollout.rng_states(),
                         schedulers={n: p[2].state_dict() for n, p in parts.items()})
    torch.save(trainer_state, os.path.join(path + ".tmp", f"trainer_state_rank{rank}.pt"))
    time.sleep(float(os.environ.get("PPO_TEST_PAUSE_BEFORE_RENAME_S", "0")))  # tests kill the run here
    dist.barrier()  # every rank's files are written
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.replace(path + ".tmp", path)  # atomic on one file system
        for old in _complete_steps(root)[:-keep] if keep else []:
            shutil.rmtree(os.path.join(root, f"step_{old}"))
        for name in [n for n in os.listdir(root) if n.endswith(".tmp")]:  # saves killed before their rename
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    dist.barrier()
    return path


def load_checkpoint(path, parts):
    """Collective (every rank). Load a save_checkpoint dir into parts (any mesh) and this rank's RNG states; return
    the saved `progress` dict. A rank the saving run did not have takes rank 0's RNG states."""
    state = _sharded_state(parts)
    dcp.load(state, checkpoint_id=path)  # collective: each rank reads the pieces its shards cover
    for name, (model, optimizer, _) in parts.items():
        set_state_dict(model, optimizer, model_state_dict=state[name], optim_state_dict=state[name + "_optimizer"])
    own = os.path.join(path, f"trainer_state_rank{dist.get_rank()}.pt")
    trainer_state = torch.load(own if os.path.isfile(own) else os.path.join(path, "trainer_state_rank0.pt"),
                               weights_only=False)  # our own file: numpy RNG state is not a tensor
    rollout.set_rng_states(trainer_state["rng"])
    for name, (_, _, scheduler) in parts.items():
        scheduler.load_state_dict(trainer_state["schedulers"][name])
    return trainer_state.get("progress", {"step": trainer_state.get("step")})  # (older checkpoints: the step)


# -----------------------------------------------------------------------------

def main(cfg, task=None):
    """Train with PPO. `task`: any rollout.Task (default: the config's toy_add or gsm8k)."""
    rollout.quiet_third_party_output()
    rank, world_size, device = model_parallel.init_distributed(cfg.collective_timeout_s)
    kernel = model_parallel.resolve_auto(cfg, device.type)  # dtype, attention: "auto" -> what runs here
    mesh = model_parallel.make_mesh(world_size, cfg.tp_size, cfg.cp_size, device.type)
    if rank == 0:
        os.makedirs(os.path.join(cfg.out_dir, "rollouts"), exist_ok=True)
        config.save(cfg, os.path.join(cfg.out_dir, "config.json"))
    print0(f"mesh dp={mesh['dp'].size()} cp={cfg.cp_size} tp={cfg.tp_size} on {world_size} x {device.type}, "
           f"{cfg.dtype}, {'packed' if cfg.packing else 'padded'} rows, attention: {kernel}, "
           f"{cfg.advantage_estimator}, {cfg.rollout_engine} engine")
    model_dir, resume_dir, task = prepare_inputs(cfg, task)
    model_dir = sft_warmup(model_dir, task, cfg, mesh) if cfg.sft_steps else model_dir
    parts, reference = build_models(model_dir, cfg, mesh)
    policy, critic = parts["policy"][0], parts.get("critic", (None,))[0]
    progress = load_checkpoint(resume_dir, parts) if resume_dir else {"step": 0}  # SFT drew the first prompts; then PPO
    progress.setdefault("prompts_drawn", cfg.sft_steps * cfg.sft_batch_size + progress["step"] * cfg.prompts_per_step)
    start_step = progress["step"]
    print0(f"resumed from {resume_dir}: step {start_step + 1} next" if resume_dir else "fresh start")
    stop_ids = rollout.stop_token_ids(model_dir, task.eos_id)  # the engine's `finished` is the trainer's
    engine = None if cfg.replay_rollouts else rollout.make_engine(cfg, model_dir, device, stop_ids)
    if engine is not None and start_step:  # the engine loaded model_dir: give it the resumed policy
        rollout.refit(engine, model_parallel.iter_full_params(policy), cfg.refit_bucket_mb)
    start_metrics_log(cfg, start_step)
    stop_requested, t_start, bad_steps, stopped = install_stop_handler(device), time.time(), 0, False
    tensorboard = tensorboard_writer(cfg)  # None unless tensorboard=true (rank 0)
    evaluate = engine is not None and bool(task.val) and cfg.eval_every > 0

    for step in range(start_step, cfg.steps):
        metrics, times, stats = {"step": step}, {}, StepStats(device)
        with timed(times, "time_step_s"):
            if evaluate and step % cfg.eval_every == 0:  # before the step's update
                metrics["val_accuracy"] = rollout.validation_accuracy(engine, task, cfg, device)
            with timed(times, "time_rollout_s"):  # 1-3. prompts, rollout, reward
                samples, all_scores, metrics["rollout_samples"] = rollouts(engine, task, cfg, step,
                                                                           progress["prompts_drawn"], mesh)
                batch = make_batch([s["prompt_ids"] for s in samples], [s["response_ids"] for s in samples],
                                   task.pad_id, [s["engine_logprobs"] for s in samples], device)
                scores = torch.tensor([s["reward"] for s in samples], device=device)  # (b,)
            with timed(times, "time_logprobs_s"):  # 4-6. no-grad passes, rewards, advantages
                score(policy, reference, critic, batch, cfg, mesh)
                compute_advantages(batch, scores, all_scores, cfg, mesh)
            with timed(times, "time_update_s"):  # 7-8. PPO epochs over fixed minibatches
                metrics["mem_used_gb"] = update(parts, batch, cfg, mesh, stats, device)
            with timed(times, "time_refit_s"):  # 9. push the policy into the engine (a collective)
                if engine is not None:  # also after skipped updates: on GPU the engine dropped its weights
                    metrics.update(rollout.refit(engine, model_parallel.iter_full_params(policy), cfg.refit_bucket_mb))
            if evaluate and step + 1 == cfg.steps:  # the policy that is exported: after the last update
                metrics["final_val_accuracy"] = rollout.validation_accuracy(engine, task, cfg, device)
            batch_stats(batch, scores, cfg, stats)  # 10. metrics: one all-reduce, then named means
            sums = stats.totals(mesh)
        metrics.update(step_metrics(sums, cfg), **times, tokens=int(sums["all_tokens"]),
                       tokens_per_s=sums["all_tokens"] / times["time_step_s"])
        log_step(step, metrics, cfg, t_start, start_step, tensorboard)
        bad_steps = bad_steps + 1 if metrics["skipped_updates"] else 0  # steps in a row with a skipped update
        if cfg.max_skipped_steps and bad_steps >= cfg.max_skipped_steps:
            print0(f"stopping: {bad_steps} steps in a row skipped updates (NaN/inf loss or grad norm): "
                   "lower lr or check the rewards")
            sys.exit(1)
        progress.update(step=step + 1, prompts_drawn=progress["prompts_drawn"] + cfg.prompts_per_step)
        if (stopped := stop_requested()) or (cfg.save_every and (step + 1) % cfg.save_every == 0) or \
                (cfg.save_every and step + 1 == cfg.steps):
            save_checkpoint(os.path.join(cfg.out_dir, "ckpt"), parts, cfg.keep_checkpoints, progress)
        if stopped:
            print0(f"stopped by a signal after step {step + 1}: checkpoint saved; --resume=auto goes on")
            break
    dist.barrier()
    if cfg.export_hf and not stopped:  # + the tokenizer files and generation_config of the dir we loaded
        model_parallel.save_hf(policy, os.path.join(cfg.out_dir, "hf"),
                               torch.bfloat16 if cfg.export_dtype == "bf16" else torch.float32, copy_from=model_dir)
    if rank == 0:
        print(summary(cfg, time.time() - t_start, stopped), flush=True)
    if engine is not None:
        engine.shutdown()  # vLLM destroys the process group itself, so this comes last
    elif dist.is_initialized():
        dist.destroy_process_group()
    model_parallel.release_mesh(mesh)


if __name__ == "__main__":
    main(CFG)
    gc.collect()  # the models held process groups in reference cycles: free them now (release_mesh)
