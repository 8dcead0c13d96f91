"""The HF engine's sampler (rollout.sample): one uniform a row from a hash of (seed, position),
then inverse transform sampling against the integer (fixed-point) cumulative sum of the row's
probabilities, all on the device. A sample is the same in any batch, the draws follow the
softmax (chi-square against the probabilities and against torch.multinomial), a step makes at
most 3 full (B, V) tensors, and generation reads the host twice a token (the stop check,
transformers' padding check)."""
import torch

import model_parallel
import rollout
from conftest import HostReads, NewTensors, gumbel_step

# the 0.999 quantile of chi-square with 7 degrees of freedom (8 outcomes): a fair sampler exceeds
# it once in a thousand seeds; these seeds are fixed, so the test is deterministic
CHI2_7_999 = 24.32


def _logits(vocab=8, rows=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 1.5  # (rows, V)


def _sample(logits, seeds, position, temperature):
    # rollout.sample divides fp32 logits by T in place (the engine's own out.logits): a copy here
    return rollout.sample(logits.clone(), seeds, position, temperature)


def test_a_sample_is_the_same_in_any_batch():
    """Each row is drawn from its own logits, seed and position alone: the same rows in other
    batches, in other orders and alone give the same tokens and logprobs (exactly), bf16 logits
    the same as their fp32 values; the logprob is log-softmax(logits / T) at the token (T = 0:
    greedy, plain log-softmax)."""
    logits = _logits(vocab=50, rows=6)
    seeds = torch.tensor([7, 11, 2**31 + 5, 0, 123456789, 42])
    order = torch.tensor([4, 0, 5, 2])
    for temperature in (1.0, 0.7, 0.0):
        expected = torch.log_softmax(logits.double() / (temperature or 1.0), -1)  # (6, V)
        for position in (0, 3, 17):
            whole = _sample(logits, seeds, position, temperature)  # (tokens, logprobs)
            rows = [_sample(logits[b:b + 1], seeds[b:b + 1], position, temperature) for b in range(6)]
            alone = [torch.cat(column) for column in zip(*rows)]
            some = _sample(logits[order], seeds[order], position, temperature)
            for w, a, s in zip(whole, alone, some):
                assert torch.equal(w, a) and torch.equal(w[order], s)
            tokens, logprobs = whole
            torch.testing.assert_close(logprobs.double(), expected.gather(1, tokens[:, None])[:, 0])
            if temperature == 0:
                assert torch.equal(tokens, logits.argmax(-1))
            low = logits.bfloat16()
            assert all(torch.equal(a, b) for a, b in zip(_sample(low, seeds, position, temperature),
                                                         _sample(low.float(), seeds, position, temperature)))
    # and the draw does change with the seed and the position: not a constant draw
    draws = {tuple(_sample(logits, seeds + k, k % 5, 1.0)[0].tolist()) for k in range(20)}
    assert len(draws) > 10


def test_draws_follow_the_softmax_like_torch_multinomial():
    """20,000 draws over 8 ids (seeds 0..19,999; two positions at T = 1, one at T = 2): their
    counts against the probabilities (goodness of fit) and against torch.multinomial's 20,000
    draws (homogeneity), both under chi-square's 0.999 quantile; a sampler that ignores the
    logits fails both by far."""
    logits = _logits()
    n = 20000
    # T = 2 rather than below 1: every expected count stays at 41 or more (chi-square wants 5 or
    # more; at T = 0.5 two ids expect 6 and 2)
    for position, temperature in ((0, 1.0), (9, 1.0), (4, 2.0)):
        probs = torch.softmax(logits[0] / temperature, -1)  # (8,)
        tokens, _ = _sample(logits.expand(n, -1), torch.arange(n), position, temperature)  # (n,)
        ours = torch.bincount(tokens, minlength=8).double()  # (8,)
        expected = n * probs.double()
        assert ((ours - expected) ** 2 / expected).sum() < CHI2_7_999, (ours, expected)
        g = torch.Generator().manual_seed(position)
        drawn = torch.multinomial(probs, n, replacement=True, generator=g)  # (n,)
        theirs = torch.bincount(drawn, minlength=8).double()
        assert ((ours - theirs) ** 2 / (ours + theirs)).sum() < CHI2_7_999, (ours, theirs)
        uniform = torch.full((8,), n / 8, dtype=torch.float64)  # what a logits-blind sampler would give
        assert ((uniform - expected) ** 2 / expected).sum() > 10 * CHI2_7_999


def test_a_step_makes_at_most_three_full_tensors():
    """The sampler's memory traffic: at most 3 new (B, V) tensors a token (the fp32 copy of bf16
    logits, the probabilities, their fixed-point cumulative sum), counted at the dispatcher; the
    step it replaced made 21 (19 in gumbel_sample), and the count sees them. The recorder itself
    counts new storage only: not views, not in-place results."""
    B, V = 16, 1000
    seeds = torch.arange(B)
    for dtype in (torch.float32, torch.bfloat16):
        for temperature in (1.0, 0.7, 0.0):
            logits = _logits(V, B).to(dtype)  # (B, V)
            with NewTensors(B * V) as new:
                rollout.sample(logits, seeds, 5, temperature)
            assert new.count <= 3, new.ops
            with NewTensors(B * V) as old:
                gumbel_step(logits, seeds, 5, temperature)
            assert old.count > 3, old.ops
    x = torch.ones(B, V)
    with NewTensors(B * V) as new:
        x.div_(2).view(V, B).exp_()
        torch.cumsum(x, -1, out=x)
    assert new.count == 0, new.ops
    with NewTensors(B * V) as new:
        x / 2
    assert new.count == 1, new.ops


def test_hf_engine_samples_alike_in_any_batch_and_reads_the_host_twice_a_token(tmp_path):
    """The engine itself: prompts of different lengths (left-padded) and budgets drawn together
    and one by one give the same responses. 12 tokens take at most 11 + 2 host reads of its own
    (the stop check after each token but the last; the tokens and logprobs at the end) and
    11 + 2 in transformers' mask code (its padding check in each decode step, two in the prompt
    pass): see rollout.HFEngine.generate for why the decode steps' one costs ~nothing on a GPU."""
    path = model_parallel.materialize_tiny_model("tiny-llama", str(tmp_path), seed=1)
    engine = rollout.HFEngine(path, torch.device("cpu"), stop_ids=[256])
    prompts, seeds, budgets = [[1, 2, 3], [40, 41, 42, 43, 44, 45, 46], [9]], [5, 6, 7], [12, 5, 9]
    with HostReads() as reads:
        together = engine.generate(prompts, seeds, budgets, 1.0)
    alone = [engine.generate([p], [s], [n], 1.0)[0] for p, s, n in zip(prompts, seeds, budgets)]
    assert [r for r, _ in together] == [r for r, _ in alone]
    assert [len(r) for r, _ in together] == budgets  # no stop drawn: each row runs to its budget
    for (_, a), (_, b) in zip(together, alone):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    ours = [w for w in reads.where if w[1].startswith("rollout.py")]
    assert len(ours) <= 11 + 2, reads.where
    assert len(reads.where) - len(ours) <= 11 + 2, reads.where


def test_hf_engine_attends_over_the_tokens_there_are(tmp_path, monkeypatch):
    """Each decode step's attention gets the keys drawn so far, one more a step: the prompt pass
    5 (the longest prompt), then 6, 7, 8. A static cache sized for the response (5 + 4) made
    every step attend over all of it, with K and V copied out to the query heads over that whole
    length (transformers' SDPA path repeats them when a mask is passed)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    seen = []  # (queries, keys) of each attention call, each layer
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def recording(module, query, key, value, attention_mask, **kwargs):
        seen.append((query.shape[-2], key.shape[-2]))
        return sdpa(module, query, key, value, attention_mask, **kwargs)
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", recording)
    path = model_parallel.materialize_tiny_model("tiny-llama", str(tmp_path), seed=1)
    engine = rollout.HFEngine(path, torch.device("cpu"), stop_ids=[])
    assert engine.model.config._attn_implementation == "sdpa"
    engine.generate([[1, 2, 3], [4, 5, 6, 7, 8]], [1, 2], [4, 4], 1.0)
    layers = engine.model.config.num_hidden_layers
    assert seen == [(q, k) for q, k in [(5, 5), (1, 6), (1, 7), (1, 8)] for _ in range(layers)], seen
