"""How the loss is aggregated (issue 29): each loss_agg_mode by hand, the critic-free advantage
estimators (GRPO with and without the std, RLOO) by hand, clip-higher by hand, and every mode on
every mesh against the single process.

The mesh check runs the trainer's own update (train_ppo.update: the global counts, the
microbatches, the dp-summed gradients) on one fixed batch at (dp, cp, tp) = (1,1,1), (2,1,1),
(1,2,1) and (1,1,2), padded and packed, with lr = 0 so that every mode sees the same weights; the
losses and grad norms of every mode must equal the single process's to 1e-5."""
import dataclasses
import functools
import json
import os

import pytest
import torch

import config
import model_parallel
import train_ppo
from _dist import run_ranks
from extensions import gspo
from train_ppo import aggregate_loss, grpo_advantages, policy_loss, rloo_advantages

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# Two responses: 3 tokens with losses 1, 2, 3 and 1 token with loss 4 (0s are masked out).
LOSS = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])


@pytest.mark.parametrize("mode, alone, in_a_global_minibatch", [
    # this batch alone: 4 tokens, 2 sequences; then as part of a global minibatch of 10 tokens and
    # 4 sequences (the counts another rank or microbatch shares), constant norm 8
    ("token-mean", (1 + 2 + 3 + 4) / 4, 10 / 10),
    ("seq-mean-token-sum", (6 + 4) / 2, 10 / 4),
    ("seq-mean-token-mean", (6 / 3 + 4 / 1) / 2, (2 + 4) / 4),
    ("seq-mean-token-sum-norm", (6 + 4) / (2 * 8), 10 / (4 * 8)),
])
def test_each_mode_by_hand(mode, alone, in_a_global_minibatch):
    assert aggregate_loss(LOSS, MASK, mode, norm=8).item() == pytest.approx(alone)
    shared = aggregate_loss(LOSS, MASK, mode, num_tokens=torch.tensor(10.0), num_seqs=4, norm=8)
    assert shared.item() == pytest.approx(in_a_global_minibatch)


@pytest.mark.parametrize("mode", MODES)
def test_shares_of_the_global_minibatch_add_up(mode):
    """Row by row (two microbatches, or two dp ranks) with the global counts: the whole's loss."""
    whole = aggregate_loss(LOSS, MASK, mode, norm=8)
    parts = [aggregate_loss(LOSS[[b]], MASK[[b]], mode, num_tokens=MASK.sum(), num_seqs=2, norm=8)
             for b in range(2)]
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item())


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregate_loss(LOSS, MASK, "seq-mean")


def test_grpo_with_and_without_the_std_and_rloo_by_hand():
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])  # two prompts, K = 4
    # Dr. GRPO: minus the group mean (0.25, then 0.5), nothing divided
    no_std = grpo_advantages(scores, 4, norm_by_std=False)
    torch.testing.assert_close(no_std, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]))
    # GRPO: divided by the unbiased std, sqrt(0.75 / 3) = 0.5 and sqrt(1 / 3)
    std = grpo_advantages(scores, 4, eps=0.0)
    expected = torch.tensor([0.75 / 0.5, -0.25 / 0.5, -0.25 / 0.5, -0.25 / 0.5] + [0.5 * 3 ** 0.5,
                            0.5 * 3 ** 0.5, -0.5 * 3 ** 0.5, -0.5 * 3 ** 0.5])
    torch.testing.assert_close(std, expected)
    # RLOO: the baseline is the mean of the other three: (0 + 0 + 0) / 3 for the first response,
    # (1 + 0 + 0) / 3 for the second; in the second group (1 + 0 + 0) / 3 and (1 + 1 + 0) / 3
    rloo = rloo_advantages(scores, 4)
    third = 1 / 3
    torch.testing.assert_close(rloo, torch.tensor([1.0, -third, -third, -third,
                                                   1 - third, 1 - third, -2 * third, -2 * third]))


def test_clip_higher_by_hand():
    # (A, ratio), clip_ratio 0.2 below and clip_ratio_high 0.28 above:
    #   (+1, 1.25): between 1.2 and 1.28: unclipped with clip-higher, clipped at 1.2 when symmetric
    #   (+1, 1.30): above 1.28: clipped at 1.28 (-1.28)
    #   (-1, 0.85): between 0.8 and 1: unclipped either way (0.85)
    #   (-1, 0.75): below 0.8: the lower bound holds: clipped at 0.8
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    ratio = torch.tensor([[1.25, 1.30, 0.85, 0.75]])
    logp = ratio.log().requires_grad_()
    per_token, clipped = policy_loss(logp - torch.zeros(1, 4), adv, (0.2, 0.28))
    torch.testing.assert_close(per_token, torch.tensor([[-1.25, -1.28, 0.85, 0.80]]))
    assert clipped.tolist() == [[False, True, False, True]]
    per_token.sum().backward()
    # d(-A r)/d logp = -A r where unclipped, 0 where clipped
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.25, 0.0, 0.85, 0.0]]))
    symmetric, clipped = policy_loss(logp.detach() - torch.zeros(1, 4), adv, 0.2)
    torch.testing.assert_close(symmetric, torch.tensor([[-1.20, -1.20, 0.85, 0.80]]))
    assert clipped.tolist() == [[True, True, False, True]]


def test_gspo_by_hand():
    """GSPO's sequence ratio (policy_loss with the sequence mask), aggregated with
    seq-mean-token-mean, against the paper's objective written at the sequence level and
    differentiated by autograd, and against numbers worked out by hand. Three responses (A = +1,
    +1, -1), token log-ratios log(pi/pi_old) with means 0.1, 0.5 and 0 (padding's are ignored):
      1: s = e^0.1 = 1.105, inside [0.8, 1.2]: loss -s on each token; d/d logp_t = -s/3 / 3 rows
      2: s = e^0.5 = 1.649, clipped at 1.2: loss -1.2, no gradient
      3: s = 1, A < 0: loss +1 on each token; d/d logp_t = +1/4 / 3 rows"""
    old = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-1.0, -1.0, 0.0, 0.0], [-3.0, -1.0, -2.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    log_ratio = torch.tensor([[0.1, -0.1, 0.3, 5.0], [0.4, 0.6, 9.0, 9.0], [-0.02, 0.0, 0.04, -0.02]])
    adv = torch.tensor([[1.0], [1.0], [-1.0]]) * torch.ones(3, 4)
    logp = (old + log_ratio).requires_grad_()
    per_token, clipped = policy_loss(gspo.sequence_log_ratio(logp, old, mask), adv, (0.2, 0.2))
    e = torch.exp(torch.tensor(0.1)).item()
    torch.testing.assert_close(per_token * mask, torch.tensor([[-e, -e, -e, 0.0], [-1.2, -1.2, 0.0, 0.0],
                                                               [1.0, 1.0, 1.0, 1.0]]))
    assert (clipped * mask.bool()).tolist() == [[False] * 4, [True, True, False, False], [False] * 4]
    loss = aggregate_loss(per_token, mask, "seq-mean-token-mean")
    loss.backward()
    by_hand = torch.tensor([[-e / 9] * 3 + [0.0], [0.0] * 4, [1 / 12] * 4])
    torch.testing.assert_close(logp.grad, by_hand)
    # the paper's objective, sequence by sequence: mean_b max(-A_b s_b, -A_b clip(s_b, 0.8, 1.2))
    theirs = (old + log_ratio).requires_grad_()
    s = torch.exp(((theirs - old) * mask).sum(-1) / mask.sum(-1))  # (3,)
    a = adv[:, 0]
    objective = torch.maximum(-a * s, -a * s.clamp(0.8, 1.2)).mean()
    objective.backward()
    torch.testing.assert_close(loss, objective)
    torch.testing.assert_close(logp.grad, theirs.grad)
    # the token-level ratio on the same numbers differs (so the switch is seen)
    ppo, _ = policy_loss(logp.detach() - old, adv, (0.2, 0.2))
    assert not torch.allclose(aggregate_loss(ppo, mask, "seq-mean-token-mean"), objective)


def test_gspo_is_the_policy_loss_mode_the_update_runs():
    """policy_loss_terms with policy_loss_mode=gspo gives GSPO's loss in its own clip range."""
    cfg = config.Config(policy_loss_mode="gspo", gspo_clip_ratio=0.2, gspo_clip_ratio_high=0.2,
                        loss_agg_mode="seq-mean-token-mean", offpolicy_is="off")
    batch = train_ppo.make_batch([[1]] * 2, [[2, 3, 4], [5, 6]], pad_id=0)
    old = torch.tensor([[0.0, -1.0, -2.0, -0.5], [0.0, -1.0, -1.0, 0.0]])
    lp = old + torch.tensor([[0.0, 0.1, -0.1, 0.3], [0.0, 0.4, 0.6, 0.0]])
    batch = dataclasses.replace(batch, old_lp=old, advantages=batch.mask.clone(), ref_lp=old)
    idx = torch.arange(2)
    aggregate = functools.partial(aggregate_loss, mode=cfg.loss_agg_mode)
    terms, _ = train_ppo.policy_loss_terms(lp, None, batch, idx, aggregate, cfg)
    e = torch.exp(torch.tensor(0.1)).item()
    assert terms["policy_loss"].item() == pytest.approx((-e - 1.2) / 2)
    cfg.gspo_clip_ratio, cfg.gspo_clip_ratio_high = 3e-4, 4e-4  # the defaults: both clipped above
    terms, _ = train_ppo.policy_loss_terms(lp, None, batch, idx, aggregate, cfg)
    assert terms["policy_loss"].item() == pytest.approx(-(1 + 4e-4))
    cfg.policy_loss_mode = "ppo"  # the token-level ratio: another number
    terms, _ = train_ppo.policy_loss_terms(lp, None, batch, idx, aggregate, cfg)
    assert terms["policy_loss"].item() != pytest.approx(-(1 + 4e-4))


# ---- every mode on every mesh

MESHES = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)]  # (dp, cp, tp)
NAMES = ("policy_loss", "entropy_loss", "value_loss", "grad_norm", "critic_grad_norm")


def _batch(cfg, device):
    """The step's global batch, the same on every rank and mesh (seeded): prompts of 3-6 tokens,
    responses of 1-9, and made-up old/reference logprobs, advantages, values and returns."""
    g = torch.Generator().manual_seed(0)
    n = cfg.global_batch_size
    prompts = [torch.randint(0, 256, (int(torch.randint(3, 7, (), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    responses = [torch.randint(0, 256, (int(torch.randint(1, 10, (), generator=g)),), generator=g).tolist()
                 for _ in range(n)]
    batch = train_ppo.make_batch(prompts, responses, pad_id=257, device=device)
    shape = batch.ids.shape
    # logprobs near a random-init model's (log 1/262 = -5.6): ratios of e^(+-0.3), some clipped
    batch.old_lp = (-5.6 + 0.3 * torch.randn(shape, generator=g)) * batch.mask
    batch.ref_lp = (-5.6 + 0.3 * torch.randn(shape, generator=g)) * batch.mask
    batch.advantages = torch.randn(shape, generator=g) * batch.mask
    batch.values = torch.randn(shape, generator=g) * batch.mask
    batch.returns = torch.randn(shape, generator=g) * batch.mask
    return batch


def _dp_summed(shares, mesh):
    """{name: this rank's share} -> {name: the sum over dp}, as floats."""
    column = torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in shares.values()])
    torch.distributed.all_reduce(column, group=mesh["dp"].get_group())
    return dict(zip(shares, column.tolist()))


def _mesh_body(rank, world_size, model_dir, dp, cp, tp, out):
    cfg = config.Config(prompts_per_step=4, samples_per_prompt=2, num_minibatches=2, micro_batch_size=1,
                        max_tokens_per_microbatch=32, tp_size=tp, cp_size=cp, lr=0.0, critic_lr=0.0,
                        entropy_coef=0.01, max_new_tokens=9, attention="masked", dtype="fp32",
                        rollout_engine="hf", out_dir=os.path.dirname(out))
    mesh = model_parallel.make_mesh(world_size, tp, cp, "cpu")
    parts = train_ppo.build_models(model_dir, cfg, mesh).parts
    whole = _batch(cfg, "cpu")
    rows = train_ppo.balanced_split(whole.lens, cfg.num_minibatches, dp)[mesh["dp"].get_local_rank()]
    batch = train_ppo.make_batch([[0]] * len(rows), [[0]] * len(rows), 257)  # the fields are replaced
    batch.ids, batch.mask, batch.lens = whole.ids[rows], whole.mask[rows], [whole.lens[i] for i in rows]
    for field in ("old_lp", "ref_lp", "advantages", "values", "returns", "engine_lp", "weight"):
        setattr(batch, field, getattr(whole, field)[rows])
    batch.unscored = min(whole.unscored, batch.unscored)
    results = {}
    for packing in (False, True):
        for mode in MODES + ("gspo",):
            # gspo: the sequence's ratio (its sequence means under packing, cp and dp), clipped
            # where these made-up ratios leave some sequences inside the range
            cfg.packing, cfg.policy_loss_mode = packing, "gspo" if mode == "gspo" else "ppo"
            cfg.loss_agg_mode = "seq-mean-token-mean" if mode == "gspo" else mode
            cfg.gspo_clip_ratio = cfg.gspo_clip_ratio_high = 0.2
            losses, _, norms = train_ppo.update(parts, batch, cfg, mesh)
            numbers = {**_dp_summed(losses, mesh), **norms}  # the norms are global already
            steps = cfg.ppo_epochs * cfg.num_minibatches
            results[f"{mode} {'packed' if packing else 'padded'}"] = {
                name: float(numbers[name]) / steps for name in NAMES}
    if world_size == 1:  # issue 34: the config's switches reach the update (checked below)
        cfg.packing, cfg.loss_agg_mode, cfg.policy_loss_mode = False, "seq-mean-token-sum-norm", "ppo"
        switches = {}
        runs = (("norm 0", dict(loss_agg_norm=0)), ("norm 3", dict(loss_agg_norm=3)),
                ("symmetric", dict(loss_agg_norm=0)), ("clip-higher", dict(clip_ratio_high=0.28)))
        for label, overrides in runs:
            for key, value in overrides.items():
                setattr(cfg, key, value)
            losses, counts, _ = train_ppo.update(parts, batch, cfg, mesh)
            summed = _dp_summed({**losses, **counts}, mesh)
            switches[label] = dict(policy_loss=summed["policy_loss"], clipped=summed["clipped_tokens"])
        results["switches"] = switches
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    model_parallel.release_mesh(mesh)


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("losses"))
    model_dir = model_parallel.materialize_tiny_model("tiny-llama", root, seed=0)
    out = os.path.join(root, "111.json")
    run_ranks(_mesh_body, 1, model_dir, 1, 1, 1, out)
    with open(out) as f:
        return model_dir, json.load(f)


def _two_rank_meshes_body(rank, world_size, model_dir, root):
    """The three 2-rank meshes in one spawn (starting ranks is most of a spawn's time)."""
    for dp, cp, tp in MESHES[1:]:
        _mesh_body(rank, world_size, model_dir, dp, cp, tp, os.path.join(root, f"{dp}{cp}{tp}.json"))


@pytest.fixture(scope="module")
def two_rank_meshes(single_process, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("meshes"))
    run_ranks(_two_rank_meshes_body, 2, single_process[0], root)
    return root


@pytest.mark.parametrize("dp, cp, tp", MESHES[1:], ids=[f"dp{d}cp{c}tp{t}" for d, c, t in MESHES[1:]])
def test_every_mode_is_mesh_invariant(single_process, two_rank_meshes, dp, cp, tp):
    _, reference = single_process
    with open(os.path.join(two_rank_meshes, f"{dp}{cp}{tp}.json")) as f:
        results = json.load(f)
    reference = {case: r for case, r in reference.items() if case != "switches"}
    # the modes differ from each other, so the check can tell them apart (GSPO from the same
    # aggregation with the token's ratio too)
    assert len({round(r["policy_loss"], 6) for r in reference.values()}) >= 5
    gspo, token = reference["gspo padded"], reference["seq-mean-token-mean padded"]
    assert abs(gspo["policy_loss"] - token["policy_loss"]) > 1e-4
    for case, expected in reference.items():
        for name in NAMES:
            got, want = results[case][name], expected[name]
            assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (case, name, got, want)


def test_the_configs_switches_reach_the_update(single_process):
    """Issue 34: loss_agg_norm and clip_ratio_high were tested on the pure functions alone, so
    removing `cfg.loss_agg_norm or` or `cfg.clip_ratio_high or None` from the trainer failed no
    test. Through train_ppo.update (lr 0, the same batch): seq-mean-token-sum-norm divides each
    response's token sum by loss_agg_norm, or by max_new_tokens (9) when it is 0, so 3 gives
    exactly 3 times the loss of 0; clip-higher at 0.28 clips fewer tokens than the symmetric 0.2
    (ratios up to e^0.3 = 1.35 here) and changes the loss."""
    switches = single_process[1]["switches"]
    norm_3, norm_0 = switches["norm 3"]["policy_loss"], switches["norm 0"]["policy_loss"]
    assert norm_3 == pytest.approx(3 * norm_0, rel=1e-5) and norm_0 != 0
    higher, symmetric = switches["clip-higher"], switches["symmetric"]
    assert 0 < higher["clipped"] < symmetric["clipped"], switches
    assert higher["policy_loss"] != pytest.approx(symmetric["policy_loss"], rel=1e-4)


def test_the_estimator_switches_reach_compute_advantages():
    """Issue 34: the trainer's compute_advantages with grpo_norm_by_std=false (Dr. GRPO: the group
    mean subtracted, nothing divided) and with advantage_estimator=rloo, by hand: 2 prompts x 4
    samples, every response token of a row gets its row's number."""
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])  # global, prompt-major
    batch = train_ppo.make_batch([[1, 2]] * 8, [[3, 4, 5]] * 8, pad_id=0)
    batch.old_lp = batch.ref_lp = batch.engine_lp
    batch.index = list(range(8))
    # group 0: mean 1/4; group 1: mean 3/4. RLOO: K/(K-1) (s - mean) = 4/3 (s - mean)
    dr_grpo = [0.75, -0.25, -0.25, -0.25, 0.25, 0.25, -0.75, 0.25]
    by_hand = {("grpo", False): dr_grpo, ("rloo", True): [4 / 3 * a for a in dr_grpo]}
    for (estimator, norm_by_std), want in by_hand.items():
        cfg = config.Config(prompts_per_step=2, samples_per_prompt=4, advantage_estimator=estimator,
                            grpo_norm_by_std=norm_by_std)
        advantages, _ = train_ppo.compute_advantages(batch, scores, cfg, mesh=None)
        expected = torch.tensor([[0.0, 0.0] + [a] * 3 for a in want])
        torch.testing.assert_close(advantages, expected, atol=1e-6, rtol=0)


# ---- the update's split over dp ranks (issue 28)

def test_balanced_split_by_hand():
    """Longest first, each to the lighter rank with room: 10 -> r0, 9 -> r1, 8 -> r1, 7 -> r0,
    4 -> r0, 3 -> r1, 2 -> r1 (full), 1 -> r0: 22 tokens each, where contiguous slices give 34
    and 10."""
    assert train_ppo.balanced_split([10, 9, 8, 7, 1, 2, 3, 4], 1, 2) == [[0, 3, 4, 7], [1, 2, 5, 6]]


class _DpDim:
    """A mesh's dp dimension as training_batch reads it: 2 ranks, this one `rank`."""

    def __init__(self, rank):
        self.rank = rank

    def size(self):
        return 2

    def get_local_rank(self):
        return self.rank


def test_the_trainer_deals_its_rows_with_balanced_split():
    """Issue 34: the tests above split rows themselves; this is the trainer's own training_batch.
    The hand case above as samples (one prompt token, then the rest): 22 tokens on each rank, where
    contiguous slices would give 34 and 10."""
    lengths = [10, 9, 8, 7, 1, 2, 3, 4]
    every = {j: dict(prompt_ids=[1], response_ids=[2] * (n - 1), engine_logprobs=[0.0] * (n - 1),
                     action_mask=[1] * (n - 1), loss_mask=[1] * (n - 1), task_score=0.0,
                     rule_reward=0.0)
             for j, n in enumerate(lengths)}
    cfg = config.Config(prompts_per_step=4, samples_per_prompt=2, num_minibatches=1, packing=True)
    for rank, rows in enumerate([[0, 3, 4, 7], [1, 2, 5, 6]]):
        batch = train_ppo.training_batch(every, cfg, {"dp": _DpDim(rank)}, 257, "cpu")
        assert batch.index == rows and sum(batch.lens) == 22, (rank, batch.index, batch.lens)


def test_balanced_split_keeps_minibatches_and_evens_tokens():
    """A GSM8K-like step (bench/packing.py's lengths): 512 samples, 4 minibatches, 8 ranks, chunks
    of 4 as the trainer deals padded rows of micro_batch_size 8. Every minibatch keeps its samples
    and splits 16 to a rank; the busiest rank has at most 5% more tokens than the mean (contiguous
    slices: ~15% more)."""
    import random
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))
    from packing import gsm8k_lengths
    lengths = gsm8k_lengths(random.Random(0), 512)
    split = train_ppo.balanced_split(lengths, 4, 8, chunk=4)
    for m in range(4):
        shares = [rows[m * 16:(m + 1) * 16] for rows in split]
        assert sorted(j for share in shares for j in share) == list(range(m * 128, (m + 1) * 128))
        tokens = [sum(lengths[j] for j in share) for share in shares]
        assert max(tokens) <= 1.05 * sum(tokens) / 8, tokens
