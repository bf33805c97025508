"""The test suite's waits: a fixed deadline (wait_for) and one that follows progress
(wait_progress), which outlasts any fixed budget while the work moves and fails soon after it
stops."""

from __future__ import annotations

import itertools
import time

import pytest

from tests.support.waiting import wait_for, wait_progress


def test_wait_progress_returns_what_check_returned_at_once() -> None:
    start = time.monotonic()
    assert wait_progress(lambda: "here", lambda: 0, stall=5, what="x") == "here"
    assert time.monotonic() - start < 1


def test_wait_progress_outlasts_the_stall_while_progress_moves() -> None:
    steps = itertools.count()
    start = time.monotonic()
    done_at = start + 1.0  # three times the stall limit

    got = wait_progress(
        lambda: time.monotonic() >= done_at and "done", lambda: next(steps), stall=0.3, interval=0.02, what="slow work"
    )
    assert got == "done" and time.monotonic() - start >= 1.0


def test_wait_progress_forgives_a_pause_shorter_than_the_stall() -> None:
    start = time.monotonic()

    def progress() -> int:  # moves, pauses for 0.25 s (under the 0.4 s limit), moves again
        t = time.monotonic() - start
        return 0 if t < 0.1 else 1 if t < 0.35 else int(t * 100)

    got = wait_progress(lambda: time.monotonic() - start >= 0.8, progress, stall=0.4, interval=0.02)
    assert got is True


def test_wait_progress_fails_after_the_stall_naming_what_and_where_it_stopped() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError) as err:
        wait_progress(lambda: None, lambda: ("RUNNING", 7), stall=0.3, interval=0.02, what="task t at step 10")
    took = time.monotonic() - start
    assert 0.3 <= took < 5  # (the upper bound: it did stop)
    message = str(err.value)
    assert "no progress for" in message and "stall limit 0.3 s" in message
    assert "task t at step 10" in message and "('RUNNING', 7)" in message and "last: None" in message


def test_wait_progress_stall_counts_from_the_last_change_not_the_start() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="progress stuck at 3"):  # a step every 0.2 s up to 3, then none
        wait_progress(lambda: False, lambda: min(3, int((time.monotonic() - start) / 0.2)), stall=0.3, interval=0.02)
    assert time.monotonic() - start >= 0.9  # 0.6 s of steps, then the full 0.3 s of nothing


def test_wait_progress_gives_up_at_the_cap_though_progress_goes_on() -> None:
    steps = itertools.count()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"not reached in 0.5 s although progress went on: a loop \(last: 0"):
        wait_progress(lambda: 0, lambda: next(steps), stall=10, cap=0.5, interval=0.02, what="a loop")
    assert 0.5 <= time.monotonic() - start < 5  # at the cap


def test_wait_for_is_a_fixed_deadline() -> None:
    steps = itertools.count()
    with pytest.raises(TimeoutError, match=r"not reached in 0.3 s: never \(last: 0\)"):
        wait_for(lambda: 0 * next(steps), timeout=0.3, what="never", interval=0.02)
    assert wait_for(lambda: next(steps) > 2, timeout=5, interval=0.01) is True
