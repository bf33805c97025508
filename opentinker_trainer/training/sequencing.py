"""Per-session sequence numbers: calls apply in order, a retry is answered from a cache.

The session expects call ``next`` (from 0). A call numbered ``next`` runs (one at a time) and,
when it succeeds, its response is kept and ``next`` moves on; when it fails with a refusal the
session is unchanged and ``next`` stays, so the caller may fix the call and send it again under the
same number. A call numbered below ``next`` is a retry: it gets the kept response (or waits for
the running call of that number) and runs nothing. A number above ``next`` is refused
(:class:`~.errors.OutOfOrder`, naming the expected number), as is a retry whose response is no
longer kept (the last ``keep`` are).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any, Awaitable, Callable

from opentinker_trainer.training.errors import OutOfOrder, OverLimit

__all__ = ["Sequencer"]


class Sequencer:
    """Orders one session's calls (see the module docstring).

    Args:
        next_sequence: the number expected first (0 for a fresh session; a resumed one continues
            from the number saved with its state).
        keep: responses kept for retries.
        max_in_flight: calls inside :meth:`run` at once (running or waiting); one more is refused
            with :class:`~.errors.OverLimit`.
    """

    def __init__(self, next_sequence: int = 0, *, keep: int = 16, max_in_flight: int = 4) -> None:
        self.next = int(next_sequence)
        self.keep = int(keep)
        self.max_in_flight = int(max_in_flight)
        self.in_flight = 0
        self._done: OrderedDict[int, Any] = OrderedDict()
        self._running: tuple[int, asyncio.Future] | None = None
        self._lock = asyncio.Lock()

    def admit(self) -> None:
        """Count one more call in flight (release with :meth:`release`), or raise OverLimit."""
        if self.in_flight >= self.max_in_flight:
            raise OverLimit(
                f"calls in flight: at most {self.max_in_flight} per session (max_in_flight_calls), "
                f"{self.in_flight} already are; wait for one to finish"
            )
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1

    async def exclusive(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """``await call()`` between sequenced calls, never during one: for a call that carries no
        sequence number and changes no state. ``call``'s exceptions propagate."""
        async with self._lock:
            return await call()

    async def run(self, sequence: int, call: Callable[[], Awaitable[Any]]) -> Any:
        """The response of call ``sequence``: ``await call()`` when it is the expected one, the kept
        response of a retry, or :class:`~.errors.OutOfOrder`. ``call``'s exceptions propagate
        (and leave ``next`` where it was)."""
        sequence = int(sequence)
        if sequence < 0:
            raise OutOfOrder(sequence, self.next, "sequence numbers start at 0")
        if sequence in self._done:
            return self._done[sequence]
        running = self._running
        if running is not None and running[0] == sequence:
            return await asyncio.shield(running[1])
        if sequence < self.next:
            raise OutOfOrder(sequence, self.next, f"call {sequence} was applied and its response is no longer kept")
        if sequence > self.next:
            raise OutOfOrder(sequence, self.next)
        async with self._lock:
            if sequence in self._done:  # applied while this call waited for the lock
                return self._done[sequence]
            if sequence != self.next:
                raise OutOfOrder(sequence, self.next)
            future = asyncio.get_running_loop().create_future()
            self._running = (sequence, future)
            try:
                response = await call()
            except BaseException as exc:
                future.set_exception(exc)
                future.exception()  # retrieved: a retry that waited re-raises it; nobody else must
                raise
            finally:
                self._running = None
            future.set_result(response)
            self._done[sequence] = response
            while len(self._done) > self.keep:
                self._done.popitem(last=False)
            self.next = sequence + 1
            return response
