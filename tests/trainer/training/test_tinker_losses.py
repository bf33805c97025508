"""Each loss of the session against Tinker's formula, written out here in plain torch as Tinker's
loss docs give it (tinker-docs.thinkingmachines.ai/tinker/losses): the per-datum loss and the
gradient of the adapter, on a fixed batch of a tiny Llama, to 1e-5. The batch shares its prompt
across datums, so the session's shared-prefix path runs too; the policy losses see ratios both
inside and outside their clip bounds."""

from __future__ import annotations

import math

import pytest
import torch

from opentinker_trainer.training.datums import Datum, Span
from opentinker_trainer.training.errors import BadRequest
from opentinker_trainer.training.losses import stable_reinforce
from opentinker_trainer.training.provenance import Recorded
from opentinker_trainer.training.session import SampleParams

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
    if name == "stable_reinforce":  # our reading (losses.py); d.sampling_logprobs hold the recorded ones here
        sampled = advantages != 0
        log_ratio = target_logprobs - sampling_logprobs
        ratio = torch.exp(log_ratio)
        weight = torch.clamp(ratio, max=1.0).detach()
        per_token = -weight * advantages * target_logprobs + config["kl_coeff"] * (ratio - 1 - log_ratio)
        return per_token[sampled].sum()
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


def recorded_batch(session) -> list[Datum]:
    """:func:`fixed_batch` as stable_reinforce datums: each completion recorded in the session as a
    sampled sequence whose sampling log-probs are the datum's, and provenance naming it. The
    datums' own ``sampling_logprobs`` (Tinker's ``logprobs`` input) are set off by 5 nats, so a
    loss that read them instead of the records would differ."""
    out = []
    for i, d in enumerate(fixed_batch(session)):
        sid = f"seq-{i}"
        start = len(PROMPT) - 1
        completion = list(d.target_tokens[start:])
        session.records.record(sid, Recorded(tuple(PROMPT), tuple(completion), tuple(d.sampling_logprobs[start:])))
        out.append(
            Datum(
                d.input_tokens,
                d.target_tokens,
                advantages=d.advantages,
                sampling_logprobs=[x - 5.0 for x in d.sampling_logprobs],
                model_input_spans=[Span(sid, 0, len(PROMPT), False), Span(sid, 0, len(completion) - 1, True)],
                loss_fn_input_spans=[Span(sid, 1, start, False), Span(sid, 0, len(completion), True)],
            )
        )
    return out


def test_stable_reinforce_on_two_tokens_by_hand() -> None:
    """logp (-1, -2), recorded q (-1.5, -1.8), A (1, -1), kl_coeff 0.1: r = (e^0.5, e^-0.2); the
    weights min(r, 1) are (1, e^-0.2); the loss is -(1)(1)(-1) - e^-0.2 (-1)(-2) + 0.1 (e^0.5 - 1.5
    + e^-0.2 - 0.8) and its gradient per logp -A w + 0.1 (r - 1)."""
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    loss = stable_reinforce(logp, torch.tensor([-1.5, -1.8]), torch.tensor([1.0, -1.0]), torch.ones(2), 0.1)
    e5, e2 = 1.6487212707, 0.8187307531
    assert float(loss.detach()) == pytest.approx(1.0 - 2.0 * e2 + 0.1 * (e5 - 1.5 + e2 - 0.8), rel=1e-6)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-1.0 + 0.1 * (e5 - 1), e2 + 0.1 * (e2 - 1)], rel=1e-6)
    unmarked = torch.tensor([-1.0, -2.0], requires_grad=True)
    zero = stable_reinforce(unmarked, torch.tensor([0.0, 0.0]), torch.zeros(2), torch.zeros(2), 0.1)
    zero.backward()
    assert float(zero.detach()) == 0.0 and unmarked.grad.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("kl_coeff", [0.0, 0.4])
def test_stable_reinforce_reads_the_recorded_logprobs_value_and_gradient(session, kl_coeff) -> None:
    batch = recorded_batch(session)
    config = {"kl_coeff": kl_coeff}
    session.optimizer.zero_grad(set_to_none=True)
    session.accumulated_calls = 0
    out = session.forward_backward(batch, "stable_reinforce", loss_fn_config=config)
    logp = session.forward(batch)
    recorded = fixed_batch(session)  # the same datums with the recorded log-probs as sampling_logprobs
    ratios = []
    for i, d in enumerate(recorded):
        want = tinker_loss("stable_reinforce", d, torch.tensor(logp[i]), config)
        assert out.losses[i] == pytest.approx(float(want), rel=1e-5, abs=1e-5)
        ratios += [1.0 if a == 0 else math.exp(lp - q) for lp, q, a in zip(logp[i], d.sampling_logprobs, d.advantages)]
    assert min(ratios) < 1 < max(ratios)  # the truncation at 1 is exercised
    assert out.metrics["importance_ratio:mean"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-5)
    want = reference_grads(session, recorded, lambda i, lp: tinker_loss("stable_reinforce", recorded[i], lp, config))
    for g, w in zip(grads(session), want):
        assert torch.allclose(g, w, atol=1e-5, rtol=1e-5), float((g - w).abs().max())
    session.optimizer.zero_grad(set_to_none=True)
    session.accumulated_calls = 0


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
        ("stable_reinforce", {"kl_coeff": -0.1}, r"loss_fn_config.kl_coeff: expected a number >= 0, got -0.1"),
        ("stable_reinforce", {"beta": 0.1}, r"loss_fn_config.beta: not read by stable_reinforce \(it reads kl_coeff"),
        ("stable_reinforce", {}, r"datums\[0\].loss_fn_input_spans: stable_reinforce needs provenance on every datum"),
    ]
    for loss_fn, config, message in cases:
        with pytest.raises(BadRequest, match=message):
            session.forward_backward(batch, loss_fn, loss_fn_config=config)
    with pytest.raises(BadRequest, match=r"datums\[0\].sequence_ratio_mask: expected 8 values"):
        session.forward_backward(no_mask, "gspo")
    with pytest.raises(BadRequest, match=r"datums\[0\].sequence_ratio_mask: expected at least one non-zero"):
        session.forward_backward(zero_mask, "gspo")
    assert session.accumulated_calls == before


def test_sample_snapshot_records_the_samples_it_returns_for_stable_reinforce(session) -> None:
    """At temperature 0.7 the record holds the log-probs the tokens were drawn with
    (sampling_logprobs), which a datum naming the sample then trains on; ids are not reused."""
    params = SampleParams(max_tokens=3, temperature=0.7, ignore_eos=True)
    (result,), _ = session.sample_snapshot([(PROMPT, 2, 7)], params, sampler=None, record=[["r-0", "r-1"]])
    data = []
    for sid, sample in zip(["r-0", "r-1"], result.samples):
        tokens = list(sample.tokens)
        seq = PROMPT + tokens
        d = Datum(
            seq[:-1],
            seq[1:],
            advantages=[0.0] * (len(PROMPT) - 1) + [1.0] * len(tokens),
            model_input_spans=[Span(sid, 0, len(PROMPT), False), Span(sid, 0, len(tokens) - 1, True)],
            loss_fn_input_spans=[Span(sid, 1, len(PROMPT) - 1, False), Span(sid, 0, len(tokens), True)],
        )
        got = session.records.resolve(d, "datums[0]")
        assert got.sampling_logprobs[len(PROMPT) - 1 :] == pytest.approx(list(sample.sampling_logprobs), abs=0)
        assert list(sample.sampling_logprobs) != pytest.approx(list(sample.logprobs), abs=1e-3)
        data.append(d)
    out = session.forward_backward(data, "stable_reinforce")
    assert all(math.isfinite(x) for x in out.losses)
    with pytest.raises(BadRequest, match=r"prompts\[0\].record_sequence_ids\[0\]: sequence 'r-0' is already recorded"):
        session.sample_snapshot([(PROMPT, 2, 7)], params, sampler=None, record=[["r-0", "r-2"]])
    session.optimizer.zero_grad(set_to_none=True)
    session.accumulated_calls = 0
