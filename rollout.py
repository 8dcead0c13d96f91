"""Where the data of a PPO step comes from: tasks, prompts, tokenizer, rewards, the generation engine, and refit
(pushing the trained weights into the engine).

Read this after train_ppo.py's step 1-3. Nothing here knows about PPO losses: the trainer asks for "these prompts,
sampled with these seeds" and gets back token ids, the engine's logprob of each sampled token, a score per sequence.
"""
import hashlib
import json
import logging
import os
import random
import re
import warnings
from contextlib import contextmanager
from typing import Optional, Protocol

import numpy as np
import tiktoken
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM


# -----------------------------------------------------------------------------
# The toy task: small-number addition, "3+4=" -> "7". Reward 1 for the exact sum then end-of-text, else 0: a
# verifiable, rule-based reward like GSM8K's. Operands 0..4 (25 facts: a 1M-parameter model learns 0..9 too slowly for
# a CPU demo). The tokenizer, built in code, is a byte-level BPE with no merges (ids 0..255) plus two special tokens;
# the toy vocab (262) exceeds these 258 ids on purpose, like padded checkpoints (Qwen2.5: 151,936 rows, 151,665 tokens).
TOY_OPERANDS = 5
EOS, PAD = "<|endoftext|>", "<|pad|>"


def toy_tokenizer() -> tiktoken.Encoding:
    # pat_str is the pre-tokenization split: irrelevant without merges
    return tiktoken.Encoding(name="toy_bytes", pat_str=r"[^\n]+|\n",
                             mergeable_ranks={bytes([i]): i for i in range(256)}, special_tokens={EOS: 256, PAD: 257})


def epoch_order(seed: int, size: int, start: int, n: int) -> list:
    """Indices of items start .. start+n-1 of an endless stream of epochs over `size` items, each epoch shuffled anew
    (seeded by (seed, epoch)): every item once per epoch, none twice before all were drawn. A function of the position
    alone, the same on every rank: a run resumed from its saved position draws what the straight run would have."""
    orders, out = {}, []
    for position in range(start, start + n):
        epoch, offset = divmod(position, size)
        if epoch not in orders:
            orders[epoch] = random.Random(f"{seed}/epoch/{epoch}").sample(range(size), size)
        out.append(orders[epoch][offset])
    return out


TOY_FACTS = [(f"{a}+{b}=", str(a + b)) for a in range(TOY_OPERANDS) for b in range(TOY_OPERANDS)]


def toy_prompts(seed: int, start: int, n: int) -> list:
    """(prompt text, answer text) pairs start .. start+n-1 of the shuffled epochs over the 25 facts."""
    return [TOY_FACTS[i] for i in epoch_order(seed, len(TOY_FACTS), start, n)]


def toy_reward(response_text: str, answer: str, finished: bool) -> float:
    """1.0 when the response is exactly the answer and the model stopped (emitted EOS)."""
    return float(finished and response_text.strip() == answer)


# -----------------------------------------------------------------------------
# Math answers (GSM8K and the like): the reward is exact match of the final number. GSM8K's references end in
# "#### 72" (Cobbe et al., 2021); a model's answer is its last \boxed{...} if any (MATH's convention, Hendrycks et al.,
# 2021), else the number after the last "####", else the last number (the "flexible extract" of eval harnesses).
# Numbers are normalized: thousands separators, "$", "%", units and a trailing period dropped, "72.00" equals "72".

_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")


def _last_number(text: str):
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def extract_answer(text: str):
    """The final number a response gives, as a canonical string ("1200", "-3.5"), or None."""
    boxed = re.findall(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}", text)
    if boxed:
        frac = re.fullmatch(r"\s*(-?)\\d?frac\{(-?\d+)\}\{(\d+)\}\s*", boxed[-1])
        if frac and int(frac[3]):  # \frac{a}{b} (or \dfrac) is a number too
            value = (-1 if frac[1] else 1) * int(frac[2]) / int(frac[3])
            return str(int(value)) if value == int(value) else repr(value)
        candidate = _last_number(boxed[-1])
    elif "####" in text:  # the number right after the marker, whatever follows it
        found = _NUMBER.findall(text.rsplit("####", 1)[1])
        candidate = found[0] if found else None
    else:
        candidate = _last_number(text)
    if candidate is None:
        return None
    value = float(candidate.replace(",", ""))
    return str(int(value)) if value == int(value) else repr(value)


def math_reward(response_text: str, reference: str, format_weight: float = 0.0) -> float:
    """1.0 if the response's final number equals the reference's. With format_weight > 0, a wrong answer given in the
    expected form (\boxed{} or ####) earns format_weight: a small shaping reward (DeepSeek-R1's format reward, 2025)."""
    answer = extract_answer(response_text)
    if answer is not None and answer == extract_answer(reference):
        return 1.0
    formatted = "\\boxed{" in response_text or "####" in response_text
    return format_weight if formatted else 0.0


def stop_token_ids(model_dir: str, eos_id) -> list:
    """Every token that ends a response: the task's EOS and each eos_token_id of the checkpoint's generation_config.json
    (Qwen2.5-Instruct: <|im_end|> and <|endoftext|>; Llama 3: three). vLLM stops at all of these by itself, so the HF
    engine, `finished`, the reward and the dumps must know them too. [] if eos_id is None: all run to max_new_tokens."""
    if eos_id is None:
        return []
    ids, path = {eos_id}, os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else eos or [])
    return sorted(ids)


def finished(response_ids: list, stop_ids: list) -> bool:
    """The response ended by itself (a stop token), rather than being cut off by max_new_tokens."""
    return bool(response_ids) and response_ids[-1] in stop_ids


def sample_seed(seed: int, step: int, prompt_index: int, sample_index: int) -> int:
    """A sample's seed depends on what it is, not on its rank or batch: a config samples the same tokens on any mesh."""
    key = f"{seed}/{step}/{prompt_index}/{sample_index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little")


# -----------------------------------------------------------------------------
# Tasks. A task is everything the trainer asks of the data side; the toy task and GSM8K implement the same Protocol,
# and so does a forker's own task (README, "How to fork").

class Task(Protocol):
    eos_id: Optional[int]  # ends a response (with generation_config's: stop_token_ids); None = never stop
    pad_id: int  # fills the right-padded (b, S) rows; never a loss token
    val: list  # held-out (prompt, answer) pairs for validation, or []

    # pairs start .. start+n-1 of the task's stream (shuffled epochs of a data set), the same on every rank
    def prompts(self, start: int, n: int) -> list: ...
    def encode(self, prompt: str) -> list: ...  # prompt token ids (chat template applied, if any)
    def target(self, answer: str) -> list: ...  # answer ids + EOS: what the SFT warm-up imitates
    def decode(self, ids: list) -> str: ...
    def reward(self, text: str, answer: str, finished: bool) -> float: ...  # finished: ended by a stop token


class TaskError(ValueError):
    """Bad task input (file, line, prompt length, tokenizer): one line, exit 2."""


class ToyTask:
    """`a+b=` with operands 0..4, the byte tokenizer above; subclass it for a toy task of your own."""

    def __init__(self, seed: int):
        self.seed, self.tok, self.val = seed, toy_tokenizer(), []
        self.eos_id, self.pad_id = self.tok.encode_single_token(EOS), self.tok.encode_single_token(PAD)

    def prompts(self, start, n):
        return toy_prompts(self.seed, start, n)

    def encode(self, prompt):
        return self.tok.encode(prompt)

    def target(self, answer):
        return self.tok.encode(answer) + [self.eos_id]

    def decode(self, ids):
        # special tokens and ids the tokenizer does not know (the model's padding rows) are dropped
        return self.tok.decode([i for i in ids if i < 256], errors="replace")

    def reward(self, text, answer, finished):
        return toy_reward(text, answer, finished)


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
                raise TaskError(f"{path}:{number}: not a JSON object with 'question' and 'answer' keys") from None
            if not str(question).strip():
                raise TaskError(f"{path}:{number}: empty question")
            if extract_answer(str(answer)) is None:
                raise TaskError(f"{path}:{number}: the answer has no final number ('#### N')")
            pairs.append((str(question), str(answer)))
    if not pairs:
        raise TaskError(f"prompts file {path!r} has no prompts")
    return pairs

# Appended to each question so that the answer is extractable (NeMo-RL's and verl's recipes, in spirit).
GSM8K_INSTRUCTION = " Let's think step by step and output the final answer after \"####\"."


class GSM8KTask:
    """Math word problems from JSONL files, with the checkpoint's own tokenizer and chat template
    (Qwen2.5, Llama 3, ...). Every prompt is checked at start: fail now, not when it is drawn."""

    def __init__(self, cfg, model_dir: str, model_vocab_size: int):
        from transformers import AutoTokenizer
        self.tok, self.seed, self.format_reward = AutoTokenizer.from_pretrained(model_dir), cfg.seed, cfg.format_reward
        if len(self.tok) > model_vocab_size:
            raise TaskError(f"the tokenizer of {model_dir} has {len(self.tok)} tokens but the model's "
                            f"vocab is {model_vocab_size}: tokenizer and checkpoint do not match")
        self.train, self.instruction = read_gsm8k(cfg.prompts), cfg.instruction or GSM8K_INSTRUCTION
        self.val = read_gsm8k(cfg.val_prompts) if cfg.val_prompts else []
        for name, pairs in (("prompts", self.train), ("val_prompts", self.val)):
            for i, (question, _) in enumerate(pairs):
                if len(self.encode(question)) + cfg.max_new_tokens > cfg.max_model_len:
                    raise TaskError(f"{name} line {i + 1}: prompt of {len(self.encode(question))} tokens + "
                                    f"max_new_tokens={cfg.max_new_tokens} exceeds max_model_len="
                                    f"{cfg.max_model_len}: raise max_model_len or shorten the prompt")
        self.eos_id = self.tok.eos_token_id
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_id

    def prompts(self, start, n):
        return [self.train[i] for i in epoch_order(self.seed, len(self.train), start, n)]

    def encode(self, question):
        text = question + self.instruction
        if self.tok.chat_template:
            return list(self.tok.apply_chat_template([{"role": "user", "content": text}],
                                                     add_generation_prompt=True, tokenize=True, return_dict=False))
        return self.tok.encode(text)

    def target(self, answer):
        return self.tok.encode(answer) + [self.eos_id]

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=True)

    def reward(self, text, answer, finished):
        # cut off by max_new_tokens: 0, lest a truncated chain of thought ending on the answer earn the full reward
        return math_reward(text, answer, self.format_reward) if finished else 0.0


def make_task(cfg, model_dir: str, model_vocab_size: int) -> Task:
    return ToyTask(cfg.seed) if cfg.task == "toy_add" else GSM8KTask(cfg, model_dir, model_vocab_size)


def validation_accuracy(engine, task: Task, cfg, device: torch.device) -> float:
    """Greedy accuracy on the held-out prompts. Collective (every rank). They are split over the
    vLLM groups (rollout_tp_size consecutive ranks pass identical requests), the count summed."""
    rank, groups = dist.get_rank(), dist.get_world_size() // cfg.rollout_tp_size
    mine, correct = task.val[rank // cfg.rollout_tp_size::groups], 0.0
    if mine:
        outs = engine.generate([task.encode(q) for q, _ in mine], [0] * len(mine), cfg.max_new_tokens, 0.0)  # greedy
        correct = sum(task.reward(task.decode(r), a, finished(r, engine.stop_ids)) == 1.0
                      for (r, _), (_, a) in zip(outs, mine))
    total = torch.tensor([float(correct)], device=device)
    dist.all_reduce(total)  # every member of a vLLM group counted the same prompts
    return total.item() / cfg.rollout_tp_size / len(task.val)


# -----------------------------------------------------------------------------
# Engines. Each step the trainer calls generate, sleep (training runs), then `refit` below: wake_up(["weights"]),
# load_weights per bucket, finish_refit, wake_up(["kv_cache"]). The HF and vLLM engines implement this Protocol.

class Engine(Protocol):
    dtype: torch.dtype  # refit casts the trained weights to this
    stop_ids: list  # a response ends at any of these (stop_token_ids): the trainer's `finished` too

    # one (response ids, engine logprob per sampled token) per prompt, sample k drawn with seeds[k] alone; T=0: greedy
    def generate(self, prompt_ids: list, seeds: list, max_new_tokens: int, temperature: float) -> list: ...
    def sleep(self) -> None: ...  # training runs now: free what can be freed (GPU memory)
    def wake_up(self, tags: list) -> None: ...  # memory of "weights" / "kv_cache" back
    def load_weights(self, named_tensors: list) -> None: ...  # one refit bucket of (HF name, full tensor)
    def finish_refit(self) -> None: ...  # all buckets are in: drop caches made by the old weights
    def shutdown(self) -> None: ...


# The HF engine: a plain (unsharded) transformers model on each rank, a hand-written sampling loop; the fallback
# without vLLM and the simplest read of generation. Refit every step like vLLM (`refit`): it samples the current policy.

class HFEngine:
    def __init__(self, model_dir: str, device: torch.device, stop_ids: list, dtype=torch.float32):
        self.device, self.stop_ids, self.dtype = device, stop_ids, dtype  # refit casts to dtype
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        self.params = dict(self.model.named_parameters())  # HF checkpoint names -> tensors

    @torch.no_grad()
    def generate(self, prompt_ids, seeds, max_new_tokens, temperature):
        """Prompts are left-padded so that every row's next token sits in the last column."""
        B, P = len(prompt_ids), max(len(p) for p in prompt_ids)
        ids = torch.zeros((B, P), dtype=torch.long, device=self.device)  # (B, P) left-padded prompts
        mask = torch.zeros(B, P, dtype=torch.long, device=self.device)  # (B, P) 1 = real token
        for b, p in enumerate(prompt_ids):
            ids[b, P - len(p):], mask[b, P - len(p):] = torch.tensor(p), 1
        # position ids count real tokens only: a left-padded prompt sees the positions it would alone (RoPE unshifted)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, P)
        gens = [torch.Generator().manual_seed(s) for s in seeds]  # one per sample: no row's draws depend on another
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
        responses, logprobs, done = [[] for _ in range(B)], [[] for _ in range(B)], [False] * B
        for _ in range(max_new_tokens):
            # the trainer's convention: log-softmax of logits / T in fp32 (T = 0: greedy, plain logprobs)
            logits = out.logits[:, -1].float().cpu()  # (B, V)
            logp = torch.log_softmax(logits / (temperature or 1.0), -1)  # (B, V)
            if temperature == 0:
                token = logp.argmax(-1, keepdim=True)  # (B, 1)
            else:
                token = torch.stack([torch.multinomial(logp[b].exp(), 1, generator=gens[b]) for b in range(B)])
            for b in range(B):
                if not done[b]:
                    responses[b].append(token[b, 0].item())
                    logprobs[b].append(logp[b, token[b, 0]].item())
                    done[b] = token[b, 0].item() in self.stop_ids
            if all(done):
                break
            mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=self.device)], 1)
            pos = pos[:, -1:] + 1  # (B, 1)
            out = self.model(input_ids=token.to(self.device), attention_mask=mask,
                             position_ids=pos, past_key_values=out.past_key_values, use_cache=True)
        return list(zip(responses, logprobs))

    @torch.no_grad()
    def load_weights(self, named_tensors):
        for name, tensor in named_tensors:
            if name not in self.params:
                raise KeyError(f"refit: the engine has no parameter named {name!r}")
            self.params[name].copy_(tensor)

    def finish_refit(self): ...  # nothing is cached across calls here (vLLM resets its prefix cache instead)
    def sleep(self): ...  # the HF engine keeps its memory (it is the CPU / debugging fallback)
    def wake_up(self, tags): ...  # nothing was freed

    def shutdown(self):
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


# -----------------------------------------------------------------------------
# The vLLM engine, colocated: one vLLM instance in every trainer process, no server, no Ray (the "hybrid engine" of
# verl and NeMo-RL), via vLLM's torchrun support, distributed_executor_backend="external_launcher": vLLM joins the
# torch world torchrun made (init_process_group first) and carves its tensor-parallel groups from it, consecutive
# blocks of rollout_tp_size ranks. "GPU only" lines were read from vLLM's source, not run (README, "Verified on").

def rng_states():
    """Every RNG the run draws from (also kept around vLLM's calls, which reseed them)."""
    return dict(torch=torch.get_rng_state(), python=random.getstate(), numpy=np.random.get_state(),
                cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def set_rng_states(state):
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextmanager
def _trainer_state_kept():
    """vLLM in-process reseeds the global RNGs, draws from the global torch RNG while sampling, and on CPU turns
    torch.set_num_threads into a no-op for the process. Put everything back: the trainer's state is the trainer's."""
    states, threads, set_threads = rng_states(), torch.get_num_threads(), torch.set_num_threads
    try:
        yield
    finally:
        set_rng_states(states)
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)


class VLLMEngine:
    def __init__(self, model_dir: str, cfg, stop_ids: list):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process
        from vllm import LLM  # imported here: the HF engine works without vLLM
        self.on_gpu, self.asleep, self.stop_ids = torch.cuda.is_available(), set(), stop_ids  # asleep: sleep()'s tags
        self.dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32  # refit casts to this
        kwargs = dict(
            model=model_dir, distributed_executor_backend="external_launcher",
            tensor_parallel_size=cfg.rollout_tp_size, dtype=str(self.dtype).removeprefix("torch."),
            data_parallel_size=1,  # >1 makes vLLM sync every decode step across ranks
            skip_tokenizer_init=True,  # token ids in and out; the tokenizer is ours
            seed=cfg.seed, max_model_len=cfg.max_model_len, use_tqdm_on_load=False,
            # the trainer's log_softmax(logits / T) of the sampled token (default "raw_logprobs" ignores T: ~0.1 off)
            logprobs_mode="processed_logprobs")
        if self.on_gpu:
            kwargs.update(gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,  # GPU only
                          enable_sleep_mode=True)  # GPU only: free weights + KV during training
        else:
            kwargs.update(enforce_eager=True,  # no compile step on CPU
                          kv_cache_memory_bytes=cfg.vllm_kv_cache_gb * 2**30)  # else 90% of RAM
        with _trainer_state_kept():
            self.llm = LLM(**kwargs)  # a collective: every rank constructs it together
        self.worker = self.llm.llm_engine.model_executor.driver_worker.worker
        self.model = self.worker.model_runner.get_model()  # in-process handles (no multiprocessing): refit writes here
        self.reloading = False

    def generate(self, prompt_ids, seeds, max_new_tokens, temperature):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        # one SamplingParams per sample: its seed gives the request its own generator. Without a tokenizer vLLM knows
        # only generation_config's EOS ids: stop_token_ids names the set (kept in the output); empty: theirs ignored too
        params = [SamplingParams(seed=s, temperature=temperature, max_tokens=max_new_tokens, logprobs=0,
                                 stop_token_ids=self.stop_ids, ignore_eos=not self.stop_ids, detokenize=False)
                  for s in seeds]
        prompts = [TokensPrompt(prompt_token_ids=p) for p in prompt_ids]
        with _trainer_state_kept():
            outs = self.llm.generate(prompts, params, use_tqdm=False)  # in prompt order
        samples = [out.outputs[0] for out in outs]  # logprobs: one {token: Logprob} per step
        return [(list(s.token_ids), [step[t].logprob for t, step in zip(s.token_ids, s.logprobs)]) for s in samples]

    # Refit uses vLLM's layerwise reloading (docs.vllm.ai, "training/layerwise") over buckets: initialize once,
    # load_weights per bucket through vLLM's own loaders (they fuse q/k/v and gate/up, shard for TP, repack for the CPU
    # kernels once a layer is complete), finalize once. reload_weights per bucket would process a layer split across
    # buckets half-loaded (NaN), and load_weights on the live model fails once CPU repacking removed the weight
    # loaders. vLLM holds a layer's tensors until the layer is complete: never reuse a bucket's buffers.
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
            # a tied lm_head loads no weight: repack its stale CPU-packed copy (|d logprob| ~2e-2) from the shared one
            lm_head = getattr(self.model, "lm_head", None)
            if lm_head is not None and self.worker.model_config.hf_text_config.tie_word_embeddings:
                lm_head.quant_method.process_weights_after_loading(lm_head)
        self.reloading = False
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights

    def sleep(self):
        if self.on_gpu:  # GPU only: level 2 drops weights and KV cache; refit rewrites every weight
            self.llm.sleep(level=2)
            self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags):
        tags = [t for t in tags if t in self.asleep]  # on CPU nothing sleeps
        if tags:  # GPU only: memory back, contents garbage until refit / the next generate
            self.llm.wake_up(tags=tags)
            self.asleep -= set(tags)

    def shutdown(self):
        """vLLM's shutdown destroys the default process group itself: call it last."""
        self.llm.llm_engine.engine_core.shutdown()


def make_engine(cfg, model_dir: str, device: torch.device, stop_ids: list) -> Engine:
    if cfg.rollout_engine == "vllm":
        return VLLMEngine(model_dir, cfg, stop_ids)
    return HFEngine(model_dir, device, stop_ids, torch.bfloat16 if cfg.dtype == "bf16" else torch.float32)


# -----------------------------------------------------------------------------
# Refit: stream the trained weights into the engine in bounded buckets. All ranks iterate `named_full_tensors` together
# (each item a collective gathering one parameter), cast to the engine's dtype (the limit counts bytes sent) and hand
# the engine a bucket before the next tensor would overflow `bucket_mb`. With one bucket (or one larger parameter) built
# at a time and at most one incomplete layer kept by vLLM, transient memory does not grow with the model, unlike a full
# state dict (why verl and NeMo-RL bucket refit). On GPU the sleeping engine gets weight memory back first, KV cache
# after the last bucket (vLLM's documented order, also TRL's and verl's): the gathered tensors never meet the KV cache.

def refit(engine: Engine, named_full_tensors, bucket_mb: float) -> dict:
    if torch.cuda.is_available():  # GPU: what training freed goes back to the driver before vLLM takes it
        torch.cuda.empty_cache()
    engine.wake_up(["weights"])
    limit, dtype = bucket_mb * 2**20, engine.dtype
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
    engine.wake_up(["kv_cache"])
    return {"refit_bytes": total, "refit_largest_bucket_bytes": largest}


# -----------------------------------------------------------------------------
# Console: the one place where third-party output is silenced. Each message below was read and found harmless;
# errors are never hidden (vLLM still logs at ERROR).
#  - vLLM WARNINGs: "RotaryEmbedding: Failed to load weights" at every refit (the rotary cache is not a checkpoint
#    tensor: vLLM puts its own copy back), "Chat template warmup failed" (we skip vLLM's tokenizer on purpose), "CPU
#    backend doesn't allow to use torch.set_num_threads" (we restore the thread count ourselves), "Triton is installed,
#    but doesn't include CPU backend".
#  - a FutureWarning from vLLM's own use of torch.distributed.reduce_op; transformers' load reports and progress bars.

def quiet_third_party_output() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # read when vLLM configures its logging,
    logging.getLogger("vllm").setLevel(logging.ERROR)  # which it does only once an engine is built
    warnings.filterwarnings("ignore", message=r"`torch.distributed.reduce_op` is deprecated", category=FutureWarning)
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


# -----------------------------------------------------------------------------
# Rollout dumps: what the policy said, readable by a person, and replayable.

def dump_rollouts(path: str, samples: list) -> None:
    """Write one JSON line per sample, atomically (temp file, then rename)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(s) + "\n" for s in sorted(samples, key=lambda s: s["index"]))
    os.replace(path + ".tmp", path)


def load_rollouts(path: str) -> dict:
    """{global index: sample} of a dumped step, for replay."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"replay_rollouts: {path} is missing (did the run have this step?)")
    with open(path) as f:
        return {s["index"]: s for s in map(json.loads, f)}
