"""The sequences a session records for stable_reinforce, and a datum's provenance resolved against
them: the recorded log-probs land on the sampled targets, and each bad claim is refused naming the
field. The clock is a plain counter, so a day passes in one assignment."""

from __future__ import annotations

import pytest

from opentinker_trainer.training.datums import Datum, Span
from opentinker_trainer.training.errors import BadRequest
from opentinker_trainer.training.provenance import IDLE_S, Recorded, SequenceRecords, first_sampled

PROMPT = (7, 8, 9)
TOKENS = (20, 21, 22)
LOGPROBS = (-0.5, -1.5, -2.5)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def datum(sid: str = "s", *, advantages=(0.0, 0.0, 1.0, 1.0, 1.0), inputs=None, targets=None) -> Datum:
    """Prompt then completion: inputs 7 8 9 20 21, targets 8 9 20 21 22."""
    return Datum(
        input_tokens=[7, 8, 9, 20, 21],
        target_tokens=[8, 9, 20, 21, 22],
        advantages=list(advantages),
        model_input_spans=inputs if inputs is not None else [Span(sid, 0, 3, False), Span(sid, 0, 2, True)],
        loss_fn_input_spans=targets if targets is not None else [Span(sid, 1, 2, False), Span(sid, 0, 3, True)],
    )


@pytest.fixture
def records():
    clock = Clock()
    r = SequenceRecords(clock=clock)
    r.record("s", Recorded(PROMPT, TOKENS, LOGPROBS))
    return r


def test_recorded_logprobs_land_on_the_sampled_targets(records) -> None:
    got = records.resolve(datum(), "datums[0]")
    assert got.sampled == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert got.sampling_logprobs == [0.0, 0.0, -0.5, -1.5, -2.5]
    assert first_sampled(datum()) == 2


def test_a_sequence_is_kept_a_day_from_its_last_use(records) -> None:
    records.clock.now += IDLE_S - 1
    records.resolve(datum(), "datums[0]")  # used: its day starts again
    records.clock.now += IDLE_S - 1
    records.resolve(datum(), "datums[0]")
    records.clock.now += IDLE_S + 1
    with pytest.raises(BadRequest, match=r"datums\[0\].model_input_spans\[0\].sequence_id: no recorded sequence 's'"):
        records.resolve(datum(), "datums[0]")
    assert len(records) == 0


def test_the_least_recently_used_go_past_the_bound() -> None:
    records = SequenceRecords(max_records=2)
    for sid in ("a", "b", "c"):
        records.record(sid, Recorded(PROMPT, TOKENS, LOGPROBS))
    with pytest.raises(BadRequest, match="no recorded sequence 'a'"):
        records.resolve(datum("a"), "datums[0]")
    records.resolve(datum("b"), "datums[0]")


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (datum("nope"), r"datums\[2\].model_input_spans\[0\].sequence_id: no recorded sequence 'nope' in this session"),
        (datum(inputs=[]), r"datums\[2\].loss_fn_input_spans: stable_reinforce needs provenance on every datum"),
        (
            datum(inputs=[Span("s", 0, 3, False), Span("s", 0, 1, True)]),
            r"datums\[2\].model_input_spans: the spans cover 4 positions, the datum has 5; they must tile it exactly",
        ),
        (
            datum(targets=[Span("s", 1, 2, False), Span("s", 0, 3, True), Span("s", 0, 1, True)]),
            r"datums\[2\].loss_fn_input_spans: the spans cover 6 positions, the datum has 5",
        ),
        (
            datum(targets=[Span("s", 0, 2, False), Span("s", 0, 3, True)]),
            r"datums\[2\].loss_fn_input_spans\[0\]: the datum's tokens there are not positions \[0, 2\) of sequence "
            r"'s''s prompt",
        ),
        (
            datum(targets=[Span("s", 1, 2, False), Span("s", 1, 3, True)]),
            r"loss_fn_input_spans\[1\]: positions \[1, 4\) are past the end of sequence 's''s sampled tokens \(3",
        ),
        (
            datum(advantages=(0.0, 0.5, 1.0, 1.0, 1.0)),
            r"datums\[2\].advantages\[1\]: stable_reinforce trains sampled tokens only; expected 0 on a target that "
            r"no sampled span covers, got 0.5",
        ),
    ],
    ids=["unknown-id", "no-provenance", "input-not-tiled", "target-not-tiled", "other-tokens", "past-end", "adv"],
)
def test_bad_provenance_is_refused_naming_the_field(records, bad, message) -> None:
    with pytest.raises(BadRequest, match=message):
        records.resolve(bad, "datums[2]")


def test_record_ids_are_one_new_id_per_sample(records) -> None:
    records.check_new(["x", "y"], 2, "prompts[0].record_sequence_ids")
    with pytest.raises(BadRequest, match=r"prompts\[0\].record_sequence_ids: expected one id per sample \(2\), got 1"):
        records.check_new(["x"], 2, "prompts[0].record_sequence_ids")
    with pytest.raises(BadRequest, match=r"record_sequence_ids\[1\]: sequence 's' is already recorded"):
        records.check_new(["x", "s"], 2, "prompts[0].record_sequence_ids")
    with pytest.raises(BadRequest, match=r"record_sequence_ids\[1\]: sequence 'x' is already recorded"):
        records.check_new(["x", "x"], 2, "prompts[0].record_sequence_ids")
