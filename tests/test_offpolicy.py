"""Issue 53: the off-policy correction, DAPO's dynamic sampling and overlong shaping, pass@k.

The correction's weights and rejection masks are checked against verl 0.9.1's
compute_rollout_correction_weights and compute_rollout_rejection_mask
(verl/trainer/ppo/rollout_corr_helper.py), re-derived here one token at a time from its source
(verl itself needs its own stack; scripts/verl_parity.py runs the very functions of its wheel
against train_ppo's, and docs/losses.md gives that run's figures), on episodes whose masks have
gaps (a tool's output between two model turns) and padding, in every level and mode both have;
the geometric level, which verl lacks, against its definition."""
import dataclasses
import itertools
import json
import math
from collections import Counter

import pytest
import torch

import config
import rollout
import train_ppo
from extensions import dapo, evaluation, offpolicy

SAFETY = 20.0  # verl's SAFETY_BOUND on a log ratio before exp


class OneRank:
    """A mesh of one dp rank, as training_batch reads it."""
    def __getitem__(self, name):
        return self

    def size(self):
        return 1

    def get_local_rank(self):
        return 0


def gapped_case(seed=0):
    """4 rows of 10 positions: a prompt, two model turns around an observation, padding; a row of
    one turn; a row with no response at all. Log ratios log pi_old - log pi_engine large enough
    that bounds of 2 and 1/2 bite, and one beyond verl's +-20 clamp."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[0, 0, 1, 1, 0, 0, 1, 1, 1, 0],
                         [0, 1, 1, 1, 1, 1, 1, 0, 0, 0],
                         [0, 0, 0, 1, 1, 0, 1, 0, 0, 0],
                         [0, 0, 0, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.float32)
    log_ratio = torch.randn(4, 10, generator=g, dtype=torch.float64) * 0.8
    log_ratio[1, 3] = 25.0  # past the clamp
    return log_ratio.float(), mask


def verl_weights(log_ratio, mask, level, upper, lower=None):
    """verl's compute_rollout_correction_weights, one row and token at a time: token level
    exp(clamp(lr)); sequence level exp(clamp(sum of the row's lr over the mask)); zero outside
    the mask; a single threshold truncates (TIS, clamp(max=upper)), a lower_upper pair masks
    (IcePop: weights outside [lower, upper] are 0). `geometric` (not verl's): exp(clamp(mean
    lr))."""
    B, S = log_ratio.shape
    out = torch.zeros(B, S, dtype=torch.float64)
    for b in range(B):
        inside = [t for t in range(S) if mask[b, t]]
        total = sum(float(log_ratio[b, t]) for t in inside)
        for t in inside:
            if level == "token":
                raw = math.exp(min(max(float(log_ratio[b, t]), -SAFETY), SAFETY))
            elif level == "sequence":
                raw = math.exp(min(max(total, -SAFETY), SAFETY))
            else:
                raw = math.exp(min(max(total / len(inside), -SAFETY), SAFETY))
            if lower is None:
                out[b, t] = min(raw, upper)
            else:
                out[b, t] = raw if lower <= raw <= upper else 0.0
    return out


def verl_rejection(log_ratio, mask, option, threshold):
    """verl's compute_rollout_rejection_mask for one option, one row at a time: per token, with
    lr clamped to +-20, k1 = -lr, k2 = lr^2 / 2, k3 = exp(lr) - 1 - lr; token_* judges each token,
    seq_sum/seq_mean/seq_max_* the row by the sum / mean / max of its tokens'; k1 kept within
    [log(1/threshold), log(threshold)], k2 and k3 at most threshold. Returns mask * keep."""
    level, k = option.rsplit("_", 1)
    B, S = log_ratio.shape
    out = torch.zeros(B, S)
    for b in range(B):
        inside = [t for t in range(S) if mask[b, t]]
        stats = {}
        for t in inside:
            lr = min(max(float(log_ratio[b, t]), -SAFETY), SAFETY)
            stats[t] = {"k1": -lr, "k2": 0.5 * lr * lr, "k3": math.exp(lr) - 1.0 - lr}[k]
        if level == "seq_sum":
            stats = dict.fromkeys(inside, sum(stats.values()))
        elif level == "seq_mean":
            stats = dict.fromkeys(inside, sum(stats.values()) / max(len(inside), 1))
        elif level == "seq_max":
            stats = dict.fromkeys(inside, max(stats.values(), default=0.0))
        for t in inside:
            if k == "k1":
                keep = math.log(1.0 / threshold) <= stats[t] <= math.log(threshold)
            else:
                keep = stats[t] <= threshold
            out[b, t] = float(keep)
    return out


MODES = [("token", "truncate"), ("sequence", "truncate"), ("geometric", "truncate"),
         ("token", "mask"), ("sequence", "mask"), ("geometric", "mask")]


@pytest.mark.parametrize("level, mode", MODES)
def test_importance_weights_equal_verls_in_every_level_and_mode(level, mode):
    log_ratio, mask = gapped_case()
    cfg = config.Config(offpolicy_is=level, offpolicy_is_mode=mode, offpolicy_is_bound=2.0,
                        offpolicy_is_lower=0.5)
    got = offpolicy.importance_weights(log_ratio, mask, cfg)
    want = verl_weights(log_ratio, mask, level, 2.0, 0.5 if mode == "mask" else None)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)
    # the bounds bite in this case: some weights truncated or masked, some not
    raw = verl_weights(log_ratio, mask, level, 1e30)
    inside = mask.bool()
    assert (raw[inside] > 2.0).any() and (raw[inside] <= 2.0).any(), level
    if level == "geometric":  # verl lacks it: exp of the mean log ratio of each row, by hand
        for b, tokens in enumerate(([2, 3, 6, 7, 8], [1, 2, 3, 4, 5, 6], [3, 4, 6])):
            w = math.exp(min(log_ratio[b, tokens].double().mean().item(), SAFETY))
            w = min(w, 2.0) if mode == "truncate" else (w if 0.5 <= w <= 2.0 else 0.0)
            assert math.isclose(got[b, tokens[0]].item(), w, rel_tol=1e-5), (b, w)


REJECT = ["token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
          "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3"]


@pytest.mark.parametrize("option", REJECT)
def test_rejection_masks_equal_verls_for_every_option(option):
    """Every option verl has, at a bound where it keeps some rows or tokens and rejects others:
    k1 a ratio (kept within [1/B, B]), k2 and k3 a divergence. The rows' sums of k1 are -0.72,
    -21.4 and 2.2, their largest k2 0.43, 200 and 1.09, their largest k3 0.60, 4.9e8 and 0.70."""
    log_ratio, mask = gapped_case(seed=1)
    bound = dict(token_k1=2.0, seq_sum_k1=2.2, seq_mean_k1=2.0, seq_sum_k2=1.5, seq_sum_k3=1.5,
                 seq_max_k2=0.5, seq_max_k3=0.65).get(option, 0.3)
    cfg = config.Config(offpolicy_reject=option, offpolicy_reject_bound=bound)
    got = offpolicy.rejection_mask(log_ratio, mask, cfg)
    want = verl_rejection(log_ratio, mask, option, bound)
    assert torch.equal(got, want), (option, got, want)
    kept = got[mask.bool()]
    assert 0 < kept.sum() < mask.sum(), f"{option}: the case keeps all or nothing"


def test_the_corrections_weight_and_metrics_by_hand(monkeypatch):
    """offpolicy_weights: importance weight times the rejection's keep, from batch.old_lp -
    batch.engine_lp; offpolicy.shares: the tokens and sequences of weight 0 and the sums of w
    and w^2 over response tokens, by hand on two rows; offpolicy.weigh: the batch's weights and
    the metrics made of those sums."""
    old = torch.tensor([[0.0, -1.0, -1.0, -1.0], [0.0, -2.0, -0.5, 0.0]])
    engine = torch.tensor([[0.0, -1.0, -2.0, -0.2], [0.0, -2.0, -0.5, 0.0]])  # ratios 1, e, e^-0.8
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]])
    batch = train_ppo.Batch(ids=None, mask=mask, engine_lp=engine, lens=[4, 3], unscored=1,
                            weight=torch.ones_like(mask), old_lp=old)
    cfg = config.Config(offpolicy_is="token", offpolicy_is_bound=2.0,
                        offpolicy_reject="token_k1", offpolicy_reject_bound=2.0)
    w = offpolicy.offpolicy_weights(batch, slice(None), cfg)
    # row 0: ratio 1 kept; e truncated to 2 but rejected by k1 (|log e| = 1 > log 2); e^-0.8
    # rejected too (0.8 > log 2 = 0.69); row 1: ratios 1, 1
    expected = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]])
    torch.testing.assert_close(w, expected)
    masked, seqs, w_sum, w_sq, n_tok, n_seq = offpolicy.shares(batch, w).tolist()
    assert (masked, seqs, w_sum, w_sq, n_tok, n_seq) == (2.0, 1.0, 3.0, 3.0, 5.0, 2.0)
    # the metrics weigh makes of them (one rank: dp_sum is the identity), and the batch's weights;
    # the ESS: (sum w)^2 / (n sum w^2) = 9 / (5 * 3)
    monkeypatch.setattr(train_ppo, "dp_sum", lambda tensor, mesh: tensor)
    weight, metrics = offpolicy.weigh(batch, cfg, None)
    torch.testing.assert_close(weight, expected)
    assert metrics == pytest.approx(dict(offpolicy_token_masked=2 / 5, offpolicy_seq_masked=1 / 2,
                                         offpolicy_ess=0.6))


def test_weighted_surrogate_keeps_zero_weight_tokens_in_the_normalizer():
    """policy_loss_terms: policy_loss = sum over response tokens of w * surrogate / N_tok with N_tok
    counting the rejected tokens too (they train a smaller step, not a renormalized one)."""
    old = torch.tensor([[0.0, -1.0, -1.0, -1.0]])
    engine = torch.tensor([[0.0, -1.0, -2.0, -1.0]])  # the middle token: ratio e, rejected
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    adv = torch.tensor([[0.0, 1.0, 1.0, 2.0]])
    batch = train_ppo.Batch(ids=None, mask=mask, engine_lp=engine, lens=[4], unscored=1,
                            weight=torch.ones_like(mask), old_lp=old, advantages=adv)
    cfg = config.Config(offpolicy_reject="token_k1", offpolicy_reject_bound=2.0, kl_coef=0.0,
                        advantage_estimator="grpo", samples_per_prompt=2)
    # the weights ppo_step gives the batch before the update (offpolicy.weigh)
    batch = dataclasses.replace(batch, weight=offpolicy.offpolicy_weights(batch, slice(None), cfg))
    lp = old.clone()  # pi = pi_old: the surrogate is -A per token
    aggregate = lambda per_token, m: train_ppo.aggregate_loss(per_token, m, num_tokens=m.sum())  # noqa: E731
    terms, _ = train_ppo.policy_loss_terms(lp, None, batch, torch.tensor([0]), aggregate, cfg)
    assert math.isclose(terms["policy_loss"].item(), (-1.0 + 0.0 - 2.0) / 3)


# -----------------------------------------------------------------------------
# Dynamic sampling

def samples_of(scores, K=2, first=0):
    """{index: sample} of groups of K with the given task scores (one list a group)."""
    every = {}
    for g, group in enumerate(scores):
        for k, score in enumerate(group):
            j = (first + g) * K + k
            every[j] = dict(index=j, task_score=score, action_mask=[1, 1], ended="stop",
                            response=f"g{first + g}s{k}")
    return every


def test_keep_groups_by_hand():
    """6 groups drawn over two rounds of 3, 2 of them varied: with prompts_per_step=3 the batch is
    the 2 varied groups and the newest group that did not vary, re-indexed 0..5 in the order
    drawn, each sample with its drawn index."""
    cfg = config.Config(prompts_per_step=3, samples_per_prompt=2, dynamic_sampling=True)
    every = samples_of([[1, 1], [0, 1], [0, 0], [1, 1], [0, 0], [1, 0]])
    assert dapo.varied_groups(every, cfg) == [1, 5]
    kept, metrics = dapo.keep_groups(every, cfg)
    assert [kept[i]["drawn"] for i in range(6)] == [2, 3, 8, 9, 10, 11]  # groups 1, 4, 5
    assert [kept[i]["index"] for i in range(6)] == list(range(6))
    assert metrics == dict(dynamic_kept_fraction=2 / 6, dynamic_filled_groups=1)
    # enough varied groups: the first 3 of them, no filling
    every = samples_of([[1, 0], [0, 0], [0, 1], [1, 0], [0, 1]])
    kept, metrics = dapo.keep_groups(every, cfg)
    assert [kept[i]["drawn"] // 2 for i in range(0, 6, 2)] == [0, 2, 3]
    assert metrics == dict(dynamic_kept_fraction=4 / 5, dynamic_filled_groups=0)


class ScoredEngine:
    """An engine whose response to a request is fixed by its seed (as the real ones: a sample is
    a function of its seed): one token, seed % 3 (a digit), then EOS. Records the seeds."""
    stop_ids = [256]  # the toy's EOS
    vocab_size = 262

    def __init__(self):
        self.seeds = []

    def generate(self, prompt_ids, seeds, budgets, temperature):
        self.seeds += seeds
        return [([ord("0") + s % 3, 256][:budget], [-0.5, -0.5][:budget])
                for s, budget in zip(seeds, budgets)]

    def sleep(self):
        pass


def _rollouts_body(rank, world_size, out):
    """A step of rollouts under dynamic sampling on this mesh (every rank); rank 0 writes the kept
    samples' drawn indices and responses, the metrics and every seed its engine used."""
    import json
    cfg = config.Config(prompts_per_step=5, samples_per_prompt=3, dynamic_sampling=True,
                        dynamic_max_rounds=3, max_new_tokens=2, overlong_buffer=1,
                        overlong_penalty=0.5, seed=3)
    engine = ScoredEngine()
    task = rollout.ToyTask(seed=3)
    every, _, metrics = rollout.rollouts(engine, task, cfg, step=7, start=40)
    seeds = [None] * world_size
    train_ppo.dist.all_gather_object(seeds, engine.seeds)
    if rank == 0:
        kept = [(every[i]["drawn"], every[i]["response"], every[i]["task_score"],
                 every[i]["length_penalty"]) for i in sorted(every)]
        with open(out, "w") as f:
            json.dump(dict(kept=kept, metrics=metrics, seeds=sorted(sum(seeds, []))), f)


@pytest.fixture(scope="module")
def dynamic_runs(tmp_path_factory):
    import json
    from _dist import run_ranks
    runs = {}
    for world in (1, 2):
        out = str(tmp_path_factory.mktemp(f"dyn{world}") / "kept.json")
        run_ranks(_rollouts_body, world, out)
        runs[world] = json.load(open(out))
    return runs


def test_dynamic_sampling_keeps_the_same_groups_on_every_mesh(dynamic_runs):
    """1 and 2 ranks (2 ranks split the 15 samples of a round unevenly, 7 and 8): the same
    rounds, the same kept groups in the same order, the same responses, the same penalties; no
    seed used twice (the key holds the round), every sample drawn once over the ranks; whole
    groups kept."""
    one = dynamic_runs[1]
    same = {k: v for k, v in one["metrics"].items() if k != "rollout_samples"}  # (per rank)
    for world in (2,):
        assert dynamic_runs[world]["kept"] == one["kept"], world
        assert {k: v for k, v in dynamic_runs[world]["metrics"].items()
                if k != "rollout_samples"} == same, world
        assert dynamic_runs[world]["seeds"] == one["seeds"], world
    rounds = one["metrics"]["dynamic_rounds"]
    assert rounds > 1 and one["metrics"]["rollout_prompts"] == 5 * rounds
    assert len(one["seeds"]) == len(set(one["seeds"])) == 15 * rounds
    drawn = [d for d, *_ in one["kept"]]
    assert all(drawn[i] // 3 == drawn[i + 1] // 3 == drawn[i + 2] // 3 and drawn[i] % 3 == 0
               for i in range(0, 15, 3))


def test_the_raw_task_score_decides_the_filter_not_the_shaped_reward():
    """A group of equal task scores whose overlong penalties differ (one response longer than the
    others) is still dropped: the filter reads task_score, and the penalty lands in
    length_penalty, not in it."""
    cfg = config.Config(prompts_per_step=1, samples_per_prompt=2, dynamic_sampling=True,
                        max_new_tokens=4, overlong_buffer=2)
    every = samples_of([[1.0, 1.0], [0.0, 1.0]])
    every[0]["action_mask"] = [1, 1, 1, 1]  # 4 tokens: past max_new_tokens - 2
    dapo.overlong_shaping(every.values(), cfg)
    assert every[0]["length_penalty"] == -1.0 and every[1]["length_penalty"] == 0.0
    assert every[0]["task_score"] == every[1]["task_score"] == 1.0  # raw scores untouched
    assert dapo.varied_groups(every, cfg) == [1]
    kept, _ = dapo.keep_groups(every, cfg)
    assert [kept[i]["drawn"] for i in (0, 1)] == [2, 3]


def test_overlong_penalty_and_mask_by_hand():
    """max_new_tokens 8, buffer 4, penalty 0.5: L <= 4 pays 0, L = 6 pays 0.5 * 2/4, L = 8 (cut)
    pays 0.5; an episode's observation tokens are not counted (7 tokens, 3 of them a tool's: L
    = 4). With overlong_mask, the cut response (ended "length") gets a loss mask of 0s."""
    cfg = config.Config(max_new_tokens=8, overlong_buffer=4, overlong_penalty=0.5,
                        overlong_mask=True)
    samples = [dict(action_mask=[1] * 3, ended="stop"), dict(action_mask=[1] * 6, ended="stop"),
               dict(action_mask=[1] * 8, ended="length"),
               dict(action_mask=[1, 1, 0, 0, 0, 1, 1], ended="stop")]
    for s in samples:
        s.update(task_score=1.0, rule_reward=1.0)
    dapo.overlong_shaping(samples, cfg)
    assert [s["length_penalty"] for s in samples] == [0.0, -0.25, -0.5, 0.0]
    # what the sample is trained on: its task score plus the penalty
    assert [s["rule_reward"] for s in samples] == [1.0, 0.75, 0.5, 1.0]
    assert [s.get("loss_mask") for s in samples] == [None, None, [0] * 8, None]


def test_overlong_shaping_reaches_the_reward_and_the_mask_of_the_batch(monkeypatch):
    """training_batch: the length penalty reaches the batch's reward (a sample's rule_reward,
    dapo.overlong_shaping's), never task_score, and a loss_mask replaces the action mask."""
    every = {0: dict(prompt_ids=[1, 2], response_ids=[5, 6, 7], engine_logprobs=[-1.0] * 3,
                     action_mask=[1, 1, 1], task_score=1.0),
             1: dict(prompt_ids=[1, 2], response_ids=[5, 6], engine_logprobs=[-1.0] * 2,
                     action_mask=[1, 1], task_score=0.0, ended="length")}
    cfg = config.Config(prompts_per_step=1, samples_per_prompt=2, micro_batch_size=2,
                        max_new_tokens=4, overlong_buffer=2, overlong_mask=True)
    for s in every.values():  # as rollout.generate_share makes them
        s.update(loss_mask=s["action_mask"], rule_reward=s["task_score"], ended=s.get("ended", "stop"))
    dapo.overlong_shaping(every.values(), cfg)
    batch = train_ppo.training_batch(every, cfg, OneRank(), 0, "cpu")
    rows = {j: r for r, j in enumerate(batch.index)}
    assert batch.reward[rows[0]] == 1.0 - 0.5 and batch.reward[rows[1]] == 0.0
    assert batch.task_score[rows[0]] == 1.0
    assert batch.mask[rows[0]].sum() == 3 and batch.mask[rows[1]].sum() == 0


def test_the_dump_holds_the_reward_trained_on_with_its_penalty(tmp_path, monkeypatch):
    """dump_rollouts without a reward model: `reward` is the task's score plus the overlong
    penalty (the step's rewards, as trained on), task_score the rule's alone."""
    monkeypatch.setattr(rollout.dist, "get_rank", lambda: 0)
    every = {j: dict(index=j, task_score=1.0, length_penalty=-0.25 * j) for j in range(2)}
    for buffer, rewards in ((2, [1.0, 0.75]), (0, [1.0, 1.0])):
        cfg = config.Config(out_dir=str(tmp_path), overlong_buffer=buffer)
        trained_on = torch.tensor([1.0, 0.75]) if buffer else torch.tensor([1.0, 1.0])
        rollout.dump_rollouts(every, trained_on, cfg, step=buffer)
        rollout.wait_for_dumps()
        with open(tmp_path / "rollouts" / f"step_{buffer}.jsonl") as f:
            dumped = [json.loads(line) for line in f]
        assert [s["reward"] for s in dumped] == rewards
        assert [s["task_score"] for s in dumped] == [1.0, 1.0]


def test_a_step_whose_every_response_overlong_mask_cut(monkeypatch):
    """overlong_mask may take every response of a step out of the loss. The step's metrics are
    then 0 over no token (no division by zero), its response length is still the model's tokens
    ((3 + 2) / 2, episode_metrics), and GAE's whitening over no token gives zeros, not NaN."""
    every = {0: dict(prompt_ids=[1, 2], response_ids=[5, 6, 7], engine_logprobs=[-1.0] * 3,
                     action_mask=[1, 1, 1], loss_mask=[0, 0, 0], task_score=1.0, rule_reward=1.0,
                     calls=0, ended="length"),
             1: dict(prompt_ids=[1, 2], response_ids=[5, 6], engine_logprobs=[-1.0] * 2,
                     action_mask=[1, 1], loss_mask=[0, 0], task_score=0.0, rule_reward=0.0,
                     calls=0, ended="length")}
    monkeypatch.setattr(train_ppo, "dp_sum", lambda tensor, mesh: tensor)
    cfg = config.Config(prompts_per_step=1, samples_per_prompt=2, micro_batch_size=2,
                        advantage_estimator="grpo", kl_coef=0.0, overlong_mask=True)
    batch = train_ppo.training_batch(every, cfg, OneRank(), 0, "cpu")
    batch = dataclasses.replace(batch, reward=batch.task_score, old_lp=batch.engine_lp)
    sums = train_ppo.UpdateSums(Counter(policy_loss=0.0), Counter(clipped_tokens=0),
                                Counter(grad_norm=0.0))
    metrics = train_ppo.step_metrics(batch, sums, cfg, mesh=None)
    assert metrics["clip_frac"] == 0.0 and rollout.episode_metrics(every.values())[
        "response_len_mean"] == 2.5
    assert metrics["mismatch_k3"] == 0.0 and metrics["reward_mean"] == 0.5
    values = torch.randn(batch.mask.shape)
    assert torch.equal(train_ppo.masked_whiten(values, batch.mask), torch.zeros_like(values))


# -----------------------------------------------------------------------------
# pass@k

@pytest.mark.parametrize("n, c, k", [(4, 0, 1), (4, 1, 1), (4, 1, 2), (5, 2, 3), (8, 3, 4),
                                     (8, 8, 4), (6, 5, 2)])
def test_pass_at_k_against_a_count_of_k_subsets(n, c, k):
    """The unbiased estimator equals the share of the C(n, k) subsets of k samples that hold a
    correct one, counted."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(samples, k))
    counted = sum(any(s) for s in subsets) / len(subsets)
    assert math.isclose(evaluation.pass_at_k(n, c, k), counted)


def test_validation_reports_greedy_accuracy_and_pass_at_k(one_rank):
    """3 prompts, 4 samples each at the training temperature from an engine whose answer is fixed
    by the seed; greedy (seed-less) answers '0'. pass@2 from each prompt's count of correct
    samples, by hand; the seeds are the same at every evaluation and no training step's."""
    task = rollout.ToyTask(seed=1)
    task.val = [("0+0=", "0"), ("1+0=", "1"), ("1+1=", "2")]
    engine = ScoredEngine()
    seeded = engine.generate
    engine.generate = lambda ids, seeds, budgets, t: (
        seeded(ids, seeds, budgets, t) if t else [([ord("0"), 256], [-0.1, -0.1])] * len(ids))
    cfg = config.Config(val_pass_k=2, val_samples=4, temperature=0.7, seed=1)
    out = evaluation.validation(engine, task, cfg)
    correct = []
    for i, (_, answer) in enumerate(task.val):
        digits = [str(rollout.sample_seed(1, -1, i, k) % 3) for k in range(4)]
        correct.append(sum(d == answer for d in digits))
    want = sum(evaluation.pass_at_k(4, c, 2) for c in correct) / 3
    assert out == pytest.approx({"val_accuracy": 1 / 3, "val_pass@2": want})
    assert 0 < want < 1, correct  # a case where pass@2 is neither all nor nothing
    assert evaluation.validation(engine, task, cfg) == out  # the same seeds each time


@pytest.fixture
def one_rank(monkeypatch):
    """A one-rank gloo process group (evaluation.validation's gather), released after the test."""
    from _dist import _free_port
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()
