"""Limits on what one owner may ask of the scheduler; going over is RESOURCE_EXHAUSTED with a
message naming the limit and its config key, never a crash.

``limits:`` in ``scheduler_config.yaml`` (every key optional)::

    limits:
      max_message_bytes: 67108864   # largest gRPC message sent or received, both directions (64 MiB)
      max_spec_bytes: 262144        # largest serialized TaskSpec a SubmitTask may carry (256 KiB)
      max_pending_per_owner: 1000   # PENDING tasks one owner may have queued; 0 = no limit
      submit_rate: 10               # SubmitTask calls per second per owner (token bucket); 0 = no limit
      submit_burst: 50              # ... of which this many may come at once
      read_rate: 100                # reads (GetTask, ListTasks, WatchTask opens...) per second per owner; 0 = no limit
      read_burst: 200               # ... of which this many may come at once
      rate_wait: 1                  # seconds a read over read_rate may wait for its token; a refusal is held as long
      max_streams_per_owner: 32     # server streams (WatchTask, downloads) open at once per owner; 0 = no limit
      max_calls_per_owner: 8        # calls one owner has in progress at once; the rest wait their turn; 0 = no limit
      spec_check_timeout: 10        # seconds SubmitTask may spend building the environment to check a spec
      max_keys_per_owner: 20        # active (unrevoked, unexpired) API keys per owner; 0 = no limit
      max_submits_in_flight: 64     # SubmitTask calls the scheduler works on at once, all callers; 0 = no limit
      max_submit_wait: 0.5          # seconds a SubmitTask may wait in the server before it is taken up; 0 = no limit
      max_uploads: 64               # user uploads in progress (UploadDataset, ImportAdapter), all owners; 0 = no limit
      max_uploads_per_owner: 4      # ... of them one owner's; 0 = no limit
      max_checkpoint_uploads: 64    # trainers' checkpoint uploads (UploadChunks) in progress; 0 = no limit
      max_checkpoint_uploads_per_node: 16     # ... of them by the workers of one node; 0 = no limit
      max_checkpoint_uploads_per_attempt: 2   # ... of them by one task attempt's credential; 0 = no limit
      upload_idle_timeout: 60       # seconds an upload may go without a payload byte (DEADLINE_EXCEEDED after)
      upload_deadline: 3600         # seconds an upload may stay open in all
      max_dataset_bytes_per_owner: 10737418240  # stored dataset bytes per owner (10 GiB); 0 = no limit
      min_free_disk_bytes: 1073741824  # free bytes the dataset disk keeps after every upload in progress

Every per-caller limit counts per owner, whatever key the owner calls with: a second key, or a
key rotated with a grace period, adds nothing to an owner's rates, streams or uploads.

Uploads come in two pools (:meth:`Limits.acquire_upload`, taken by the auth interceptor, which also
applies the two upload timeouts: :func:`opentinker_scheduler.security.auth.timed_uploads`). Users'
uploads hold one of their owner's ``max_uploads_per_owner`` slots and one of ``max_uploads``;
trainers' checkpoint uploads hold one of ``max_checkpoint_uploads``, which no user key can take, so
users never starve a task's checkpoints; a worker's upload also holds one of its node's
``max_checkpoint_uploads_per_node`` and one of its attempt's ``max_checkpoint_uploads_per_attempt``,
so no compromised node or worker takes the whole pool. Only an attempt credential (or an admin key)
uploads a checkpoint: a node key is refused before it takes a slot. An upload whose messages carry no payload byte for
``upload_idle_timeout`` seconds is ended: empty chunks do not keep it alive. The dataset byte and
disk checks are :meth:`opentinker_scheduler.data.datasets.DatasetStore.begin`'s.

Reads (:data:`opentinker_scheduler.security.auth.READ_METHODS`) take a token of their owner's
read bucket (:meth:`Limits.take_read`), and one more per 4 KiB of the answer
(:meth:`Limits.charge_read`: a page of a hundred tasks costs more than one task); submits and
adapter imports one of the owner's submit bucket. Over the read rate a read waits for its token,
up to ``rate_wait`` seconds, then runs; a submit never waits (it would hold one of the
scheduler's ``max_submits_in_flight``). A call that gets no token is refused, before any work,
with a ``google.rpc.RetryInfo`` saying when one is back, and the refusal is answered only after
``rate_wait`` seconds, once the call has given back what it held (:meth:`Limits.refusal_wait`,
held by the auth interceptor). So a flood from many threads is slowed to its owner's rates and
costs the scheduler neither work nor a storm of refusals.

Unary calls of SchedulerService and AdminService run as one of their owner's
``max_calls_per_owner`` calls in progress (:meth:`Limits.acquire_turn`, taken by the auth
interceptor after the read token). An owner's further calls wait their turn in arrival order,
each woken when one of the owner's calls ends; at most :data:`MAX_WAITING_CALLS` wait, and more are
refused (held as a rate refusal is). Owners never wait for each other's turns: a burst of one
owner's calls queues behind itself, so another owner's call finds at most
``max_calls_per_owner`` of them ahead of it on the scheduler's event loop instead of the whole
burst.

The per-caller limits (pending, rates, streams, calls, per-owner uploads, dataset bytes per owner)
default to the values above when ``auth.enabled`` is true. With authentication off (one trusted
user, ``make demo``, the benchmarks) they default to no limit; a value written in the config
applies in both modes. Message and spec sizes always apply, and so do ``max_submits_in_flight``
and ``max_submit_wait``, the scheduler's own load: over them a submit is refused at once with
``RESOURCE_EXHAUSTED`` (reason ``OVERLOADED``) and a ``google.rpc.RetryInfo``, before anything is
done (:mod:`opentinker_scheduler.admission.load`); the upload pools (``max_uploads``,
``max_checkpoint_uploads``), the timeouts and ``min_free_disk_bytes`` hold in both modes too.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import threading
import time
from typing import Callable, Iterator

from opentinker_scheduler.config.limits import DEFAULTS, LimitsConfig  # noqa: F401 - the section, re-exported
from opentinker_scheduler.errors import ResourceExhausted

#: Bytes of a read's answer that cost one more read token (:meth:`Limits.charge_read`).
READ_TOKEN_BYTES = 4096
#: Rate refusals of one owner held at once (:meth:`Limits.refusal_wait`); more are answered at once.
MAX_HELD_REFUSALS = 64
#: Calls of one owner waiting for a turn (:meth:`Limits.acquire_turn`); more are refused.
MAX_WAITING_CALLS = 64
#: Heavy reads (a ListTasks page) of one owner built at once (:meth:`Limits.heavy_read`); the
#: others wait their turn, which costs the scheduler nothing.
HEAVY_READS_PER_OWNER = 1

#: The limiter and owner of a rate refusal of the call being handled (:func:`hold_rate_refusal`).
_RATE_REFUSED: contextvars.ContextVar[tuple[Limits, str] | None] = contextvars.ContextVar(
    "opentinker_rate_refused", default=None
)

#: Upload pools (:meth:`Limits.acquire_upload`).
USER_UPLOADS = "user"
CHECKPOINT_UPLOADS = "checkpoint"


class TokenBucket:
    """Token bucket (rate tokens per second, at most ``burst`` stored), one per owner.

    Reference: the classic token-bucket shaper (RFC 2697 uses the same bookkeeping).
    """

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens = float(burst)
        self.stamp = now

    def reserve(self, now: float, most_wait: float) -> tuple[float, bool]:
        """Take one token, owing it when none is stored if it comes back within ``most_wait``
        seconds: ``(seconds to wait, True)``; else ``(seconds until one is back, False)`` and
        nothing is taken. Owed tokens queue callers at the bucket's rate."""
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        wait = max(0.0, (1.0 - self.tokens) / self.rate)
        if wait > most_wait:
            return wait, False
        self.tokens -= 1.0
        return wait, True


class Limits:
    """The scheduler's per-owner limiters and upload pools.

    Thread-safe (the counters are touched from gRPC handlers only, but tests call them from
    threads). Times come from ``clock`` (seconds, monotonic) so tests need not sleep.
    """

    _MAX_BUCKETS = 100_000  # idle buckets are dropped beyond this many owners

    def __init__(self, config: LimitsConfig, *, clock=time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self._buckets: dict[tuple[str, str], TokenBucket] = {}
        self._streams: dict[str, int] = {}
        self._uploads: dict[str, int] = {}  # user uploads per owner
        self._pools = {USER_UPLOADS: 0, CHECKPOINT_UPLOADS: 0}
        self._node_uploads: dict[str, int] = {}  # checkpoint uploads per node
        self._attempt_uploads: dict[str, int] = {}  # checkpoint uploads per attempt ("task/attempt")
        self._held: dict[str, int] = {}  # rate refusals held per owner (refusal_wait)
        self._turns: dict[str, _Turns] = {}  # acquire_turn: calls in progress and waiting, per owner
        self._heavy: dict[str, tuple[asyncio.Semaphore, int]] = {}  # heavy_read: turns, callers per owner
        self._lock = threading.Lock()

    def check_spec_size(self, size_bytes: int) -> None:
        """Raises ResourceExhausted when a serialized TaskSpec of ``size_bytes`` is too large."""
        most = self.config.max_spec_bytes
        if most and size_bytes > most:
            raise ResourceExhausted(
                f"spec: {size_bytes} bytes serialized, more than the limit of {most} (limits.max_spec_bytes)"
            )

    def take_submit(self, owner: str, *, override: tuple[float | None, int | None, str] | None = None) -> None:
        """Take a SubmitTask token of ``owner`` (SubmitTask and ImportAdapter share it). A submit
        never waits for its token: it would hold one of the scheduler's ``max_submits_in_flight``.

        Args:
            override: ``(rate, burst, config key)`` of the caller's quota queue
                (``queues[i].limits``); a None value keeps the ``limits:`` section's.

        Raises:
            ResourceExhausted: the owner's bucket is empty (:meth:`take_rate`).
        """
        rate, burst, where = self.config.submit_rate, self.config.submit_burst, "limits.submit_rate"
        if override is not None:
            rate = override[0] if override[0] is not None else rate
            burst = override[1] if override[1] is not None else burst
            where = override[2]
        what = f"SubmitTask calls per second per owner (burst {burst}) ({where})"
        self.take_rate("submit", owner, rate, burst, what, most_wait=0.0)

    def take_read(self, owner: str, method: str) -> float:
        """Take a read token of ``owner`` for ``method`` (``/package.Service/Method``); see
        :meth:`take_rate`."""
        rate, burst = self.config.read_rate, self.config.read_burst
        name = method.rsplit("/", 1)[-1]
        return self.take_rate(
            "read",
            owner,
            rate,
            burst,
            f"read calls per second per owner (burst {burst}) (limits.read_rate): {name} refused",
        )

    def take_rate(
        self, kind: str, owner: str, rate: float | None, burst: int | None, what: str, *, most_wait: float | None = None
    ) -> float:
        """Take a token of ``owner``'s ``kind`` bucket (``rate`` per second, ``burst`` stored;
        no rate: no limit).

        Returns:
            Seconds the call waits for its token before it runs (0.0 within the burst): at most
            ``most_wait`` (default ``rate_wait``). Waiting costs the scheduler nothing, so a
            client flooding from many threads is slowed to its owner's rate (:func:`paced`).

        Raises:
            ResourceExhausted: no token within that time; the message names the limit
                (``what``), ``retry_after`` says when a token is back. The refusal is marked, so
                :func:`hold_rate_refusal` holds its answer.
        """
        if not rate:
            return 0.0
        now = self.clock()
        with self._lock:
            bucket = self._buckets.get((kind, owner))
            if bucket is None:
                if len(self._buckets) >= self._MAX_BUCKETS:
                    self._buckets.clear()  # full buckets again: at worst one extra burst each
                bucket = self._buckets[(kind, owner)] = TokenBucket(rate, int(burst or 1), now)
            elif (bucket.rate, bucket.burst) != (rate, int(burst or 1)):  # the queue's limits changed
                bucket.rate, bucket.burst = rate, int(burst or 1)
            wait, taken = bucket.reserve(now, self.config.rate_wait or 0.0 if most_wait is None else most_wait)
        if not taken:
            _RATE_REFUSED.set((self, owner))
            raise ResourceExhausted(
                f"{kind} rate limit: at most {rate:g} {what}; retry in {wait:.2f} s", retry_after=wait
            )
        return wait

    def charge_read(self, owner: str, response_bytes: int) -> None:
        """Charge ``owner`` one more read token per :data:`READ_TOKEN_BYTES` of an answer past the
        first, so a page of a hundred tasks costs what it takes to build (its next reads wait)."""
        extra = response_bytes // READ_TOKEN_BYTES
        if not extra or not self.config.read_rate:
            return
        with self._lock:
            bucket = self._buckets.get(("read", owner))
            if bucket is not None:
                bucket.tokens -= extra

    @contextlib.contextmanager
    def refusal_wait(self, owner: str) -> Iterator[float]:
        """Seconds to hold a rate refusal of ``owner`` before answering it (``rate_wait``), so a
        flooding client waits as an honest one would instead of asking again at once; 0.0 when
        :data:`MAX_HELD_REFUSALS` of the owner's refusals are held already."""
        with self._lock:
            held = self._held.get(owner, 0)
            hold = held < MAX_HELD_REFUSALS
            if hold:
                self._held[owner] = held + 1
        try:
            yield (self.config.rate_wait or 0.0) if hold else 0.0
        finally:
            if hold:
                with self._lock:
                    _drop(self._held, owner)

    async def acquire_turn(self, owner: str) -> bool:
        """Become one of ``owner``'s ``max_calls_per_owner`` calls in progress, waiting in
        arrival order behind the owner's own calls when they are all taken. Give the turn back
        with :meth:`release_turn` when the answer is ready. Call it on the event loop only.

        Returns:
            Whether a turn was taken (False: no limit, nothing to give back).

        Raises:
            ResourceExhausted: :data:`MAX_WAITING_CALLS` of ``owner``'s calls wait already; the
                refusal is held like a rate refusal (:func:`hold_rate_refusal`).
        """
        most = self.config.max_calls_per_owner
        if not most:
            return False
        turns = self._turns.get(owner)
        if turns is None:
            turns = self._turns[owner] = _Turns()
        if turns.running < most and not turns.waiting:
            turns.running += 1
            return True
        if len(turns.waiting) >= MAX_WAITING_CALLS:
            wait = self.config.rate_wait or 1.0
            _RATE_REFUSED.set((self, owner))
            raise ResourceExhausted(
                f"too many calls in progress: {turns.running} running and {len(turns.waiting)} waiting for owner "
                f"{owner!r}, the limit is {most} at once (limits.max_calls_per_owner); retry in {wait:g} s",
                retry_after=wait,
            )
        turn = asyncio.get_running_loop().create_future()
        turns.waiting.append(turn)
        try:
            await turn  # release_turn hands a turn over: ``running`` already counts this call
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.release_turn(owner)  # handed over as the call was cancelled: pass it on
            else:
                if turn in turns.waiting:
                    turns.waiting.remove(turn)
                self._forget_turns(owner, turns)
            raise
        return True

    def release_turn(self, owner: str) -> None:
        """Give back a turn of :meth:`acquire_turn`: to the owner's oldest waiting call, if any."""
        turns = self._turns.get(owner)
        if turns is None:
            return
        while turns.waiting:
            turn = turns.waiting.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        turns.running -= 1
        self._forget_turns(owner, turns)

    def _forget_turns(self, owner: str, turns: _Turns) -> None:
        if turns.running <= 0 and not turns.waiting:
            self._turns.pop(owner, None)

    def calls_in_progress(self, owner: str) -> tuple[int, int]:
        """``owner``'s calls ``(running, waiting)`` (:meth:`acquire_turn`)."""
        turns = self._turns.get(owner)
        return (turns.running, len(turns.waiting)) if turns is not None else (0, 0)

    @contextlib.asynccontextmanager
    async def heavy_read(self, owner: str):
        """``async with limits.heavy_read(owner):`` runs the block as one of ``owner``'s
        :data:`HEAVY_READS_PER_OWNER` heavy reads at a time; a flood of them from one owner then
        queues behind itself and leaves the event loop to other owners' calls between its
        slices. Call it on the event loop only."""
        turns, callers = self._heavy.get(owner) or (asyncio.Semaphore(HEAVY_READS_PER_OWNER), 0)
        self._heavy[owner] = (turns, callers + 1)
        try:
            async with turns:
                yield
        finally:
            turns, callers = self._heavy[owner]
            if callers > 1:
                self._heavy[owner] = (turns, callers - 1)
            else:
                del self._heavy[owner]

    def check_pending(self, owner: str, count, *, override: tuple[int | None, str] | None = None) -> None:
        """Raises ResourceExhausted when ``owner`` already has the limit of PENDING tasks queued.

        ``count`` is an int or a function returning one (called only when a limit is set);
        ``override``: ``(limit, config key)`` of the owner's quota queue (None limit: the
        ``limits:`` section's).
        """
        most, where = self.config.max_pending_per_owner, "limits.max_pending_per_owner"
        if override is not None and override[0] is not None:
            most, where = override
        if not most:
            return
        pending = count() if callable(count) else count
        if pending >= most:
            raise ResourceExhausted(
                f"owner {owner!r} already has {pending} PENDING task(s), the limit is {most} "
                f"({where}); wait for some to start or cancel some"
            )

    def acquire_stream(self, owner: str) -> None:
        """Take one of ``owner``'s concurrent stream slots; give it back with :meth:`release_stream`.

        Raises:
            ResourceExhausted: ``owner`` already holds ``max_streams_per_owner`` streams.
        """
        most = self.config.max_streams_per_owner
        with self._lock:
            open_now = self._streams.get(owner, 0)
            if most and open_now >= most:
                raise ResourceExhausted(
                    f"too many concurrent streams: {open_now} open for owner {owner!r}, the limit is {most} "
                    "(limits.max_streams_per_owner); close a watch or download first"
                )
            self._streams[owner] = open_now + 1

    def release_stream(self, owner: str) -> None:
        with self._lock:
            _drop(self._streams, owner)

    @contextlib.contextmanager
    def stream(self, owner: str) -> Iterator[None]:
        """``with limits.stream(owner):`` holds one slot for the block (see :meth:`acquire_stream`)."""
        self.acquire_stream(owner)
        try:
            yield
        finally:
            self.release_stream(owner)

    def open_streams(self, owner: str) -> int:
        with self._lock:
            return self._streams.get(owner, 0)

    def acquire_upload(self, owner: str, pool: str = USER_UPLOADS, *, attempt=None) -> None:
        """Take an upload slot of ``pool``; give it back with :meth:`release_upload` and the same arguments.

        ``USER_UPLOADS`` (datasets, adapter imports): one of ``owner``'s ``max_uploads_per_owner``
        and one of ``max_uploads``. ``CHECKPOINT_UPLOADS`` (trainers): one of
        ``max_checkpoint_uploads``, a pool of its own; with ``attempt`` (the
        :class:`~opentinker_scheduler.state.worker_credentials.AttemptScope` of the uploading
        worker's credential) also one of its node's ``max_checkpoint_uploads_per_node`` and one of
        its attempt's ``max_checkpoint_uploads_per_attempt``.

        Raises:
            ResourceExhausted: a limit is reached (the message names it and its config key).
        """
        with self._lock:
            if pool == CHECKPOINT_UPLOADS:
                most, where, what = self.config.max_checkpoint_uploads, "limits.max_checkpoint_uploads", "checkpoint"
                if attempt is not None:
                    self._check_holder(attempt)
            else:
                most, where, what = self.config.max_uploads, "limits.max_uploads", "user"
                mine, per_owner = self._uploads.get(owner, 0), self.config.max_uploads_per_owner
                if per_owner and mine >= per_owner:
                    raise ResourceExhausted(
                        f"too many uploads in progress: {mine} open for owner {owner!r}, the limit is {per_owner} "
                        "(limits.max_uploads_per_owner); retry when one has finished",
                        retry_after=1.0,
                    )
            if most and self._pools[pool] >= most:
                raise ResourceExhausted(
                    f"too many {what} uploads in progress: {self._pools[pool]} open on this scheduler, "
                    f"the limit is {most} ({where}); retry when some have finished",
                    retry_after=1.0,
                )
            self._pools[pool] += 1
            if pool == USER_UPLOADS:
                self._uploads[owner] = self._uploads.get(owner, 0) + 1
            elif attempt is not None:
                node, key = attempt.node_id, f"{attempt.task_id}/{attempt.attempt}"
                self._node_uploads[node] = self._node_uploads.get(node, 0) + 1
                self._attempt_uploads[key] = self._attempt_uploads.get(key, 0) + 1

    def _check_holder(self, attempt) -> None:
        """Raises ResourceExhausted when ``attempt`` itself or its node holds its most checkpoint uploads."""
        key = f"{attempt.task_id}/{attempt.attempt}"
        for held, most, where, whose in (
            (
                self._attempt_uploads.get(key, 0),
                self.config.max_checkpoint_uploads_per_attempt,
                "limits.max_checkpoint_uploads_per_attempt",
                attempt.describe(),
            ),
            (
                self._node_uploads.get(attempt.node_id, 0),
                self.config.max_checkpoint_uploads_per_node,
                "limits.max_checkpoint_uploads_per_node",
                f"node {attempt.node_id!r}",
            ),
        ):
            if most and held >= most:
                raise ResourceExhausted(
                    f"too many checkpoint uploads in progress: {held} open for {whose}, the limit is {most} "
                    f"({where}); retry when one has finished",
                    retry_after=1.0,
                )

    def release_upload(self, owner: str, pool: str = USER_UPLOADS, *, attempt=None) -> None:
        with self._lock:
            self._pools[pool] = max(0, self._pools[pool] - 1)
            if pool == USER_UPLOADS:
                _drop(self._uploads, owner)
            elif attempt is not None:
                _drop(self._node_uploads, attempt.node_id)
                _drop(self._attempt_uploads, f"{attempt.task_id}/{attempt.attempt}")

    def open_uploads(self, pool: str | None = None) -> int:
        """Uploads in progress in ``pool``, or in both pools (None)."""
        with self._lock:
            return sum(self._pools.values()) if pool is None else self._pools[pool]


class _Turns:
    """One owner's calls in progress (:meth:`Limits.acquire_turn`) and those waiting, oldest first."""

    __slots__ = ("running", "waiting")

    def __init__(self) -> None:
        self.running = 0
        self.waiting: collections.deque[asyncio.Future] = collections.deque()


def _drop(counts: dict[str, int], owner: str) -> None:
    left = counts.get(owner, 1) - 1
    if left > 0:
        counts[owner] = left
    else:
        counts.pop(owner, None)


async def paced(take: Callable[[], float]) -> None:
    """Take a rate token with ``take`` (:meth:`Limits.take_read`) and wait for it when it is owed."""
    wait = take()
    if wait:
        await asyncio.sleep(wait)


async def hold_rate_refusal() -> None:
    """When the call being handled was refused for a rate (:meth:`Limits.take_rate`), wait
    :meth:`Limits.refusal_wait` before its refusal is sent."""
    refused = _RATE_REFUSED.get()
    if refused is None:
        return
    limits, owner = refused
    with limits.refusal_wait(owner) as hold:
        if hold:
            await asyncio.sleep(hold)
