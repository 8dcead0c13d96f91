"""Per-token log-probabilities and entropy from logits sharded on vocab (tp) and sequence (cp).

The policy's lm_head is column-parallel, so each tp rank holds the logits of one slice of the
vocabulary and no rank ever materialises the full (B, S, V) tensor; under context parallelism each
cp rank also holds only its zigzag share of the positions. This module turns those shards into the
(B, S) per-token numbers PPO needs, aligned as in train_ppo.py's docstring: out[:, i] scores x_i
from the logits at i-1, and out[:, 0] = 0 (also at every packed sequence start).

    lp  = token_logprobs(logits, input_ids, tp_group=tp, cp_group=cp, chunk_size=1024, temperature=0.8)
    ent = token_entropy(logits, tp_group=tp, cp_group=cp, chunk_size=1024, temperature=0.8)

Logits arrive in the compute dtype (bf16 on GPU) and are upcast to fp32 and divided by the sampling
temperature one chunk at a time: a full fp32 copy would cost more than the logits themselves.

Where the ideas come from (the code and prose are our own):
1. Vocab-parallel log-softmax: the max and the sum of exponentials are all-reduced over tp and the
   target's logit comes from the one rank that owns it (Megatron-LM's vocab-parallel cross entropy,
   Shoeybi et al. 2019, "Megatron-LM", sec. 3).
2. A hand-written backward, grad = (one_hot - softmax) * grad_out, so autograd keeps no graph of
   the softmax (also Megatron-LM's cross entropy).
3. Chunking over tokens with the softmax recomputed in the backward, so the extra memory is
   O(chunk * V/tp) (NeMo-RL's and verl's chunked logprob computation).
4. Zigzag context parallelism, rank r keeping chunks r and 2cp-1-r of 2*cp: the load-balanced CP
   of Megatron-LM / TransformerEngine, and zhuzilin/ring-flash-attention's zigzag ring attention
   (Liu et al. 2023).

Deliberately left out: a fused kernel that never materialises even one chunk (liger-kernel style),
and logits sharded on the sequence by SP (ours arrive sharded on vocab only).
Logits must be finite (a -inf logit makes the entropy 0 * inf = nan).
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

def zigzag_positions(seq_len, cp_size, cp_rank):
    """Global positions held by cp_rank, in local order: chunk r, then chunk 2cp-1-r."""
    if cp_size == 1:
        return torch.arange(seq_len)  # (S,)
    if seq_len % (2 * cp_size) != 0:
        raise ValueError(f"seq_len={seq_len} must be a multiple of 2*cp_size={2 * cp_size}")
    chunk = seq_len // (2 * cp_size)
    # under a causal mask late positions attend to more keys; pairing chunk r with its mirror
    # 2cp-1-r gives every rank one cheap and one costly chunk, hence equal attention work
    late = 2 * cp_size - 1 - cp_rank
    early_pos = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)  # (S/2cp,)
    late_pos = torch.arange(late * chunk, (late + 1) * chunk)  # (S/2cp,)
    return torch.cat([early_pos, late_pos])  # (S/cp,)


def zigzag_split(x, cp_size, cp_rank, dim=1):
    """This cp rank's zigzag part of x along dim (differentiable; x itself when cp = 1)."""
    if cp_size == 1:
        return x
    positions = zigzag_positions(x.shape[dim], cp_size, cp_rank).to(x.device)  # (S/cp,)
    return x.index_select(dim, positions)  # (..., S/cp, ...)


class _CPGather(torch.autograd.Function):
    """All-gather zigzag shards over cp into natural order; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x_local, cp_group, dim):
        ctx.cp_group, ctx.dim = cp_group, dim
        cp_size = _size(cp_group)
        parts = [torch.empty_like(x_local) for _ in range(cp_size)]  # cp x (..., S/cp, ...)
        dist.all_gather(parts, x_local.contiguous(), group=cp_group)
        # rank r's part is [chunk r, chunk 2cp-1-r]: put its two halves back where they belong
        chunks = [None] * (2 * cp_size)
        for r, part in enumerate(parts):
            chunks[r], chunks[2 * cp_size - 1 - r] = part.chunk(2, dim)  # 2 x (..., S/2cp, ...)
        return torch.cat(chunks, dim)  # (..., S, ...)

    @staticmethod
    def backward(ctx, grad_full):
        # Every cp rank computes the same loss from the same gathered tensor, so d loss / d x_local
        # is this rank's entries of grad_full; summing over cp would count the loss cp times.
        # (FSDP later sums parameter gradients over dp*cp: the cp ranks' tokens add up there.)
        cp_size, cp_rank = _size(ctx.cp_group), _rank(ctx.cp_group)
        return zigzag_split(grad_full, cp_size, cp_rank, ctx.dim), None, None  # (..., S/cp, ...)


def cp_gather(x_local, cp_group, dim=1):
    """Full tensor in natural order along dim from each cp rank's zigzag part (identity if cp=1)."""
    return x_local if _size(cp_group) == 1 else _CPGather.apply(x_local, cp_group, dim)


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
    """(first vocab id of this rank's shard, model vocab size) from every rank's actual shard size.
    DTensor shards like torch.chunk (510 over 4 ranks is 128/128/128/126), and the model's vocab may
    exceed the tokenizer's, so offsets are never derived from V // tp: we gather the real sizes."""
    local_vocab = logits.shape[-1]
    if _size(tp_group) == 1:
        return 0, local_vocab
    # an all-gather of one int per rank, written as a sum of one-hot vectors (one small message)
    sizes = torch.zeros(_size(tp_group), dtype=torch.long, device=logits.device)  # (tp,)
    sizes[_rank(tp_group)] = local_vocab
    _all_reduce_(sizes, dist.ReduceOp.SUM, tp_group)
    sizes = sizes.tolist()  # a host sync, once per call
    return sum(sizes[: _rank(tp_group)]), sum(sizes)


def _logprob_chunk(x, local_target, owned, tp_group, temperature, with_entropy=False):
    """log p(target) for n tokens whose vocab is split over tp, p = softmax(x / temperature).
    x: (n, V/tp) logits in their own dtype (bf16 or fp32); local_target: (n,) target id within this
    shard (clamped into range); owned: (n,) whether this rank's shard holds the target.
    Returns, in the math dtype: logprob (n,), logsumexp (n,) = log sum_v exp(x_v / T), exps
    (n, V/tp) = exp((x - max) / T), the sum of exps (n,), and the entropy (n,) if asked (else None)."""
    math_dtype = _math_dtype(x.dtype)
    # all-reduce 1 (MAX): log-softmax does not change when a constant is subtracted from every
    # logit; subtracting the global max keeps every exp() <= 1, so the sum cannot overflow
    max_logit = x.max(dim=-1).values.to(math_dtype)  # (n,)
    _all_reduce_(max_logit, dist.ReduceOp.MAX, tp_group)
    # s = x/T - max/T as one fused pass (add with alpha), then exp in place; bf16 x plus an
    # fp32 shift promotes to fp32: this is the block's one fp32 buffer (two with the entropy)
    shifted = torch.add(-max_logit[:, None] / temperature, x, alpha=1 / temperature)  # (n, V/tp)
    exps = shifted.exp() if with_entropy else shifted.exp_()  # (n, V/tp)
    target_logit = x.gather(1, local_target[:, None]).squeeze(1).to(math_dtype) / temperature  # (n,)
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


def _logprob_forward(logits, local_target, owned, tp_group, chunk_size, keep_probs, temperature,
                     with_entropy=False):
    """Loop _logprob_chunk over blocks of chunk_size tokens (one block if chunk_size is 0).
    Every tp rank holds the same tokens, so all ranks cut the same blocks and their collectives
    pair up. keep_probs (unchunked training only) returns the full softmax for the backward;
    with_entropy also returns each token's entropy (else None)."""
    num_tokens, math_dtype = logits.shape[0], _math_dtype(logits.dtype)
    step = chunk_size if chunk_size > 0 else max(num_tokens, 1)
    logprob = logits.new_empty(num_tokens, dtype=math_dtype)  # (N,)
    logsumexp = logits.new_empty(num_tokens, dtype=math_dtype)  # (N,)
    entropy = logits.new_empty(num_tokens, dtype=math_dtype) if with_entropy else None  # (N,)
    probs = None
    for start in range(0, num_tokens, step):
        rows = slice(start, start + step)
        logprob[rows], logsumexp[rows], exps, sum_exps, block_entropy = _logprob_chunk(
            logits[rows], local_target[rows], owned[rows], tp_group, temperature, with_entropy)
        if with_entropy:
            entropy[rows] = block_entropy
        if keep_probs:
            probs = exps.div_(sum_exps[:, None])  # (N, V/tp)  softmax over the whole vocab
    return logprob, logsumexp, probs, entropy


def _one_hot_minus_probs_(probs, grad_out, local_target, owned):
    """In place: probs (n, V/tp) becomes grad_out * (one_hot(target) - probs), this rank's slice."""
    probs.mul_(-grad_out[:, None])  # (n, V/tp)
    # the one-hot lives on the rank owning the target; elsewhere we add 0 at a clamped column
    probs.scatter_add_(1, local_target[:, None], torch.where(owned, grad_out, 0.0)[:, None])
    return probs


class _VocabParallelLogprob(torch.autograd.Function):
    """log p(target) from vocab-sharded logits (N, V/tp) -> (N,), at temperature T (x = logits / T).
    Backward, derived: log p_t = x_t - log sum_v exp(x_v), and d/dx_v log sum exp = softmax_v, so
        d log p_t / d x_v = 1[v == t] - softmax_v   =>   grad_x = grad_out * (one_hot(t) - softmax),
    and grad_logits = grad_x / T, returned in the logits' dtype.
    Every tp rank backpropagates the same loss, so each needs only its own vocab columns of this,
    and its softmax already carries the all-reduced denominator: the backward has no communication.
    The max drops out of the derivative (shift invariance), hence its all-reduce without a gradient."""

    @staticmethod
    def forward(ctx, logits, local_target, owned, tp_group, chunk_size, temperature):
        keep_probs = chunk_size == 0
        logprob, logsumexp, probs, _ = _logprob_forward(logits, local_target, owned, tp_group, chunk_size,
                                                        keep_probs, temperature)
        ctx.chunk_size, ctx.logits_dtype, ctx.temperature = chunk_size, logits.dtype, temperature
        if keep_probs:
            # unchunked: keep the softmax (N, V/tp); the logits themselves may be freed
            ctx.save_for_backward(probs, local_target, owned)
        else:
            # chunked: keep only the logits the caller already has plus one number per token,
            # and rebuild softmax = exp(x - logsumexp) block by block in the backward
            ctx.save_for_backward(logits, local_target, owned, logsumexp)
        return logprob  # (N,)

    @staticmethod
    def backward(ctx, grad_logprob):  # grad_logprob: (N,)
        grad_x = grad_logprob / ctx.temperature  # (N,)  d/dlogits = d/dx / T
        if ctx.chunk_size == 0:
            probs, local_target, owned = ctx.saved_tensors  # (N, V/tp), (N,), (N,)
            # a fresh buffer, not probs in place: a second backward (retain_graph, gradcheck)
            # must still find the softmax intact
            grad = _one_hot_minus_probs_(probs.clone(), grad_x, local_target, owned)
            return grad.to(ctx.logits_dtype), None, None, None, None, None  # (N, V/tp)
        logits, local_target, owned, logsumexp = ctx.saved_tensors  # (N, V/tp), (N,) x3
        grad = torch.empty_like(logits)  # (N, V/tp)  in the logits' dtype: the only full-size buffer
        for start in range(0, logits.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            # softmax = exp(x/T - lse) (one fused add, as in the forward), built straight into
            # grad when the logits are fp32; bf16 logits promote to one fp32 block
            same_dtype = grad.dtype == logsumexp.dtype
            probs = torch.add(-logsumexp[rows, None], logits[rows], alpha=1 / ctx.temperature,
                              out=grad[rows] if same_dtype else None).exp_()  # (n, V/tp)
            probs = _one_hot_minus_probs_(probs, grad_x[rows], local_target[rows], owned[rows])  # (n, V/tp)
            if not same_dtype:
                grad[rows] = probs  # (n, V/tp)  cast to the logits' dtype on the store
        return grad, None, None, None, None, None


def token_logprobs(logits, input_ids, *, tp_group=None, cp_group=None, cu_seqlens=None, chunk_size=0,
                   temperature=1.0, with_entropy=False):
    """log pi(x_i | x_<i) at every position i of input_ids, from this rank's shard of the logits,
    for the distribution softmax(logits / temperature).
    logits: (B, S/cp, V/tp), this rank's vocab shard at its zigzag positions (B=1 when packed).
    input_ids: (B, S) the full token ids, held by every tp and cp rank.
    Returns (B, S) in fp32 (fp64 for fp64 logits), identical on every rank; out[:, 0] = 0 and, with
    cu_seqlens, 0 at every sequence start. Differentiable w.r.t. logits (hand-written backward).
    chunk_size > 0: tokens go through in blocks of chunk_size, softmax recomputed in the backward.
    with_entropy (no grad only; token_entropy has the differentiable one): returns (logprobs,
    entropy), the entropy aligned like the logprobs and computed from the same softmax pass."""
    batch, seq_len = input_ids.shape
    cp_size, cp_rank = _size(cp_group), _rank(cp_group)
    if logits.shape[:2] != (batch, seq_len // cp_size) or seq_len % cp_size:
        raise ValueError(f"logits {tuple(logits.shape)} must be (B, S/cp, V/tp) for input_ids "
                         f"{tuple(input_ids.shape)} and cp={cp_size}")
    vocab_start, vocab_size = _vocab_range(logits, tp_group)
    # an id beyond the model's vocab would silently score 0 on every rank: refuse (a host sync)
    if input_ids.min() < 0 or input_ids.max() >= vocab_size:
        raise ValueError(f"input_ids must lie in [0, {vocab_size}) (the model's vocab), got "
                         f"[{int(input_ids.min())}, {int(input_ids.max())}]")

    # Each local row of logits sits at global position g and predicts token g+1. We score that
    # next token here, gather the scores over cp in natural order, and shift right by one.
    positions = zigzag_positions(seq_len, cp_size, cp_rank).to(input_ids.device)  # (S/cp,)
    # (g = S-1 has no next token: clamped here, its score dropped by the shift)
    next_ids = input_ids[:, (positions + 1).clamp(max=seq_len - 1)]  # (B, S/cp)
    local_ids = next_ids.reshape(-1).to(logits.device) - vocab_start  # (N,)  N = B*S/cp
    owned = (local_ids >= 0) & (local_ids < logits.shape[-1])  # (N,)  target in this shard?
    local_ids = local_ids.clamp(0, logits.shape[-1] - 1)  # (N,)  any valid column when not owned
    flat_logits = logits.reshape(-1, logits.shape[-1])  # (N, V/tp)
    if torch.is_grad_enabled() and logits.requires_grad:
        if with_entropy:
            raise ValueError("token_logprobs(with_entropy=True) is for no-grad passes: use token_entropy")
        logprob = _VocabParallelLogprob.apply(flat_logits, local_ids, owned, tp_group, chunk_size, temperature)  # (N,)
    else:
        # inference (old/reference policy): same math, nothing saved, chunking still bounds temps
        logprob, _, _, entropy = _logprob_forward(flat_logits, local_ids, owned, tp_group, chunk_size, False,
                                                  temperature, with_entropy)  # (N,), (N,) or None
    next_token_logprob = cp_gather(logprob.view(batch, -1), cp_group, dim=1)  # (B, S)
    if not with_entropy:
        return shift_right(next_token_logprob, cu_seqlens)  # (B, S)
    entropy = cp_gather(entropy.view(batch, -1), cp_group, dim=1)  # (B, S)
    return shift_right(next_token_logprob, cu_seqlens), shift_right(entropy, cu_seqlens)  # (B, S) x2


# ----------------------------------------------------------------------------
# entropy of the vocab-sharded distribution (a metric, and the optional entropy bonus)

class _TPSum(torch.autograd.Function):
    """All-reduce SUM over tp forward, identity backward (Megatron-LM's "reduce from the tensor
    parallel region"): every tp rank backpropagates the same loss, so the gradient reaching a
    rank's partial sum is the gradient of the total, with no further reduction."""

    @staticmethod
    def forward(ctx, partial, tp_group):
        return _all_reduce_(partial.clone(), dist.ReduceOp.SUM, tp_group)

    @staticmethod
    def backward(ctx, grad_total):
        return grad_total, None


def token_entropy(logits, *, tp_group=None, cp_group=None, cu_seqlens=None, chunk_size=0, temperature=1.0):
    """Entropy of the distribution each x_i was drawn from, softmax(logits / temperature),
    aligned like token_logprobs.
    logits: (B, S/cp, V/tp). Returns (B, S) in fp32 (fp64 for fp64 logits); 0 at position 0 and
    at sequence starts. Differentiable through plain autograd ops (with grad, each block keeps its
    own (n, V/tp) intermediates, so chunking bounds the memory of no-grad calls only).
    With m = max_v x_v, s = (x - m) / T and Z = sum_v exp(s_v), p = exp(s) / Z and
        H = -sum_v p_v log p_v = log Z - sum_v p_v s_v,
    where every term is bounded (s <= 0) just as in the log-softmax above."""
    batch, local_seq, local_vocab = logits.shape
    flat_logits = logits.reshape(-1, local_vocab)  # (N, V/tp)
    math_dtype = _math_dtype(logits.dtype)
    step = chunk_size if chunk_size > 0 else max(flat_logits.shape[0], 1)
    blocks = []
    for start in range(0, flat_logits.shape[0], step):
        x = flat_logits[start : start + step]  # (n, V/tp)  in the logits' dtype
        # H does not depend on m, so m is a constant to autograd (detached) and only the sums
        # below carry gradient; MAX all-reduce as in the log-softmax
        max_logit = x.detach().max(dim=-1).values.to(math_dtype)  # (n,)
        _all_reduce_(max_logit, dist.ReduceOp.MAX, tp_group)
        shifted = (x - max_logit[:, None]) / temperature  # (n, V/tp)  math dtype (bf16 promotes)
        exps = shifted.exp()  # (n, V/tp)
        partial = torch.stack([exps.sum(dim=-1), (exps * shifted).sum(dim=-1)])  # (2, n)
        z, z_times_mean_shifted = _TPSum.apply(partial, tp_group)  # (n,), (n,)
        blocks.append(z.log() - z_times_mean_shifted / z)  # (n,)
    entropy = torch.cat(blocks).view(batch, local_seq)  # (B, S/cp)
    return shift_right(cp_gather(entropy, cp_group, dim=1), cu_seqlens)  # (B, S)


# ----------------------------------------------------------------------------
# packed rows back to one sequence per row

def unpack_packed(packed, cu_seqlens, seq_len):
    """(1, T) packed row -> (n, seq_len): sequence k at row k, left-aligned, zero-padded.
    Pure indexing, so it is differentiable and works for ids, logprobs and masks alike."""
    starts = cu_seqlens[:-1].long().to(packed.device)  # (n,)
    lengths = cu_seqlens[1:].long().to(packed.device) - starts  # (n,)
    if int(lengths.max()) > seq_len:
        raise ValueError(f"a packed sequence has {int(lengths.max())} tokens > seq_len={seq_len}")
    offsets = torch.arange(seq_len, device=packed.device)  # (S,)
    valid = offsets[None, :] < lengths[:, None]  # (n, S)
    index = (starts[:, None] + offsets[None, :]).clamp(max=packed.shape[1] - 1)  # (n, S)
    return packed[0][index].masked_fill(~valid, 0)  # (n, S)
