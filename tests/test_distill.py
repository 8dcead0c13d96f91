"""On-policy distillation (docs/distillation.md): its two forms against an independent computation
of verl 0.9.1's (verl/trainer/distillation/losses.py with core_algos' kl_penalty, agg_loss and
vanilla policy loss, re-derived here from their source, not imported: verl needs its own stack),
on episodes with gapped action masks, in every loss_agg_mode, losses and gradients; the refusals;
no reference pass at kl_coef 0. The teacher's logprobs on every mesh, and equal to the reference's
when the teacher is the initial policy: test_e2e.py's replays."""
import dataclasses
import functools
import json
import os

import pytest
import torch

import config
import model_parallel
import train_ppo
from extensions import distill, offpolicy

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
EOS, NORM = 256, 8


def _batch(seed=0):
    """Three episodes, two with observations inside the response (mask gaps), right-padded; every
    number off the mask wild and finite (a loss that read it would differ from verl's, which
    multiplies by the mask). The teacher's logprob of one token is far below the student's, so
    that the clamp at +-10 acts."""
    g = torch.Generator().manual_seed(seed)
    prompts = [[5, 6, 7], [5, 6], [5, 6, 7, 8]]
    responses = [[1, 2, 40, 41, 3, 4, 5], [1, 2, 3], [1, 42, 2, 3, 43, 44, 45, 4, EOS]]
    masks = [[1, 1, 0, 0, 1, 1, 1], [1, 1, 1], [1, 0, 1, 1, 0, 0, 0, 1, 1]]
    batch = train_ppo.make_batch(prompts, responses, 0, action_masks=masks)
    shape, on = batch.ids.shape, batch.mask.bool()

    def spread(x, off):
        return torch.where(on, x, torch.full(shape, off))
    old = spread(-1.5 + 0.5 * torch.randn(shape, generator=g), -7.0)
    teacher = spread(-1.5 + torch.randn(shape, generator=g), 4.0)
    teacher[0, 4] = -15.0  # a response token (row 0's first after its prompt of 3): |d| > 10
    assert on[0, 4]
    engine = spread(old + 0.2 * torch.randn(shape, generator=g), 2.0)
    return dataclasses.replace(batch, old_lp=old, extra={"teacher_lp": teacher}, engine_lp=engine,
                               advantages=torch.zeros(shape), index=[0, 1, 2])


# ---- verl 0.9.1, re-derived --------------------------------------------------------------
def verl_kl_penalty(logprob, ref_logprob, mode):  # core_algos.kl_penalty
    if mode == "k1":
        return logprob - ref_logprob
    if mode == "k2":
        return 0.5 * (logprob - ref_logprob).square()
    kl = (ref_logprob - logprob).clamp(min=-20, max=20)  # "low_var_kl" = k3
    return (torch.exp(kl) - kl - 1).clamp(min=-10, max=10)


def verl_agg_loss(loss_mat, loss_mask, mode):  # core_algos.agg_loss, one rank = the global batch
    masked = loss_mat * loss_mask
    if mode == "token-mean":
        return masked.sum() / loss_mask.sum()
    seq_sums = masked.sum(-1)
    if mode == "seq-mean-token-mean":
        return (seq_sums / loss_mask.sum(-1)).mean()
    if mode == "seq-mean-token-sum":
        return seq_sums.mean()
    return seq_sums.sum() / (loss_mask.shape[0] * NORM)  # seq-mean-token-sum-norm


def verl_vanilla(old_log_prob, log_prob, advantages, clip_low, clip_high, clip_ratio_c=3.0):
    """compute_policy_loss_vanilla's per-token loss, dual clip included."""
    ratio = torch.exp((log_prob - old_log_prob).clamp(min=-20.0, max=20.0))
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    return torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)


def verl_distillation(lp, batch, form, estimator, mode, coef, current_pi=False, tis=None):
    """verl's distillation_loss times distillation_loss_coef. The reward form with the sampling
    policy's estimate as advantages (Thinking Machines'; ours), or with verl's own choice, the
    current policy's detached (current_pi=True)."""
    mask, teacher = batch.mask, batch.extra["teacher_lp"]
    if form == "loss":
        losses = verl_kl_penalty(lp, teacher, estimator).clamp(min=-10.0, max=10.0)
        return coef * verl_agg_loss(losses, mask, mode)
    pi = lp.detach() if current_pi else batch.old_lp
    losses = verl_kl_penalty(pi, teacher, estimator).clamp(min=-10.0, max=10.0)
    per_token = verl_vanilla(batch.old_lp, lp, -losses.detach(), 0.2, 0.2)
    if tis is not None:  # rollout_is_weights
        per_token = per_token * tis
    return coef * verl_agg_loss(per_token, mask, mode)


def ours(lp, batch, cfg):
    if cfg.offpolicy_is != "off":  # the correction's weights, as ppo_step gives them (offpolicy.weigh)
        batch = dataclasses.replace(batch, weight=offpolicy.offpolicy_weights(batch, slice(None), cfg))
    aggregate = functools.partial(train_ppo.aggregate_loss, mode=cfg.loss_agg_mode,
                                  num_tokens=batch.mask.sum(), num_seqs=3, norm=NORM)
    terms, _ = train_ppo.policy_loss_terms(lp, None, batch, torch.arange(3), aggregate, cfg)
    return terms


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("form, estimator", [("reward", "k1"), ("reward", "k3"), ("loss", "k3"),
                                             ("loss", "k2")])
def test_both_forms_equal_verls_in_every_loss_mode(form, estimator, mode):
    """The distillation term and its gradient w.r.t. the student's logprobs: verl's, on gapped
    masks, with the clamp acting on one token; the reward form with TIS (offpolicy_is=token, bound
    1.5). The term joins the task's policy_loss as verl's sum of losses; distill_task=false leaves
    it alone."""
    batch = _batch()
    cfg = config.Config(teacher="dir", distill_form=form, distill_estimator=estimator,
                        distill_coef=0.7, loss_agg_mode=mode, offpolicy_is="token",
                        offpolicy_is_bound=1.5, kl_coef=0.0,
                        advantage_estimator="grpo", samples_per_prompt=3)
    g = torch.Generator().manual_seed(1)
    moved = batch.old_lp + 0.3 * torch.randn(batch.old_lp.shape, generator=g)  # pi != pi_old
    batch = dataclasses.replace(batch, advantages=torch.randn(moved.shape, generator=g))
    tis = torch.exp(batch.old_lp - batch.engine_lp).clamp(max=1.5)
    for lp_value in (moved, batch.old_lp):
        lp = lp_value.clone().requires_grad_()
        terms = ours(lp, batch, cfg)
        assert list(terms) == ["policy_loss", "distill_loss"]
        (grad,) = torch.autograd.grad(terms["distill_loss"], lp)
        ref_lp = lp_value.clone().requires_grad_()
        expected = verl_distillation(ref_lp, batch, form, estimator, mode, 0.7, tis=tis)
        (expected_grad,) = torch.autograd.grad(expected, ref_lp)
        torch.testing.assert_close(terms["distill_loss"], expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)
        assert grad.abs().sum() > 0 and not grad[~batch.mask.bool()].any()
    # in an update's first minibatch (pi = pi_old) verl's own choice, the current pi, agrees
    if form == "reward":
        lp = batch.old_lp.clone().requires_grad_()
        verl_own = verl_distillation(lp, batch, form, estimator, mode, 0.7, current_pi=True, tis=tis)
        torch.testing.assert_close(ours(lp, batch, cfg)["distill_loss"], verl_own)
    pure = ours(batch.old_lp.clone(), batch, dataclasses.replace(cfg, distill_task=False))
    assert list(pure) == ["distill_loss"]


def test_the_clamp_acts_and_can_be_turned_off():
    """One token's k2 estimate is (13.5)^2 / 2 = 91: clamped to 10 by default, whole with
    distill_clamp=0."""
    batch = _batch()
    cfg = config.Config(teacher="dir", distill_form="loss", distill_estimator="k2",
                        loss_agg_mode="seq-mean-token-sum", kl_coef=0.0)
    lp = batch.old_lp.clone()
    clamped = ours(lp, batch, cfg)["distill_loss"]
    whole = ours(lp, batch, dataclasses.replace(cfg, distill_clamp=0.0))["distill_loss"]
    d = 0.5 * (lp[0, 4] - batch.extra["teacher_lp"][0, 4]) ** 2
    assert d > 90
    torch.testing.assert_close(whole - clamped, (d - 10.0) / 3)  # a sum per row, over 3 rows


@pytest.mark.parametrize("argv, match", [
    (["--teacher=/no/such/dir"], "teacher='/no/such/dir' is not a directory"),
    (["--teacher=.", "--distill_form=loss", "--distill_estimator=k1"],
     "distill_form=loss with distill_estimator=k1 trains nothing"),
    (["--teacher=.", "--distill_task=false"], "distill_task=false .* with advantage_estimator=gae"),
    (["--distill_task=false"], "distill_task=false needs a teacher"),
])
def test_bad_distillation_settings_are_one_line(argv, match):
    with pytest.raises(config.ConfigError, match=match) as info:
        config.validate(config.parse_args(argv), 1)
    assert "\n" not in str(info.value)


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path):
    """Token ids must mean the same tokens: a teacher dir whose tokenizer is not the policy's is
    one line (CheckpointError, start_run's "input error"); the same tokenizer passes, and so do two
    dirs that both rely on the task's own (the toy presets)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    policy = model_parallel.materialize_tiny_model("tiny-llama", str(tmp_path / "p"), seed=0)
    teacher = model_parallel.materialize_tiny_model("tiny-llama", str(tmp_path / "t"), seed=1)
    cfg = config.Config(teacher=teacher)
    distill.check_teacher(cfg, policy)  # both the toy task's tokenizer

    def save(path, vocab):
        fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, "a")))
        fast.save_pretrained(path)
    save(policy, {"a": 0, "b": 1, "c": 2})
    save(teacher, {"a": 0, "b": 1, "c": 2})
    distill.check_teacher(cfg, policy)
    save(teacher, {"a": 0, "c": 1, "b": 2})  # the same tokens, other ids
    with pytest.raises(model_parallel.CheckpointError, match="has another tokenizer") as info:
        distill.check_teacher(cfg, policy)
    assert "\n" not in str(info.value)
    with open(os.path.join(teacher, "config.json")) as f:
        assert json.load(f)["vocab_size"] == 262  # rows may differ from the ids; here they hold


def test_no_reference_pass_at_kl_coef_0(monkeypatch):
    """Nothing reads the reference at kl_coef 0: build_models keeps no copy of the initial weights
    (no snapshot), and no_grad_passes() runs no reference pass (no weight swap, no forward,
    ref_lp None); at kl_coef > 0 it does both (the check can fail)."""
    calls = []

    def forward_batch(forward, model, batch, cfg, mesh, **kwargs):
        calls.append("forward")
        return [torch.zeros(batch.ids.shape), None]

    class Swap:
        def __enter__(self):
            calls.append("swap")

        def __exit__(self, *args):
            return False
    monkeypatch.setattr(train_ppo, "forward_batch", forward_batch)
    monkeypatch.setattr(model_parallel, "load_policy", lambda *args, **kwargs: torch.nn.Linear(1, 1))
    monkeypatch.setattr(model_parallel, "snapshot_weights", lambda *args: calls.append("snapshot"))
    monkeypatch.setattr(model_parallel, "swapped_weights", lambda policy, snapshot: Swap())
    batch = _batch()
    for kl_coef, expected in ((0.0, ["forward"]), (0.1, ["snapshot", "forward", "swap", "forward"])):
        calls.clear()
        cfg = config.Config(kl_coef=kl_coef, advantage_estimator="grpo", samples_per_prompt=3)
        models = train_ppo.build_models("dir", cfg, None)
        old_lp, _, ref_lp, values = train_ppo.no_grad_passes(models, batch, cfg, None)
        assert calls == expected and values is None
        assert (ref_lp is None) == (kl_coef == 0)


def test_the_distill_demo_recipe_parses(tmp_path, monkeypatch):
    """`make distill-demo`'s training command (make -n prints it; its run is minutes, its code the
    replays' above): every flag one the trainer takes, the config valid at 2 ranks, a teacher and
    the loss form with k3."""
    import shlex
    import subprocess
    from conftest import ROOT
    out = subprocess.run(["make", "-n", "--no-print-directory", "distill-demo"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    # (without out/demo, make -n also prints the demo's own recipe first: its $(MAKE) line runs)
    line = next(line for line in out.replace("\\\n", " ").splitlines()
                if "torchrun" in line and "--teacher" in line)
    argv = shlex.split(line)
    argv = argv[argv.index("train_ppo.py") + 1:]
    monkeypatch.chdir(ROOT)
    cfg = config.parse_args(argv)
    assert (cfg.teacher, cfg.distill_form, cfg.distill_estimator) == ("out/demo/hf", "loss", "k3")
    assert cfg.model == "out/demo/sft" and cfg.sft_steps == 0
    cfg.teacher = cfg.model = cfg.out_dir = str(tmp_path)  # (nothing of the demo's is needed)
    config.validate(cfg, 2)
