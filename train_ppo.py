"""PPO for a Hugging Face causal LM on a PyTorch device mesh. Launch:

    # CPU demo, 2 processes (what `make demo` runs):
    torchrun --nproc_per_node=2 train_ppo.py --config configs/demo_cpu.toml
    # one node of 8 GPUs, tensor parallel 2 inside each group of 4 data-parallel replicas:
    torchrun --nproc_per_node=8 train_ppo.py --config FILE --tp_size=2
    # 2 nodes (run on each, same --rdzv_endpoint):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 \
        train_ppo.py --config FILE
    # every option with its default and doc:
    python train_ppo.py --help

The algorithm is PPO with a learned critic and GAE, as used for RLHF by InstructGPT
(Ouyang et al., 2022) and documented in "The N+ implementation details of RLHF with PPO"
(Huang et al., 2024). One step, in the order of the code below:
  1. draw prompts (same RNG on every rank); each data-parallel (dp) rank keeps its slice
  2. rollout: the engine samples responses and returns its own logprob of each token
  3. reward: a rule-based score per sequence, placed on its last response token
  4. three forward passes without grad: old policy logprobs, reference logprobs, values
  5. per-token reward = score - kl_coef * KL(policy || reference)
  6. GAE -> advantages and returns; advantages whitened over the whole global batch
  7. ppo_epochs x minibatches x microbatches of clipped policy and value losses
  8. global grad-norm clip, AdamW step (policy and critic each have their own)
  9. refit: the new policy weights are streamed into the rollout engine
 10. metrics, rollout dump, plot; a checkpoint every save_every steps (resume=auto continues)
Deviations from the paper's PPO, on purpose:
  1. the minibatch split is fixed across epochs (no reshuffle), so that it does not
     depend on the mesh and every mesh trains on the same minibatches;
  2. the KL penalty uses a fixed kl_coef (no adaptive KL controller);
  3. there is no reward model: the toy task's reward is a rule (as in RLVR / GSM8K).
Deliberately left out: pretraining-loss mixing (PPO-ptx), reward normalization.
"""
import json
import math
import os
import signal
import sys
import time

import config

# Fail fast: a bad config is refused here, in a fraction of a second, before torch and
# transformers are imported (10 s and more). torchrun sets WORLD_SIZE.
if __name__ == "__main__":
    CFG = config.load(sys.argv[1:], world_size=int(os.environ.get("WORLD_SIZE", "1")))

import torch  # noqa: E402  (after the config check, on purpose)
import torch.distributed as dist  # noqa: E402
from transformers import AutoConfig  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

import model_parallel  # noqa: E402
import rollout  # noqa: E402

# -----------------------------------------------------------------------------
# PPO math: small pure functions on (B, S) tensors in DESIGN.md's alignment, importable
# by tests and readers. Position i is the action "emit x_i"; `mask` is 1 on response
# tokens. Losses are sums over tokens divided by `num_tokens`, the number of response
# tokens in the *global* minibatch, so neither dp nor the microbatch size changes them.


def masked_sum(x, mask):
    return (x * mask).sum()


def kl_penalty(logprobs, ref_logprobs, kind="k1"):
    """Per-token estimate of KL(pi || pi_ref) from the sampled token (Schulman, "Approximating
    KL divergence", 2020). k1 = log(pi/pi_ref): unbiased, can be negative per token.
    k3 = (r - 1) - log r with r = pi_ref/pi: unbiased, always >= 0, lower variance."""
    log_ratio = logprobs - ref_logprobs  # (B, S)
    if kind == "k1":
        return log_ratio
    if kind == "k3":
        return torch.expm1(-log_ratio) + log_ratio  # (B, S) = (r - 1) - log r
    raise ValueError(f"unknown KL estimator {kind!r}")


def compute_gae(rewards, values, mask, gamma, lam):
    """Generalized advantage estimation (Schulman et al., 2016, eq. 16), right to left:
        delta_t = r_t + gamma * V_next - V_t,   A_t = delta_t + gamma * lam * A_next
    where "next" is the next *response* token of the row: positions outside the mask (the
    prompt, padding, or a gap such as a tool's output) are skipped, and after the last
    response token the episode ends (V_next = 0, A_next = 0). Returns (advantages, returns)
    with returns = A + V, both 0 outside the mask."""
    B, S = rewards.shape
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)  # (B,)
    next_adv = torch.zeros_like(next_value)  # (B,)
    advantages = torch.zeros_like(values)  # (B, S)
    for t in reversed(range(S)):
        m = mask[:, t].bool()  # (B,)
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # (B,)
        adv = delta + gamma * lam * next_adv  # (B,)
        advantages[:, t] = torch.where(m, adv, 0.0)
        next_value = torch.where(m, values[:, t], next_value)  # carried across gaps
        next_adv = torch.where(m, adv, next_adv)
    returns = (advantages + values) * mask  # (B, S)
    return advantages, returns


def masked_whiten(x, mask, group=None, eps=1e-8):
    """(x - mean) / std over the masked tokens of the *global* batch: sum, sum of squares
    and count are all-reduced over `group` (the dp group), so every rank whitens with the
    same statistics, never per rank. Unbiased variance, as TRL's masked_whiten."""
    stats = torch.stack([masked_sum(x, mask), masked_sum(x * x, mask), mask.sum()]).double()
    if group is not None:
        dist.all_reduce(stats, group=group)
    total, total_sq, n = stats
    mean = total / n
    var = (total_sq - n * mean * mean) / (n - 1).clamp(min=1)
    return ((x - mean) * torch.rsqrt(var + eps)).to(x.dtype) * mask


def policy_loss(logprobs, old_logprobs, advantages, mask, clip_ratio, num_tokens=None,
                tis_weight=None):
    """Clipped surrogate (Schulman et al., 2017, eq. 7), as a loss to minimize:
        ratio = pi / pi_old,  loss_t = max(-A_t * ratio, -A_t * clip(ratio, 1-eps, 1+eps))
    `tis_weight` (optional, (B, S)) reweights each token by a truncated importance weight
    pi_trainer / pi_engine for the mismatch between the engine and the trainer.
    Returns (loss, number of tokens whose ratio was clipped)."""
    num_tokens = mask.sum() if num_tokens is None else num_tokens
    ratio = torch.exp(logprobs - old_logprobs)  # (B, S)
    unclipped = -advantages * ratio  # (B, S)
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio)  # (B, S)
    per_token = torch.maximum(unclipped, clipped)  # (B, S) the pessimistic bound
    if tis_weight is not None:
        per_token = per_token * tis_weight
    n_clipped = masked_sum((clipped > unclipped).float(), mask).detach()
    return masked_sum(per_token, mask) / num_tokens, n_clipped


def value_loss(values, old_values, returns, mask, value_clip, num_tokens=None):
    """Clipped value loss (PPO2 baselines; "N+ details" #9):
        v_clip = V_old + clip(V - V_old, -c, c),  loss_t = 0.5 * max((V - R)^2, (v_clip - R)^2)
    value_clip = 0 turns the clipping off (plain 0.5 * (V - R)^2)."""
    num_tokens = mask.sum() if num_tokens is None else num_tokens
    loss = (values - returns) ** 2  # (B, S)
    if value_clip > 0:
        v_clipped = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
        loss = torch.maximum(loss, (v_clipped - returns) ** 2)  # (B, S)
    return 0.5 * masked_sum(loss, mask) / num_tokens


# -----------------------------------------------------------------------------
# Plumbing: which samples a rank owns, batches as tensors, logging.

def local_indices(global_batch, num_minibatches, dp_size, dp_rank):
    """Global sample indices of this dp rank, minibatch-major. Global minibatch m is the
    contiguous block [m*M, (m+1)*M) of the step's samples on every mesh, and rank r keeps
    its r-th slice of each block: so minibatch membership does not depend on dp."""
    M = global_batch // num_minibatches
    share = M // dp_size
    return [m * M + dp_rank * share + i for m in range(num_minibatches) for i in range(share)]


def collate(prompts, responses, pad_id, engine_logprobs=None):
    """Right-padded (b, S) tensors: ids, response mask, engine logprobs, lengths."""
    lens = [len(p) + len(r) for p, r in zip(prompts, responses)]
    b, S = len(lens), max(lens)
    ids = torch.full((b, S), pad_id, dtype=torch.long)  # (b, S)
    mask = torch.zeros(b, S)  # (b, S) 1 where the token was generated
    engine_lp = torch.zeros(b, S)  # (b, S) engine's logprob of each generated token
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, :lens[i]] = torch.tensor(p + r)
        mask[i, len(p):lens[i]] = 1
        if engine_logprobs is not None:
            engine_lp[i, len(p):lens[i]] = torch.tensor(engine_logprobs[i])
    return ids, mask, engine_lp, lens


def micro_rows(rows, start=0):
    """Row indices of a microbatch (offset by `start`) and its loss weight. An empty one is a
    dummy that keeps FSDP's collectives matched across dp ranks: it reruns a real row
    with weight 0, so it costs compute but changes nothing."""
    return ([start + i for i in rows], 1.0) if rows else ([start], 0.0)


def forward_batch(fn, model, ids, lens, mesh, cfg, **kw):
    """Run a no-grad forward over the microbatches of a batch and concatenate the rows.
    Every dp rank runs the same number of forwards (dummies included: FSDP's all-gathers
    are collectives), and a dummy's output is dropped."""
    outs = [None, None]
    for rows in model_parallel.microbatches(lens, cfg, mesh):
        idx, _ = micro_rows(rows)  # a dummy's output is thrown away below
        res = fn(model, ids[idx], [lens[i] for i in idx], mesh, cfg, **kw)
        res = res if isinstance(res, tuple) else (res, None)
        for k in range(2):
            if rows and res[k] is not None:
                if outs[k] is None:
                    outs[k] = torch.zeros(ids.shape, dtype=res[k].dtype)  # (b, S)
                outs[k][rows] = res[k]  # packing reorders rows: put each back in its place
    return tuple(outs)


def validate(engine, task, cfg, rank, world_size):
    """Greedy accuracy on the held-out prompts. The prompts are split over the vLLM groups
    (rollout_tp_size consecutive ranks pass identical requests), the count summed."""
    groups = world_size // cfg.rollout_tp_size
    mine = task.val[rank // cfg.rollout_tp_size::groups]
    correct = 0.0
    if mine:
        outs = engine.generate([task.encode(q) for q, _ in mine], [0] * len(mine),
                               cfg.max_new_tokens, 0.0, task.eos_id)  # temperature 0: greedy
        correct = sum(task.reward(task.decode(r), a, r[-1] == task.eos_id) == 1.0
                      for (r, _), (_, a) in zip(outs, mine))
    total = torch.tensor([float(correct)])
    dist.all_reduce(total)  # every member of a vLLM group counted the same prompts
    return total.item() / cfg.rollout_tp_size / len(task.val)


def main(cfg):
    rank, world_size, device = model_parallel.init_distributed(cfg.collective_timeout_s)
    hf_logging.set_verbosity_error()  # one console line per step: no load reports or bars
    hf_logging.disable_progress_bar()
    master = rank == 0  # rank 0 alone writes files and prints
    print0 = lambda *a: print(*a, flush=True) if master else None
    mesh = model_parallel.make_mesh(world_size, cfg.tp_size, cfg.cp_size, device.type)
    dp_group, dp_size, dp_rank = mesh["dp"].get_group(), mesh["dp"].size(), mesh["dp"].get_local_rank()
    dp_sum = lambda t: (dist.all_reduce(t, group=dp_group), t)[1]  # sum over dp ranks
    if master:
        os.makedirs(os.path.join(cfg.out_dir, "rollouts"), exist_ok=True)
        config.save(cfg, os.path.join(cfg.out_dir, "config.json"))
        print0(json.dumps(vars(cfg)))
    print0(f"mesh dp={dp_size} cp={cfg.cp_size} tp={cfg.tp_size} on {world_size} x {device.type}")
    model_dir = cfg.model
    if model_dir in model_parallel.TINY_PRESETS:  # write the preset as a real HF checkpoint
        model_dir = model_parallel.materialize_tiny_model(cfg.model, cfg.out_dir, cfg.seed)
    try:  # model files, checkpoint, prompts, tokenizer: bad input is refused before any heavy work
        for path in filter(None, (model_dir, cfg.critic_model)):
            model_parallel.check_hf_dir(path, cfg.tp_size)
        resume_dir = model_parallel.find_checkpoint(cfg.resume, cfg.out_dir)
        task = rollout.make_task(cfg, model_dir, AutoConfig.from_pretrained(model_dir).vocab_size)
    except (rollout.TaskError, model_parallel.CheckpointError) as e:
        print0(f"input error: {e}")
        sys.exit(2)
    eos_id, pad_id = task.eos_id, task.pad_id

    # ---- supervised warm-up: SFT on the task's reference answers, the usual first stage
    # of RLHF. Kept short on purpose: PPO should start from a policy that knows the
    # format and is right sometimes, and has the rest to learn from reward.
    if cfg.sft_steps:
        sft_dir = os.path.join(cfg.out_dir, "sft")
        if not os.path.isfile(os.path.join(sft_dir, "config.json")):
            policy = model_parallel.load_policy(model_dir, mesh, cfg)
            opt = torch.optim.AdamW(policy.parameters(), lr=cfg.sft_lr, weight_decay=0.0)
            share = cfg.sft_batch_size // dp_size
            for it in range(cfg.sft_steps):
                pairs = task.prompts(f"sft{it}", cfg.sft_batch_size)
                mine = pairs[dp_rank * share:(dp_rank + 1) * share]
                ids, mask, _, lens = collate([task.encode(p) for p, _ in mine],
                                             [task.target(a) for _, a in mine], pad_id)
                n_tok = dp_sum(mask.sum())
                for rows in model_parallel.microbatches(lens, cfg, mesh):
                    idx, w = micro_rows(rows)
                    lp, _ = model_parallel.forward_policy(policy, ids[idx], [lens[i] for i in idx],
                                                          mesh, cfg, 1.0, False)
                    (-w * masked_sum(lp, mask[idx]) / n_tok).backward()  # mean NLL of answers
                model_parallel.clip_grad_norm(list(policy.parameters()), cfg.max_grad_norm)
                opt.step()
                opt.zero_grad(set_to_none=True)
                if it % 10 == 0 or it == cfg.sft_steps - 1:
                    print0(f"sft {it + 1}/{cfg.sft_steps}")
            model_parallel.save_hf(policy, sft_dir)
            del policy, opt
        model_dir = sft_dir

    # ---- models: policy, reference (a CPU copy of the policy's shards), critic, engine
    policy = model_parallel.load_policy(model_dir, mesh, cfg)
    ref_snapshot = model_parallel.snapshot_weights(policy)  # initial policy's shards (model_dir: also on resume)
    critic = model_parallel.load_critic(cfg.critic_model or model_dir, mesh, cfg)
    opt_pi = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    opt_v = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr, weight_decay=cfg.weight_decay)
    warmup = lambda step: min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, warmup) for o in (opt_pi, opt_v)]
    parts = {"policy": (policy, opt_pi, scheds[0]), "critic": (critic, opt_v, scheds[1])}  # a checkpoint's content
    # resume: weights, optimizer, LR and RNG states, and the number of steps done
    start_step = model_parallel.load_checkpoint(resume_dir, parts) if resume_dir else 0
    print0(f"resumed from {resume_dir}: step {start_step + 1} next" if resume_dir else "fresh start")
    engine = None if cfg.replay_rollouts else rollout.make_engine(cfg, model_dir, device)
    if engine is not None and start_step:  # the engine loaded model_dir: give it the resumed policy
        rollout.refit(engine, model_parallel.iter_full_params(policy), cfg.refit_bucket_mb)
    my_indices = local_indices(cfg.global_batch_size, cfg.num_minibatches, dp_size, dp_rank)
    R, ranks_per_dp = cfg.rollout_tp_size, cfg.tp_size * cfg.cp_size  # mesh: dp outermost
    gen_indices = sorted({j for r in range(rank // R * R, rank // R * R + R)  # my vLLM TP group
                          for j in local_indices(cfg.global_batch_size, cfg.num_minibatches,
                                                 dp_size, r // ranks_per_dp)})
    K = cfg.samples_per_prompt
    metrics_path = os.path.join(cfg.out_dir, "metrics.jsonl")
    if master and os.path.exists(metrics_path):  # a fresh run starts a fresh log, a resumed one goes on
        kept = [line for line in open(metrics_path) if json.loads(line)["step"] < start_step]
        open(metrics_path, "w").writelines(kept)
    stop = torch.zeros(1)  # SIGTERM (preemption), Ctrl-C: finish the step, save, exit 0; a second one kills
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda num, _: (stop.fill_(1), signal.signal(num, signal.SIG_DFL)))
    t_start, bad_steps = time.time(), 0

    for step in range(start_step, cfg.steps):
        t_step = time.time()
        m = {"step": step}
        # ---- 1-3. prompts, rollout, reward
        if engine is not None and task.val and cfg.eval_every and step % cfg.eval_every == 0:
            m["val_accuracy"] = validate(engine, task, cfg, rank, world_size)
        prompts = task.prompts(step, cfg.prompts_per_step)
        prompt_ids = [task.encode(p) for p, _ in prompts]  # (chat template applied)
        if cfg.replay_rollouts:
            dumped = rollout.load_rollouts(os.path.join(cfg.replay_rollouts, f"step_{step}.jsonl"))
            samples = [dumped[j] for j in my_indices]
        else:
            # The ranks of one vLLM tensor-parallel group must pass identical requests: the
            # group generates the samples of all its members, and each keeps its own.
            outs = dict(zip(gen_indices, engine.generate(
                [prompt_ids[j // K] for j in gen_indices],
                [rollout.sample_seed(cfg.seed, step, j // K, j % K) for j in gen_indices],
                cfg.max_new_tokens, cfg.temperature, eos_id)))
            engine.sleep()  # GPU: vLLM frees its memory for training
            samples = []
            for j in my_indices:
                (resp, lps), p = outs[j], prompt_ids[j // K]
                text, finished = task.decode(resp), resp[-1] == eos_id
                samples.append({"index": j, "prompt": prompts[j // K][0], "response": text,
                                "answer": prompts[j // K][1], "prompt_ids": p, "response_ids": resp,
                                "engine_logprobs": lps,
                                "reward": task.reward(text, prompts[j // K][1], finished)})
        gathered = [None] * world_size
        dist.all_gather_object(gathered, samples)  # rank 0 writes everyone's samples
        if master:
            unique = {s["index"]: s for part in gathered for s in part}.values()
            rollout.dump_rollouts(os.path.join(cfg.out_dir, "rollouts", f"step_{step}.jsonl"), list(unique))
        ids, mask, engine_lp, lens = collate([s["prompt_ids"] for s in samples],
                                             [s["response_ids"] for s in samples],
                                             pad_id, [s["engine_logprobs"] for s in samples])
        score = torch.tensor([s["reward"] for s in samples])  # (b,)
        last = torch.tensor(lens) - 1  # (b,) position of each row's last response token
        rows = torch.arange(len(samples))
        t_rollout = time.time() - t_step

        # ---- 4. three forward passes without grad, on the training mesh
        t_train = time.time()
        with torch.no_grad():
            old_lp, entropy = forward_batch(model_parallel.forward_policy, policy, ids, lens,
                                            mesh, cfg, temperature=cfg.temperature, with_entropy=True)
            with model_parallel.swapped_weights(policy, ref_snapshot):  # reference = initial policy
                ref_lp, _ = forward_batch(model_parallel.forward_policy, policy, ids, lens,
                                          mesh, cfg, temperature=cfg.temperature, with_entropy=False)
            old_values, _ = forward_batch(model_parallel.forward_critic, critic, ids, lens, mesh, cfg)
            old_values = old_values * mask  # (b, S)
            t_logprobs = time.time() - t_train

            # ---- 5. per-token reward: -kl_coef * KL everywhere, + score on the last token
            kl = kl_penalty(old_lp, ref_lp, cfg.kl_estimator) * mask  # (b, S)
            rewards = -cfg.kl_coef * kl  # (b, S)
            rewards[rows, last] += score

            # ---- 6. GAE, then whiten advantages over the global batch
            advantages, returns = compute_gae(rewards, old_values, mask, cfg.gamma, cfg.lam)
            if cfg.whiten_advantages:
                advantages = masked_whiten(advantages, mask, group=dp_group)
            # Truncated importance sampling (Yao et al., "Your efficient RL framework secretly
            # brings you off-policy RL training", 2025): the engine sampled from pi_engine, not
            # from the trainer's pi_old; weight each token by min(pi_old / pi_engine, cap).
            tis = torch.clamp(torch.exp(old_lp - engine_lp), max=cfg.tis_cap) * mask  # (b, S)

        # ---- 7-8. PPO epochs over fixed minibatches; one optimizer step per minibatch
        share = len(samples) // cfg.num_minibatches
        sums = torch.zeros(6)  # pg loss, vf loss, clipped tokens, tokens, pi grad norm, v grad norm
        skipped = [0, 0]  # updates skipped for a NaN/inf loss or grad norm: policy, critic
        for epoch in range(cfg.ppo_epochs):
            for mb in range(cfg.num_minibatches):
                sl = slice(mb * share, (mb + 1) * share)
                mb_lens = lens[sl]
                mb_tokens = dp_sum(mask[sl].sum())  # global response tokens of this minibatch
                for model, opt, which in ((policy, opt_pi, 0), (critic, opt_v, 1)):
                    mb_loss = torch.zeros(())  # this rank's share of the minibatch loss
                    for micro in model_parallel.microbatches(mb_lens, cfg, mesh):
                        idx, w = micro_rows(micro, sl.start)
                        i_lens = [lens[i] for i in idx]
                        if which == 0:
                            lp, ent = model_parallel.forward_policy(policy, ids[idx], i_lens, mesh, cfg,
                                                                    cfg.temperature, cfg.entropy_coef > 0)
                            loss, n_clip = policy_loss(lp, old_lp[idx], advantages[idx], mask[idx],
                                                       cfg.clip_ratio, mb_tokens, tis[idx] if cfg.tis_cap else None)
                            if cfg.entropy_coef > 0:  # bonus: maximize entropy
                                loss = loss - cfg.entropy_coef * masked_sum(ent, mask[idx]) / mb_tokens
                            sums[2] += w * n_clip
                        else:
                            v = model_parallel.forward_critic(critic, ids[idx], i_lens, mesh, cfg)
                            loss = value_loss(v, old_values[idx], returns[idx], mask[idx],
                                              cfg.value_clip, mb_tokens)
                        (w * loss).backward()
                        mb_loss += w * loss.detach()
                    gn = model_parallel.clip_grad_norm(list(model.parameters()), cfg.max_grad_norm)
                    sums[which] += mb_loss
                    sums[4 + which] += gn
                    # NaN/inf loss on a dp rank or grad norm: skip the update (as Megatron-LM does)
                    finite = dp_sum(torch.tensor([float(math.isfinite(gn) and mb_loss.isfinite())])).item() == dp_size
                    if finite:
                        opt.step()
                    skipped[which] += not finite
                    opt.zero_grad(set_to_none=True)
        for s in scheds:
            s.step()
        t_train = time.time() - t_train

        # ---- 9. refit: push the updated policy into the engine (a collective on every rank)
        # (also after skipped updates: on GPU the sleeping engine has dropped its weights)
        t_refit = time.time()
        if engine is not None:
            engine.wake_up()
            m.update(rollout.refit(engine, model_parallel.iter_full_params(policy), cfg.refit_bucket_mb))
        t_refit = time.time() - t_refit

        # ---- 10. metrics: sums over dp ranks, then means
        n_updates = cfg.ppo_epochs * cfg.num_minibatches
        sums[:2] = dp_sum(sums[:2].clone())  # each rank's loss is its share of the global loss
        sums[2] = dp_sum(sums[2:3].clone())[0]
        err = (returns - old_values) * mask  # (b, S) critic's error on the returns
        tok_stats = dp_sum(torch.stack([
            mask.sum(), masked_sum(kl, mask), masked_sum(entropy, mask),
            masked_sum((old_lp - engine_lp).abs(), mask), masked_sum(torch.exp((old_lp - engine_lp).abs()), mask),
            score.sum(), (score ** 2).sum(),
            torch.tensor(float(len(samples))), torch.tensor(float(sum(lens))),
            returns.sum(), (returns ** 2).sum(), err.sum(), (err ** 2).sum()]).double())
        (n_tok, kl_sum, ent_sum, mis_sum, mult_sum, r_sum, r_sq, n_seq, all_tok,
         ret_sum, ret_sq, err_sum, err_sq) = tok_stats.tolist()
        reward_mean = r_sum / n_seq
        # explained variance = 1 - Var(R - V) / Var(R) over the global batch's response tokens
        var_ret = ret_sq / n_tok - (ret_sum / n_tok) ** 2
        var_err = err_sq / n_tok - (err_sum / n_tok) ** 2
        step_time = time.time() - t_step
        m.update(reward_mean=reward_mean, reward_std=math.sqrt(max(r_sq / n_seq - reward_mean ** 2, 0.0)),
                 kl=kl_sum / n_tok, policy_loss=sums[0].item() / n_updates,
                 value_loss=sums[1].item() / n_updates,
                 value_explained_var=1 - var_err / max(var_ret, 1e-12),
                 entropy=ent_sum / n_tok, clip_frac=sums[2].item() / (n_tok * cfg.ppo_epochs),
                 grad_norm=sums[4].item() / n_updates, critic_grad_norm=sums[5].item() / n_updates,
                 logprob_mismatch=mis_sum / n_tok, token_mult_prob_error=mult_sum / n_tok,
                 response_len_mean=n_tok / n_seq, skipped_updates=sum(skipped),
                 tokens_per_s=all_tok / step_time, time_rollout_s=t_rollout, time_train_s=t_train, time_logprobs_s=t_logprobs,
                 time_refit_s=t_refit, time_step_s=step_time, peak_mem_gb=model_parallel.peak_memory_gb())
        if master:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(m) + "\n")
            elapsed = time.time() - t_start
            eta = elapsed / (step + 1 - start_step) * (cfg.steps - step - 1)
            print0(f"step {step + 1}/{cfg.steps} | reward {reward_mean:.3f} | kl {m['kl']:.4f} | "
                   f"pg {m['policy_loss']:+.4f} | vf {m['value_loss']:.4f} | "
                   f"len {m['response_len_mean']:.1f} | {step_time:.1f}s/step | "
                   f"elapsed {elapsed:.0f}s | eta {eta:.0f}s")
            if cfg.plot_every and ((step + 1) % cfg.plot_every == 0 or step + 1 == cfg.steps):
                plot_curves(metrics_path, os.path.join(cfg.out_dir, "curves.png"))
        bad_steps = bad_steps + 1 if sum(skipped) else 0  # steps in a row with a skipped update
        if cfg.max_skipped_steps and bad_steps >= cfg.max_skipped_steps:
            print0(f"stopping: {bad_steps} steps in a row skipped updates (NaN/inf loss or grad norm): lower lr or check the rewards")
            sys.exit(1)
        # ---- checkpoint every save_every steps, at the end, and on a signal to any rank
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # ranks may get the signal at different steps
        if stop.item() or (cfg.save_every and ((step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps)):
            model_parallel.save_checkpoint(os.path.join(cfg.out_dir, "ckpt"), step + 1, parts, cfg.keep_checkpoints)
        if stop.item():
            print0(f"stopped by a signal after step {step + 1}: checkpoint saved; --resume=auto goes on")
            break
    dist.barrier()
    if cfg.export_hf and not stop.item():  # tokenizer files from the original model dir, if it has them
        model_parallel.save_hf(policy, os.path.join(cfg.out_dir, "hf"), copy_from=cfg.model)
    if engine is not None:
        engine.shutdown()  # vLLM destroys the process group itself, so this comes last
    elif dist.is_initialized():
        dist.destroy_process_group()


def plot_curves(metrics_path, png_path):
    """reward, KL and both losses against step, from metrics.jsonl (rank 0)."""
    import matplotlib
    matplotlib.use("Agg")  # no display on a training node
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in open(metrics_path)]
    fig, axes = plt.subplots(2, 2, figsize=(9, 6))
    for ax, key in zip(axes.flat, ("reward_mean", "kl", "policy_loss", "value_loss")):
        ax.plot([r["step"] for r in rows], [r[key] for r in rows])
        ax.set_title(key)
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(png_path + ".tmp.png")
    plt.close(fig)
    os.replace(png_path + ".tmp.png", png_path)


if __name__ == "__main__":
    main(CFG)
