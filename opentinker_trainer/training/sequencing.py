"""Per-session sequence numbers: calls apply in order, a retry is answered from a cache.

The session expects call ``next`` (from 0). A call numbered ``next`` runs (one at a time); its
answer, a response or a refusal, is kept and ``next`` moves on. A refused call so uses up its
number, as on Tinker: a caller that numbers its calls itself goes on with the next number, and
the refusal is the answer of every retry. A call numbered below ``next`` is a retry: it gets the
kept answer (or waits for the running call of that number) and runs nothing, or is refused
(:class:`~.errors.OutOfOrder`, naming the expected number) when its answer is no longer kept
(the last ``keep`` are).

A call numbered above ``next`` is held: the session keeps it and runs it in its turn, and its
answer is kept like any other, even when its caller went away meanwhile. A caller that numbers
its calls itself may so send several at once, in any order, and learn each answer later by a
retry. A held call whose turn does not come within ``hold_s`` seconds is dropped and refused
(:class:`~.errors.OutOfOrder`): its number is not used up. Holding is bounded: at most
``max_held`` calls of ``max_held_bytes`` request bytes in all; a call beyond them is refused
at once the same way.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from opentinker_trainer.training.errors import OutOfOrder, OverLimit

__all__ = ["Sequencer"]


class Sequencer:
    """Orders one session's calls (see the module docstring).

    Args:
        next_sequence: the number expected first (0 for a fresh session; a resumed one continues
            from the number saved with its state).
        keep: responses kept for retries.
        max_in_flight: calls running or waiting for their turn at once, held calls aside (see
            :meth:`admit`); one more is refused with :class:`~.errors.OverLimit`.
        max_held, max_held_bytes: most calls held at once, and most request bytes they carry.
        hold_s: seconds a held call waits for its turn.
    """

    def __init__(
        self,
        next_sequence: int = 0,
        *,
        keep: int = 16,
        max_in_flight: int = 4,
        max_held: int = 64,
        max_held_bytes: int = 256 << 20,
        hold_s: float = 60.0,
    ) -> None:
        self.next = int(next_sequence)
        self.keep = int(keep)
        self.max_in_flight = int(max_in_flight)
        self.max_held = int(max_held)
        self.max_held_bytes = int(max_held_bytes)
        self.hold_s = float(hold_s)
        self.in_flight = 0
        self.held_bytes = 0
        self._held: dict[int, _Held] = {}
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

    def ahead(self, sequence: int) -> bool:
        """Whether call ``sequence`` would be held rather than run or answered now."""
        return int(sequence) > self.next

    async def run(
        self,
        sequence: int,
        call: Callable[[], Awaitable[Any]],
        *,
        size: int = 0,
        held: Callable[[], Awaitable[None]] | None = None,
    ) -> Any:
        """The response of call ``sequence``: ``await call()`` in its turn, or the kept answer of
        a retry. An exception of ``call`` is its answer: kept, raised again to retries, and
        ``next`` moves on. A caller that goes away (its RPC cancelled) does not stop a call that
        started or is held: it runs to its end and keeps its answer, since its work may change
        the session.

        Args:
            size: the call's request bytes, counted against ``max_held_bytes`` while it is held.
            held: awaited once the call is held (also by a retry of a held call): the caller may
                tell its client that the session has the call.

        Raises:
            OutOfOrder: the answer is no longer kept, or the call is ahead and holding is full,
                or it was held ``hold_s`` seconds and its turn did not come.
        """
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
            entry = self._held.get(sequence) or self._hold(sequence, call, int(size))
            if held is not None:
                await held()
            return await asyncio.shield(entry.answer)
        return await asyncio.shield(self._start(sequence, call))

    def _start(self, sequence: int, call: Callable[[], Awaitable[Any]]) -> asyncio.Future:
        applied = asyncio.ensure_future(self._apply(sequence, call))
        applied.add_done_callback(_retrieved)
        return applied

    def _hold(self, sequence: int, call: Callable[[], Awaitable[Any]], size: int) -> "_Held":
        if len(self._held) >= self.max_held or self.held_bytes + size > self.max_held_bytes:
            raise OutOfOrder(
                sequence,
                self.next,
                f"the session holds {len(self._held)} calls of {self.held_bytes} bytes ahead of it already, "
                f"at most {self.max_held} calls of {self.max_held_bytes} bytes (max_held_calls, max_held_bytes)",
            )
        loop = asyncio.get_running_loop()
        entry = _Held(call, size, loop.create_future())
        entry.answer.add_done_callback(_retrieved)
        entry.expiry = loop.call_later(self.hold_s, self._expire, sequence, entry)
        self._held[sequence] = entry
        self.held_bytes += size
        return entry

    def _unhold(self, sequence: int) -> "_Held | None":
        entry = self._held.pop(sequence, None)
        if entry is not None:
            self.held_bytes -= entry.size
            entry.expiry.cancel()
        return entry

    def _expire(self, sequence: int, entry: "_Held") -> None:
        if self._held.get(sequence) is not entry:
            return
        self._unhold(sequence)
        entry.answer.set_exception(
            OutOfOrder(sequence, self.next, f"held {self.hold_s:g} s, and call {self.next} did not arrive")
        )

    def _run_held(self) -> None:
        """Start the held call of number ``next``, if any; its holder gets its answer."""
        entry = self._unhold(self.next)
        if entry is None:
            return
        applied = self._start(self.next, entry.call)

        def settle(done: asyncio.Future) -> None:
            if done.cancelled():
                entry.answer.cancel()
            elif done.exception() is not None:
                entry.answer.set_exception(done.exception())
            else:
                entry.answer.set_result(done.result())

        applied.add_done_callback(settle)

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
        self._run_held()

    def _answer(self, sequence: int) -> Any:
        answer = self._done[sequence]
        if isinstance(answer, _Refused):
            raise answer.error
        return answer


def _retrieved(task: asyncio.Future) -> None:
    """Mark ``task``'s exception retrieved: its caller may have gone away, and the answer is kept."""
    if not task.cancelled():
        task.exception()


@dataclass
class _Held:
    """A call held for its turn; ``answer`` is its answer once it ran."""

    call: Callable[[], Awaitable[Any]]
    size: int
    answer: asyncio.Future
    expiry: asyncio.TimerHandle = field(init=False)


class _Refused:
    """The kept answer of a call that raised ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error
