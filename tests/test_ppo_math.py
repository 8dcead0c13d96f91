"""The pure PPO functions of train_ppo.py against small cases computed by hand."""
import math

import pytest
import torch

from train_ppo import aggregate_loss, compute_gae, kl_penalty, masked_whiten, policy_loss, value_loss


def test_gae_skips_masked_gaps_and_ends_at_last_response_token():
    # Response tokens at 1, 2 and 4; position 3 is a gap (e.g. a tool's output), 5 padding.
    # Its reward and value must be ignored: 2's successor is 4. By hand, gamma=.9, lam=.8:
    #   t=4: delta = 1 + .9*0 - 3 = -2            A4 = -2
    #   t=2: delta = 0 + .9*3 - 2 = .7            A2 = .7 + .72*(-2) = -.74
    #   t=1: delta = .5 + .9*2 - 1 = 1.3          A1 = 1.3 + .72*(-.74) = .7672
    rewards = torch.tensor([[0.0, 0.5, 0.0, 9.0, 1.0, 4.0]])
    values = torch.tensor([[0.0, 1.0, 2.0, 5.0, 3.0, 7.0]])
    mask = torch.tensor([[0.0, 1, 1, 0, 1, 0]])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.7672, -0.74, 0.0, -2.0, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, 1.7672, 1.26, 0.0, 1.0, 0.0]]))


def test_gae_with_gamma_lam_one_is_reward_to_go_minus_value():
    # gamma = lam = 1: A_t = sum of rewards from t on - V_t (Monte Carlo advantage).
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0], [0.0, 0.3, -0.1, 2.0, 0.0]])
    values = torch.tensor([[0.0, 0.0, 0.2, 0.4, 0.6], [0.0, 1.0, 1.0, 1.0, 9.0]])
    mask = torch.tensor([[0.0, 0, 1, 1, 1], [0.0, 1, 1, 1, 0]])
    adv, _ = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    expected = torch.tensor([[0.0, 0.0, 0.8, 0.6, 0.4], [0.0, 2.2 - 1, 1.9 - 1, 2.0 - 1, 0.0]])
    torch.testing.assert_close(adv, expected)


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(math.log(2))
    # k3 with r = pi_ref / pi = 0.5: (r - 1) - log r = -0.5 + log 2
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(-0.5 + math.log(2))
    # k3 is never negative, k1 is when the policy is less likely than the reference
    assert kl_penalty(ref, logp, "k1").item() < 0 < kl_penalty(ref, logp, "k3").item()


def test_k3_is_clamped_as_verls_low_var_kl():
    """A collapsed token (log-ratio far from 0) must not give inf or NaN, in value or gradient:
    k3 is clamped to [0, 10]; inside the clamp it is unchanged."""
    log_ratio = torch.tensor([-100.0, -50.0, -3.0, 1.0, 50.0, 100.0], requires_grad=True)
    k3 = kl_penalty(log_ratio, torch.zeros(6), "k3")
    k3.sum().backward()
    assert torch.isfinite(k3).all() and torch.isfinite(log_ratio.grad).all()
    assert k3[:3].tolist() == [10.0, 10.0, 10.0]  # -3: e^3 - 1 - 3 = 16.1, past the clamp
    assert k3[3].item() == pytest.approx(math.exp(-1))  # (r - 1) - log r at r = e^-1: e^-1 - 1 + 1
    assert (k3[4:] >= 0).all() and (k3[4:] <= 10).all()  # 50: e^-50 - 1 + 50 = 49, clamped
    assert log_ratio.grad[[0, 1, 2, 4, 5]].tolist() == [0.0] * 5  # no gradient past the clamp


def test_dual_clip_by_hand():
    # (A, ratio) = (-1, 5) (-1, 2) (+1, 5) (-2, 4), eps = 0.2, c = 3:
    #   max(-A r, -A clip(r)):  5    2   -1.2   8
    #   cap -A c where A < 0:   3    3    -     6    ->  3, 2, -1.2, 6: tokens 0 and 3 dual-clipped
    # token 2 is clipped as usual; only token 1 keeps a gradient, d(-A r)/d logp = -A r = 2
    adv = torch.tensor([[-1.0, -1.0, 1.0, -2.0]])
    logp = torch.log(torch.tensor([[5.0, 2.0, 5.0, 4.0]])).requires_grad_()
    per_token, clipped = policy_loss(logp - torch.zeros(1, 4), adv, 0.2, clip_ratio_c=3.0)
    loss = per_token.mean()
    assert loss.item() == pytest.approx((3 + 2 - 1.2 + 6) / 4) and clipped.sum().item() == 3
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 2.0, 0.0, 0.0]]) / 4)
    plain, plain_clipped = policy_loss(logp - torch.zeros(1, 4), adv, 0.2)  # clip_ratio_c=0: off
    assert plain.mean().item() == pytest.approx((5 + 2 - 1.2 + 8) / 4) and plain_clipped.sum().item() == 1


def test_whiten_uses_only_masked_tokens():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # mean 2, unbiased variance ((1)+(0)+(1))/2 = 1
    torch.testing.assert_close(masked_whiten(x, mask), torch.tensor([[-1.0, 0.0, 1.0, 0.0]]),
                               atol=1e-6, rtol=0)
    y = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    std = math.sqrt(5 / 3)
    expected = torch.tensor([[-1.5, -0.5, 0.5, 1.5]]) / std
    torch.testing.assert_close(masked_whiten(y, torch.ones(1, 4)), expected)


def test_policy_loss_both_clipping_branches():
    # Four tokens: (A, ratio) = (+1, 1.5) (+1, 0.5) (-1, 1.5) (-1, 0.5), eps = 0.2.
    #   -A*r: -1.5 -0.5  1.5  0.5      -A*clip(r): -1.2 -0.8  1.2  0.8
    #   max:  -1.2 -0.5  1.5  0.8      (tokens 0 and 3 are clipped: no gradient)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.5, 0.5]])).requires_grad_()
    per_token, clipped = policy_loss(logp - old, adv, clip=0.2)
    loss = per_token.mean()
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.5 + 0.8) / 4)
    assert clipped.tolist() == [[True, False, False, True]]
    loss.backward()
    # d(-A r)/d logp = -A r on the unclipped tokens, divided by the 4 tokens
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5, 1.5, 0.0]]) / 4)


def test_token_mean_normalizes_by_the_given_global_token_count():
    adv, logp = torch.tensor([[0.0, 2.0]]), torch.zeros(1, 2)
    mask = torch.tensor([[0.0, 1.0]])
    per_token, _ = policy_loss(logp - logp, adv, 0.2)
    loss = aggregate_loss(per_token, mask, num_tokens=torch.tensor(4.0))
    assert loss.item() == pytest.approx(-2.0 / 4)  # one token of -A*1, over 4 global tokens


def test_value_loss_both_clipping_branches():
    # old V = 1, c = 0.2.  (V, R) = (1.5, 2): max(.25, (1.2-2)^2=.64) = .64 -> clipped branch
    #                      (0.9, 2): |V - old| < c, both 1.21
    #                      (1.5, 1.3): max(.04, (1.2-1.3)^2=.01) = .04 -> unclipped branch
    v = torch.tensor([[1.5, 0.9, 1.5]], requires_grad=True)
    old, ret = torch.ones(1, 3), torch.tensor([[2.0, 2.0, 1.3]])
    loss = value_loss(v, old, ret, value_clip=0.2).mean()
    assert loss.item() == pytest.approx(0.5 * (0.64 + 1.21 + 0.04) / 3)
    loss.backward()
    # clipped token: no gradient; others: (V - R) / 3
    torch.testing.assert_close(v.grad, torch.tensor([[0.0, -1.1, 0.2]]) / 3)
    plain = value_loss(v, old, ret, value_clip=0.0).mean()
    assert plain.item() == pytest.approx(0.5 * (0.25 + 1.21 + 0.04) / 3)

