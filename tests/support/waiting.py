"""Waiting on progress (a state, an event, a log line) rather than for a fixed time.

Two kinds of wait:

* :func:`wait_for`: a fixed deadline. For short things whose time does not grow with the work
  (a process starting to listen, a signal delivered, a reply to one call); give it a generous
  ``timeout``, many times what a quiet machine needs.
* :func:`wait_progress`: for long-running work (a task reaching a step or ending, a checkpoint
  appearing, a resume). It waits as long as ``progress()`` (a step count, a number of events, the
  lines a log has) keeps changing, and fails only when nothing moved for ``stall`` seconds. A
  loaded machine makes the work slower, not stuck, so the wait stretches with it; a hang still
  fails after ``stall`` seconds, naming what was awaited and where progress stopped.

:data:`STALL_S`: on a quiet 2-core machine the longest stretch of work with no sign of progress
is about 10 s (a new worker process importing torch and loading the model before its first
step, while a second one does the same); 120 s is 12 times that, which covers a machine several
times oversubscribed. :data:`CAP_S` bounds a wait that keeps moving but never arrives (a retry
loop, say); it stays below the suite's per-test hang guard (``timeout`` in ``pyproject.toml``)
so the wait's own message, naming what it waited for, is what a person reads.
"""

from __future__ import annotations

import time
from typing import Any, Callable, TypeVar

T = TypeVar("T")

#: Seconds without progress after which a :func:`wait_progress` fails.
STALL_S = 120.0
#: Seconds a :func:`wait_progress` waits at most, progress or not.
CAP_S = 900.0

_UNSEEN = object()


def wait_for(check: Callable[[], T], timeout: float = 60, what: str = "", interval: float = 0.2) -> T:
    """Call ``check()`` until it returns something truthy, and return that; ``TimeoutError``
    (naming ``what`` and the last value) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise TimeoutError(f"not reached in {timeout} s: {what} (last: {last!r})")


def wait_progress(
    check: Callable[[], T],
    progress: Callable[[], Any],
    *,
    stall: float = STALL_S,
    what: str = "",
    interval: float = 0.2,
    cap: float = CAP_S,
) -> T:
    """Call ``check()`` until it returns something truthy, and return that, for as long as the
    work moves: ``progress()`` (called after each falsy ``check()``; any value that compares
    equal while nothing happens: a step, a count of events, a tuple of them) changed in the last
    ``stall`` seconds.

    Raises:
        TimeoutError: ``progress()`` returned the same value for ``stall`` seconds, or ``cap``
            seconds passed; the message names ``what``, the last ``check()`` value and the last
            progress value.
    """
    start = time.monotonic()
    moved = start
    seen: Any = _UNSEEN
    while True:
        last = check()
        if last:
            return last
        current = progress()
        now = time.monotonic()
        if current != seen:
            seen, moved = current, now
        elif now - moved >= stall:
            raise TimeoutError(
                f"no progress for {now - moved:.0f} s (stall limit {stall:g} s): {what} "
                f"(last: {last!r}; progress stuck at {seen!r})"
            )
        if now - start >= cap:
            raise TimeoutError(
                f"not reached in {cap:g} s although progress went on: {what} (last: {last!r}; progress: {seen!r})"
            )
        time.sleep(interval)
