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

A call may be *joinable* (a ``key``): while it runs, the held calls of the same key numbered right
after it (and after those) may join it (:meth:`Sequencer.run`), to run as one piece of work, such
as sample calls drawn in one batch. Joined calls are consecutive, so no other call runs between
them, and each keeps its own number and answer.
"""

from __future__ import annotations

import asyncio
import queue
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Hashable

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
        #: Answers of the calls running now, by number: the running call and those that joined it.
        self._running: dict[int, asyncio.Future] = {}
        #: The joinable call running now, if any.
        self._joining: _Joining | None = None
        #: What each number held, running or kept answers (``what`` of :meth:`run`).
        self._calls: dict[int, Hashable] = {}
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
        call: Callable[..., Awaitable[Any]],
        *,
        size: int = 0,
        held: Callable[[], Awaitable[None]] | None = None,
        key: Hashable | None = None,
        item: Any = None,
        what: Hashable = None,
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
            key: makes the call joinable. It then runs as ``await call(join)``: ``join()``,
                called from another thread while the call runs, takes the held calls of the same
                ``key`` numbered right after the call and the calls it took, and returns their
                ``item``s in order. ``call`` returns one answer per call, itself first, then the
                joined ones in the order taken; an exception among them is that call's refusal.
                A joined call's own ``call`` never runs.
            item: what ``join`` gives of this call when it joins another.
            what: the call's method and request, sequence number aside. A call whose number is
                held, running or kept for another ``what`` is refused: its client gave that number
                up (a call held while the one before it never came) and reused it.

        Raises:
            OutOfOrder: the answer is no longer kept, or the call is ahead and holding is full,
                or it was held ``hold_s`` seconds and its turn did not come, or the number is
                another call's.
        """
        sequence = int(sequence)
        if sequence < 0:
            raise OutOfOrder(sequence, self.next, "sequence numbers start at 0")
        known = self._calls.get(sequence, _UNKNOWN)
        if known is not _UNKNOWN and known != what:
            raise OutOfOrder(
                sequence,
                self.next,
                f"call {sequence} is another call, held or applied; ask GetInfo for the next number",
            )
        if sequence in self._done:
            return self._answer(sequence)
        if sequence in self._running:
            return await asyncio.shield(self._running[sequence])
        if sequence < self.next:
            raise OutOfOrder(sequence, self.next, f"call {sequence} was applied and its response is no longer kept")
        if sequence > self.next:
            entry = self._held.get(sequence) or self._hold(sequence, call, int(size), key, item, what)
            if held is not None:
                await held()
            return await asyncio.shield(entry.answer)
        self._calls[sequence] = what
        return await asyncio.shield(self._start(sequence, call, key))

    def _start(self, sequence: int, call: Callable[..., Awaitable[Any]], key: Hashable | None) -> asyncio.Future:
        applied = asyncio.ensure_future(self._apply(sequence, call, key))
        applied.add_done_callback(_retrieved)
        return applied

    def _hold(
        self,
        sequence: int,
        call: Callable[..., Awaitable[Any]],
        size: int,
        key: Hashable | None,
        item: Any,
        what: Hashable,
    ) -> "_Held":
        if len(self._held) >= self.max_held or self.held_bytes + size > self.max_held_bytes:
            raise OutOfOrder(
                sequence,
                self.next,
                f"the session holds {len(self._held)} calls of {self.held_bytes} bytes ahead of it already, "
                f"at most {self.max_held} calls of {self.max_held_bytes} bytes (max_held_calls, max_held_bytes)",
            )
        loop = asyncio.get_running_loop()
        entry = _Held(call, size, loop.create_future(), key, item)
        entry.answer.add_done_callback(_retrieved)
        entry.expiry = loop.call_later(self.hold_s, self._expire, sequence, entry)
        self._held[sequence] = entry
        self._calls[sequence] = what
        self.held_bytes += size
        self._feed()
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
        self._calls.pop(sequence, None)
        entry.answer.set_exception(
            OutOfOrder(sequence, self.next, f"held {self.hold_s:g} s, and call {self.next} did not arrive")
        )

    def _run_held(self) -> None:
        """Start the held call of number ``next``, if any; its holder gets its answer."""
        entry = self._unhold(self.next)
        if entry is None:
            return
        applied = self._start(self.next, entry.call, entry.key)

        def settle(done: asyncio.Future) -> None:
            if done.cancelled():
                entry.answer.cancel()
            elif done.exception() is not None:
                entry.answer.set_exception(done.exception())
            else:
                entry.answer.set_result(done.result())

        applied.add_done_callback(settle)

    async def _apply(self, sequence: int, call: Callable[..., Awaitable[Any]], key: Hashable | None) -> Any:
        """Run call ``sequence`` in its turn, with the calls that join it, and keep their
        answers; see :meth:`run`."""
        async with self._lock:
            if sequence in self._done:  # applied while this call waited for the lock
                return self._answer(sequence)
            if sequence != self.next:
                raise OutOfOrder(sequence, self.next)
            future = asyncio.get_running_loop().create_future()
            self._running[sequence] = future
            joining = _Joining(sequence, key) if key is not None else None
            taken = [0]

            def join() -> list[Any]:
                items = []
                while True:
                    try:
                        items.append(joining.given.get_nowait())
                    except queue.Empty:
                        taken[0] += len(items)
                        return items

            try:
                if joining is None:
                    response = await call()
                else:
                    self._joining = joining
                    self._feed()
                    answers = list(await call(join))
                    if len(answers) != 1 + taken[0]:
                        raise RuntimeError(f"a joined call gave {len(answers)} answers for {1 + taken[0]} calls")
                    response = answers[0]
            except BaseException as exc:
                joined = self._unjoin(joining, taken[0])
                self._running.pop(sequence, None)
                future.set_exception(exc)
                future.exception()  # retrieved: a retry that waited re-raises it; nobody else must
                if isinstance(exc, Exception):
                    self._keep(sequence, _Refused(exc))
                else:
                    self._calls.pop(sequence, None)
                for number, entry in joined:
                    self._running.pop(number, None)
                    entry.answer.set_exception(exc)
                    if isinstance(exc, Exception):
                        self._keep(number, _Refused(exc))
                    else:
                        self._calls.pop(number, None)
                raise
            joined = self._unjoin(joining, taken[0])
            self._running.pop(sequence, None)
            self._settle(sequence, future, response)
            for (number, entry), answer in zip(joined, answers[1:] if joining is not None else ()):
                self._running.pop(number, None)
                self._settle(number, entry.answer, answer)
            if isinstance(response, Exception):
                raise response
            return response

    def _feed(self) -> None:
        """Give the running joinable call the held calls of its key numbered right after it and
        the calls it was given."""
        joining = self._joining
        if joining is None:
            return
        while True:
            number = joining.sequence + len(joining.pushed) + 1
            entry = self._held.get(number)
            if entry is None or entry.key != joining.key:
                return
            self._unhold(number)
            self._running[number] = entry.answer
            joining.pushed.append((number, entry))
            joining.given.put(entry.item)

    def _unjoin(self, joining: "_Joining | None", taken: int) -> list[tuple[int, "_Held"]]:
        """End ``joining``: the calls its call took, in order; those given and not taken are held
        again, to run in their turn."""
        if joining is None:
            return []
        self._joining = None
        loop = asyncio.get_running_loop()
        for number, entry in joining.pushed[taken:]:
            self._running.pop(number, None)
            entry.expiry = loop.call_later(self.hold_s, self._expire, number, entry)
            self._held[number] = entry
            self.held_bytes += entry.size
        return joining.pushed[:taken]

    def _settle(self, sequence: int, future: asyncio.Future, answer: Any) -> None:
        """Keep ``answer`` as call ``sequence``'s and give it to ``future`` (an exception: its refusal)."""
        if isinstance(answer, Exception):
            future.set_exception(answer)
            future.exception()
            self._keep(sequence, _Refused(answer))
        else:
            future.set_result(answer)
            self._keep(sequence, answer)

    def _keep(self, sequence: int, answer: Any) -> None:
        self._done[sequence] = answer
        while len(self._done) > self.keep:
            self._calls.pop(self._done.popitem(last=False)[0], None)
        self.next = sequence + 1
        self._run_held()

    def _answer(self, sequence: int) -> Any:
        answer = self._done[sequence]
        if isinstance(answer, _Refused):
            raise answer.error
        return answer


_UNKNOWN = object()


def _retrieved(task: asyncio.Future) -> None:
    """Mark ``task``'s exception retrieved: its caller may have gone away, and the answer is kept."""
    if not task.cancelled():
        task.exception()


@dataclass
class _Held:
    """A call held for its turn; ``answer`` is its answer once it ran."""

    call: Callable[..., Awaitable[Any]]
    size: int
    answer: asyncio.Future
    #: The joinable call's key (None: not joinable) and what a call it joins gets of it.
    key: Hashable | None = None
    item: Any = None
    expiry: asyncio.TimerHandle = field(init=False)


@dataclass
class _Joining:
    """A joinable call while it runs: the calls given to it (``pushed``, in order, their items
    in ``given`` for its thread to take)."""

    sequence: int
    key: Hashable
    pushed: list[tuple[int, _Held]] = field(default_factory=list)
    given: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)


class _Refused:
    """The kept answer of a call that raised ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error
