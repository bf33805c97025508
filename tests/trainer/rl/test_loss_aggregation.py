"""The GRPO loss aggregations by name (``loss_aggregation``), each against TRL's formulas.

TRL's ``GRPOTrainer`` (``loss_type``, https://huggingface.co/docs/trl/main/en/grpo_trainer),
with ``x`` the per-token loss and ``m`` the completion mask, ``[B, T]``:

* ``"grpo"``    — ``((x * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()``: per-sequence mean, then batch mean;
* ``"bnpo"``    — ``(x * m).sum() / m.sum().clamp(min=1)``: a token mean;
* ``"dr_grpo"`` — ``(x * m).sum() / (x.size(0) * max_completion_length)`` (Liu et al. 2025,
  https://arxiv.org/abs/2503.20783).

Ours: ``seq_mean`` = ``"grpo"``, ``token_mean`` = ``"bnpo"``, ``dr_grpo`` = ``"dr_grpo"``.
"""

from __future__ import annotations

import pytest
import torch

from opentinker_trainer.rl.grpo import (
    LOSS_AGGREGATIONS,
    GRPOBatch,
    aggregate,
    group_advantages,
    grpo_update,
    kl_k3,
    loss_normalizer,
    pg_loss,
)

from tests.trainer.rl.test_grpo_update import T, Config, TinyPolicy, chunks, logprobs_of, make_rows

nan = float("nan")

# A fixed [B=3, T=4] batch; masked-out positions hold NaN and a huge value (they must not count).
X = torch.tensor(
    [
        [1.0, 2.0, 3.0, nan],
        [4.0, 1e30, nan, nan],
        [-1.0, 0.5, 0.5, 2.0],
    ]
)
M = torch.tensor(
    [
        [True, True, True, False],
        [True, False, False, False],
        [True, True, True, True],
    ]
)
L = 6  # max_completion_length of dr_grpo (the sampler's max_new_tokens), > T

# The same numbers by hand: row sums 6, 4, 2; lengths 3, 1, 4; 8 tokens.
BY_HAND = {
    "token_mean": (6 + 4 + 2) / 8,
    "seq_mean": (6 / 3 + 4 / 1 + 2 / 4) / 3,
    "dr_grpo": (6 + 4 + 2) / (3 * L),
}


def trl(x: torch.Tensor, m: torch.Tensor, loss_type: str, max_completion_length: int) -> torch.Tensor:
    """TRL's formulas (see the module docstring), with NaN removed from the masked positions first."""
    m = m.float()
    x = torch.where(m.bool(), x, torch.zeros_like(x))
    if loss_type == "grpo":
        return ((x * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (x * m).sum() / m.sum().clamp(min=1.0)
    return (x * m).sum() / (x.size(0) * max_completion_length)


TRL_NAME = {"token_mean": "bnpo", "seq_mean": "grpo", "dr_grpo": "dr_grpo"}


def test_the_names_are_the_three_aggregations():
    assert LOSS_AGGREGATIONS == ("token_mean", "seq_mean", "dr_grpo")


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
def test_each_aggregation_is_trls_formula_on_a_fixed_batch(aggregation):
    got = aggregate(X, M, aggregation, max_completion_length=L)
    assert got.item() == pytest.approx(BY_HAND[aggregation], rel=1e-6)
    assert got.item() == pytest.approx(trl(X, M, TRL_NAME[aggregation], L).item(), rel=1e-6)


def test_dr_grpo_defaults_to_the_batch_width_and_its_normaliser_ignores_the_lengths():
    assert aggregate(X, M, "dr_grpo").item() == pytest.approx(12 / (3 * 4))
    shorter = M & (torch.arange(4) < 1)  # every completion one token long: same constant
    assert loss_normalizer(shorter, "dr_grpo", L).item() == loss_normalizer(M, "dr_grpo", L).item() == 3 * L


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
def test_micro_batches_with_the_batch_normaliser_add_up_to_the_batch(aggregation):
    n = loss_normalizer(M, aggregation, L)
    parts = sum(aggregate(X[sl], M[sl], aggregation, n) for sl in (slice(0, 1), slice(1, 3)))
    assert parts.item() == pytest.approx(BY_HAND[aggregation], rel=1e-6)


def test_seq_mean_leaves_out_rows_with_no_counted_token():
    m = M.clone()
    m[1] = False  # e.g. a row without a reward
    assert aggregate(X, m, "seq_mean").item() == pytest.approx((6 / 3 + 2 / 4) / 2)
    assert aggregate(X, torch.zeros_like(M), "seq_mean").item() == 0.0


def test_an_unknown_aggregation_is_refused():
    with pytest.raises(ValueError, match="token_mean, seq_mean, dr_grpo"):
        aggregate(X, M, "sum")
    with pytest.raises(ValueError, match="token_mean, seq_mean, dr_grpo"):
        loss_normalizer(M, "mean")


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
def test_pg_loss_on_policy_is_the_aggregation_of_minus_the_advantage(aggregation):
    logp = torch.log(torch.full((3, 4), 0.3))
    adv = torch.tensor([1.0, -2.0, 0.5])
    loss, _ = pg_loss(logp, logp, adv, M, aggregation=aggregation, max_completion_length=L)
    per_token = -adv.unsqueeze(1).expand(3, 4)
    assert loss.item() == pytest.approx(trl(per_token, M, TRL_NAME[aggregation], L).item(), rel=1e-6)


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
def test_grpo_update_aggregates_the_policy_loss_and_the_kl_term_alike(aggregation):
    context, completion, mask = make_rows(6)
    rewards = torch.tensor([[1.0, 0.0, 0.5], [0.0, nan, 1.0]])  # a missing reward: row 4 drops out
    logprobs = logprobs_of(context, completion)
    model, reference = TinyPolicy(), TinyPolicy(seed=7).requires_grad_(False)
    with torch.no_grad():
        logp, ref = logprobs(model, slice(0, 6)), logprobs(reference, slice(0, 6))
    adv, _ = group_advantages(rewards)
    # TRL's formulas on the rows with a reward (a missing reward's row is no row of the loss) ...
    kept = ~torch.isnan(rewards.flatten())
    per_token = -adv.flatten().unsqueeze(1).expand(6, T)
    want_policy = trl(per_token[kept], mask[kept], TRL_NAME[aggregation], 9)
    want_kl = trl(kl_k3(logp, ref)[kept], mask[kept], TRL_NAME[aggregation], 9)
    if aggregation == "dr_grpo":  # ... but Dr. GRPO's constant B * L counts every row of the batch
        want_policy, want_kl = want_policy * 5 / 6, want_kl * 5 / 6
    cfg = Config(kl_coef=0.1, loss_aggregation=aggregation, max_new_tokens=9)
    batch = GRPOBatch(rewards=rewards, mask=mask, chunks=chunks(6, 4))
    out = grpo_update(model, torch.optim.AdamW(model.parameters(), lr=0.05), batch, logprobs, cfg, reference=reference)
    assert out["loss/policy"] == pytest.approx(want_policy.item(), rel=1e-5, abs=1e-7)
    assert out["loss/kl"] == pytest.approx(want_kl.item(), rel=1e-5)
    assert out["loss/total"] == pytest.approx(out["loss/policy"] + 0.1 * out["loss/kl"])


def test_the_aggregations_give_different_steps():
    """The choice reaches the gradient: three aggregations, three different updates."""
    context, completion, mask = make_rows(6)
    rewards = torch.tensor([[1.0, 0.0, 0.5], [0.0, 0.2, 1.0]])
    logprobs = logprobs_of(context, completion)
    weights = []
    for aggregation in LOSS_AGGREGATIONS:
        model = TinyPolicy()
        batch = GRPOBatch(rewards=rewards, mask=mask, chunks=chunks(6, 6))
        cfg = Config(loss_aggregation=aggregation, max_grad_norm=1e6)
        grpo_update(model, torch.optim.SGD(model.parameters(), lr=1.0), batch, logprobs, cfg)
        weights.append(model.head.weight.detach().clone())
    assert not torch.allclose(weights[0], weights[1]) and not torch.allclose(weights[0], weights[2])
