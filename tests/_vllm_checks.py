"""The colocated vLLM engine on 2 CPU ranks, measured against independent computations.
Launched by tests/test_vllm.py (which makes the assertions), or by hand:

    torchrun --standalone --nproc_per_node=2 tests/_vllm_checks.py --rollout_tp_size=1 --dir=/tmp/v1
    torchrun --standalone --nproc_per_node=2 tests/_vllm_checks.py --rollout_tp_size=2 --dir=/tmp/v2

rollout_tp_size=1: one engine per rank (dp=2); 2: one engine across both ranks. A script and
not a tests/_dist.run_ranks body because vLLM's shutdown destroys the default process group,
which run_ranks destroys again afterwards; and engine creation is slow (15-60 s), so one
launch runs every check in sequence, in the order a PPO step would:

1. sample twice with the same per-sample seeds (and with the batch reversed, other seeds);
2. the engine's logprobs against a plain single-process HF model of the same checkpoint;
3. one AdamW step of the FSDP policy, then rollout.refit in small buckets (each recorded);
4. sample again: the engine's logprobs against the trainer's forward_policy on the same ids,
   single-turn, then on sampled episodes of multi-token turns (their model tokens only);
5. refit the original weights back: the first samples must come back.

Every rank writes what it measured; rank 0 gathers it into DIR/results.json.
"""
import argparse
import json
import os
import sys
import time
from dataclasses import replace

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
import model_parallel
import rollout
import train_ppo
from config import Config
from conftest import plain_logprobs  # the tests' shared reference (tests/, this script's dir, is on sys.path)
from extensions import multiturn

parser = argparse.ArgumentParser()
parser.add_argument("--rollout_tp_size", type=int, default=1)
parser.add_argument("--model", default="tiny-llama", help="a tiny preset of model_parallel")
parser.add_argument("--tied", action="store_true", help="tie lm_head to the embedding")
parser.add_argument("--dir", required=True, help="for the tiny checkpoint and results.json")
args = parser.parse_args()

TEMPERATURE, MAX_NEW_TOKENS = 0.7, 12  # T != 1: a wrong temperature convention would show
BUCKET_MB, SMALL_BUCKET_MB = 1, 0.25  # the tiny model: 5 MB in all, its largest tensors 0.5 MB
rank, world_size, device = model_parallel.init_distributed()
cfg = Config(out_dir=args.dir, rollout_engine="vllm", rollout_tp_size=args.rollout_tp_size, seed=7,
             max_model_len=64, vllm_kv_cache_gb=1, temperature=TEMPERATURE, max_new_tokens=MAX_NEW_TOKENS)
mesh = model_parallel.make_mesh(world_size, 1, 1, "cpu")  # the trainer: FSDP over dp=2
path = model_parallel.materialize_tiny_model(args.model, args.dir, seed=3, tie_word_embeddings=args.tied)
policy = model_parallel.load_policy(path, mesh, cfg)
plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # the reference
measured = {"rank": rank}

t0 = time.perf_counter()
tok = rollout.toy_tokenizer()
stop_ids = [tok.encode_single_token(rollout.EOS)]
engine = rollout.make_engine(cfg, path, device, stop_ids[0])  # a collective: both ranks build it together
measured["init_s"] = time.perf_counter() - t0

# Ranks of one vLLM TP group pass identical requests; different groups pass different ones.
group_index = rank // cfg.rollout_tp_size
prompts = [tok.encode(p) for p, _ in rollout.ToyTask(cfg.seed).prompts(6 * group_index, 6)]
seeds = [rollout.sample_seed(cfg.seed, group_index, i, 0) for i in range(len(prompts))]


def generate(prompt_list, seed_list):
    return engine.generate(prompt_list, seed_list, [MAX_NEW_TOKENS] * len(prompt_list), TEMPERATURE)


def rows(outs):
    """Right-padded (b, S) prompt+response ids, lengths, response mask, engine logprobs."""
    full = [p + r for p, (r, _) in zip(prompts, outs)]
    S = max(map(len, full))
    ids = torch.zeros(len(full), S, dtype=torch.long)  # (b, S)
    mask, engine_lp = torch.zeros(len(full), S, dtype=torch.bool), torch.zeros(len(full), S)  # (b, S)
    for b, (p, (r, lps)) in enumerate(zip(prompts, outs)):
        ids[b, :len(p) + len(r)] = torch.tensor(p + r)
        mask[b, len(p):len(p) + len(r)] = True  # position i holds the action "emit x_i"
        engine_lp[b, len(p):len(p) + len(r)] = torch.tensor(lps)
    return ids, [len(f) for f in full], mask, engine_lp


@torch.no_grad()
def hf_logprobs(ids, lens):
    """log softmax(logits / T) of each token from the unsharded HF model, one row at a time
    (no padding at all), position i from logits[i-1]."""
    out = torch.zeros(ids.shape)  # (b, S)
    for b, n in enumerate(lens):
        row = ids[b:b + 1, :n]  # (1, n)
        out[b, :n] = plain_logprobs(plain(row).logits.float() / TEMPERATURE, row)[0]
    return out


def tokens(outs):
    return [r for r, _ in outs]


# ---- 1. seeds: a sample depends on its seed only, not on the call or the batch ---------------
rng_before = torch.get_rng_state()
t0 = time.perf_counter()
first = generate(prompts, seeds)
measured["first_generate_s"] = time.perf_counter() - t0
measured["rng_unchanged"] = torch.equal(rng_before, torch.get_rng_state())  # trainer's RNG is its own
measured["same_seeds_same_samples"] = generate(prompts, seeds) == first  # ids and logprobs
measured["reversed_batch_same_samples"] = tokens(generate(prompts[::-1], seeds[::-1])[::-1]) == tokens(first)
measured["batch_of_one_same_sample"] = tokens(generate(prompts[3:4], seeds[3:4])) == tokens(first)[3:4]
other = generate(prompts, [s + 1 for s in seeds])
measured["other_seeds_changed"] = sum(a != b for a, b in zip(tokens(other), tokens(first)))
measured["n_samples"] = len(prompts)
# one request identical on every rank: the sample must not depend on the rank or its engine
measured["shared_sample"] = tokens(generate([tok.encode("1+2=")], [12345]))[0]
measured["group_samples"] = tokens(first)
# issue 53: one call of more prompt tokens than a scheduler step takes (pass@k's 8 samples of each
# of 48 prompts): vLLM 0.32's CPU runner crashed on a seeded prefill split over two steps. The
# engine cuts such a call in pieces of one step's budget: the call returns, and each sample is
# still its seed's alone
budget = engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
long_prompt = (prompts[0] * 40)[:40]  # 40 tokens, + 12 new within max_model_len 64
many = [long_prompt] * (budget // 40 + 10)
many_seeds = list(range(1000, 1000 + len(many)))
big = tokens(generate(many, many_seeds))
measured["over_budget_times"] = len(many) * 40 / budget
measured["over_budget_same_samples"] = (big[:2] + big[-2:] == tokens(generate(many[:2], many_seeds[:2]))
                                        + tokens(generate(many[-2:], many_seeds[-2:])))

# ---- 2. before refit: engine logprobs == plain HF on the engine's own samples ----------------
ids, lens, mask, engine_lp = rows(first)
measured["diff_before_refit_vs_hf"] = (engine_lp - hf_logprobs(ids, lens))[mask].abs().mean().item()
measured["n_response_tokens"] = int(mask.sum())

# ---- 2b. multi-turn episodes: vLLM and the HF engine of the same checkpoint build the same ones
# (greedy), each turn continued from the ids so far. Every id ends a turn here (the random model
# rarely says EOS), and every finished turn is answered by the same observation, "[7]"


class Calculator:
    def observe(self, turn, episode):
        return tok.encode("[7]")


turns_cfg = Config(seed=7, max_turns=3, max_new_tokens=MAX_NEW_TOKENS, max_model_len=64)
turn_ends = list(range(engine.vocab_size))
hf_engine = rollout.HFEngine(path, device, turn_ends)
engine.stop_ids = turn_ends
keys = [(0, i, 0) for i in range(len(prompts))]
episodes = {name: [e[:3] for e in multiturn.run_episodes(e, Calculator(), turns_cfg, prompts, keys, 0.0)]
            for name, e in (("vllm", engine), ("hf", hf_engine))}
engine.stop_ids = stop_ids
measured["episodes"] = {name: [(ids, mask) for ids, _, mask in eps] for name, eps in episodes.items()}
measured["episode_logprob_max_diff"] = max(abs(a - b) for (_, la, _), (_, lb, _) in zip(*episodes.values())
                                           for a, b in zip(la, lb))
del hf_engine

# ---- 3. train one step (FSDP over both ranks), then refit in small recorded buckets ----------
engine.sleep()  # as train_ppo.py does around training (a no-op on CPU)
lp, _ = model_parallel.forward_policy(policy, ids, lens, mesh, replace(cfg, temperature=1.0))  # (b, S)
(-lp[mask].sum() / mask.sum()).backward()  # make the engine's own samples likelier
torch.optim.AdamW(policy.parameters(), lr=1e-2).step()  # (refit wakes the engine up)


def recorded_refit(named_full_tensors, bucket_mb):
    """rollout.refit, noting the names and byte sizes of every bucket the engine is handed."""
    buckets, load_weights = [], engine.load_weights

    def recording_load_weights(named):
        buckets.append([(n, t.numel() * t.element_size()) for n, t in named])
        load_weights(named)

    engine.load_weights = recording_load_weights
    t0 = time.perf_counter()
    try:
        stats = rollout.refit(engine, named_full_tensors, bucket_mb=bucket_mb)
    finally:
        engine.load_weights = load_weights
    seconds = time.perf_counter() - t0
    return dict(stats, buckets=buckets, bucket_limit_bytes=bucket_mb * 2**20, seconds=seconds)


measured["refit"] = recorded_refit(model_parallel.iter_full_params(policy), BUCKET_MB)
measured["param_bytes"] = {n: p.numel() * p.element_size() for n, p in plain.named_parameters()}

# ---- 4. after refit: engine logprobs == the trainer's forward_policy on the same ids ----------
after = generate(prompts, seeds)
ids, lens, mask, engine_lp = rows(after)
with torch.no_grad():
    # (b, S)
    trainer_lp, _ = model_parallel.forward_policy(policy, ids, lens, mesh, cfg)
measured["diff_after_refit_vs_trainer"] = (engine_lp - trainer_lp)[mask].abs().mean().item()
# the update must have moved these logprobs far more than the tolerance, or step 4 proves nothing
measured["diff_trained_vs_initial"] = (trainer_lp - hf_logprobs(ids, lens))[mask].abs().mean().item()
measured["samples_changed_by_refit"] = sum(a != b for a, b in zip(tokens(after), tokens(first)))

# ---- 4b. sampled episodes of multi-token turns on the trainer's weights: each turn's seeds and
# context, and the engine's logprobs of the model's tokens against forward_policy on the rows
# train_ppo.training_batch would build (make_batch with the action masks). A turn ends at an id
# divisible by 3 (measured: 1 to 11 tokens, 2 to 3 on average, 3 in 5 of 2 or more); "[7]" answers
# each finished turn. max_model_len 20: where turns are long, no room is left for a third turn, so
# that a turn's call serves only the episodes still running (seen with tiny-llama)
calls, engine_generate, engine_stop_ids = [], engine.generate, engine.stop_ids


def recording_generate(prompt_list, seed_list, budgets, temperature):
    calls.append(dict(contexts=[list(p) for p in prompt_list], seeds=list(seed_list)))
    return engine_generate(prompt_list, seed_list, budgets, temperature)


episode_cfg = Config(seed=cfg.seed, max_turns=3, max_new_tokens=MAX_NEW_TOKENS, max_model_len=20)
episode_keys = [(group_index, i, 0) for i in range(len(prompts))]  # turn 0's seeds are `seeds`
engine.generate, engine.stop_ids = recording_generate, [i for i in range(engine.vocab_size) if i % 3 == 0]
t0 = time.perf_counter()
try:
    # (ids, engine logprobs, action mask) of each episode
    sampled = [e[:3] for e in multiturn.run_episodes(engine, Calculator(), episode_cfg, prompts, episode_keys,
                                                   TEMPERATURE)]
finally:
    engine.generate, engine.stop_ids = engine_generate, engine_stop_ids
batch = train_ppo.make_batch(prompts, [r for r, _, _ in sampled], tok.encode_single_token(rollout.PAD),
                             [lps for _, lps, _ in sampled], action_masks=[a for _, _, a in sampled])
with torch.no_grad():
    trainer_lp, _ = model_parallel.forward_policy(policy, batch.ids, batch.lens, mesh, cfg)  # (b, S)
response = train_ppo.make_batch(prompts, [r for r, _, _ in sampled], 0).mask.bool()  # (b, S) every token
measured["sampled_episodes"] = dict(
    prompts=prompts, episodes=[(ids, mask) for ids, _, mask in sampled], calls=calls,
    single_turn=tokens(after),  # step 4's samples: the same seeds as turn 0, one stop token
    expected_seeds=[[rollout.sample_seed(cfg.seed, *key, t) for t in range(3)] for key in episode_keys],
    # mean |engine - trainer| on the model's tokens (action mask 1), and on every response token
    diff_vs_trainer=(batch.engine_lp - trainer_lp)[batch.mask.bool()].abs().mean().item(),
    diff_all_response_tokens=(batch.engine_lp - trainer_lp)[response].abs().mean().item(),
    seconds=time.perf_counter() - t0)

# ---- 5. refit the initial weights (the plain model's, named as in the checkpoint), in buckets
# smaller than the largest tensors: those must travel alone, and every fused layer is split
measured["refit_back"] = recorded_refit(plain.named_parameters(), SMALL_BUCKET_MB)
back = generate(prompts, seeds)
measured["refit_back_same_samples"] = tokens(back) == tokens(first)
measured["refit_back_max_logprob_diff"] = max(abs(a - b)
                                              for (_, la), (_, lb) in zip(back, first)
                                              for a, b in zip(la, lb))

# ---- 6. a second stop token (Qwen2.5's <|endoftext|> beside <|im_end|>) ends a response too: the
# greedy response with EOS alone, then with its first new token past position 0 added to the set
free = tokens(engine.generate(prompts[:1], [0], [MAX_NEW_TOKENS], 0.0))[0]
k = next((i for i in range(1, len(free)) if free[i] not in free[:i] + stop_ids), 0)
engine.stop_ids = stop_ids + [free[k]]
stopped = tokens(engine.generate(prompts[:1], [0], [MAX_NEW_TOKENS], 0.0))[0]
measured["second_stop"] = dict(free=free, k=k, stopped=stopped)
engine.stop_ids = stop_ids

# ---- gather to rank 0, then shut the engine down: last, it destroys the process group --------
gathered = [None] * world_size
dist.all_gather_object(gathered, measured)
if rank == 0:
    with open(os.path.join(args.dir, "results.json"), "w") as f:
        json.dump(gathered, f, indent=1)
    for m in gathered:
        long = ("refit", "refit_back", "param_bytes", "sampled_episodes")
        summary = {k: v for k, v in m.items() if k not in long}
        print(json.dumps(summary), flush=True)
dist.barrier()
engine.shutdown()
