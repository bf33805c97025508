"""Waiting on progress (a state, an event, a log line) rather than for a fixed time."""

from __future__ import annotations

import time


def wait_for(check, timeout: float = 60, what: str = "", interval: float = 0.2):
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
