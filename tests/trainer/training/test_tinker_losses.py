"""Each loss of the session against Tinker's formula, written out here in plain torch as Tinker's
loss docs give it (tinker-docs.thinkingmachines.ai/tinker/losses): the per-datum loss and the
gradient of the adapter, on a fixed batch of a tiny Llama, to 1e-5. The batch shares its prompt
across datums, so the session's shared-prefix path runs too; the policy losses see ratios both
inside and outside their clip bounds."""

from __future__ import annotations

import pytest
import torch

from opentinker_trainer.training.datums import Datum
from opentinker_trainer.training.errors import BadRequest

from tests.trainer.training.test_training_session import grads, new_session, reference_grads

PROMPT = [41, 300, 77, 12, 250]
#: Offsets of the sampler's log-probs from the model's: ratios from e^-0.6 to e^0.7.
SHIFTS = [-0.6, 0.05, 0.3, -0.1, 0.7, -0.25, 0.15, 0.0]


def tinker_loss(name: str, d: Datum, logp: torch.Tensor, config: dict) -> torch.Tensor:
    """Tinker's documented implementation of loss ``name`` on one datum."""
    target_logprobs = logp
    sampling_logprobs = torch.tensor(d.sampling_logprobs)
    advantages = torch.tensor(d.advantages)
    if name == "cross_entropy":
        return (-target_logprobs * torch.tensor(d.weights)).sum()
    if name == "importance_sampling":
        prob_ratio = torch.exp(target_logprobs - sampling_logprobs)
        return -(prob_ratio * advantages).sum()
    if name == "ppo":
        prob_ratio = torch.exp(target_logprobs - sampling_logprobs)
        clipped_ratio = torch.clamp(prob_ratio, config["clip_low_threshold"], config["clip_high_threshold"])
        return -torch.min(prob_ratio * advantages, clipped_ratio * advantages).sum()
    if name == "cispo":
        prob_ratio = torch.exp(target_logprobs - sampling_logprobs)
        clipped_ratio = torch.clamp(prob_ratio, config["clip_low_threshold"], config["clip_high_threshold"])
        return -(clipped_ratio.detach() * target_logprobs * advantages).sum()
    if name == "dro":
        quadratic_term = (target_logprobs - sampling_logprobs) ** 2
        return -(target_logprobs * advantages - 0.5 * config["beta"] * quadratic_term).sum()
    if name == "gspo":
        in_ratio = torch.tensor(d.sequence_ratio_mask) != 0
        log_ratio = (target_logprobs.detach() - sampling_logprobs)[in_ratio].mean()
        ratio = torch.exp(log_ratio + target_logprobs - target_logprobs.detach())
        clipped_ratio = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
        return -torch.min(ratio * advantages, clipped_ratio * advantages).sum()
    raise AssertionError(name)


@pytest.fixture(scope="module")
def session(tiny_model_dir, tmp_path_factory):
    return new_session(tiny_model_dir, tmp_path_factory.mktemp("tinker"), "tinker")


def fixed_batch(session) -> list[Datum]:
    """Four next-token datums on one prompt: advantages 0 on the prompt, of both signs on the
    completion; sampler log-probs offset from the model's by :data:`SHIFTS`; weights of both signs."""
    seqs = [PROMPT + [(31 * i + 11 * t) % 400 + 20 for t in range(4 + i % 2)] for i in range(4)]
    plain = [Datum(s[:-1], s[1:]) for s in seqs]
    logp = session.forward(plain)
    out = []
    for i, (d, lp) in enumerate(zip(plain, logp)):
        n, start = len(d.input_tokens), len(PROMPT) - 1
        adv = [0.0] * start + [(1.5 - i) * (1 + 0.1 * t) for t in range(n - start)]
        out.append(
            Datum(
                d.input_tokens,
                d.target_tokens,
                weights=[(-1.0) ** t * (0.2 + 0.1 * t) for t in range(n)],
                advantages=adv,
                sampling_logprobs=[x - SHIFTS[(t + i) % len(SHIFTS)] for t, x in enumerate(lp)],
                sequence_ratio_mask=[0.0] * start + [1.0] * (n - start),
            )
        )
    return out


CASES = [
    ("cross_entropy", {}),
    ("importance_sampling", {}),
    ("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.3}),  # asymmetric
    ("cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 1.1}),
    ("dro", {"beta": 0.3}),
    ("gspo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05}),
    ("gspo", {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}),
]


@pytest.mark.parametrize(("loss_fn", "config"), CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_loss_value_and_gradient_are_tinkers(session, loss_fn, config) -> None:
    batch = fixed_batch(session)
    session.optimizer.zero_grad(set_to_none=True)
    session.accumulated_calls = 0
    out = session.forward_backward(batch, loss_fn, loss_fn_config=config)
    logp = session.forward(batch)
    for i, d in enumerate(batch):
        want = tinker_loss(loss_fn, d, torch.tensor(logp[i]), config)
        assert out.losses[i] == pytest.approx(float(want), rel=1e-5, abs=1e-5)
    assert out.metrics["loss:sum"] == pytest.approx(sum(out.losses), rel=1e-9)
    assert out.metrics["tokens:sum"] == sum(len(d.input_tokens) for d in batch)
    want = reference_grads(session, batch, lambda i, lp: tinker_loss(loss_fn, batch[i], lp, config))
    got = grads(session)
    assert any(float(w.abs().max()) > 1e-3 for w in want)  # a gradient worth comparing
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-5, rtol=1e-5), float((g - w).abs().max())
    session.optimizer.zero_grad(set_to_none=True)
    session.accumulated_calls = 0


def test_defaults_are_tinkers_and_clip_fraction_counts_clipped_ratios(session) -> None:
    batch = fixed_batch(session)
    logp = session.forward(batch)
    ratios = torch.cat([torch.exp(torch.tensor(lp) - torch.tensor(d.sampling_logprobs)) for d, lp in zip(batch, logp)])
    for loss_fn, default in [
        ("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
        ("cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
    ]:
        plain = session.forward_backward(batch, loss_fn)
        explicit = session.forward_backward(batch, loss_fn, loss_fn_config=default)
        assert plain.losses == explicit.losses
        outside = ((ratios < default["clip_low_threshold"]) | (ratios > default["clip_high_threshold"])).float()
        assert plain.metrics["clip_fraction:mean"] == pytest.approx(float(outside.mean()), abs=1e-6)
        assert plain.metrics["importance_ratio:mean"] == pytest.approx(float(ratios.mean()), rel=1e-5)
    assert 0 < session.forward_backward(batch, "ppo").metrics["clip_fraction:mean"] < 1
    session.optimizer.zero_grad(set_to_none=True)
    session.accumulated_calls = 0


def test_bad_loss_configs_are_refused_naming_the_field_with_nothing_accumulated(session) -> None:
    batch = fixed_batch(session)
    no_mask = [Datum(d.input_tokens, d.target_tokens, (), d.advantages, d.sampling_logprobs) for d in batch]
    zero_mask = [
        Datum(d.input_tokens, d.target_tokens, (), d.advantages, d.sampling_logprobs, [0.0] * len(d.input_tokens))
        for d in batch
    ]
    before = session.accumulated_calls
    cases = [
        (
            "ppo",
            {"clip_low_threshold": 1.1},
            r"loss_fn_config.clip_low_threshold: expected a ratio in \[0, 1\], got 1.1",
        ),
        ("ppo", {"clip_low_threshold": -0.1}, r"loss_fn_config.clip_low_threshold: expected a ratio in \[0, 1\]"),
        ("cispo", {"clip_high_threshold": 0.5}, r"loss_fn_config.clip_high_threshold: expected a ratio >= 1, got 0.5"),
        ("gspo", {"clip_high_threshold": float("inf")}, "loss_fn_config.clip_high_threshold: expected a finite number"),
        ("dro", {}, "loss_fn_config.beta: dro needs it"),
        ("dro", {"beta": -1.0}, r"loss_fn_config.beta: expected a number >= 0, got -1.0"),
        ("ppo", {"beta": 0.1}, r"loss_fn_config.beta: not read by ppo \(it reads clip_low_threshold, clip_high"),
        ("importance_sampling", {"clip_low_threshold": 0.5}, "not read by importance_sampling"),
        ("stable_reinforce", {}, "loss_fn: stable_reinforce is not supported: Tinker publishes no formula"),
    ]
    for loss_fn, config, message in cases:
        with pytest.raises(BadRequest, match=message):
            session.forward_backward(batch, loss_fn, loss_fn_config=config)
    with pytest.raises(BadRequest, match=r"datums\[0\].sequence_ratio_mask: expected 8 values"):
        session.forward_backward(no_mask, "gspo")
    with pytest.raises(BadRequest, match=r"datums\[0\].sequence_ratio_mask: expected at least one non-zero"):
        session.forward_backward(zero_mask, "gspo")
    assert session.accumulated_calls == before
