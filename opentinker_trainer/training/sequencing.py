"""Per-session sequence numbers: calls apply in order, a retry is answered from a cache.

The session expects call ``next`` (from 0). A call numbered ``next`` runs (one at a time); its
answer, a response or a refusal, is kept and ``next`` moves on. A refused call so uses up its
number, as on Tinker: a caller that numbers its calls itself goes on with the next number, and
the refusal is the answer of every retry. A call numbered below ``next`` is a retry: it gets the
kept answer (or waits for the running call of that number) and runs nothing. A number above ``next`` is refused
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
        answer of a retry, or :class:`~.errors.OutOfOrder`. An exception of ``call`` is its answer:
        kept, raised again to retries, and ``next`` moves on. A caller that goes away (its RPC
        cancelled) does not stop a call that started: it runs to its end and keeps its answer,
        since its work may have changed the session already."""
        sequence = int(sequence)
        if sequence < 0:
            raise OutOfOrder(sequence, self.next, "sequence numbers start at 0")
        if sequence in self._done:
            return self._answer(sequence)
        running = self._running
        if running is not None and running[0] == sequence:
            return await asyncio.shield(running[1])
        if sequence < self.next:
            raise OutOfOrder(sequence, self.next, f"call {sequence} was applied and its response is no longer kept")
        if sequence > self.next:
            raise OutOfOrder(sequence, self.next)
        applied = asyncio.ensure_future(self._apply(sequence, call))
        applied.add_done_callback(_retrieved)
        return await asyncio.shield(applied)

    async def _apply(self, sequence: int, call: Callable[[], Awaitable[Any]]) -> Any:
        """Run call ``sequence`` in its turn and keep its answer; see :meth:`run`."""
        async with self._lock:
            if sequence in self._done:  # applied while this call waited for the lock
                return self._answer(sequence)
            if sequence != self.next:
                raise OutOfOrder(sequence, self.next)
            future = asyncio.get_running_loop().create_future()
            self._running = (sequence, future)
            try:
                response = await call()
            except Exception as exc:
                future.set_exception(exc)
                future.exception()  # retrieved: a retry that waited re-raises it; nobody else must
                self._keep(sequence, _Refused(exc))
                raise
            except BaseException as exc:
                future.set_exception(exc)
                future.exception()
                raise
            finally:
                self._running = None
            future.set_result(response)
            self._keep(sequence, response)
            return response

    def _keep(self, sequence: int, answer: Any) -> None:
        self._done[sequence] = answer
        while len(self._done) > self.keep:
            self._done.popitem(last=False)
        self.next = sequence + 1

    def _answer(self, sequence: int) -> Any:
        answer = self._done[sequence]
        if isinstance(answer, _Refused):
            raise answer.error
        return answer


def _retrieved(task: asyncio.Future) -> None:
    """Mark ``task``'s exception retrieved: its caller may have gone away, and the answer is kept."""
    if not task.cancelled():
        task.exception()


class _Refused:
    """The kept answer of a call that raised ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error
