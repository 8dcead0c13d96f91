"""The HF engine's sampler (rollout.gumbel_sample): per-sample noise from a hash of (seed,
position, token id), then Gumbel-max, all on the device. A sample is the same in any batch, the
draws follow the softmax (chi-square against the probabilities and against torch.multinomial),
and generation reads the host once a token."""
import torch

import model_parallel
import rollout
from conftest import HostReads

# the 0.999 quantile of chi-square with 7 degrees of freedom (8 outcomes): a fair sampler exceeds
# it once in a thousand seeds; these seeds are fixed, so the test is deterministic
CHI2_7_999 = 24.32


def _logp(vocab=8, rows=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(rows, vocab, generator=g) * 1.5, -1)  # (rows, V)


def test_a_sample_is_the_same_in_any_batch():
    """Each row is drawn from its own (seed, position) alone: the same rows in other batches, in
    other orders and alone give the same tokens (exactly)."""
    logp = _logp(vocab=50, rows=6)
    seeds = torch.tensor([7, 11, 2**31 + 5, 0, 123456789, 42])
    for position in (0, 3, 17):
        whole = rollout.gumbel_sample(logp, seeds, position)
        alone = torch.cat([rollout.gumbel_sample(logp[b:b + 1], seeds[b:b + 1], position) for b in range(6)])
        order = torch.tensor([4, 0, 5, 2])
        some = rollout.gumbel_sample(logp[order], seeds[order], position)
        assert torch.equal(whole, alone) and torch.equal(whole[order], some)
    # and the noise does change with the seed and the position: not a constant draw
    draws = {tuple(rollout.gumbel_sample(logp, seeds + k, k % 5).tolist()) for k in range(20)}
    assert len(draws) > 10


def test_draws_follow_the_softmax_like_torch_multinomial():
    """20,000 draws over 8 ids (seeds 0..19,999, two positions): their counts against the
    probabilities (goodness of fit) and against torch.multinomial's 20,000 draws (homogeneity),
    both under chi-square's 0.999 quantile; a sampler that ignores logp fails both by far."""
    logp = _logp()
    probs = logp.exp()[0]  # (8,)
    n = 20000
    for position in (0, 9):
        tokens = rollout.gumbel_sample(logp.expand(n, -1), torch.arange(n), position)  # (n,)
        ours = torch.bincount(tokens, minlength=8).double()  # (8,)
        expected = n * probs.double()
        assert ((ours - expected) ** 2 / expected).sum() < CHI2_7_999, (ours, expected)
        g = torch.Generator().manual_seed(position)
        drawn = torch.multinomial(probs, n, replacement=True, generator=g)  # (n,)
        theirs = torch.bincount(drawn, minlength=8).double()
        assert ((ours - theirs) ** 2 / (ours + theirs)).sum() < CHI2_7_999, (ours, theirs)
    uniform = torch.full((8,), n / 8, dtype=torch.float64)  # what a logp-blind sampler would give
    assert ((uniform - expected) ** 2 / expected).sum() > 10 * CHI2_7_999


def test_hf_engine_samples_alike_in_any_batch_and_reads_the_host_once_a_token(tmp_path):
    """The engine itself: prompts of different lengths (left-padded) drawn together and one by one
    give the same responses; 12 tokens take at most 12 host reads (the stop check), plus one in
    the prompt pass (transformers' padding check) and the final two (the tokens, the logprobs)."""
    path = model_parallel.materialize_tiny_model("tiny-llama", str(tmp_path), seed=1)
    engine = rollout.HFEngine(path, torch.device("cpu"), stop_ids=[256])
    prompts, seeds = [[1, 2, 3], [40, 41, 42, 43, 44, 45, 46], [9]], [5, 6, 7]
    with HostReads() as reads:
        together = engine.generate(prompts, seeds, [12] * len(prompts), 1.0)
    alone = [engine.generate([p], [s], [12], 1.0)[0] for p, s in zip(prompts, seeds)]
    assert [r for r, _ in together] == [r for r, _ in alone]
    for (_, a), (_, b) in zip(together, alone):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    assert reads.count <= 12 + 3, reads.where
