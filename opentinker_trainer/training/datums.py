"""A batch of datums and its checks.

A datum is one sequence: ``input_tokens`` (``N`` ids) and, per position ``t``, the token the
model should predict there (``target_tokens[t]``), with the loss's per-token inputs (``weights``
for ``cross_entropy``; ``advantages`` and ``sampling_logprobs`` for the policy losses;
``sequence_ratio_mask`` for ``gspo``), each of length ``N``. Tinker's ``Datum`` (``model_input`` +
``loss_fn_inputs``) has the same layout; its ``logprobs`` input is ``sampling_logprobs``. Its
provenance, the :class:`Span` runs that tile ``input_tokens`` and ``target_tokens``, is what
``stable_reinforce`` reads (:mod:`.provenance`).

:func:`check_batch` refuses a bad batch before anything runs, naming the datum and the field
(:class:`~.errors.BadRequest`), or one over the session's bounds (:class:`~.errors.OverLimit`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from opentinker_trainer.training.errors import BadRequest, OverLimit

__all__ = ["LOSS_FNS", "Datum", "Limits", "Span", "check_batch", "check_count"]

#: Loss names, as the client writes them (Tinker's).
LOSS_FNS = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce")
_POLICY = ("advantages", "sampling_logprobs")
#: Fields each loss reads besides the tokens; ``weights`` may be empty (all 1).
_NEEDS = {
    "cross_entropy": (),
    "importance_sampling": _POLICY,
    "ppo": _POLICY,
    "cispo": _POLICY,
    "dro": _POLICY,
    "gspo": (*_POLICY, "sequence_ratio_mask"),
    "stable_reinforce": ("advantages",),
    "forward": (),
}
_PER_TOKEN = ("weights", "advantages", "sampling_logprobs", "sequence_ratio_mask")


@dataclass(frozen=True)
class Span:
    """``length`` consecutive datum tokens that are positions ``[offset, offset + length)`` of the
    recorded sequence ``sequence_id``: of its sampled tokens when ``sampled``, else of its prompt."""

    sequence_id: str
    offset: int
    length: int
    sampled: bool


@dataclass(frozen=True)
class Datum:
    """One sequence of a batch; every per-token field has ``len(input_tokens)`` values (or none)."""

    input_tokens: Sequence[int]
    target_tokens: Sequence[int]
    weights: Sequence[float] = field(default=())
    advantages: Sequence[float] = field(default=())
    sampling_logprobs: Sequence[float] = field(default=())
    sequence_ratio_mask: Sequence[float] = field(default=())
    model_input_spans: Sequence[Span] = field(default=())
    loss_fn_input_spans: Sequence[Span] = field(default=())

    def __len__(self) -> int:
        return len(self.input_tokens)


@dataclass(frozen=True)
class Limits:
    """Bounds per call (the ``lora_session`` hyper-parameters)."""

    max_datums_per_call: int = 1024
    max_tokens_per_call: int = 262_144
    max_in_flight_calls: int = 4


def check_count(datums: int, tokens: int, limits: Limits) -> None:
    """Raises :class:`OverLimit` when ``datums`` or ``tokens`` (input tokens so far) exceed the bounds."""
    if datums > limits.max_datums_per_call:
        raise OverLimit(f"datums: at most {limits.max_datums_per_call} per call (max_datums_per_call), got {datums}")
    if tokens > limits.max_tokens_per_call:
        raise OverLimit(
            f"datums: at most {limits.max_tokens_per_call} input tokens per call (max_tokens_per_call), got {tokens}"
        )


def check_batch(datums: Sequence[Datum], loss_fn: str, *, vocab_size: int, limits: Limits, context: int) -> None:
    """Check a batch for ``loss_fn`` (one of :data:`LOSS_FNS`, or ``"forward"``).

    Raises:
        BadRequest: no datums; an unknown loss; a datum with no tokens, more than ``context``
            tokens, a token id outside ``[0, vocab_size)``, a per-token field of another length
            than ``input_tokens``, a field its loss needs left empty, a non-finite value
            (``datums[3].advantages[7]: expected a finite number, got nan``), or a
            ``sequence_ratio_mask`` that marks no token.
        OverLimit: more datums or input tokens than ``limits`` allow.
    """
    if loss_fn not in _NEEDS:
        raise BadRequest(f"loss_fn: expected one of {', '.join(LOSS_FNS)}, got {loss_fn!r}")
    if not datums:
        raise BadRequest("datums: expected at least one datum, got an empty batch")
    check_count(len(datums), sum(len(d) for d in datums), limits)
    needs = _NEEDS[loss_fn]
    for i, d in enumerate(datums):
        n = len(d.input_tokens)
        where = f"datums[{i}]"
        if n == 0:
            raise BadRequest(f"{where}.input_tokens: expected at least one token, got none")
        if n > context:
            raise BadRequest(f"{where}.input_tokens: at most {context} tokens (the model's context), got {n}")
        per_token = {"target_tokens": d.target_tokens}
        if loss_fn != "forward":
            per_token.update({name: getattr(d, name) for name in _PER_TOKEN})
        for name, values in per_token.items():
            if name in needs or name == "target_tokens":
                if len(values) != n:
                    raise BadRequest(f"{where}.{name}: expected {n} values (one per input token), got {len(values)}")
            elif len(values) not in (0, n):
                raise BadRequest(
                    f"{where}.{name}: expected {n} values (one per input token) or none, got {len(values)}"
                )
        for name in ("input_tokens", "target_tokens"):
            for t, tok in enumerate(getattr(d, name)):
                if not 0 <= tok < vocab_size:
                    raise BadRequest(f"{where}.{name}[{t}]: expected a token id in [0, {vocab_size}), got {tok}")
        for name in ("weights", *needs):
            for t, v in enumerate(getattr(d, name)):
                if not math.isfinite(v):
                    raise BadRequest(f"{where}.{name}[{t}]: expected a finite number, got {v}")
        if "sequence_ratio_mask" in needs and not any(d.sequence_ratio_mask):
            raise BadRequest(f"{where}.sequence_ratio_mask: expected at least one non-zero value (a token to average)")
