"""Per-token log-probabilities and entropy from logits sharded on vocab (tp) and sequence (cp).

The policy's lm_head is column-parallel, so each tp rank holds the logits of one slice of the
vocabulary: with tp > 1 no rank holds full-vocab logits (at tp=1 the rank holds its microbatch's
whole (B, S, V) in the compute dtype, and their gradient: 2.5 GB each in bf16 for a packed row of
8192 tokens of Qwen's 151,936 ids; chunking bounds only the fp32 math on them). Under context
parallelism each cp rank also holds only its zigzag share of the positions. This module turns
those shards into the (B, S) per-token numbers PPO needs, aligned as in train_ppo.py's docstring:
out[:, i] scores x_i from the logits at i-1, and out[:, 0] = 0 (also at every packed sequence
start).

    lp = token_logprobs(logits, input_ids, tp_group=tp, cp_group=cp, chunk_size=1024,
                        temperature=0.8)
    lp, ent = token_logprobs(logits, input_ids, tp_group=tp, cp_group=cp, with_entropy=True)

Logits arrive in the compute dtype (bf16 on GPU) and are upcast to fp32 and divided by the
temperature one chunk of chunk_size tokens at a time. chunk_size 0 makes all tokens one chunk: a
full fp32 copy, twice the size of the bf16 logits, whose softmax is kept for the backward unless
the entropy is asked for too.

Where the ideas come from (the code and prose are our own):
1. Vocab-parallel log-softmax: the max and the sum of exponentials are all-reduced over tp, and
   the target's logit comes from the one rank that owns it (Megatron-LM's vocab-parallel cross
   entropy, Shoeybi et al. 2019, "Megatron-LM", sec. 3).
2. A hand-written backward, grad = (one_hot - softmax) * grad_out, so autograd keeps no graph of
   the softmax (also Megatron-LM's cross entropy).
3. Chunking over tokens with the softmax recomputed in the backward, so the extra memory is
   O(chunk * V/tp) (NeMo-RL's and verl's chunked logprob computation).
4. Zigzag context parallelism, rank r keeping chunks r and 2cp-1-r of 2*cp: the load-balanced CP
   of Megatron-LM / TransformerEngine, and zhuzilin/ring-flash-attention's zigzag ring attention
   (Liu et al. 2023).

Deliberately left out: a fused kernel that never materialises even one chunk (liger-kernel style),
and logits sharded on the sequence by SP (ours arrive sharded on vocab only). Logits must be
finite (a -inf logit makes the entropy 0 * inf = nan).
"""
import torch
import torch.distributed as dist

# ----------------------------------------------------------------------------
# process groups: None means "this dim is not parallel", so tp = cp = 1 runs the very same code
# below, with every collective skipped and no init_process_group needed.

def _size(group):
    return 1 if group is None else dist.get_world_size(group)


def _rank(group):
    return 0 if group is None else dist.get_rank(group)


def _all_reduce_(tensor, op, group):
    """In-place all-reduce that is a no-op on a dim of size 1."""
    if _size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _math_dtype(dtype):
    # softmax math in fp32 even for bf16 logits (bf16 keeps 8 bits of mantissa: exp and the sum
    # over a 150k vocab would lose the small probabilities); fp64 stays fp64 for gradcheck
    return torch.promote_types(dtype, torch.float32)


# ----------------------------------------------------------------------------
# context parallel: the zigzag split and its inverse

def zigzag_positions(seq_len, cp_size, cp_rank, device=None):
    """Global positions held by cp_rank, in local order: chunk r, then chunk 2cp-1-r; made on
    `device` (no copy from the host)."""
    if cp_size == 1:
        return torch.arange(seq_len, device=device)  # (S,)
    if seq_len % (2 * cp_size) != 0:
        raise ValueError(f"seq_len={seq_len} must be a multiple of 2*cp_size={2 * cp_size}")
    chunk = seq_len // (2 * cp_size)
    # under a causal mask late positions attend to more keys; pairing chunk r with its mirror
    # 2cp-1-r gives every rank one cheap and one costly chunk, hence equal attention work
    pair = (cp_rank, 2 * cp_size - 1 - cp_rank)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device)
                      for c in pair])  # (S/cp,)


def cp_gather(x_local, cp_group, dim=1):
    """Collective over cp. Full tensor in natural order along dim from each cp rank's zigzag part
    (x itself when cp = 1; _CPGather, at the end of the file, gathers it)."""
    return x_local if _size(cp_group) == 1 else _CPGather.apply(x_local, cp_group, dim)


def gather_shifted(x_local, cp_group, cu_seqlens, shift=True):
    """Collective over cp. Per-position values (B, S/cp) at this rank's zigzag positions -> (B, S)
    in natural order (cp_gather), then shifted right by one (shift_right: what position i computes
    belongs to token i + 1) unless shift=False."""
    gathered = cp_gather(x_local, cp_group, dim=1)  # (B, S)
    return shift_right(gathered, cu_seqlens) if shift else gathered


def shift_right(per_position, cu_seqlens):
    """(B, S) values computed at logits position g (about token g+1) -> aligned at position g+1.
    Position 0, and with packing every sequence start, has no prediction of its own: it gets 0.
    The last position's value (it would score a token past the end) is dropped."""
    batch = per_position.shape[0]
    out = torch.cat([per_position.new_zeros(batch, 1), per_position[:, :-1]], dim=1)  # (B, S)
    if cu_seqlens is not None:
        if batch != 1:
            raise ValueError(f"cu_seqlens needs one packed row, got batch {batch}")
        # the last logits of sequence k scored the first token of sequence k+1: meaningless
        out = out.index_fill(1, cu_seqlens[:-1].long().to(out.device), 0.0)  # (1, T)
    return out


# ----------------------------------------------------------------------------
# vocab-parallel log-softmax with a hand-written backward (Megatron-LM, Shoeybi et al. 2019)

def _vocab_range(logits, tp_group):
    """Collective over tp. (first vocab id of this rank's shard, model vocab size) from the real
    shard sizes. DTensor shards like torch.chunk (510 over 4 ranks is 128/128/128/126), and the
    model's vocab may exceed the tokenizer's, so offsets are never derived from V // tp: we gather
    the real sizes. With tp > 1 both are 0-dim tensors on the device (read by no host code)."""
    local_vocab = logits.shape[-1]
    if _size(tp_group) == 1:
        return 0, local_vocab
    # an all-gather of one int per rank, written as a sum of one-hot vectors (one small message)
    sizes = torch.zeros(_size(tp_group), dtype=torch.long, device=logits.device)  # (tp,)
    sizes[_rank(tp_group)] = local_vocab
    _all_reduce_(sizes, dist.ReduceOp.SUM, tp_group)
    return sizes[: _rank(tp_group)].sum(), sizes.sum()


def _logprob_chunk(x, local_target, owned, tp_group, temperature, with_entropy=False):
    """Collective over tp. log p(target) for n tokens whose vocab is split over tp,
    p = softmax(x / T).

    x: (n, V/tp) logits in their own dtype (bf16 or fp32); local_target: (n,) target id within
    this shard (clamped into range); owned: (n,) whether this rank's shard holds the target.
    Returns, in the math dtype: logprob (n,), logsumexp (n,) = log sum_v exp(x_v / T),
    exps (n, V/tp) = exp((x - max) / T), the sum of exps (n,), and the entropy (n,) if asked
    (else None)."""
    math_dtype = _math_dtype(x.dtype)
    # all-reduce 1 (MAX): log-softmax does not change when a constant is subtracted from every
    # logit; subtracting the global max keeps every exp() <= 1, so the sum cannot overflow
    max_logit = x.max(dim=-1).values.to(math_dtype)  # (n,)
    _all_reduce_(max_logit, dist.ReduceOp.MAX, tp_group)
    # s = x/T - max/T as one fused pass (add with alpha), then exp in place; bf16 x plus an fp32
    # shift promotes to fp32: this is the block's one fp32 buffer (two with the entropy)
    shifted = torch.add(-max_logit[:, None] / temperature, x, alpha=1 / temperature)  # (n, V/tp)
    exps = shifted.exp() if with_entropy else shifted.exp_()  # (n, V/tp)
    target_logit = (x.gather(1, local_target[:, None]).squeeze(1).to(math_dtype)
                    / temperature)  # (n,)
    # all-reduce 2 (SUM), numbers per token in one message: the partition function's terms Z from
    # every shard, the target's logit, which only the rank owning it contributes, and for the
    # entropy sum_v exp(s_v) s_v (a row-wise dot product, no (n, V/tp) temporary)
    sums = [exps.sum(dim=-1), torch.where(owned, target_logit, 0.0)]
    if with_entropy:
        sums.append(torch.bmm(exps[:, None, :], shifted[:, :, None]).view(-1))  # (n,)
    sums = _all_reduce_(torch.stack(sums), dist.ReduceOp.SUM, tp_group)  # (2 or 3, n)
    logsumexp = max_logit / temperature + sums[0].log()  # (n,)  over the whole vocab
    # H = -sum_v p_v log p_v with p = exp(s) / Z: log p = s - log Z, so H = log Z - sum_v p_v s_v
    entropy = sums[0].log() - sums[2] / sums[0] if with_entropy else None  # (n,)
    return sums[1] - logsumexp, logsumexp, exps, sums[0], entropy


def _in_shard(local_ids, width):
    """Each target's id within this rank's vocab shard of `width` columns (`local_ids`: its id
    minus the shard's first, (N,)), as (the column, clamped into range where another rank owns
    the target: any valid one; whether this shard owns it), both (N,)."""
    owned = (local_ids >= 0) & (local_ids < width)  # (N,)
    return local_ids.clamp(0, width - 1), owned


def _logprob_forward(logits, local_ids, tp_group, chunk_size, temperature, with_entropy=False):
    """Collective over tp. Loop _logprob_chunk over blocks of chunk_size tokens (one block if
    chunk_size is 0); `local_ids` as _in_shard takes them.

    Every tp rank holds the same tokens, so all ranks cut the same blocks and their collectives
    pair up. Returns (logprob, logsumexp, entropy (None unless with_entropy), and the last block's
    exps and their sums): with chunk_size 0 that block is every token, whose softmax the
    autograd function may keep for its backward."""
    local_target, owned = _in_shard(local_ids, logits.shape[-1])
    num_tokens, math_dtype = logits.shape[0], _math_dtype(logits.dtype)
    step = chunk_size if chunk_size > 0 else max(num_tokens, 1)
    logprob = logits.new_empty(num_tokens, dtype=math_dtype)  # (N,)
    logsumexp = logits.new_empty(num_tokens, dtype=math_dtype)  # (N,)
    entropy = logits.new_empty(num_tokens, dtype=math_dtype) if with_entropy else None  # (N,)
    exps = sum_exps = None
    for start in range(0, num_tokens, step):
        rows = slice(start, start + step)
        logprob[rows], logsumexp[rows], exps, sum_exps, block_entropy = _logprob_chunk(
            logits[rows], local_target[rows], owned[rows], tp_group, temperature, with_entropy)
        if with_entropy:
            entropy[rows] = block_entropy
    return logprob, logsumexp, entropy, exps, sum_exps


def _grad_from_probs_(probs, coef, grad_logprob, local_target, owned):
    """In place: probs (n, V/tp) becomes grad_logprob * one_hot(target) - probs * coef, this
    rank's slice of d loss / d x (see _VocabParallelLogprob); coef is (n, 1) or (n, V/tp)."""
    probs.mul_(-coef)  # (n, V/tp)
    # the one-hot lives on the rank owning the target; elsewhere we add 0 at a clamped column
    probs.scatter_add_(1, local_target[:, None], torch.where(owned, grad_logprob, 0.0)[:, None])
    return probs


class _VocabParallelLogprob(torch.autograd.Function):
    """log p(target) from vocab-sharded logits (N, V/tp) -> (N,), and the entropy H (N,) if asked,
    for p = softmax(x) with x = logits / T.

    Backward, derived (d/dx_v log sum exp = p_v, sum_v p_v = 1):
        log p_t = x_t - log sum_v exp(x_v)    =>  d log p_t / d x_v = 1[v == t] - p_v
        H = -sum_u p_u log p_u                =>  d H / d x_v       = -p_v (log p_v + H)
    so with upstream gradients g (logprob) and h (entropy)
        grad_x = g one_hot(t) - p * (g + h (log p + H)),   grad_logits = grad_x / T.
    Every tp rank backpropagates the same loss, and its p and H already carry the all-reduced
    sums, so each rank computes its own vocab columns of this with no communication. The max
    drops out of the derivative (shift invariance), hence its all-reduce without a gradient."""

    @staticmethod
    def forward(ctx, logits, local_ids, tp_group, chunk_size, temperature, with_entropy):
        logprob, logsumexp, entropy, exps, sum_exps = _logprob_forward(
            logits, local_ids, tp_group, chunk_size, temperature, with_entropy)
        local_target, owned = _in_shard(local_ids, logits.shape[-1])
        # unchunked (one block) and no entropy: keep that block's softmax for the backward
        keep_probs = chunk_size == 0 and not with_entropy and exps is not None
        ctx.keep_probs = keep_probs
        ctx.logits_dtype = logits.dtype
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size if chunk_size > 0 else max(logits.shape[0], 1)
        if keep_probs:
            # unchunked logprobs only: keep the softmax (N, V/tp); the logits may then be freed
            probs = exps.div_(sum_exps[:, None])  # (N, V/tp), in place of the exps
            ctx.save_for_backward(probs, local_target, owned)
        else:
            # keep only the logits the caller already has plus a few numbers per token, and
            # rebuild log p = x/T - logsumexp block by block in the backward
            ctx.save_for_backward(logits, local_target, owned, logsumexp, entropy)
        return logprob, entropy  # (N,), (N,) or None

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):  # (N,), (N,) or None
        grad_logprob = grad_logprob / ctx.temperature  # (N,)  d/dlogits = d/dx / T
        if ctx.keep_probs:
            probs, local_target, owned = ctx.saved_tensors  # (N, V/tp), (N,), (N,)
            # a fresh buffer, not probs in place: a second backward (retain_graph, gradcheck)
            # must still find the softmax intact
            grad = _grad_from_probs_(probs.clone(), grad_logprob[:, None], grad_logprob,
                                     local_target, owned)
            return grad.to(ctx.logits_dtype), None, None, None, None, None  # (N, V/tp)
        (logits, local_target, owned,
         logsumexp, entropy) = ctx.saved_tensors  # (N, V/tp), (N,) x3 or x4
        if grad_entropy is not None:
            grad_entropy = grad_entropy / ctx.temperature  # (N,)
        # in the logits' dtype: the backward's only full-size buffer
        grad = torch.empty_like(logits)  # (N, V/tp)
        for start in range(0, logits.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            # log p = x/T - lse as one fused add (as in the forward), built straight into grad
            # when the logits are fp32; bf16 logits promote to one fp32 block
            same_dtype = grad.dtype == logsumexp.dtype
            log_probs = torch.add(-logsumexp[rows, None], logits[rows], alpha=1 / ctx.temperature,
                                  out=grad[rows] if same_dtype else None)  # (n, V/tp)
            # what multiplies p in grad_x: g, or with the entropy g + h (log p + H), one more block
            coef = grad_logprob[rows, None]  # (n, 1)
            if grad_entropy is not None:
                log_p_plus_h = log_probs + entropy[rows, None]  # (n, V/tp)
                coef = log_p_plus_h.mul_(grad_entropy[rows, None]).add_(coef)  # (n, V/tp)
            probs = log_probs.exp_()  # (n, V/tp)  p, in place of log p
            block = _grad_from_probs_(probs, coef, grad_logprob[rows],
                                      local_target[rows], owned[rows])
            if not same_dtype:
                grad[rows] = block  # (n, V/tp)  cast to the logits' dtype
        return grad, None, None, None, None, None


def token_logprobs(logits, input_ids, *, tp_group=None, cp_group=None, cu_seqlens=None,
                   chunk_size=0, temperature=1.0, with_entropy=False):
    """Collective over tp and cp. log pi(x_i | x_<i) at every position i of input_ids, from this
    rank's logits, for the distribution pi = softmax(logits / temperature).

    logits: (B, S/cp, V/tp), this rank's vocab shard at its zigzag positions (B=1 when packed).
    input_ids: (B, S) the full token ids, held by every tp and cp rank.
    Returns (B, S) in fp32 (fp64 for fp64 logits), identical on every rank; out[:, 0] = 0 and,
    with cu_seqlens, 0 at every sequence start. Differentiable w.r.t. logits (hand-written
    backward).
    chunk_size > 0: tokens go through in blocks of chunk_size, softmax recomputed in the backward.
    with_entropy: returns (logprobs, entropy), the entropy of the distribution each x_i was drawn
    from, aligned like the logprobs, from the same softmax pass and differentiable as well."""
    batch, seq_len = input_ids.shape
    cp_size, cp_rank = _size(cp_group), _rank(cp_group)
    if logits.shape[:2] != (batch, seq_len // cp_size) or seq_len % cp_size:
        raise ValueError(f"logits {tuple(logits.shape)} must be (B, S/cp, V/tp) for input_ids "
                         f"{tuple(input_ids.shape)} and cp={cp_size}")
    vocab_start, vocab_size = _vocab_range(logits, tp_group)
    # an id beyond the model's vocab would silently score 0 on every rank: refuse. Checked on the
    # device, with no host read (which would make the CPU wait for the GPU every microbatch): on
    # CPU it raises at once, on a GPU it is a device-side assert that stops the run
    in_vocab = (input_ids.min() >= 0) & (input_ids.max() < vocab_size)
    torch._assert_async(in_vocab, "input_ids must lie in [0, the model's vocab size)")
    # Each local row of logits sits at global position g and predicts token g+1. We score that
    # next token here, gather the scores over cp in natural order, and shift right by one.
    positions = zigzag_positions(seq_len, cp_size, cp_rank, input_ids.device)  # (S/cp,)
    # (g = S-1 has no next token: clamped here, its score dropped by the shift)
    next_ids = input_ids[:, (positions + 1).clamp(max=seq_len - 1)]  # (B, S/cp)
    # each target's id within this rank's vocab shard: in it where 0 <= id < V/tp (_in_shard)
    local_ids = next_ids.reshape(-1).to(logits.device) - vocab_start  # (N,)  N = B*S/cp
    flat_logits = logits.reshape(-1, logits.shape[-1])  # (N, V/tp)
    if torch.is_grad_enabled() and logits.requires_grad:
        logprob, entropy = _VocabParallelLogprob.apply(
            flat_logits, local_ids, tp_group,
            chunk_size, temperature, with_entropy)  # (N,), (N,) or None
    else:
        # inference (old/reference policy): same math, nothing saved, chunking still bounds temps
        logprob, _, entropy, _, _ = _logprob_forward(
            flat_logits, local_ids, tp_group,
            chunk_size, temperature, with_entropy)  # (N,), (N,) or None

    def align(per_row):
        """(N,) at this rank's rows -> (B, S): gathered over cp, shifted right by one."""
        return gather_shifted(per_row.view(batch, -1), cp_group, cu_seqlens)

    if with_entropy:
        return align(logprob), align(entropy)  # (B, S), (B, S)
    return align(logprob)  # (B, S)


# ----------------------------------------------------------------------------
# Beyond one step at cp = 1: the zigzag split's gather over cp > 1 (cp_gather calls it) and the
# split itself (its backward)

def zigzag_split(x, cp_size, cp_rank, dim=1):
    """This cp rank's zigzag part of x along dim (differentiable; x itself when cp = 1)."""
    if cp_size == 1:
        return x
    positions = zigzag_positions(x.shape[dim], cp_size, cp_rank, x.device)  # (S/cp,)
    return x.index_select(dim, positions)  # (..., S/cp, ...)


class _CPGather(torch.autograd.Function):
    """All-gather zigzag shards over cp into natural order; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x_local, cp_group, dim):
        ctx.cp_group, ctx.dim = cp_group, dim
        parts = [torch.empty_like(x_local) for _ in range(_size(cp_group))]  # cp x (..., S/cp, ...)
        dist.all_gather(parts, x_local.contiguous(), group=cp_group)
        # rank r's part is [chunk r, chunk 2cp-1-r]: put its two halves back where they belong, so
        # chunks 0..cp-1 are the ranks' first halves in rank order, chunks cp..2cp-1 their second
        # halves in reverse rank order
        firsts, seconds = zip(*[part.chunk(2, dim)
                                for part in parts])  # cp x (..., S/2cp, ...) each
        return torch.cat(firsts + seconds[::-1], dim)  # (..., S, ...)

    @staticmethod
    def backward(ctx, grad_full):
        # Every cp rank computes the same loss from the same gathered tensor, so d loss / d x_local
        # is this rank's entries of grad_full; summing over cp would count the loss cp times.
        # (FSDP later sums parameter gradients over dp*cp: the cp ranks' tokens add up there.)
        cp_size, cp_rank = _size(ctx.cp_group), _rank(ctx.cp_group)
        return zigzag_split(grad_full, cp_size, cp_rank, ctx.dim), None, None  # (..., S/cp, ...)
