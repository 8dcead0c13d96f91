"""The HF engine's generation against the loop it replaced, and its sampler's (B, V) tensors.

    .venv/bin/python bench/hf_generate.py            # B=64, 64 new tokens, V=262 and V=32000
    .venv/bin/python bench/hf_generate.py --smoke    # B=4, 4 tokens, V=262 (seconds)

`rollout.HFEngine.generate` draws every token on the device: one uniform a row from a hash of
(seed, position), then inverse transform sampling against the integer cumulative sum of the row's
probabilities (rollout.sample), the whole step's (B, V) never leaving the device and one host
read per token for the stop check (plus transformers' padding check, see rollout.py). Its cache
is transformers' growing DynamicCache, and no forward pass follows the last token. Its peer
here, `before`, is the loop of c103464, kept verbatim below: the same growing cache, but the
(B, V) logits copied to the host every token, one torch.multinomial per row with that row's
generator, and three .item() per row per token.
Both run the same model (a tiny Llama, random weights, hidden 256, 2 layers, with a vocab of
262 and of 32,000), the same prompts (B of 4-12 tokens) and no stop token, so both generate
every token; one thread, fp32, CPU. Each pair is timed --repeats times interleaved (before,
after, before, ...), the median kept. On a GPU the host copy grows with B x V (311 MB a token
at B=512 with Qwen's 151,936 ids) and every .item() waits for the device: not measured here.

What bounds the sampler on a GPU is memory traffic: the full (B, V) tensors a token. They are
counted (tests/conftest.NewTensors: op outputs of B x V elements in new storage) on one call of
rollout.sample at the bench's B and largest V, with fp32 logits (this engine's) and bf16 logits
(a GPU engine's: one more, the fp32 copy), and on the step it replaced (log-softmax, then
Gumbel-max over a hash of every (row, id): conftest.gumbel_step), which makes 21 with fp32
logits, 19 of them in gumbel_sample.
Last line: RESULT hf_generate_s_before=... hf_generate_s_after=... (V=262) and the same with
_32k for V=32000 (left out by --smoke), speedup ratios, and sampler_bv_tensors=N (the larger
count, bf16's).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402

import model_parallel  # noqa: E402
import rollout  # noqa: E402
from conftest import NewTensors, gumbel_step  # noqa: E402


@torch.no_grad()
def generate_before(engine, prompt_ids, seeds, max_new_tokens, temperature):
    """The HF engine's loop before device sampling (rollout.py at c103464), for the comparison."""
    B, P = len(prompt_ids), max(len(p) for p in prompt_ids)
    ids = torch.zeros((B, P), dtype=torch.long, device=engine.device)
    mask = torch.zeros(B, P, dtype=torch.long, device=engine.device)
    for b, p in enumerate(prompt_ids):
        ids[b, P - len(p):] = torch.tensor(p)
        mask[b, P - len(p):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    out = engine.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
    responses, logprobs = [[] for _ in range(B)], [[] for _ in range(B)]
    done = [False] * B
    for _ in range(max_new_tokens):
        logits = out.logits[:, -1].float().cpu()  # (B, V)
        logp = torch.log_softmax(logits / (temperature or 1.0), -1)  # (B, V)
        if temperature == 0:
            token = logp.argmax(-1, keepdim=True)  # (B, 1)
        else:
            token = torch.stack([torch.multinomial(logp[b].exp(), 1, generator=gens[b])
                                 for b in range(B)])  # (B, 1)
        for b in range(B):
            if not done[b]:
                responses[b].append(token[b, 0].item())
                logprobs[b].append(logp[b, token[b, 0]].item())
                done[b] = token[b, 0].item() in engine.stop_ids
        if all(done):
            break
        mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=engine.device)], 1)
        pos = pos[:, -1:] + 1
        out = engine.model(input_ids=token.to(engine.device), attention_mask=mask, position_ids=pos,
                           past_key_values=out.past_key_values, use_cache=True)
    return list(zip(responses, logprobs))


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(vocab, batch, new_tokens, repeats, tmp):
    path = model_parallel.materialize_tiny_model("tiny-llama", tmp, seed=1, vocab_size=vocab)
    engine = rollout.HFEngine(path, torch.device("cpu"), stop_ids=[])
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (4 + b % 9,), generator=gen).tolist() for b in range(batch)]
    seeds = list(range(batch))
    before, after = [], []
    for _ in range(repeats):
        before.append(timed(lambda: generate_before(engine, prompts, seeds, new_tokens, 1.0)))
        after.append(timed(lambda: engine.generate(prompts, seeds, [new_tokens] * len(prompts), 1.0)))
    outs = engine.generate(prompts, seeds, [new_tokens] * len(prompts), 1.0)
    assert all(len(r) == new_tokens for r, _ in outs), "no stop token: every row runs to the end"
    return statistics.median(before), statistics.median(after)


def sampler_tensors(step, batch, vocab, dtype):
    """The new (B, V) tensors one sampled token makes (step: rollout.sample or the one it
    replaced, at temperature 0.7)."""
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)).to(dtype)  # (B, V)
    with NewTensors(batch * vocab) as new:
        step(logits, torch.arange(batch), 0, 0.7)
    return new.count


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="B=4, 4 tokens, V=262, 1 repeat")
    args = p.parse_args()
    torch.set_num_threads(1)
    cases = [(262, "")] if args.smoke else [(262, ""), (32000, "_32k")]
    batch, new_tokens, repeats = (4, 4, 1) if args.smoke else (64, 64, args.repeats)
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        for vocab, suffix in cases:
            before, after = measure(vocab, batch, new_tokens, repeats, os.path.join(tmp, str(vocab)))
            figures[f"hf_generate_s_before{suffix}"] = before
            figures[f"hf_generate_s_after{suffix}"] = after
            figures[f"speedup{suffix}"] = before / after
            print(f"V={vocab}: B={batch}, {new_tokens} new tokens: before {before:.3f} s, "
                  f"after {after:.3f} s ({before / after:.2f}x)", flush=True)
    vocab = cases[-1][0]
    counts = [sampler_tensors(rollout.sample, batch, vocab, dtype)
              for dtype in (torch.float32, torch.bfloat16)]
    old = sampler_tensors(gumbel_step, batch, vocab, torch.float32)
    print(f"sampler: {counts[0]} new (B, V) tensors a token with fp32 logits, {counts[1]} with bf16 "
          f"(B={batch}, V={vocab}); the Gumbel-max step it replaced: {old} (fp32)", flush=True)
    figures["sampler_bv_tensors"] = max(counts)
    print("RESULT " + " ".join(f"{k}={v:.4g}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
