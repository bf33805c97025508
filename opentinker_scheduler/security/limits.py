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
      max_streams_per_owner: 32     # server streams (WatchTask, downloads) open at once per owner; 0 = no limit
      spec_check_timeout: 10        # seconds SubmitTask may spend building the environment to check a spec
      max_keys_per_owner: 20        # active (unrevoked, unexpired) API keys per owner; 0 = no limit
      max_submits_in_flight: 64     # SubmitTask calls the scheduler works on at once, all callers; 0 = no limit
      max_submit_wait: 0.5          # seconds a SubmitTask may wait in the server before it is taken up; 0 = no limit
      max_uploads: 64               # user uploads in progress (UploadDataset, ImportAdapter), all owners; 0 = no limit
      max_uploads_per_owner: 4      # ... of them one owner's; 0 = no limit
      max_checkpoint_uploads: 64    # trainers' checkpoint uploads (UploadChunks) in progress; 0 = no limit
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
users never starve a task's checkpoints. An upload whose messages carry no payload byte for
``upload_idle_timeout`` seconds is ended: empty chunks do not keep it alive. The dataset byte and
disk checks are :meth:`opentinker_scheduler.data.datasets.DatasetStore.begin`'s.

Reads (:data:`opentinker_scheduler.security.auth.READ_METHODS`) take a token of their owner's
read bucket; over it the call is refused before any work with a ``google.rpc.RetryInfo`` saying
when a token is back, so one owner's flood costs the scheduler a refusal per call, not a query.

The per-caller limits (pending, rates, streams, per-owner uploads, dataset bytes per owner)
default to the values above when ``auth.enabled`` is true. With authentication off (one trusted
user, ``make demo``, the benchmarks) they default to no limit; a value written in the config
applies in both modes. Message and spec sizes always apply, and so do ``max_submits_in_flight``
and ``max_submit_wait``, the scheduler's own load: over them a submit is refused at once with
``RESOURCE_EXHAUSTED`` (reason ``OVERLOADED``) and a ``google.rpc.RetryInfo``, before anything is
done (:mod:`opentinker_scheduler.admission.load`); the upload pools (``max_uploads``,
``max_checkpoint_uploads``), the timeouts and ``min_free_disk_bytes`` hold in both modes too.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

from opentinker_scheduler.config.limits import DEFAULTS, LimitsConfig  # noqa: F401 - the section, re-exported
from opentinker_scheduler.errors import ResourceExhausted

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

    def take(self, now: float) -> float:
        """Take one token; returns 0.0 on success, else the seconds until one is available."""
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


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
        self._lock = threading.Lock()

    def check_spec_size(self, size_bytes: int) -> None:
        """Raises ResourceExhausted when a serialized TaskSpec of ``size_bytes`` is too large."""
        most = self.config.max_spec_bytes
        if most and size_bytes > most:
            raise ResourceExhausted(
                f"spec: {size_bytes} bytes serialized, more than the limit of {most} (limits.max_spec_bytes)"
            )

    def _take(self, kind: str, owner: str, rate: float, burst: int) -> float:
        """Take a token of ``owner``'s ``kind`` bucket; 0.0, or the seconds until one is back."""
        now = self.clock()
        with self._lock:
            bucket = self._buckets.get((kind, owner))
            if bucket is None:
                if len(self._buckets) >= self._MAX_BUCKETS:
                    self._buckets.clear()  # full buckets again: at worst one extra burst each
                bucket = self._buckets[(kind, owner)] = TokenBucket(rate, burst, now)
            elif (bucket.rate, bucket.burst) != (rate, burst):  # the queue's limits changed
                bucket.rate, bucket.burst = rate, burst
            return bucket.take(now)

    def check_submit_rate(self, owner: str, *, override: tuple[float | None, int | None, str] | None = None) -> None:
        """Take a SubmitTask token of ``owner``.

        Args:
            override: ``(rate, burst, config key)`` of the caller's quota queue
                (``queues[i].limits``); a None value keeps the ``limits:`` section's.

        Raises:
            ResourceExhausted: the owner's bucket is empty; the message says when to retry, and
                ``retry_after`` carries it.
        """
        rate, burst, where = self.config.submit_rate, self.config.submit_burst, "limits.submit_rate"
        if override is not None:
            rate = override[0] if override[0] is not None else rate
            burst = override[1] if override[1] is not None else burst
            where = override[2]
        if not rate:
            return
        wait = self._take("submit", owner, rate, int(burst or 1))
        if wait:
            raise ResourceExhausted(
                f"submit rate limit: at most {rate:g} SubmitTask calls per second per owner "
                f"(burst {burst}) ({where}); retry in {wait:.2f} s",
                retry_after=wait,
            )

    def check_read_rate(self, owner: str, method: str) -> None:
        """Take a read token of ``owner`` for ``method`` (``/package.Service/Method``).

        Raises:
            ResourceExhausted: the owner's read bucket is empty; ``retry_after`` says when a token
                is back.
        """
        rate, burst = self.config.read_rate, self.config.read_burst
        if not rate:
            return
        wait = self._take("read", owner, rate, int(burst or 1))
        if wait:
            name = method.rsplit("/", 1)[-1]
            raise ResourceExhausted(
                f"read rate limit: at most {rate:g} read calls per second per owner (burst {burst}) "
                f"(limits.read_rate); {name} refused, retry in {wait:.2f} s",
                retry_after=wait,
            )

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

    def acquire_upload(self, owner: str, pool: str = USER_UPLOADS) -> None:
        """Take an upload slot of ``pool``; give it back with :meth:`release_upload`.

        ``USER_UPLOADS`` (datasets, adapter imports): one of ``owner``'s ``max_uploads_per_owner``
        and one of ``max_uploads``. ``CHECKPOINT_UPLOADS`` (trainers): one of
        ``max_checkpoint_uploads``, a pool of its own.

        Raises:
            ResourceExhausted: a limit is reached (the message names it and its config key).
        """
        with self._lock:
            if pool == CHECKPOINT_UPLOADS:
                most, where, what = self.config.max_checkpoint_uploads, "limits.max_checkpoint_uploads", "checkpoint"
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

    def release_upload(self, owner: str, pool: str = USER_UPLOADS) -> None:
        with self._lock:
            self._pools[pool] = max(0, self._pools[pool] - 1)
            if pool == USER_UPLOADS:
                _drop(self._uploads, owner)

    def open_uploads(self, pool: str | None = None) -> int:
        """Uploads in progress in ``pool``, or in both pools (None)."""
        with self._lock:
            return sum(self._pools.values()) if pool is None else self._pools[pool]


def _drop(counts: dict[str, int], owner: str) -> None:
    left = counts.get(owner, 1) - 1
    if left > 0:
        counts[owner] = left
    else:
        counts.pop(owner, None)
