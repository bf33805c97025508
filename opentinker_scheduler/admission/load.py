"""Stage 0 of a submit: whether the scheduler takes the call at all (its load, its shutdown).

An overloaded scheduler must say so, early and cheaply, and must not drop calls. grpc.aio takes
one call from gRPC core per event-loop turn; while the loop is busy the rest wait inside core,
and core drops what waits beyond ``grpc.server.max_pending_requests`` (1000 by default; all of
them past the hard limit, 3000) with a bare ``CANCELLED`` that the scheduler never sees, so the
client cannot tell whether its task was made. ``server.py`` raises those limits, so every call
reaches the scheduler; but then the excess waits in core instead (at 2000 submits/s offered to a
scheduler that takes ~500/s: p99 11.8 s), and the scheduler only sees calls at the rate it
serves them, so a count of the calls in progress stays low.

:class:`SubmitGate` refuses a SubmitTask call at once, before anything else runs, when

* it waited in the server longer than ``limits.max_submit_wait`` (0.5 s by default, 0 = no
  bound) before the scheduler took it up: the wait is ``budget - time remaining`` when the client
  sent its budget (:mod:`opentinker_common.net.call_budget`; ``RLClient`` does). Refusing costs
  about an empty call, a fifth of a submit, so while more is offered than the scheduler can do,
  the wait stays near the bound and the excess is refused. (Refusing down to a lower wait once
  the bound is hit, as CoDel does, was tried: the arrivals do not slow down for it, so it only
  refused more calls: 131 instead of 278 served per second at 900/s offered). A call that waited
  more than :data:`HOPELESS` times the bound is served, not refused: refusing did not drain the
  queue, because even refusing every call costs more CPU than the scheduler has (about four times
  the submits it can serve; at 1500/s offered to one that had ~0.6 core, refusing all of them
  served 10 submits/s). Beyond that, gRPC core's own pending limit (raised, not removed) sheds
  calls as ``CANCELLED`` before the scheduler sees them: the client asks again with the same
  ``request_id`` and learns whether the task exists;
* ``limits.max_submits_in_flight`` calls are in progress already (64 by default, 0 = no bound):
  slow submits (environment checks) do not pile up.

The refusal is ``RESOURCE_EXHAUSTED`` with reason ``OVERLOADED``: no rate-limit token taken, no
audit record (like a refused key, it is logged, at most every 10 s with a count, and counted on
``/metrics``), nothing written. It carries a ``google.rpc.RetryInfo``: the wait, or the mean time
an admitted submit took lately, whichever is longer.

While the scheduler stops (:meth:`SubmitGate.drain`), new calls, and admitted ones that have not
reached the write yet, get ``UNAVAILABLE`` (reason ``SHUTTING_DOWN``, retry in 1 s): nothing is
created, and ``RLClient`` tries again after that, by then at the next scheduler. Calls past the
write are answered before the server stops (:meth:`SubmitGate.wait_idle`).

The price of saying so: a refusal costs the scheduler about an empty call, where core's silent
drop cost nothing, so at two or three times the load it can serve it serves fewer submits than
before (BENCHMARKS.md has the figures).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import structlog

from opentinker_common.net.call_budget import waited_s
from opentinker_scheduler.config.limits import DEFAULTS
from opentinker_scheduler.errors import ResourceExhausted, Unavailable

__all__ = ["DEFAULT_MAX_IN_FLIGHT", "DEFAULT_MAX_WAIT_S", "SubmitGate"]

log = structlog.get_logger("opentinker.scheduler")

#: ``limits.max_submits_in_flight`` when the config leaves it unset.
DEFAULT_MAX_IN_FLIGHT: int = DEFAULTS["max_submits_in_flight"]
#: ``limits.max_submit_wait`` when the config leaves it unset (seconds).
DEFAULT_MAX_WAIT_S: float = DEFAULTS["max_submit_wait"]
#: The retry advice stays within these bounds (seconds).
MIN_RETRY_S, MAX_RETRY_S = 0.1, 10.0
#: What a client is told to wait while the scheduler stops (seconds).
SHUTDOWN_RETRY_S = 1.0
#: A call that waited this many times ``max_wait_s`` is served: refusing does not drain the queue.
HOPELESS = 4.0
#: At most one "refusing submits" log line per this many seconds.
LOG_EVERY_S = 10.0


class SubmitGate:
    """Counts the SubmitTask calls in progress and refuses those over ``limit``, or that waited
    longer than ``max_wait_s`` before they were taken up (0: no bound).

        Single-threaded (the event loop); ``clock`` is monotonic seconds, for tests.

        Attributes:
            in_flight: calls admitted and not yet answered.
            refused: ``{"OVERLOADED": n, "SHUTTING_DOWN": n}``, for ``/metrics``.
            draining: :meth:`drain` was called.
    """

    def __init__(
        self,
        limit: int = DEFAULT_MAX_IN_FLIGHT,
        *,
        max_wait_s: float = DEFAULT_MAX_WAIT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self.max_wait_s = max_wait_s
        self.clock = clock
        self.in_flight = 0
        self.refused: dict[str, int] = {}
        self.draining = False
        self._mean_s = MIN_RETRY_S  # moving mean of an admitted call's duration
        self._idle: asyncio.Event | None = None
        self._logged_at = -LOG_EVERY_S
        self._unlogged = 0

    @property
    def retry_after(self) -> float:
        """Seconds a refused caller should wait: the recent mean duration of an admitted call."""
        return round(min(MAX_RETRY_S, max(MIN_RETRY_S, self._mean_s)), 3)

    def enter(self, context: Any = None) -> float:
        """Admit one call (``context``: its ``grpc.aio.ServicerContext``, for the wait); returns
        its start time, for :meth:`leave`.

        Raises:
            ResourceExhausted: the call waited longer than ``max_wait_s`` (but not
                :data:`HOPELESS` times that), or ``limit`` calls are in progress (reason ``OVERLOADED``).
            Unavailable: the scheduler is stopping (reason ``SHUTTING_DOWN``).
        """
        if self.draining:
            self._count("SHUTTING_DOWN")
            raise self._stopping()
        waited = waited_s(context) if self.max_wait_s and context is not None else None
        if waited is not None and self.max_wait_s < waited <= HOPELESS * self.max_wait_s:
            self._count("OVERLOADED")
            wait = round(min(MAX_RETRY_S, max(waited, self.retry_after)), 3)
            raise ResourceExhausted(
                f"scheduler overloaded: the call waited {waited:.2f} s in the server before the scheduler could take "
                f"it up, the limit is {self.max_wait_s:g} s (limits.max_submit_wait); no task was created; "
                f"retry in {wait:g} s",
                retry_after=wait,
                reason="OVERLOADED",
            )
        if self.limit and self.in_flight >= self.limit:
            self._count("OVERLOADED")
            wait = self.retry_after
            raise ResourceExhausted(
                f"scheduler overloaded: {self.in_flight} SubmitTask calls in progress, the limit is {self.limit} "
                f"(limits.max_submits_in_flight); no task was created; retry in {wait:g} s",
                retry_after=wait,
                reason="OVERLOADED",
            )
        self.in_flight += 1
        return self.clock()

    def leave(self, started: float) -> None:
        """The call admitted at ``started`` was answered (or failed)."""
        self.in_flight -= 1
        self._mean_s += 0.05 * (self.clock() - started - self._mean_s)
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()

    def check_open(self) -> None:
        """Called just before the write: a stopping scheduler writes no new task.

        Raises:
            Unavailable: :meth:`drain` was called (reason ``SHUTTING_DOWN``).
        """
        if self.draining:
            self._count("SHUTTING_DOWN")
            raise self._stopping()

    def drain(self) -> None:
        """Refuse every new call, and every admitted one that has not written its task yet."""
        self.draining = True

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no call is in progress, at most ``timeout`` seconds; whether none is."""
        if self.in_flight == 0:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        finally:
            self._idle = None
        return True

    def _stopping(self) -> Unavailable:
        return Unavailable(
            f"scheduler shutting down; no task was created; retry in {SHUTDOWN_RETRY_S:g} s",
            retry_after=SHUTDOWN_RETRY_S,
            reason="SHUTTING_DOWN",
        )

    def _count(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        self._unlogged += 1
        now = self.clock()
        if now - self._logged_at >= LOG_EVERY_S:
            log.warning(
                "refusing submits",
                reason=reason,
                refused=self._unlogged,
                in_flight=self.in_flight,
                limit=self.limit,
                retry_after=self.retry_after,
            )
            self._logged_at, self._unlogged = now, 0
