"""One flat config for the whole run.

    python train_ppo.py --help                       # every field, its default and its doc
    torchrun ... train_ppo.py --config configs/demo_cpu.toml --steps=5 --lr=3e-5

Order of precedence: dataclass default < `--config FILE` (flat TOML) < `--key=value`.
Sizes say whether they are *per rank* or *global* (summed over data-parallel ranks), as in "The
N+ implementation details of RLHF with PPO" (Huang et al., 2024). Nothing here touches
torch.distributed or a model: bad input is refused before any heavy work starts, with one line
naming the key and the fix (`ConfigError`).
"""
import ast
import contextlib
import dataclasses
import importlib.util
import inspect
import io
import json
import logging
import os
import sys
import textwrap
import time
import tokenize
import tomllib
import typing
import warnings
from typing import Literal


class ConfigError(ValueError):
    """A problem with the user's config: printed as one line, exit code 2."""


@dataclasses.dataclass
class CoreConfig:
    """Every setting of the core. A field's doc is the run of comment lines directly above it
    and/or its trailing comment; `# ---- name ----` banners head the groups (see field_docs).
    Config, below, adds the extensions' options to these."""

    # the keys the user gave, in the config file or on the command line, whatever the value (one
    # equal to the default, written out, counts): parse_args sets them, notes() reads them. Not a
    # setting: a class attribute (unannotated), not a field
    given = frozenset()

    # ---- I/O ----
    # where metrics.jsonl, rollouts/, curves.png and config.json go
    out_dir: str = "out/run"
    # one seed for prompts, sampling and the value head's init: the whole run
    seed: int = 1
    # number of PPO steps (one rollout + one update each); 0 = only the SFT warm-up (out_dir/sft),
    # a first stage for a reward model to start from (make rlhf-demo)
    steps: int = 20
    # redraw out_dir/curves.png every N steps (and at the end); 0 = never
    plot_every: int = 5
    # checkpoint out_dir/ckpt/step_N every N steps and at the end (0 = only on SIGTERM/SIGINT)
    save_every: int = 0
    # keep the newest N checkpoints, delete older ones (0 = keep all)
    keep_checkpoints: int = 2
    # "" = a fresh run; "auto" = the newest complete checkpoint in out_dir/ckpt (a fresh run if
    # there is none); or a step_N dir
    resume: str = ""
    # at the end, write the policy as an HF checkpoint dir out_dir/hf (with the model's tokenizer
    # files)
    export_hf: bool = True
    # dtype of that export (needs export_hf): auto = the run's compute dtype, as dtype=auto picks
    # it (bf16 on a GPU under fsdp; fp32 on a CPU, or under ddp); bf16; fp32
    export_dtype: Literal["auto", "bf16", "fp32"] = "auto"
    # stop when this many steps in a row skipped their update for a NaN/inf loss or grad norm
    # (0 = never stop)
    max_skipped_steps: int = 3
    # a collective waiting longer raises (a dead or stuck rank) instead of hanging
    collective_timeout_s: int = 1800
    # a previous run's out_dir/rollouts: train on those instead of generating
    replay_rollouts: str = ""

    # ---- model ----
    # an HF checkpoint dir, or a built-in tiny preset: tiny-llama/qwen2/qwen3/mistral/gemma3
    model: str = "tiny-llama"
    # checkpoint for the critic's backbone; "" = the (warmed-up) policy's. A reward model's dir
    # (a *ForSequenceClassification checkpoint) also gives it its score head: the critic starts
    # from the reward model, as in OpenRLHF
    critic_model: str = ""
    # a reward model, *ForSequenceClassification with num_labels 1 (scripts/train_reward_model.py
    # trains one): its score at each response's last token is the PPO reward, and the task's rule
    # is logged beside it as task_score. "" = the task's rule is the reward
    reward_model: str = ""
    # tensor-parallel degree (GPUs that split each matmul)
    tp_size: int = 1
    # context-parallel degree (GPUs that split each sequence); dp = world / (tp * cp)
    cp_size: int = 1
    # with tp > 1: shard the norms and the residual stream on the sequence dim
    sequence_parallel: bool = False
    # pack sequences into rows of max_tokens_per_microbatch tokens, each attending only within its
    # own sequence; the kernel is attention's (auto: varlen on a GPU in bf16, masked SDPA on a CPU)
    packing: bool = False
    # per rank, with packing: the token budget of one packed row
    max_tokens_per_microbatch: int = 512
    # per rank, without packing: sequences in one forward/backward
    micro_batch_size: int = 8
    # tokens per chunk of the fp32 logprob softmax; 0 = one chunk: a (tokens, vocab/tp) fp32
    # softmax kept for the backward
    logprob_chunk_size: int = 1024
    # recompute the decoder layers in the backward (saves GPU memory)
    activation_checkpointing: bool = False
    # FSDP2 CPU offload of params, grads and optimizer state (saves GPU memory)
    cpu_offload: bool = False
    # fsdp: FSDP2 shards params, grads and AdamW state over dp*cp. ddp: whole replicas, gradients
    # all-reduced (DDP; fp32, tp=1): faster for small models on gloo
    data_parallel: Literal["fsdp", "ddp"] = "fsdp"
    # FSDP2: false keeps each gathered layer until the backward (and across no-grad
    # microbatches): half the all-gathers, at the cost of the whole model's memory (ZeRO-2-like;
    # on CPU, data_parallel=ddp is faster still)
    reshard_after_forward: bool = True
    # compute dtype: bf16 (FSDP2 mixed precision, fp32 master weights) or fp32; auto = bf16 on
    # CUDA (with fsdp), else fp32
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    # masked: SDPA with a document mask. varlen: on CUDA in bf16 flash-attn's varlen kernel, else
    # torch's; a PyTorch stand-in elsewhere. auto = varlen with a flash kernel, or where a dense
    # mask would be large (packed rows on CUDA), else masked
    attention: Literal["auto", "masked", "varlen"] = "auto"

    # ---- task and rollout ----
    # toy_add: "a+b=" (operands 0..4), reward 1 for the exact sum; toy_tool: two-digit sums with a
    # calculator to call (multi-turn: max_turns >= 2); gsm8k: math word problems
    task: Literal["toy_add", "toy_tool", "gsm8k"] = "toy_add"
    # gsm8k: a JSONL file of {"question", "answer": "... #### N"} lines
    prompts: str = ""
    # gsm8k: a held-out JSONL file (same format) for validation
    val_prompts: str = ""
    # gsm8k: appended to each question; "" = rollout.GSM8K_INSTRUCTION (think step by step, answer
    # after ####)
    instruction: str = ""
    # gsm8k: the reward for a wrong answer given in the expected form
    format_reward: float = 0.0
    # vllm (colocated), hf (a plain HF model per rank), or auto = vllm if it is installed
    rollout_engine: Literal["auto", "vllm", "hf"] = "auto"
    prompts_per_step: int = 16  # global: distinct prompts per step
    samples_per_prompt: int = 4  # responses sampled per prompt
    max_new_tokens: int = 6  # per response (per model turn, in an episode of several)
    # sampling temperature; the trainer divides its logits by it too
    temperature: float = 1.0
    # vLLM tensor-parallel size (ranks that share one engine)
    rollout_tp_size: int = 1
    # weights are pushed into the engine in buckets of at most this size
    refit_bucket_mb: int = 64
    max_model_len: int = 512  # vLLM: longest prompt + response, in tokens
    # vLLM on GPU: the fraction of GPU memory for its weights + KV cache (the trainer shares the
    # GPU). 0.3 x 80 GB = 24 GB: Qwen2.5-1.5B in bf16 (3 GB) + ~750k tokens of KV cache; sleep
    # mode frees it while training
    vllm_gpu_memory_utilization: float = 0.3
    vllm_kv_cache_gb: int = 1  # vLLM on CPU: KV cache size in GiB (per rank)
    # pi_old of the ratio. trainer: a no-grad policy pass (exact whatever the engine). engine: the
    # engine's sampling logprobs, one forward fewer, as TRL's PPOTrainer; exact only if the engine
    # computes as the trainer does (the HF engine in fp32), and no entropy metric then
    old_logprobs: Literal["trainer", "engine"] = "trainer"

    # ---- supervised warm-up (SFT) before PPO ----
    # It gives PPO a policy worth improving.

    # optimizer steps of SFT on the task's reference answers (0 = none)
    sft_steps: int = 0
    sft_batch_size: int = 32  # global: sequences per SFT step
    sft_lr: float = 1e-3  # AdamW lr of the warm-up

    # ---- PPO ----
    # The defaults are verl's PPO defaults (ppo_trainer.yaml), made for pretrained models.

    # the first N PPO steps update only the critic (verl's critic_warmup): the policy's first
    # updates then see a critic that already predicts something (gae only)
    critic_warmup_steps: int = 0
    # gae: a learned critic + GAE (PPO). grpo: each response's score against its prompt group's
    # mean (and std), no critic (DeepSeekMath). rloo: against the mean of the group's other
    # responses, no critic (Ahmadian et al., 2024). docs/losses.md compares them.
    advantage_estimator: Literal["gae", "grpo", "rloo"] = "gae"
    # grpo: divide by the group's std (GRPO); false subtracts the group mean only (Dr. GRPO)
    grpo_norm_by_std: bool = True
    lr: float = 1e-6  # policy AdamW learning rate
    critic_lr: float = 1e-5  # critic AdamW learning rate
    # linear LR warm-up (in PPO steps) for policy and critic
    warmup_steps: int = 0
    weight_decay: float = 0.0  # AdamW weight decay (both models)
    # clip the global grad norm of each model to this (0 = no clipping)
    max_grad_norm: float = 1.0
    # beta: with gae a per-token reward penalty beta * KL(policy || reference); with grpo/rloo
    # (no per-token reward) the weight of the kl_loss term in the policy loss instead. 0 = no
    # reference at all (no pass, no copy of the initial weights, no kl metric)
    kl_coef: float = 0.001
    # k1 = log ratio (unbiased), k3 = (r - 1) - log r (low variance, >= 0): the reward penalty's
    # and the logged kl's. grpo/rloo's kl_loss is k3 whatever this says (DeepSeekMath's estimator)
    kl_estimator: Literal["k1", "k3"] = "k1"
    gamma: float = 1.0  # GAE discount
    lam: float = 1.0  # GAE lambda
    # PPO policy ratio clip epsilon: the ratio is kept in [1 - clip_ratio, 1 + clip_ratio_high]
    clip_ratio: float = 0.2
    # the upper clip (DAPO's clip-higher, e.g. 0.28); 0 = clip_ratio (symmetric)
    clip_ratio_high: float = 0.0
    # dual clip: for A < 0 cap the loss at -A * c (c > 1; 0 = off)
    clip_ratio_c: float = 3.0
    # clip of the value update around the old values (0 = no clipping)
    value_clip: float = 0.5
    entropy_coef: float = 0.0  # entropy bonus weight in the policy loss
    # log the policy's entropy (computed in the old-policy pass)
    log_entropy: bool = True
    ppo_epochs: int = 1  # passes over each step's rollouts
    # optimizer steps per epoch; each is a global minibatch
    num_minibatches: int = 1
    # gae only: normalize the advantages over the global batch (grpo and rloo normalize within
    # each prompt's group instead: grpo_norm_by_std)
    whiten_advantages: bool = True
    # how the per-token losses of a global minibatch become one number (docs/losses.md):
    # token-mean (every response token weighs the same), seq-mean-token-sum, seq-mean-token-mean
    # (every response weighs the same), seq-mean-token-sum-norm (Dr. GRPO: token sums over a
    # constant). Every count is global, so the mesh never changes the loss.
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    # seq-mean-token-sum-norm's constant; 0 = max_new_tokens (max_model_len for a task with
    # turns, multiturn.py: an episode's responses can fill the context)
    loss_agg_norm: int = 0

    @property
    def global_batch_size(self) -> int:
        """Sequences per PPO step, summed over all data-parallel ranks."""
        return self.prompts_per_step * self.samples_per_prompt


# -----------------------------------------------------------------------------
# The extensions' options. Each extension (extensions/NAME.py; README, "Extensions") declares, at
# its top, its options in a dataclass `Options`, written as CoreConfig's fields are, and in
# `check(cfg)` its own refusals, and in `idle(cfg)` (if any) when its options do nothing. This file
# runs those definitions alone, from the file's text, in a namespace of the few names they may
# use: the rest of the file imports torch and the core, and a bad option is refused before either
# loads. Config is CoreConfig's fields, then each extension's in this order; validate runs each
# check, notes each idle. Removing an extension removes its line here.
EXTENSIONS = ["lora", "distill", "offpolicy", "dapo", "gspo", "evaluation", "multiturn",
              "optimizer_offload", "tensorboard", "async_rollout"]
EXTENSIONS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "extensions")


def extension_options(name: str):
    """(Options, check, the text of Options, idle) of extensions/NAME.py: its definitions of
    Options, check and idle (none: nothing of it is ever idle) run alone, where they may use
    dataclasses, Literal, ConfigError, os and json."""
    path = os.path.join(EXTENSIONS_DIR, f"{name}.py")
    with open(path, encoding="utf-8") as f:
        source = f.read()
    nodes = [node for node in ast.parse(source, path).body
             if isinstance(node, (ast.ClassDef, ast.FunctionDef))
             and node.name in ("Options", "check", "idle")]
    scope = dict(dataclasses=dataclasses, Literal=Literal, ConfigError=ConfigError, os=os,
                 json=json)
    exec(compile(ast.Module(nodes, type_ignores=[]), path, "exec"), scope)
    options = next(node for node in nodes if node.name == "Options")
    # its whole lines (a segment would end before the last line's trailing comment): its docs
    text = "\n".join(source.splitlines()[options.lineno - 1:options.end_lineno])
    return scope["Options"], scope["check"], text, scope.get("idle", lambda cfg: ())


# {extension: (its Options, its check, the text of its Options, its idle)}
OPTIONS = {name: extension_options(name) for name in EXTENSIONS}
Config = dataclasses.make_dataclass(
    "Config", [(f.name, f.type, dataclasses.field(default=f.default))
               for options, *_ in OPTIONS.values() for f in dataclasses.fields(options)],
    bases=(CoreConfig,), namespace={"__module__": __name__, "__doc__": "Every setting of a run: "
                                    "CoreConfig's fields, then each extension's (EXTENSIONS)."})


# Fields that must be >= 1 (integers) and > 0 (floats).
POSITIVE = ("tp_size", "cp_size", "max_tokens_per_microbatch", "micro_batch_size",
            "prompts_per_step", "samples_per_prompt", "max_new_tokens", "rollout_tp_size",
            "refit_bucket_mb", "max_model_len", "vllm_gpu_memory_utilization", "vllm_kv_cache_gb",
            "sft_batch_size", "ppo_epochs", "num_minibatches", "temperature",
            "collective_timeout_s")
# Every other int or float field must be >= 0, an extension's too: a coefficient, a rate or a
# count where 0 means "off" or "never" (a new field is checked too), except these: the seed, and
# gamma and lam, which _validate_values checks against [0, 1] with a message of their own. (An
# extension's fields that must be > 0: its own check.)
SIGNED = ("seed", "gamma", "lam")


# Keys a config of an earlier version may name, and what replaced them: one line says so.
MOVED = {"tis_cap": "offpolicy_is=token with offpolicy_is_bound=CAP (truncated importance "
                    "sampling is one mode of the off-policy correction, docs/losses.md)"}


# attention=masked builds a (B, T/cp, T) mask for a microbatch of B rows, and SDPA a score tensor
# of that size per head: past 4096 x 4096 entries (one 4096-token row, or 16 rows of 1024) that is
# O(B T^2) memory and FLOPs, mostly spent across documents or on padding (varlen skips both).
MASK_LIMIT = 4096 * 4096


def masked_attention_error(row_tokens: int, cp_size: int, rows: int = 1):
    """The refusal of a masked-attention microbatch of `rows` rows of `row_tokens` tokens above
    MASK_LIMIT, or None. The batch counts: 32 rows of 1024 tokens cost as much as one of 5800."""
    if rows * row_tokens ** 2 // cp_size > MASK_LIMIT:
        return (f"attention=masked would build a dense {rows}x{row_tokens // cp_size}x{row_tokens} "
                f"mask per microbatch (limit 4096x4096 entries): use attention=varlen, or shorter "
                f"or fewer rows (max_tokens_per_microbatch packed; "
                f"max_model_len, micro_batch_size)")
    return None


def flash_runs(device_type: str, dtype: str) -> bool:
    """Whether a flash varlen kernel (flash-attn's or torch's) is the varlen kernel: on CUDA, in
    bf16 (neither takes fp32). The one rule: resolve_auto names the kernel by it, and
    model_parallel._varlen_kernel picks the function by it."""
    return device_type == "cuda" and dtype == "bf16"


def resolve_auto(cfg: Config, device_type: str, gpu_kernel) -> str:
    """Replace "auto" in cfg.dtype, cfg.export_dtype and cfg.attention by what runs on this device
    ("cuda" or "cpu"), whose flash varlen kernel is `gpu_kernel` (its name, or None: the trainer
    asks model_parallel.gpu_kernel_name); return the attention kernel's name (the run's first line
    prints it). The GPU recipe is bf16 with a flash varlen kernel (flash-attn's, else torch's);
    elsewhere exact fp32 with masked SDPA.

    A packed row never gets a dense mask on a GPU (nor on CPU past MASK_LIMIT): its (T/cp, T)
    scores per head cost O(T^2) memory (3.2 GB a layer at 8192 tokens and 1.5B) and ~15x the FLOPs,
    mostly across documents, for nothing. Without a flash kernel (fp32) the reference kernel
    attends document by document instead."""
    if cfg.dtype == "auto":
        cfg.dtype = "bf16" if device_type == "cuda" and cfg.data_parallel == "fsdp" else "fp32"
    cfg.export_dtype = cfg.dtype if cfg.export_dtype == "auto" else cfg.export_dtype
    kernel = gpu_kernel if flash_runs(device_type, cfg.dtype) else None
    if cfg.attention == "auto":
        longest = (cfg.max_tokens_per_microbatch if cfg.packing
                   else cfg.max_model_len)  # a row at most
        rows = 1 if cfg.packing else cfg.micro_batch_size
        packed_gpu = cfg.packing and device_type == "cuda"
        dense_ok = not packed_gpu and not masked_attention_error(longest, cfg.cp_size, rows)
        cfg.attention = "varlen" if kernel or not dense_ok else "masked"
    if cfg.attention == "masked":
        return "masked SDPA"
    return kernel or "reference varlen (one SDPA per document)"


def field_docs(cls=None) -> dict:
    """{field name: its doc}, read from the comments in the class's source, so that `--help` and
    the code can never disagree (cleanrl keeps the docs next to the fields too). cls: a dataclass;
    None: Config, whose docs are CoreConfig's and those of each extension's Options, each of
    those ending with the extension's file.

    A field's doc is the run of comment lines directly above it, then its trailing comment if it
    has one, joined into one paragraph. Two kinds of comment lines belong to no field:
      - a group heading, written as a banner: `# ---- PPO ----`;
      - a comment followed by a blank line: a note on the group (e.g. where its defaults come from).
    """
    if cls is not None:
        return _comment_docs(inspect.getsource(cls), cls.__dataclass_fields__)
    docs = _comment_docs(inspect.getsource(CoreConfig), CoreConfig.__dataclass_fields__)
    for name, (options, _, text, _) in OPTIONS.items():  # each doc ends with its extension's file
        found = _comment_docs(text, options.__dataclass_fields__)
        docs.update({key: f"{doc} (extensions/{name}.py)" for key, doc in found.items()})
    return docs


def _comment_docs(source: str, names) -> dict:
    """{name: its doc} for each of `names` declared in `source` (field_docs' rule)."""
    # {line number: comment text}; tokenize, not a split on "#": a string default may hold a "#"
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    comments = {t.start[0]: t.string.lstrip("#").strip()
                for t in tokens if t.type == tokenize.COMMENT}
    docs, above = {}, []
    for number, line in enumerate(source.splitlines(), 1):
        text = line.strip()
        if text.startswith("#") and not text.startswith("# ----"):
            above.append(comments[number])
            continue
        name = text.split(":")[0]
        if name in names:
            docs[name] = " ".join(above + [comments.get(number, "")]).strip()
        # a heading, a blank line or any other code ends the run of comment lines
        above = []
    return docs


def print_help() -> None:
    """The module docstring, then every field: `--name=default` and its whole doc under it."""
    docs = field_docs()
    print(__doc__)
    for f in dataclasses.fields(Config):
        print(f"  --{f.name}={f.default!r}")
        # never break inside a word: "tiny-llama" or "data_parallel=ddp" must read whole
        print(textwrap.fill(docs[f.name], width=100,
                            initial_indent=" " * 6, subsequent_indent=" " * 6,
                            break_long_words=False, break_on_hyphens=False))


def _coerce(key: str, value, typ):
    """Turn a TOML value or a command-line string into the field's type, or refuse. A Literal
    field takes a string (_validate_values checks it is one of the choices)."""
    typ = str if typing.get_origin(typ) is typing.Literal else typ
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
    elif typ is int and not isinstance(value, bool):
        if isinstance(value, int) or (isinstance(value, str) and value.lstrip("-").isdigit()):
            return int(value)
    elif typ is float and not isinstance(value, bool):
        with contextlib.suppress(TypeError, ValueError):  # not a number: refused below
            return float(value)
    elif typ is str and isinstance(value, str):
        return value
    default = Config.__dataclass_fields__[key].default
    example = str(default).lower() if typ is bool else default
    raise ConfigError(f"{key}={value!r} is not of type {typ.__name__}: "
                      f"write it like --{key}={example}")


def parse_args(argv: list) -> Config:
    """--config FILE first, then --key=value overrides. Raises ConfigError."""
    types = typing.get_type_hints(Config)
    values: dict = {}
    argv = list(argv)
    # accept both "--config FILE" and "--config=FILE"
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            raise ConfigError("--config needs a file: --config configs/demo_cpu.toml")
        argv[i:i + 2] = [f"--config={argv[i + 1]}"]
    overrides = {}
    for arg in argv:
        if not arg.startswith("--") or "=" not in arg:
            raise ConfigError(f"cannot parse argument {arg!r}: write --key=value (see --help)")
        key, value = arg[2:].split("=", 1)
        if key == "config":
            if not os.path.isfile(value):
                raise ConfigError(f"config file {value!r} not found: pass an existing .toml file")
            try:
                with open(value, "rb") as f:
                    values.update({k: ("config file", v) for k, v in tomllib.load(f).items()})
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"config file {value!r} is not valid TOML ({e})") from None
        else:
            overrides[key] = ("command line", value)
    values.update(overrides)  # the command line wins over the file
    kwargs = {}
    for key, (where, value) in values.items():
        if key in MOVED:
            raise ConfigError(f"{key} (in the {where}) was replaced: use {MOVED[key]}")
        if key not in types:
            close = [k for k in types if k.startswith(key[:3])]
            hint = f" (did you mean {close[0]}?)" if close else " (see --help for the keys)"
            raise ConfigError(f"unknown key {key!r} in the {where}{hint}")
        kwargs[key] = _coerce(key, value, types[key])
    cfg = Config(**kwargs)
    cfg.given = frozenset(kwargs)
    return cfg


def _validate_values(cfg: Config) -> None:
    """Each field on its own: one of its choices, in its range."""
    for key, typ in typing.get_type_hints(Config).items():
        allowed = typing.get_args(typ)  # a Literal field's choices (other types: none)
        if allowed and getattr(cfg, key) not in allowed:
            raise ConfigError(f"{key}={getattr(cfg, key)!r} is not supported: use one of {allowed}")
    for key in POSITIVE:
        if not getattr(cfg, key) > 0:
            raise ConfigError(f"{key}={getattr(cfg, key)} must be > 0")
    for key, typ in typing.get_type_hints(Config).items():
        if typ in (int, float) and key not in SIGNED and getattr(cfg, key) < 0:
            raise ConfigError(f"{key}={getattr(cfg, key)} must be >= 0")
    # a dual clip caps the ratio of negative-advantage tokens: at c <= 1 it would cap every ratio
    if 0 < cfg.clip_ratio_c <= 1:
        raise ConfigError(f"clip_ratio_c={cfg.clip_ratio_c} must be > 1 (verl's default 3.0) "
                          f"or 0 for no dual clip")
    if cfg.advantage_estimator != "gae" and cfg.samples_per_prompt < 2:  # a group estimator
        raise ConfigError(f"advantage_estimator={cfg.advantage_estimator} needs samples_per_prompt "
                          f">= 2 (got {cfg.samples_per_prompt}): its advantage is a response's "
                          f"score against the other responses to its prompt")
    if cfg.critic_warmup_steps and cfg.advantage_estimator != "gae":
        raise ConfigError(f"critic_warmup_steps={cfg.critic_warmup_steps} needs a critic: "
                          f"advantage_estimator=gae (or critic_warmup_steps=0)")
    if not (0.0 <= cfg.gamma <= 1.0 and 0.0 <= cfg.lam <= 1.0):
        raise ConfigError(f"gamma={cfg.gamma} and lam={cfg.lam} must lie in [0, 1]")


def _validate_sizes(cfg: Config, world_size: int) -> None:
    """The mesh: world = dp * cp * tp (torchtitan asserts the same product, naming each factor).
    Batch arithmetic: every global minibatch splits evenly over dp ranks, and (without packing)
    every rank's share splits into whole microbatches."""
    if world_size % (cfg.tp_size * cfg.cp_size):
        raise ConfigError(f"world size {world_size} is not divisible by tp_size*cp_size = "
                          f"{cfg.tp_size}*{cfg.cp_size}: choose tp_size and cp_size whose product "
                          f"divides the number of processes")
    dp = world_size // (cfg.tp_size * cfg.cp_size)
    generators = cfg.rollout_ranks or world_size  # the ranks that generate (async_rollout.py)
    if generators % cfg.rollout_tp_size:
        raise ConfigError(f"rollout_tp_size={cfg.rollout_tp_size} does not divide the "
                          f"{generators} ranks that generate: vLLM tensor-parallel groups are "
                          f"made of whole ranks")
    if cfg.global_batch_size % cfg.num_minibatches:
        raise ConfigError(f"num_minibatches={cfg.num_minibatches} does not divide the global batch "
                          f"prompts_per_step*samples_per_prompt = {cfg.global_batch_size}")
    minibatch = cfg.global_batch_size // cfg.num_minibatches
    if minibatch % dp:
        raise ConfigError(f"a global minibatch of {minibatch} sequences does not split over "
                          f"dp={dp} ranks: change prompts_per_step, samples_per_prompt or "
                          f"num_minibatches")
    if not cfg.packing and (minibatch // dp) % cfg.micro_batch_size:
        raise ConfigError(f"micro_batch_size={cfg.micro_batch_size} does not divide the per-rank "
                          f"minibatch of {minibatch // dp} sequences: pick a divisor of it")
    if cfg.sft_steps and cfg.sft_batch_size % dp:
        raise ConfigError(f"sft_batch_size={cfg.sft_batch_size} does not split over dp={dp} ranks")
    # a packed row holds whole sequences, up to max_model_len tokens each (prompt + response; the
    # SFT warm-up's rows are cut to it), in a multiple of 2*cp*tp tokens: refused now, not at the
    # first long response hours in
    multiple = 2 * cfg.cp_size * cfg.tp_size
    if cfg.packing and cfg.max_tokens_per_microbatch // multiple * multiple < cfg.max_model_len:
        least = -(-cfg.max_model_len // multiple) * multiple
        raise ConfigError(f"max_tokens_per_microbatch={cfg.max_tokens_per_microbatch} cannot hold "
                          f"a sequence of max_model_len={cfg.max_model_len} tokens (a packed row "
                          f"is a multiple of 2*cp*tp={multiple}): raise it to {least} or more, "
                          f"or lower max_model_len")


def _validate_paths(cfg: Config) -> None:
    """Files and directories the run reads, and out_dir, which it writes."""
    if cfg.resume and cfg.resume != "auto" and not is_checkpoint(cfg.resume):
        raise ConfigError(f"resume={cfg.resume!r} is not a complete checkpoint (a step_N dir with "
                          f".metadata and trainer_state_rank0.pt): give out_dir/ckpt/step_N, "
                          f"or resume=auto")
    if cfg.task == "gsm8k" and not os.path.isfile(cfg.prompts):
        raise ConfigError(f"task=gsm8k needs prompts=FILE (a GSM8K-format JSONL file); "
                          f"{cfg.prompts!r} is not a file")
    if cfg.reward_model and not os.path.isdir(cfg.reward_model):
        raise ConfigError(f"reward_model={cfg.reward_model!r} is not a directory: give a "
                          f"*ForSequenceClassification checkpoint dir "
                          f"(scripts/train_reward_model.py)")
    if cfg.val_prompts and not os.path.isfile(cfg.val_prompts):
        raise ConfigError(f"val_prompts={cfg.val_prompts!r} is not a file")
    if cfg.replay_rollouts and not os.path.isdir(cfg.replay_rollouts):
        raise ConfigError(f"replay_rollouts={cfg.replay_rollouts!r} is not a directory of "
                          f"step_N.jsonl")
    # last, so that a refused config leaves nothing behind; fail now, not in an hour
    try:
        os.makedirs(cfg.out_dir, exist_ok=True)
        probe = os.path.join(cfg.out_dir, f".write_test_{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"out_dir={cfg.out_dir!r} is not writable ({e.strerror}): "
                          f"choose another out_dir")


def is_checkpoint(path: str) -> bool:
    """A training checkpoint dir (train_ppo.save_checkpoint's) is complete once renamed from .tmp:
    DCP's .metadata (written last, by rank 0) and rank 0's trainer state are both in it."""
    files = [os.path.join(path, name) for name in (".metadata", "trainer_state_rank0.pt")]
    return not path.rstrip("/").endswith(".tmp") and all(map(os.path.isfile, files))


def validate(cfg: Config, world_size: int) -> None:
    """Refuse impossible combinations before anything is loaded. One line each."""
    _validate_values(cfg)
    if cfg.rollout_ranks >= world_size:  # the last ranks only generate (async_rollout.py)
        raise ConfigError(f"rollout_ranks={cfg.rollout_ranks} leaves no rank of the {world_size} "
                          f"to train: launch more processes, or lower rollout_ranks")
    _validate_sizes(cfg, world_size - cfg.rollout_ranks)  # the trainer's mesh
    vllm_installed = importlib.util.find_spec("vllm") is not None
    # "auto" is resolved here, so that config.json records what ran
    if cfg.rollout_engine == "auto":
        cfg.rollout_engine = "vllm" if vllm_installed else "hf"
    if cfg.rollout_engine == "vllm" and not vllm_installed:
        raise ConfigError("rollout_engine='vllm' but vLLM is not installed: install it "
                          "(see README) or use rollout_engine=hf")
    if cfg.rollout_engine == "hf" and cfg.rollout_tp_size != 1:
        raise ConfigError(f"rollout_tp_size={cfg.rollout_tp_size} needs rollout_engine=vllm "
                          "(the HF engine is one full model per rank)")
    if cfg.data_parallel == "ddp" and (cfg.tp_size > 1 or cfg.dtype == "bf16" or cfg.cpu_offload):
        raise ConfigError("data_parallel=ddp (plain fp32 replicas) needs tp_size=1, "
                          "dtype=fp32/auto, cpu_offload=false")
    # refused now, not at the first long rollout hours in: a packed row is at most
    # max_tokens_per_microbatch; an unpacked microbatch is micro_batch_size rows of at most
    # max_model_len (prompt + response)
    unpacked = (cfg.micro_batch_size, cfg.max_model_len)
    rows, tokens = (1, cfg.max_tokens_per_microbatch) if cfg.packing else unpacked
    if cfg.attention == "masked" and masked_attention_error(tokens, cfg.cp_size, rows):
        raise ConfigError(masked_attention_error(tokens, cfg.cp_size, rows))
    if cfg.sequence_parallel and cfg.tp_size == 1:
        raise ConfigError("sequence_parallel=true needs tp_size > 1 "
                          "(it shards activations over tp)")
    for _, check, *_ in OPTIONS.values():  # each extension's own refusals (its file's check)
        check(cfg)
    _validate_launch(cfg, os.environ)
    _validate_paths(cfg)


def _validate_launch(cfg: Config, environ) -> None:
    """What the launch must give the run, read from the variables torchrun sets (none: a plain
    `python train_ppo.py`). A tensor-parallel group lies within a node: the mesh puts tp innermost,
    on consecutive ranks, and a node runs LOCAL_WORLD_SIZE consecutive ranks. Restarts need a
    fresh store each rendezvous round (docs/nodes.md)."""
    node = int(environ.get("LOCAL_WORLD_SIZE", "0"))  # --nproc_per_node
    for name in ("tp_size", "rollout_tp_size"):
        if node % getattr(cfg, name):
            raise ConfigError(f"{name}={getattr(cfg, name)} does not divide the processes of a "
                              f"node (--nproc_per_node={node}): a tensor-parallel group must lie "
                              f"within one node, or every layer's collectives cross the network")
    # torchrun hands its workers one store for every rendezvous round, and a restarted worker
    # reads the dead round's addresses in it: init_process_group then fails with "Gloo
    # connectFullMesh failed" (NCCL the same: pytorch/pytorch#167288). With this variable each
    # round gets a store of its own, hosted by its rank 0, on any node and after either kind of
    # restart (a worker's failure, a node lost or joining).
    restarts = environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if restarts != "0" and environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise ConfigError(f"torchrun --max-restarts={restarts} needs "
                          f"TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment "
                          f"(export it before torchrun, on every node): without it a restarted "
                          f"worker fails in init_process_group")


def idle(cfg: Config):
    """The core's settings that do nothing in this run, or less than their names say, as (key,
    why) pairs; each extension's file has its own `idle` for its options. notes() keeps the keys
    the user gave. A new option that can be idle says when here (or in its extension's idle)."""
    if cfg.advantage_estimator != "gae":  # no critic, no GAE
        for key in ("critic_model", "critic_lr", "gamma", "lam", "value_clip", "whiten_advantages"):
            yield key, f"does nothing with advantage_estimator={cfg.advantage_estimator}: no critic"
    if cfg.advantage_estimator != "grpo":
        yield "grpo_norm_by_std", f"does nothing with advantage_estimator={cfg.advantage_estimator}"
    if cfg.kl_coef == 0:
        yield "kl_estimator", "does nothing with kl_coef=0 (no reference policy)"
    elif cfg.advantage_estimator != "gae":  # the KL loss term is k3 (train_ppo.policy_loss_terms)
        yield "kl_estimator", (f"sets only the logged kl with advantage_estimator="
                               f"{cfg.advantage_estimator}: the KL loss term is k3")
    if not cfg.sft_steps:
        for key in ("sft_batch_size", "sft_lr"):
            yield key, "does nothing with sft_steps=0"
    if not cfg.export_hf:
        yield "export_dtype", "does nothing with export_hf=false"
    if cfg.replay_rollouts:  # no engine: the dumped samples are trained on again
        for key in ("rollout_engine", "rollout_tp_size", "refit_bucket_mb"):
            yield key, "does nothing with replay_rollouts (no engine)"


def notes(cfg: Config) -> list:
    """One line for each setting the user gave that does nothing in this run, or less than its
    name says (the core's idle, then each extension's): `note: KEY=VALUE WHY`. Defaults never
    show. What only the task tells (held-out prompts) is said where the task is built."""
    said = {}
    for rule in [idle, *(extension[3] for extension in OPTIONS.values())]:
        for key, why in rule(cfg):
            if key in cfg.given:
                said.setdefault(key, note_line(cfg, key, why))  # one line a key: its first why
    return list(said.values())


def note_line(cfg: Config, key: str, why: str) -> str:
    """`note: KEY=VALUE WHY`, the value as a command line writes it (extensions' task_notes too)."""
    value = getattr(cfg, key)
    return f"note: {key}={str(value).lower() if isinstance(value, bool) else value} {why}"


def load(argv: list, world_size: int) -> Config:
    """The entry point: parse, validate, or print one line and exit(2)."""
    if "--help" in argv or "-h" in argv:
        if os.environ.get("RANK", "0") == "0":
            print_help()
        sys.exit(0)
    try:
        cfg = parse_args(argv)
        validate(cfg, world_size)
    except ConfigError as e:
        # every rank refuses; one of them says why
        if os.environ.get("RANK", "0") == "0":
            print(f"config error: {e}", file=sys.stderr)
        else:
            # the others leave a moment later: the first worker to exit makes torchrun stop the
            # rest (on another node too), and rank 0, still starting Python, was cut off before
            # its line (seen with two agents under load)
            time.sleep(3)
        sys.exit(2)
    if os.environ.get("RANK", "0") == "0":
        for line in notes(cfg):
            print(line, flush=True)
    quiet_third_party_output()  # the config is good: the run loads models next
    return cfg


def save(cfg: Config, path: str, **facts) -> None:
    """Write the resolved config as JSON (rank 0 only), with `facts` the run learned beside it
    (vllm_model_runner: the runner vLLM picked)."""
    with open(path, "w") as f:
        json.dump(dataclasses.asdict(cfg) | facts, f, indent=1)


# -----------------------------------------------------------------------------
# Console: the one place where third-party output is silenced. Each message below was read and
# found harmless; errors are never hidden (vLLM still logs at ERROR).
#  - vLLM WARNINGs: "RotaryEmbedding: Failed to load weights" at every refit (the rotary cache is
#    not a checkpoint tensor: vLLM puts its own copy back), "Chat template warmup failed" (we skip
#    vLLM's tokenizer on purpose), "CPU backend doesn't allow to use torch.set_num_threads" (we
#    restore the thread count ourselves), "Triton is installed, but doesn't include CPU backend".
#  - a FutureWarning from vLLM's own use of torch.distributed.reduce_op.
#  - transformers' load reports and progress bars.

def quiet_third_party_output() -> None:
    """Called once, at the start of a run (load), before any model is loaded."""
    # the variable is read when vLLM configures its logging, which it does only once an engine is
    # built; the logger's level covers a vLLM already imported
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    logging.getLogger("vllm").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=r"`torch.distributed.reduce_op` is deprecated",
                            category=FutureWarning)
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


if __name__ == "__main__":
    # `python config.py ARGS`: a command line checked before torchrun starts its processes (the
    # Makefile's recipes do), with WORLD_SIZE as torchrun will set it: one line and exit 2 if it
    # is bad; if it is good, a note for each setting given that does nothing (notes), or nothing
    load(sys.argv[1:], world_size=int(os.environ.get("WORLD_SIZE", "1")))
