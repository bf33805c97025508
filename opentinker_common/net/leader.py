"""Following the leader among several schedulers: ``SCHEDULER_URL=host-a:8888,host-b:8888``.

Every scheduler serves reads; only the leader takes writes and node streams. A follower refuses
those with UNAVAILABLE and a ``google.rpc.ErrorInfo`` (reason ``NOT_LEADER``, domain
``opentinker.scheduler``, metadata ``leader``: the leader's ``host:port``, or ``""`` during an election);
:func:`not_leader` reads it from any gRPC error. :class:`SchedulerTargets` is the list of
addresses a client or a trainer was given, with the one in use: it moves to the leader a
follower names, or to the next address when one cannot be reached.

One load-balancer address works as well: the balancer sends traffic to the instance whose
readiness check passes (``/ready``: the leader only).
"""

from __future__ import annotations

import threading
import time

from opentinker_common.net.url import SchedulerAddress, parse_scheduler_address

__all__ = ["SchedulerTargets", "not_leader", "parse_scheduler_urls", "NOT_LEADER_REASON", "ERROR_DOMAIN"]

NOT_LEADER_REASON = "NOT_LEADER"
ERROR_DOMAIN = "opentinker.scheduler"  # as the scheduler's errors.ERROR_DOMAIN
_DETAILS_KEY = "grpc-status-details-bin"
#: Longest pause, in seconds, between a client's tries while it looks for the leader (a follower's
#: refusal, an address or balancer that cannot be reached): a failover takes about a second, so
#: a longer pause would only add to it.
FAILOVER_BACKOFF_MAX_S = 1.0


def parse_scheduler_urls(text: str) -> list[SchedulerAddress]:
    """One scheduler URL, or several separated by commas (``host-a:8888,host-b:8888``), each in
    any form :func:`~opentinker_common.net.url.parse_scheduler_address` takes; duplicates once.

    Raises:
        ValueError: an empty entry or a bad URL (the message names it), or URLs that disagree on
            TLS (``https://`` for some, not for others).
    """
    if not isinstance(text, str):
        raise TypeError(f"scheduler URL must be a string, got {type(text).__name__}")
    parts = [p.strip() for p in text.split(",")]
    if len(parts) > 1 and any(not p for p in parts):
        raise ValueError(f"bad scheduler URL list {text!r}: an empty entry between commas")
    out: list[SchedulerAddress] = []
    for part in parts:
        address = parse_scheduler_address(part)
        if all(a.target != address.target for a in out):
            out.append(address)
    if len({a.tls for a in out}) > 1:
        raise ValueError(f"bad scheduler URL list {text!r}: some entries ask for TLS (https://) and others do not")
    return out


def not_leader(err) -> str | None:
    """For a gRPC error (sync or asyncio): None when it is not a follower's refusal; else the
    leader's ``host:port`` it names, ``""`` when no leader is known yet (an election)."""
    try:
        metadata = err.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - an error without metadata
        return None
    raw = next((v for k, v in metadata if k == _DETAILS_KEY), None)
    if raw is None:
        return None
    try:
        from google.rpc import error_details_pb2, status_pb2

        status = status_pb2.Status.FromString(raw if isinstance(raw, bytes) else raw.encode())
    except Exception:  # noqa: BLE001 - not a google.rpc.Status
        return None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            if info.reason == NOT_LEADER_REASON and info.domain == ERROR_DOMAIN:
                return info.metadata.get("leader", "")
    return None


class SchedulerTargets:
    """The scheduler addresses given, and the one in use (thread-safe).

    A leader named by a follower that is not among them (an address only the cluster knows) is
    used as given; it is dropped again when it cannot be reached. A leader that could not be
    reached a moment ago (``stale_s``) is not followed: right after a leader dies, the followers
    still name it until its lease expires, and the caller does better to keep asking the follower
    that is about to take over than to bounce between it and the dead address.
    """

    #: Seconds a named leader that could not be reached is not followed again.
    stale_s = 3.0

    def __init__(self, targets: list[str] | tuple[str, ...]) -> None:
        if not targets:
            raise ValueError("expected at least one scheduler address")
        self.given = tuple(targets)
        self._extra = ""
        self._index = 0
        self._unreachable: dict[str, float] = {}  # address -> monotonic time it failed
        self._lock = threading.Lock()

    @property
    def current(self) -> str:
        with self._lock:
            return self._extra or self.given[self._index]

    @property
    def several(self) -> bool:
        """More than one address to go to (so an unreachable one is worth leaving)."""
        return len(self.given) > 1

    def follow(self, leader: str) -> str:
        """Use ``leader`` (a follower named it), unless it could not be reached within the last
        ``stale_s`` seconds; returns the address now in use."""
        with self._lock:
            failed = self._unreachable.get(leader)
            if failed is not None and time.monotonic() - failed < self.stale_s:
                return self._extra or self.given[self._index]
            if leader in self.given:
                self._index, self._extra = self.given.index(leader), ""
            elif leader:
                self._extra = leader
            return self._extra or self.given[self._index]

    def advance(self) -> str:
        """Leave the address in use (unreachable) for the next one; returns it."""
        with self._lock:
            if self._extra:
                self._extra = ""
            else:
                self._index = (self._index + 1) % len(self.given)
            return self.given[self._index]

    def _advance_live(self) -> None:
        """Leave a follower that knows no leader (an election) for the next address that has
        not failed within ``stale_s``; stay when there is none: that follower lives and may be
        the one to lead, where the others' addresses just failed."""
        with self._lock:
            now = time.monotonic()
            start = self._index if self._extra else (self._index + 1) % len(self.given)
            for k in range(len(self.given)):
                i = (start + k) % len(self.given)
                failed = self._unreachable.get(self.given[i])
                if (failed is None or now - failed >= self.stale_s) and (self._extra or i != self._index):
                    self._index, self._extra = i, ""
                    return

    def moved(self, err) -> bool:
        """After an UNAVAILABLE ``err``: move to the leader it names; from a follower knowing no
        leader, to the next address that has not just failed (or stay); from an address that
        could not be reached, to the next one, when there are several. False when there is
        nowhere else to go (one address, not a follower's refusal)."""
        hint = not_leader(err)
        if hint:
            self.follow(hint)
            return True
        if hint == "":
            self._advance_live()
            return True
        with self._lock:
            self._unreachable[self._extra or self.given[self._index]] = time.monotonic()
        if self.several or self._extra:
            self.advance()
            return True
        return False


class FollowingChannel:
    """A blocking ``grpc.Channel`` look-alike over several scheduler addresses, for code that
    holds one channel (a task worker's artifact uploads, dataset and adapter lookups): a unary
    call refused by a follower, or whose address cannot be reached, goes again to the leader (or
    the next address) with backoff within its timeout; a streaming call is made on the address in
    use and, when it fails, moves there for the next call. Stubs take it as a channel.

    Args:
        targets: ``host:port`` of every scheduler.
        make: opens a real channel to one address (plaintext or TLS, as the caller needs).
        timeout_s: the budget of a unary call made without a timeout.
    """

    def __init__(self, targets: list[str] | tuple[str, ...], make, *, timeout_s: float = 30.0) -> None:
        self.targets = SchedulerTargets(targets)
        self._make = make
        self.timeout_s = timeout_s
        self._channels: dict[str, object] = {}
        self._lock = threading.Lock()

    def _channel(self, target: str):
        with self._lock:
            channel = self._channels.get(target)
            if channel is None:
                channel = self._channels[target] = self._make(target)
            return channel

    def _moved(self, err) -> bool:
        code = getattr(err, "code", None)
        return callable(code) and code().name == "UNAVAILABLE" and self.targets.moved(err)

    def unary_unary(self, method, *args, **kwargs):
        import random

        def call(request, timeout=None, metadata=None, **call_kw):
            deadline = time.monotonic() + (timeout if timeout is not None else self.timeout_s)
            delay = 0.1
            while True:
                stub_call = self._channel(self.targets.current).unary_unary(method, *args, **kwargs)
                try:
                    return stub_call(
                        request, timeout=max(0.05, deadline - time.monotonic()), metadata=metadata, **call_kw
                    )
                except Exception as err:  # noqa: BLE001 - grpc.RpcError; anything else is re-raised
                    pause = random.uniform(delay / 2, delay)
                    if not self._moved(err) or time.monotonic() + pause >= deadline:
                        raise
                    time.sleep(pause)
                    delay = min(FAILOVER_BACKOFF_MAX_S, delay * 2)

        return call

    def unary_stream(self, method, *args, **kwargs):
        def call(request, *c_args, **c_kw):
            responses = self._channel(self.targets.current).unary_stream(method, *args, **kwargs)(
                request, *c_args, **c_kw
            )

            def iterate():
                try:
                    yield from responses
                except Exception as err:  # noqa: BLE001 - grpc.RpcError: the next call goes elsewhere
                    self._moved(err)
                    raise

            return iterate()

        return call

    def stream_unary(self, method, *args, **kwargs):
        def call(requests, *c_args, **c_kw):
            try:
                return self._channel(self.targets.current).stream_unary(method, *args, **kwargs)(
                    requests, *c_args, **c_kw
                )
            except Exception as err:  # noqa: BLE001 - grpc.RpcError: the next call goes elsewhere
                self._moved(err)
                raise

        return call

    def stream_stream(self, method, *args, **kwargs):
        return self._channel(self.targets.current).stream_stream(method, *args, **kwargs)

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
