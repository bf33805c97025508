"""How attempts read: used against max_attempts, hand-backs (preemption, drain) apart."""

from __future__ import annotations

from opentinker_common.attempts import attempts_text


def test_attempts_without_hand_backs_read_n_of_max() -> None:
    assert attempts_text(2, 3) == "2 of 3"
    assert attempts_text(2, 0) == "2"


def test_hand_backs_are_shown_apart_and_never_exceed_the_budget() -> None:
    # Three preemptions: attempt 4 with max_attempts 3, one attempt used.
    assert attempts_text(4, 3, 3) == "4: 1 of 3 used, 3 handed back (preempted, drained or node lost; not counted)"
    assert attempts_text(4, 0, 3) == "4: 3 handed back (preempted, drained or node lost; not counted)"
