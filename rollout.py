"""Where the data of a PPO step comes from: tasks, prompts, tokenizer, rewards, the
generation engine, and refit (pushing the trained weights into the engine).

Read this after train_ppo.py's step 1-3. Nothing here knows about PPO losses: the trainer
asks for "these prompts, sampled with these seeds" and gets back token ids, the engine's
own logprob of each sampled token, and a score per sequence.
"""
import hashlib
import json
import os
import random

import tiktoken
import torch
from transformers import AutoModelForCausalLM

# -----------------------------------------------------------------------------
# Tokenizer for the toy task: built in code, nothing downloaded.
# A byte-level BPE with no merges: every byte is its own token (ids 0..255), plus two
# special tokens. Real models bring their own tokenizer (issue 7); the toy model's vocab
# (262) is deliberately larger than this tokenizer's 258 ids, as with real checkpoints
# whose embedding matrix is padded (Qwen2.5: 151,936 rows for 151,665 tokens).

EOS, PAD = "<|endoftext|>", "<|pad|>"


def toy_tokenizer() -> tiktoken.Encoding:
    return tiktoken.Encoding(
        name="toy_bytes",
        pat_str=r"[^\n]+|\n",  # pre-tokenization split: irrelevant without merges
        mergeable_ranks={bytes([i]): i for i in range(256)},
        special_tokens={EOS: 256, PAD: 257},
    )


def decode(tok: tiktoken.Encoding, ids: list) -> str:
    """Text of token ids, dropping special tokens and ids the tokenizer does not know
    (the model may sample one of its padding rows: it scores like any wrong answer)."""
    return tok.decode([i for i in ids if i < 256], errors="replace")


# -----------------------------------------------------------------------------
# The toy task: small-number addition, "3+4=" -> "7". Reward 1 for the exact sum followed
# by end-of-text, 0 otherwise: a verifiable, rule-based reward like GSM8K's. Operands are
# 0..4, so 25 facts: a 1M-parameter model memorizes 100 facts (0..9) too slowly for a CPU
# demo of a few minutes, by SFT or by RL alike (measured: 150 SFT steps reach only 47%).
TOY_OPERANDS = 5


def toy_prompts(seed: int, step, n: int) -> list:
    """n (prompt text, answer text) pairs for `step`, identical on every rank: the RNG is
    seeded from (seed, step) only, never from the rank."""
    rng = random.Random(f"{seed}/prompts/{step}")
    pairs = [(rng.randrange(TOY_OPERANDS), rng.randrange(TOY_OPERANDS)) for _ in range(n)]
    return [(f"{a}+{b}=", str(a + b)) for a, b in pairs]


def toy_reward(response_text: str, answer: str, finished: bool) -> float:
    """1.0 when the response is exactly the answer and the model stopped (emitted EOS)."""
    return float(finished and response_text.strip() == answer)


def sample_seed(seed: int, step: int, prompt_index: int, sample_index: int) -> int:
    """The seed of one sample depends on what it is, not on which rank draws it or with
    which batch, so that the same config samples the same tokens on any mesh."""
    key = f"{seed}/{step}/{prompt_index}/{sample_index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little")


# -----------------------------------------------------------------------------
# The HF engine: a plain (unsharded) transformers model on each rank with a hand-written
# sampling loop. It is the fallback when vLLM is absent and the simplest place to read how
# generation works. It is refit from the trained weights after every step by exactly the
# code path vLLM uses (`refit` below), so its samples always come from the current policy.

class HFEngine:
    def __init__(self, model_dir: str, device: torch.device):
        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.to(device).eval()
        self.params = dict(self.model.named_parameters())  # HF checkpoint names -> tensors

    @torch.no_grad()
    def generate(self, prompt_ids: list, seeds: list, max_new_tokens: int,
                 temperature: float, eos_id: int) -> list:
        """One (response ids, engine logprob of each sampled token) per prompt.
        Prompts are left-padded so that every row's next token sits in the last column."""
        B, P = len(prompt_ids), max(len(p) for p in prompt_ids)
        ids = torch.full((B, P), eos_id, dtype=torch.long)  # (B, P) left-padded prompts
        mask = torch.zeros(B, P, dtype=torch.long)  # (B, P) 1 = real token
        for b, p in enumerate(prompt_ids):
            ids[b, P - len(p):], mask[b, P - len(p):] = torch.tensor(p), 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        # Position ids count real tokens only, so a left-padded prompt sees the same
        # positions as it would alone (otherwise RoPE would shift by the padding).
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, P)
        # One generator per sample: a row's draws never depend on the other rows.
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        responses, logprobs = [[] for _ in range(B)], [[] for _ in range(B)]
        done = [False] * B
        for _ in range(max_new_tokens):
            # Same convention as the trainer: log-softmax of logits / T, in fp32.
            logp = torch.log_softmax(out.logits[:, -1].float() / temperature, -1).cpu()  # (B, V)
            token = torch.stack([torch.multinomial(logp[b].exp(), 1, generator=gens[b])
                                 for b in range(B)])  # (B, 1)
            for b in range(B):
                if not done[b]:
                    responses[b].append(token[b, 0].item())
                    logprobs[b].append(logp[b, token[b, 0]].item())
                    done[b] = token[b, 0].item() == eos_id
            if all(done):
                break
            mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=self.device)], 1)
            pos = pos[:, -1:] + 1  # (B, 1)
            out = self.model(input_ids=token.to(self.device), attention_mask=mask,
                             position_ids=pos, past_key_values=out.past_key_values, use_cache=True)
        return list(zip(responses, logprobs))

    @torch.no_grad()
    def load_weights(self, named_tensors: list) -> None:
        """One refit bucket: full tensors named as in the HF checkpoint."""
        for name, tensor in named_tensors:
            if name not in self.params:
                raise KeyError(f"refit: the engine has no parameter named {name!r}")
            self.params[name].copy_(tensor)

    def finish_refit(self) -> None:
        """Nothing is cached across calls here (vLLM resets its prefix cache instead)."""


def make_engine(cfg, model_dir: str, device: torch.device):
    return HFEngine(model_dir, device)


# -----------------------------------------------------------------------------
# Refit: stream the trained weights into the engine in bounded buckets.
# Every rank iterates `named_full_tensors` together (each item is a collective that
# gathers one parameter to full), casts it to the engine's dtype, and hands the engine a
# bucket whenever the next tensor would overflow `bucket_mb`. At most one bucket (plus
# one parameter larger than a bucket on its own) is alive at a time, so the transient
# memory does not grow with the model, unlike gathering a full state dict first
# (verl and NeMo-RL both bucket their refit for this reason).

def refit(engine, named_full_tensors, bucket_mb: int, dtype=torch.float32) -> dict:
    limit = bucket_mb * 2**20
    bucket, size, largest, total = [], 0, 0, 0
    for name, tensor in named_full_tensors:
        tensor = tensor.detach().to(dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit:  # flush before overflowing
            engine.load_weights(bucket)
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
        largest, total = max(largest, size), total + nbytes
    if bucket:
        engine.load_weights(bucket)
    engine.finish_refit()
    return {"refit_bytes": total, "refit_largest_bucket_bytes": largest}


# -----------------------------------------------------------------------------
# Rollout dumps: what the policy said, readable by a person, and replayable.

def dump_rollouts(path: str, samples: list) -> None:
    """Write one JSON line per sample, atomically (temp file, then rename)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        for s in sorted(samples, key=lambda s: s["index"]):
            f.write(json.dumps(s) + "\n")
    os.replace(path + ".tmp", path)


def load_rollouts(path: str) -> dict:
    """{global index: sample} of a dumped step, for replay."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"replay_rollouts: {path} is missing (did the run have this step?)")
    with open(path) as f:
        return {s["index"]: s for s in map(json.loads, f)}
