"""logprobs.py against the plain single-process computation on the unsharded logits.

Every sharded input is cut here from the full logits with the test's own rules (torch.chunk for
the vocab split, as DTensor does; an independent zigzag), never with the code under test.
Run: .venv/bin/python -m pytest -q tests/test_logprobs.py
"""

import pytest
import torch

from _dist import grid_groups, run_ranks
from conftest import at_positions, plain_logprobs
from logprobs import (
    cp_gather,
    token_logprobs,
    zigzag_positions,
    zigzag_split,
)
from model_parallel import unpack_packed  # (the layout's: packed rows back to one sequence a row)

TOL = dict(atol=1e-5, rtol=0)  # fp32 everywhere in the distributed cases


def close(actual, expected, what):
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")


# ----------------------------------------------------------------------------
# independent references (plain_logprobs is conftest's, shared with the other test files)


def plain_entropy(full_logits, seq_starts=()):
    """out[:, i] = entropy of softmax(logits[:, i-1]); 0 at position 0 and at starts."""
    logp = torch.log_softmax(full_logits[:, :-1], dim=-1)
    return at_positions(-(logp.exp() * logp).sum(-1), seq_starts)


def vocab_columns(vocab, tp, tp_rank):
    """This rank's vocab columns, split like DTensor Shard(-1): torch.chunk's ceil-sized pieces."""
    return torch.chunk(torch.arange(vocab), tp)[tp_rank]


def zigzag_reference(seq_len, cp, cp_rank):
    """Positions of cp_rank: chunk k (of 2cp) belongs to rank min(k, 2cp-1-k); ascending order is
    exactly 'chunk r, then chunk 2cp-1-r' because r < 2cp-1-r."""
    chunk = seq_len // (2 * cp)
    owner = [min(g // chunk, 2 * cp - 1 - g // chunk) for g in range(seq_len)]
    return torch.tensor([g for g in range(seq_len) if owner[g] == cp_rank])


def shard(full, tp, tp_rank, cp, cp_rank):
    """(B, S, V) -> this rank's (B, S/cp, V/tp) as a fresh leaf."""
    positions = zigzag_reference(full.shape[1], cp, cp_rank)
    local = full[:, positions][:, :, vocab_columns(full.shape[2], tp, tp_rank)]
    return local.detach().clone().requires_grad_(True)


def make_case(vocab, packed, seed):
    """Full logits, ids (tokenizer vocab < model vocab), loss weights, cu_seqlens, starts."""
    gen = torch.Generator().manual_seed(seed)
    if packed:  # three sequences in one (1, 32) row, then padding (32 is a multiple of 2*cp*tp)
        batch, seq_len, cu_seqlens = 1, 32, torch.tensor([0, 5, 12, 27], dtype=torch.int32)
    else:  # right-padded rows
        batch, seq_len, cu_seqlens = 3, 16, None
    full = 3.0 * torch.randn(batch, seq_len, vocab, generator=gen)
    ids = torch.randint(0, vocab - 3, (batch, seq_len), generator=gen)  # 3 unused model ids
    weights = torch.randn(batch, seq_len, generator=gen)  # makes every position's gradient distinct
    starts = [] if cu_seqlens is None else cu_seqlens[:-1].tolist()
    return full, ids, weights, cu_seqlens, starts


def reference_grads(full, weights, fn):
    leaf = full.clone().requires_grad_(True)
    value = fn(leaf)
    (value * weights).sum().backward()
    return value.detach(), leaf.grad


# ----------------------------------------------------------------------------
# every case on one (tp, cp) layout; run in-process for tp = cp = 1 and on spawned ranks otherwise


def check_layout(tp, cp, tp_rank, cp_rank, tp_group, cp_group):
    for vocab in (96, 95, 510):  # 95: uneven over 2 and 4; 510 over 4 is 128/128/128/126
        for packed in (False, True):
            full, ids, weights, cu_seqlens, starts = make_case(vocab, packed, seed=vocab + packed)
            ref_lp, ref_lp_grad = reference_grads(
                full, weights, lambda x: plain_logprobs(x, ids, starts)
            )
            ref_ent, ref_ent_grad = reference_grads(
                full, weights, lambda x: plain_entropy(x, starts)
            )
            for chunk_size in (0, 13):  # 13 divides none of the token counts (48/cp, 32/cp)
                where = f"tp={tp} cp={cp} tp_rank={tp_rank} cp_rank={cp_rank} V={vocab} "
                where += f"packed={packed} chunk={chunk_size}"
                kwargs = dict(tp_group=tp_group, cp_group=cp_group, cu_seqlens=cu_seqlens)
                kwargs["chunk_size"] = chunk_size

                local = shard(full, tp, tp_rank, cp, cp_rank)
                lp = token_logprobs(local, ids, **kwargs)
                (lp * weights).sum().backward()
                close(lp, ref_lp, f"logprobs {where}")
                close(local.grad, shard(ref_lp_grad, tp, tp_rank, cp, cp_rank), f"grad {where}")

                # the entropy alone, then both together: each gradient, and their sum
                local = shard(full, tp, tp_rank, cp, cp_rank)
                _, ent = token_logprobs(local, ids, with_entropy=True, **kwargs)
                (ent * weights).sum().backward()
                close(ent, ref_ent, f"entropy {where}")
                expected = shard(ref_ent_grad, tp, tp_rank, cp, cp_rank)
                close(local.grad, expected, f"entropy grad {where}")
                local = shard(full, tp, tp_rank, cp, cp_rank)
                lp, ent = token_logprobs(local, ids, with_entropy=True, **kwargs)
                ((lp - 0.5 * ent) * weights).sum().backward()
                close(lp, ref_lp, f"logprobs with the entropy {where}")
                expected = shard(ref_lp_grad - 0.5 * ref_ent_grad, tp, tp_rank, cp, cp_rank)
                close(local.grad, expected, f"logprob - 0.5 entropy grad {where}")

                with torch.no_grad():  # inference path: same values, no graph
                    lp = token_logprobs(local, ids, **kwargs)
                    fused_lp, fused_ent = token_logprobs(local, ids, with_entropy=True, **kwargs)
                assert lp.grad_fn is None
                close(lp, ref_lp, f"no-grad logprobs {where}")
                close(fused_lp, ref_lp, f"logprobs with the entropy {where}")
                close(fused_ent, ref_ent, f"entropy from the logprob pass {where}")

    # cp_gather alone: natural order forward; backward hands back this rank's slice, not a sum
    gen = torch.Generator().manual_seed(7)
    full, upstream = torch.randn(2, 8, 3, generator=gen), torch.randn(2, 8, 3, generator=gen)
    local = full[:, zigzag_reference(8, cp, cp_rank)].clone().requires_grad_(True)
    gathered = cp_gather(local, cp_group, dim=1)
    gathered.backward(upstream)
    torch.testing.assert_close(gathered, full, atol=0, rtol=0)
    expected = upstream[:, zigzag_reference(8, cp, cp_rank)]
    torch.testing.assert_close(local.grad, expected, atol=0, rtol=0)


def _all_layouts_body(rank, world_size):
    # one spawn of 4 ranks serves every layout (starting ranks costs far more than the cases);
    # layouts smaller than 4 ranks run as dp replicas, each checking the same thing
    for tp, cp in [(2, 1), (1, 2), (4, 1), (2, 2)]:
        dp = world_size // (tp * cp)
        _, cp_group, tp_group = grid_groups((dp, cp, tp))  # tp innermost, as in the mesh
        check_layout(tp, cp, rank % tp, (rank // tp) % cp, tp_group, cp_group)


def test_single_process_no_groups():
    check_layout(1, 1, 0, 0, None, None)


def test_distributed_matches_plain():
    """tp x cp in (2,1), (1,2), (4,1), (2,2) on 4 gloo ranks, every case of check_layout."""
    run_ranks(_all_layouts_body, 4)


# ----------------------------------------------------------------------------
# single-process properties


def test_gradcheck_float64():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 6, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    ids = torch.randint(0, 5, (1, 6), generator=gen)
    for chunk_size, cu in ((0, None), (4, torch.tensor([0, 2, 6], dtype=torch.int32))):
        kwargs = dict(cu_seqlens=cu, chunk_size=chunk_size)
        assert torch.autograd.gradcheck(lambda x: token_logprobs(x, ids, **kwargs), (logits,))
        both = lambda x: token_logprobs(x, ids, with_entropy=True, **kwargs)  # noqa: E731
        assert torch.autograd.gradcheck(both, (logits,))


def test_saved_tensors():
    """Inference saves nothing; unchunked keeps the softmax; chunked (or with the entropy) only the
    logits + O(N)."""
    logits = torch.randn(2, 6, 10, requires_grad=True)
    ids = torch.randint(0, 10, (2, 6))

    def saved_by(fn):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = fn()
        return out, saved

    for context in (torch.no_grad, torch.enable_grad):
        with context():
            out, saved = saved_by(lambda: token_logprobs(logits.detach(), ids, chunk_size=4))
        assert saved == [] and out.grad_fn is None
    out, saved = saved_by(lambda: token_logprobs(logits, ids, chunk_size=0))
    # the softmax, a new (N, V) buffer
    assert any(t.shape == (12, 10) and t.data_ptr() != logits.data_ptr() for t in saved)
    out, saved = saved_by(lambda: token_logprobs(logits, ids, chunk_size=4))
    big = [t for t in saved if t.numel() >= 12 * 10]
    assert len(big) == 1 and big[0].data_ptr() == logits.data_ptr()  # the caller's logits, no copy
    assert sum(t.numel() for t in saved if t is not big[0]) <= 3 * 12  # targets, owned, logsumexp
    for chunk_size in (0, 4):  # with the entropy: the logits again, plus the entropy itself
        out, saved = saved_by(lambda: token_logprobs(logits, ids, chunk_size=chunk_size, with_entropy=True))
        big = [t for t in saved if t.numel() >= 12 * 10]
        assert len(big) == 1 and big[0].data_ptr() == logits.data_ptr()
        assert sum(t.numel() for t in saved if t is not big[0]) <= 4 * 12


def test_packed_equals_each_sequence_alone():
    """Pack three sequences, unpack the logprobs, compare with each sequence computed on its own."""
    gen = torch.Generator().manual_seed(3)
    lengths, vocab = [4, 7, 3], 9
    seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    seq_logits = [torch.randn(n, vocab, generator=gen) for n in lengths]
    pad = 2  # packed row padded to 16 tokens
    ids = torch.cat(seqs + [torch.zeros(pad, dtype=torch.long)])[None]  # (1, 16)
    logits = torch.cat(seq_logits + [torch.randn(pad, vocab, generator=gen)])[None]  # (1, 16, V)
    cu_seqlens = torch.tensor([0, 4, 11, 14], dtype=torch.int32)
    packed_lp = token_logprobs(logits, ids, cu_seqlens=cu_seqlens, chunk_size=3)  # (1, 16)
    rows = unpack_packed(packed_lp, cu_seqlens, 8)  # (3, 8)
    for k, (seq, lg) in enumerate(zip(seqs, seq_logits)):
        expected = torch.zeros(8)
        expected[: len(seq)] = plain_logprobs(lg[None], seq[None])[0]  # the sequence alone
        torch.testing.assert_close(rows[k], expected, **TOL)


def test_unpack_packed_by_hand():
    packed = torch.tensor([[10.0, 11, 12, 20, 21, 30, 31, 32, 33, 0]], requires_grad=True)
    cu_seqlens = torch.tensor([0, 3, 5, 9], dtype=torch.int32)
    rows = unpack_packed(packed, cu_seqlens, 5)
    expected = torch.tensor([[10.0, 11, 12, 0, 0], [20, 21, 0, 0, 0], [30, 31, 32, 33, 0]])
    torch.testing.assert_close(rows, expected, atol=0, rtol=0)
    weights = torch.arange(15.0).view(3, 5)
    (rows * weights).sum().backward()
    expected_grad = torch.tensor([[0.0, 1, 2, 5, 6, 10, 11, 12, 13, 0]])  # pad slot 9 gets nothing
    torch.testing.assert_close(packed.grad, expected_grad, atol=0, rtol=0)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    rows = unpack_packed(ids, torch.tensor([0, 2, 5]), 3)
    torch.testing.assert_close(rows, torch.tensor([[5, 6, 0], [7, 8, 9]]), atol=0, rtol=0)
    # checked on the device, not read back (torch._assert_async): RuntimeError
    with pytest.raises(RuntimeError, match="longer than seq_len=3"):
        unpack_packed(packed, cu_seqlens, 3)


def test_zigzag_by_hand():
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert zigzag_positions(12, 3, 1).tolist() == [2, 3, 8, 9]
    assert zigzag_positions(5, 1, 0).tolist() == [0, 1, 2, 3, 4]
    x = torch.arange(16).view(1, 8, 2)
    assert zigzag_split(x, 2, 1, dim=1)[0, :, 0].tolist() == [4, 6, 8, 10]
    with pytest.raises(ValueError):
        zigzag_positions(10, 2, 0)


def test_ids_beyond_model_vocab_are_an_error():
    """Checked on the device without a host read (torch._assert_async): on CPU it raises at once,
    a RuntimeError; on a GPU a device-side assert stops the run."""
    logits = torch.randn(1, 4, 10)
    with pytest.raises(RuntimeError, match="vocab"):
        token_logprobs(logits, torch.tensor([[1, 2, 10, 3]]))
    with pytest.raises(RuntimeError, match="vocab"):
        token_logprobs(logits, torch.tensor([[1, -1, 0, 3]]))


def test_bf16_logits_compute_in_fp32():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 6, 50, generator=gen).bfloat16().requires_grad_(True)
    ids = torch.randint(0, 50, (2, 6), generator=gen)
    for chunk_size in (0, 4):
        out = token_logprobs(logits, ids, chunk_size=chunk_size)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, plain_logprobs(logits.detach().float(), ids), **TOL)
        (grad,) = torch.autograd.grad(out.sum(), logits)
        assert grad.dtype == torch.bfloat16
        as_fp32 = logits.detach().float().requires_grad_(True)
        (reference,) = torch.autograd.grad(plain_logprobs(as_fp32, ids).sum(), as_fp32)
        # the only difference is the bf16 rounding of the returned gradient
        torch.testing.assert_close(grad.float(), reference, atol=1e-2, rtol=1e-2)


def test_temperature_is_applied_per_chunk_in_fp32():
    """token_logprobs and its entropy at T=0.7 equal plain log_softmax(logits.float() / 0.7), value
    and gradient, for fp32 and bf16 logits, chunked or not (the temperature and the upcast moved
    inside the chunk loop; the reference does them up front on the whole tensor)."""
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(2, 7, 50, generator=gen) * 3
    ids = torch.randint(0, 50, (2, 7), generator=gen)
    weights = torch.randn(2, 7, generator=gen)
    for dtype, grad_tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        logits = base.to(dtype).requires_grad_(True)
        as_fp32 = logits.detach().float().requires_grad_(True)
        want = plain_logprobs(as_fp32 / 0.7, ids)
        (want_grad,) = torch.autograd.grad((want * weights).sum(), as_fp32)
        want_ent = plain_entropy(as_fp32 / 0.7, ())
        (want_ent_grad,) = torch.autograd.grad((want_ent * weights).sum(), as_fp32)
        for chunk_size in (0, 3):
            out = token_logprobs(logits, ids, chunk_size=chunk_size, temperature=0.7)
            torch.testing.assert_close(out, want.detach(), **TOL)
            (grad,) = torch.autograd.grad((out * weights).sum(), logits)
            assert grad.dtype == dtype
            torch.testing.assert_close(grad.float(), want_grad, atol=grad_tol, rtol=grad_tol)
            entropy_args = dict(chunk_size=chunk_size, temperature=0.7, with_entropy=True)
            with torch.no_grad():
                _, ent = token_logprobs(logits, ids, **entropy_args)
            torch.testing.assert_close(ent, want_ent.detach(), **TOL)
            _, ent = token_logprobs(logits, ids, **entropy_args)
            (grad,) = torch.autograd.grad((ent * weights).sum(), logits)
            assert grad.dtype == dtype
            torch.testing.assert_close(grad.float(), want_ent_grad, atol=grad_tol, rtol=grad_tol)
