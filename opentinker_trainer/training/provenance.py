"""The sampled sequences a session records for ``stable_reinforce``, and the provenance that names them.

Tinker's sampler records "stability information" for each sampled sequence when asked
(``record_stability_info``); a training datum then names the sequence behind each of its tokens,
its provenance (``Datum.with_provenance``, https://tinker-docs.thinkingmachines.ai/tinker/datum/).
A record here is the sequence's prompt, its sampled tokens and their ``sampling_logprobs``: the
log-probability of each token under the distribution that drew it (temperature, top-k, top-p
applied), as the sampler computed it.

Tinker keeps a recorded sequence for one day after sampling, and each training request that uses
it restarts that day. :class:`SequenceRecords` does the same (:data:`IDLE_S`), for this attempt
of the session only, and keeps the :data:`MAX_RECORDS` most recently used.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from opentinker_trainer.training.datums import Datum, Span
from opentinker_trainer.training.errors import BadRequest

__all__ = ["IDLE_S", "MAX_RECORDS", "Provenance", "Recorded", "SequenceRecords", "first_sampled"]

#: Seconds a recorded sequence is kept without a training request that names it (Tinker's day).
IDLE_S = 86_400.0
#: Recorded sequences kept at most; the least recently used go first.
MAX_RECORDS = 65_536


@dataclass(frozen=True)
class Recorded:
    """One sampled sequence: the prompt it continued, its tokens and their sampling log-probs."""

    prompt: Sequence[int]
    tokens: Sequence[int]
    sampling_logprobs: Sequence[float]


@dataclass(frozen=True)
class Provenance:
    """A datum resolved against the records: per target position, whether it is a sampled token
    and, where it is, the sampler's log-probability of it (0 elsewhere)."""

    sampled: list[float]
    sampling_logprobs: list[float]


def first_sampled(d: Datum) -> int:
    """The first target position that a sampled span covers (``len(d)`` if none)."""
    position = 0
    for span in d.loss_fn_input_spans:
        if span.sampled and span.length > 0:
            return position
        position += span.length
    return len(d)


class SequenceRecords:
    """Recorded sequences by id, each kept until ``idle_s`` seconds pass without use.

    Args:
        idle_s: seconds a record is kept after it was recorded or last named by a datum.
        max_records: records kept at most; recording more drops the least recently used.
        clock: monotonic seconds.
    """

    def __init__(
        self, *, idle_s: float = IDLE_S, max_records: int = MAX_RECORDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.idle_s = float(idle_s)
        self.max_records = int(max_records)
        self.clock = clock
        self._records: collections.OrderedDict[str, tuple[Recorded, float]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def check_new(self, ids: Sequence[str], n: int, where: str) -> None:
        """Raises :class:`BadRequest` unless ``ids`` are ``n`` distinct ids none of which is recorded."""
        if len(ids) != n:
            raise BadRequest(f"{where}: expected one id per sample ({n}), got {len(ids)}")
        for k, sequence_id in enumerate(ids):
            if not sequence_id:
                raise BadRequest(f"{where}[{k}]: expected a non-empty sequence id")
            if sequence_id in self._records or sequence_id in ids[:k]:
                raise BadRequest(f"{where}[{k}]: sequence {sequence_id!r} is already recorded; ids name one sample")

    def record(self, sequence_id: str, recorded: Recorded) -> None:
        """Keep ``recorded`` under ``sequence_id``."""
        self._records[sequence_id] = (recorded, self.clock())
        self._records.move_to_end(sequence_id)
        while len(self._records) > self.max_records:
            self._records.popitem(last=False)

    def _get(self, sequence_id: str, now: float) -> Recorded | None:
        entry = self._records.get(sequence_id)
        if entry is None:
            return None
        if now - entry[1] > self.idle_s:
            del self._records[sequence_id]
            return None
        return entry[0]

    def resolve(self, d: Datum, where: str) -> Provenance:
        """The :class:`Provenance` of datum ``d`` (``where`` names it: ``datums[3]``); restarts the
        idle time of every sequence it names.

        Raises:
            BadRequest: no provenance; spans that do not tile ``input_tokens`` or ``target_tokens``;
                a span naming a sequence not recorded (never, or no longer); a span past the end of
                its sequence's prompt or tokens, or whose tokens differ from the datum's; a non-zero
                advantage on a target that no sampled span covers.
        """
        n = len(d)
        if not d.loss_fn_input_spans or not d.model_input_spans:
            raise BadRequest(
                f"{where}.loss_fn_input_spans: stable_reinforce needs provenance on every datum "
                "(Datum.with_provenance, naming the sampled sequences), got none"
            )
        now = self.clock()
        used: dict[str, Recorded] = {}
        sampled = [0.0] * n
        logprobs = [0.0] * n
        for name, tokens in (("model_input_spans", d.input_tokens), ("loss_fn_input_spans", d.target_tokens)):
            spans = getattr(d, name)
            total = sum(max(s.length, 0) for s in spans)
            if total != n:
                raise BadRequest(
                    f"{where}.{name}: the spans cover {total} positions, the datum has {n}; they must tile it exactly"
                )
            position = 0
            for k, span in enumerate(spans):
                field = f"{where}.{name}[{k}]"
                recorded = used.get(span.sequence_id) or self._get(span.sequence_id, now)
                if recorded is None:
                    raise BadRequest(
                        f"{field}.sequence_id: no recorded sequence {span.sequence_id!r} in this session; sample "
                        "with record_stability_info=True and train within a day of the last use, on the same "
                        "session attempt"
                    )
                used[span.sequence_id] = recorded
                _check_span(span, field, recorded, tokens[position : position + span.length])
                if span.sampled and name == "loss_fn_input_spans":
                    for j in range(span.length):
                        sampled[position + j] = 1.0
                        logprobs[position + j] = float(recorded.sampling_logprobs[span.offset + j])
                position += span.length
        for t, (a, s) in enumerate(zip(d.advantages, sampled)):
            if a != 0 and not s:
                raise BadRequest(
                    f"{where}.advantages[{t}]: stable_reinforce trains sampled tokens only; expected 0 on a target "
                    f"that no sampled span covers, got {a}"
                )
        for sequence_id in used:
            if sequence_id in self._records:
                self._records[sequence_id] = (used[sequence_id], now)
                self._records.move_to_end(sequence_id)
        return Provenance(sampled=sampled, sampling_logprobs=logprobs)


def _check_span(span: Span, field: str, recorded: Recorded, datum_tokens: Sequence[int]) -> None:
    if span.offset < 0 or span.length < 0:
        raise BadRequest(f"{field}: expected offset and length >= 0, got {span.offset} and {span.length}")
    source = recorded.tokens if span.sampled else recorded.prompt
    what = "sampled tokens" if span.sampled else "prompt"
    if span.offset + span.length > len(source):
        raise BadRequest(
            f"{field}: positions [{span.offset}, {span.offset + span.length}) are past the end of sequence "
            f"{span.sequence_id!r}'s {what} ({len(source)} tokens)"
        )
    claimed = list(source[span.offset : span.offset + span.length])
    if claimed != list(datum_tokens):
        raise BadRequest(
            f"{field}: the datum's tokens there are not positions [{span.offset}, {span.offset + span.length}) "
            f"of sequence {span.sequence_id!r}'s {what}"
        )
