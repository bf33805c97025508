"""GRPO estimators: advantages, masked means, the clipped surrogate, KL estimators."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opentinker_trainer.rl.grpo import (
    approx_kl_k3,
    clip_fraction,
    group_advantages,
    kl_k3,
    masked_mean,
    masked_sum,
    pg_loss,
    token_logprobs,
)

nan = float("nan")


# --- group_advantages ---------------------------------------------------------------------------


def test_advantages_are_standardised_within_each_group():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]])
    adv, zero_std = group_advantages(rewards)
    for row, r in zip(adv, rewards):
        expected = (r - r.mean()) / (r.std() + 1e-6)
        torch.testing.assert_close(row, expected)
    assert zero_std.tolist() == [False, False]
    torch.testing.assert_close(adv.sum(dim=1), torch.zeros(2), atol=1e-6, rtol=0)


def test_all_equal_groups_get_exactly_zero_advantage():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.1, 0.1, 0.1], [0.0, 1.0, 0.0]])
    adv, zero_std = group_advantages(rewards)
    assert zero_std.tolist() == [True, True, True, False]
    assert torch.equal(adv[:3], torch.zeros(3, 3))  # exactly, not approximately
    assert torch.isfinite(adv).all()


def test_unscaled_advantages_only_subtract_the_mean():
    rewards = torch.tensor([[4.0, 0.0, 2.0]])
    adv, _ = group_advantages(rewards, scale=False)
    torch.testing.assert_close(adv, torch.tensor([[2.0, -2.0, 0.0]]))


def test_nan_rewards_are_masked_out_of_group_statistics():
    rewards = torch.tensor([[1.0, nan, 0.0, 1.0], [nan, nan, nan, nan], [nan, 2.0, nan, nan], [nan, 1.0, 1.0, nan]])
    adv, zero_std = group_advantages(rewards)
    assert torch.isfinite(adv).all()
    valid = torch.tensor([1.0, 0.0, 1.0])
    expected = (valid - valid.mean()) / (valid.std() + 1e-6)
    torch.testing.assert_close(adv[0, [0, 2, 3]], expected)
    assert adv[0, 1] == 0.0
    # No valid reward, a single valid reward, equal valid rewards: no signal, all zeros.
    assert zero_std.tolist() == [False, True, True, True]
    assert torch.equal(adv[1:], torch.zeros(3, 4))


def test_group_advantages_refuses_a_flat_tensor():
    with pytest.raises(ValueError, match="num_groups, group_size"):
        group_advantages(torch.zeros(8))


# Rewards as environments give them: 0/1, small multiples of 1/4, and NaN for a missing one.
reward_values = st.one_of(st.sampled_from([0.0, 1.0, nan]), st.integers(-40, 40).map(lambda i: i / 4))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(reward_values, min_size=2, max_size=8), min_size=1, max_size=5))
def test_advantages_properties(rows):
    width = max(len(r) for r in rows)
    rewards = torch.tensor([r + [nan] * (width - len(r)) for r in rows], dtype=torch.float32)
    adv, zero_std = group_advantages(rewards)
    valid = ~torch.isnan(rewards)
    assert torch.isfinite(adv).all()
    assert (adv[~valid] == 0).all()
    for g in range(rewards.shape[0]):
        vals = rewards[g][valid[g]]
        distinct = vals.unique().numel()
        assert bool(zero_std[g]) == (distinct < 2)
        if zero_std[g]:
            assert (adv[g] == 0).all()
        else:
            # Centred: the valid advantages sum to ~0, and order is preserved.
            assert abs(adv[g][valid[g]].sum().item()) < 1e-3 * vals.numel()
            order_r = torch.argsort(vals, stable=True)
            assert (adv[g][valid[g]][order_r].diff() >= -1e-6).all()


# --- masked reductions --------------------------------------------------------------------------


def test_masked_mean_ignores_masked_values_even_nan_and_inf():
    values = torch.tensor([[1.0, 2.0, nan], [3.0, float("inf"), 5.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert masked_mean(values, mask).item() == pytest.approx(2.0)
    assert masked_sum(values, mask).item() == pytest.approx(6.0)
    torch.testing.assert_close(masked_mean(values, mask, dim=1), torch.tensor([1.5, 3.0]))


def test_masked_mean_of_nothing_is_zero():
    assert masked_mean(torch.tensor([nan, 1.0]), torch.tensor([False, False])).item() == 0.0


# --- token log-probs ------------------------------------------------------------------------------


def test_token_logprobs_match_log_softmax_gather():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    tokens = torch.randint(0, 11, (3, 5))
    expected = torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(token_logprobs(logits, tokens), expected)
    low = token_logprobs(logits.to(torch.bfloat16), tokens)
    assert low.dtype == torch.float32


# --- the clipped surrogate --------------------------------------------------------------------------


def _loss_at(ratio: float, advantage: float, eps: float = 0.2):
    old = torch.zeros(1, 1)
    logp = torch.full((1, 1), math.log(ratio), requires_grad=True)
    loss, stats = pg_loss(logp, old, torch.tensor([advantage]), torch.ones(1, 1, dtype=torch.bool), eps)
    loss.backward()
    return loss.item(), logp.grad.item(), stats


@pytest.mark.parametrize(
    "ratio, advantage, expected_loss, has_grad, clipped",
    [
        (1.0, 1.0, -1.0, True, False),
        (1.1, 1.0, -1.1, True, False),
        (1.5, 1.0, -1.2, False, True),  # A > 0: no credit beyond 1 + eps
        (0.5, 1.0, -0.5, True, False),  # A > 0, ratio dropped: unclipped (pessimistic) branch
        (0.5, -1.0, 0.8, False, True),  # A < 0: no push below 1 - eps
        (1.5, -1.0, 1.5, True, False),  # A < 0, ratio grew: unclipped, keeps the gradient
        (1.0, 0.0, 0.0, False, False),
    ],
)
def test_pg_loss_clipping(ratio, advantage, expected_loss, has_grad, clipped):
    loss, grad, stats = _loss_at(ratio, advantage)
    assert loss == pytest.approx(expected_loss, abs=1e-6)
    assert (abs(grad) > 0) == has_grad
    assert stats["clipfrac"].item() == (1.0 if clipped else 0.0)


def test_on_policy_gradient_is_minus_advantage_times_grad_logp():
    torch.manual_seed(0)
    logp = torch.randn(4, 3, requires_grad=True)
    adv = torch.tensor([1.0, -2.0, 0.5, 0.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]], dtype=torch.bool)
    loss, stats = pg_loss(logp, logp.detach(), adv, mask, 0.2)
    loss.backward()
    expected = torch.where(mask, -adv.unsqueeze(1) / mask.sum(), torch.zeros(()))
    torch.testing.assert_close(logp.grad, expected.expand_as(logp))
    assert stats["approx_kl"].item() == 0.0 and stats["clipfrac"].item() == 0.0
    assert loss.item() == pytest.approx(-(adv.unsqueeze(1) * mask).sum().item() / mask.sum().item())


def test_pg_loss_is_a_token_mean_and_ignores_masked_nan():
    logp = torch.tensor([[0.0, nan], [0.0, 0.0]])
    old = torch.zeros(2, 2)
    mask = torch.tensor([[True, False], [True, True]])
    loss, _ = pg_loss(logp, old, torch.tensor([3.0, 0.0]), mask)
    assert loss.item() == pytest.approx(-1.0)  # (-3 + 0 + 0) / 3 tokens
    loss_mb, _ = pg_loss(logp[:1], old[:1], torch.tensor([3.0]), mask[:1], normalizer=3.0)
    assert loss_mb.item() == pytest.approx(-1.0)  # micro-batch sums add up to the batch mean


def test_clip_fraction_counts_only_clipped_sides():
    ratio = torch.tensor([[1.5, 0.5, 1.5, 0.5]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    assert clip_fraction(ratio, adv, torch.ones(1, 4, dtype=torch.bool), 0.2).item() == 0.5


# --- KL estimators --------------------------------------------------------------------------------


def test_k3_is_nonnegative_zero_at_equality_and_unbiased():
    torch.manual_seed(0)
    p = torch.distributions.Categorical(logits=torch.randn(6))
    q = torch.distributions.Categorical(logits=torch.randn(6))
    x = p.sample((200_000,))
    est = kl_k3(p.log_prob(x), q.log_prob(x)).mean()
    exact = torch.distributions.kl_divergence(p, q)
    assert est.item() == pytest.approx(exact.item(), rel=0.05)
    assert (kl_k3(p.log_prob(x), q.log_prob(x)) >= 0).all()
    assert kl_k3(torch.tensor(0.3), torch.tensor(0.3)).item() == 0.0


def test_approx_kl_of_old_vs_new():
    torch.manual_seed(1)
    old = torch.distributions.Categorical(logits=torch.randn(5))
    new = torch.distributions.Categorical(logits=torch.randn(5))
    x = old.sample((200_000,)).unsqueeze(0)
    est = approx_kl_k3(new.log_prob(x), old.log_prob(x), torch.ones_like(x, dtype=torch.bool))
    exact = torch.distributions.kl_divergence(old, new)
    assert est.item() == pytest.approx(exact.item(), rel=0.05)
