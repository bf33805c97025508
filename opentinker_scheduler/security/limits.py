"""Limits on what one caller may ask of the scheduler; going over is RESOURCE_EXHAUSTED with a
message naming the limit and its config key, never a crash.

``limits:`` in ``scheduler_config.yaml`` (every key optional)::

    limits:
      max_message_bytes: 67108864   # largest gRPC message sent or received, both directions (64 MiB)
      max_spec_bytes: 262144        # largest serialized TaskSpec a SubmitTask may carry (256 KiB)
      max_pending_per_owner: 1000   # PENDING tasks one owner may have queued; 0 = no limit
      submit_rate: 10               # SubmitTask calls per second per API key (token bucket); 0 = no limit
      submit_burst: 50              # ... of which this many may come at once
      max_streams_per_key: 32       # server streams (WatchTask, downloads) open at once per key; 0 = no limit
      spec_check_timeout: 10        # seconds SubmitTask may spend building the environment to check a spec
      max_keys_per_owner: 20        # active (unrevoked, unexpired) API keys per owner; 0 = no limit
      max_submits_in_flight: 64     # SubmitTask calls the scheduler works on at once, all callers; 0 = no limit
      max_submit_wait: 0.5          # seconds a SubmitTask may wait in the server before it is taken up; 0 = no limit
      max_uploads: 64               # uploads in progress (UploadDataset, UploadChunks), all keys; 0 = no limit
      upload_idle_timeout: 60       # seconds an upload may go without a message (DEADLINE_EXCEEDED after)
      upload_deadline: 3600         # seconds an upload may stay open in all
      max_dataset_bytes_per_owner: 10737418240  # stored dataset bytes per owner (10 GiB); 0 = no limit
      min_free_disk_bytes: 1073741824  # free bytes the dataset disk keeps after every upload in progress

Uploads are streams too: each holds one of its key's ``max_streams_per_key`` slots and one of the
scheduler's ``max_uploads`` (:meth:`Limits.acquire_upload`, taken by the auth interceptor, which
also applies the two upload timeouts: :func:`opentinker_scheduler.security.auth.timed_uploads`);
the dataset byte and disk checks are :meth:`opentinker_scheduler.data.datasets.DatasetStore.begin`'s.

The per-caller limits (pending, rate, streams, dataset bytes per owner) default to the values above
when ``auth.enabled`` is true. With authentication off (one trusted user, ``make demo``, the
benchmarks) they default to no limit; a value written in the config applies in both modes. Message
and spec sizes always apply, and so do ``max_submits_in_flight`` and ``max_submit_wait``, the
scheduler's own load: over them a submit is refused at once with ``RESOURCE_EXHAUSTED`` (reason
``OVERLOADED``) and a ``google.rpc.RetryInfo``, before anything is done
(:mod:`opentinker_scheduler.admission.load`); the upload bounds (``max_uploads``, the timeouts,
``min_free_disk_bytes``) hold in both modes too.

``submit_rate``/``submit_burst`` and ``max_streams_per_key`` count per API key, not per owner: an
owner with several keys gets each key's allowance. ``max_keys_per_owner`` (enforced by
:class:`~opentinker_scheduler.security.keys.KeyStore` on create and on rotation with a grace period, also
for keys an admin creates) bounds that to ``max_keys_per_owner`` times the per-key limits.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

from opentinker_scheduler.config.limits import DEFAULTS, LimitsConfig  # noqa: F401 - the section, re-exported
from opentinker_scheduler.errors import ResourceExhausted


class TokenBucket:
    """Token bucket (rate tokens per second, at most ``burst`` stored), one per API key.

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
    """The scheduler's per-caller limiters, keyed by API key prefix (or owner with auth off).

    Thread-safe (the stream counter is touched from gRPC handlers only, but tests call it from
    threads). Times come from ``clock`` (seconds, monotonic) so tests need not sleep.
    """

    _MAX_BUCKETS = 100_000  # idle buckets are dropped beyond this many keys

    def __init__(self, config: LimitsConfig, *, clock=time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self._buckets: dict[str, TokenBucket] = {}
        self._streams: dict[str, int] = {}
        self._uploads = 0
        self._lock = threading.Lock()

    def check_spec_size(self, size_bytes: int) -> None:
        """Raises ResourceExhausted when a serialized TaskSpec of ``size_bytes`` is too large."""
        most = self.config.max_spec_bytes
        if most and size_bytes > most:
            raise ResourceExhausted(
                f"spec: {size_bytes} bytes serialized, more than the limit of {most} (limits.max_spec_bytes)"
            )

    def check_submit_rate(self, key: str, *, override: tuple[float | None, int | None, str] | None = None) -> None:
        """Take a SubmitTask token for ``key``.

        Args:
            override: ``(rate, burst, config key)`` of the caller's quota queue
                (``queues[i].limits``); a None value keeps the ``limits:`` section's.

        Raises:
            ResourceExhausted: the key's bucket is empty; the message says when to retry.
        """
        rate, burst, where = self.config.submit_rate, self.config.submit_burst, "limits.submit_rate"
        if override is not None:
            rate = override[0] if override[0] is not None else rate
            burst = override[1] if override[1] is not None else burst
            where = override[2]
        if not rate:
            return
        now = self.clock()
        with self._lock:
            bucket = self._buckets.get(key)
            if bucket is None:
                if len(self._buckets) >= self._MAX_BUCKETS:
                    self._buckets.clear()  # full buckets again: at worst one extra burst each
                bucket = self._buckets[key] = TokenBucket(rate, int(burst or 1), now)
            elif (bucket.rate, bucket.burst) != (rate, int(burst or 1)):  # the queue's limits changed
                bucket.rate, bucket.burst = rate, int(burst or 1)
            wait = bucket.take(now)
        if wait:
            raise ResourceExhausted(
                f"submit rate limit: at most {rate:g} SubmitTask calls per second per API key "
                f"(burst {burst}) ({where}); retry in {wait:.2f} s"
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

    def acquire_stream(self, key: str, *, locked: bool = False) -> None:
        """Take one of ``key``'s concurrent stream slots; give it back with :meth:`release_stream`.
        ``locked``: the caller holds the limiter's lock already.

        Raises:
            ResourceExhausted: ``key`` already holds ``max_streams_per_key`` streams.
        """
        if not locked:
            with self._lock:
                self.acquire_stream(key, locked=True)
            return
        most = self.config.max_streams_per_key
        open_now = self._streams.get(key, 0)
        if most and open_now >= most:
            raise ResourceExhausted(
                f"too many concurrent streams: {open_now} open for this API key, the limit is {most} "
                "(limits.max_streams_per_key); close a watch, download or upload first"
            )
        self._streams[key] = open_now + 1

    def acquire_upload(self, key: str) -> None:
        """Take one of ``key``'s stream slots (uploads count as streams, ``max_streams_per_key``)
        and one of the scheduler's ``max_uploads`` upload slots (all keys together); give both
        back with :meth:`release_upload`.

        Raises:
            ResourceExhausted: either limit is reached (the message names it and its config key).
        """
        most = self.config.max_uploads
        with self._lock:
            if most and self._uploads >= most:
                raise ResourceExhausted(
                    f"too many uploads in progress: {self._uploads} open on this scheduler, the limit is {most} "
                    "(limits.max_uploads); retry when some have finished"
                )
            self.acquire_stream(key, locked=True)
            self._uploads += 1

    def release_upload(self, key: str) -> None:
        with self._lock:
            self._uploads = max(0, self._uploads - 1)
        self.release_stream(key)

    def open_uploads(self) -> int:
        with self._lock:
            return self._uploads

    def release_stream(self, key: str) -> None:
        with self._lock:
            left = self._streams.get(key, 1) - 1
            if left > 0:
                self._streams[key] = left
            else:
                self._streams.pop(key, None)

    @contextlib.contextmanager
    def stream(self, key: str) -> Iterator[None]:
        """``with limits.stream(key):`` holds one slot for the block (see :meth:`acquire_stream`)."""
        self.acquire_stream(key)
        try:
            yield
        finally:
            self.release_stream(key)

    def open_streams(self, key: str) -> int:
        with self._lock:
            return self._streams.get(key, 0)
