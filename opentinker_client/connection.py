"""``SchedulerConnection``: the one gRPC channel an :class:`~opentinker_client.RLClient` talks to the
scheduler through, with the caller's API key and the mapping of gRPC errors to the client's.

The task, data and serving parts of the client (:mod:`~opentinker_client.client_tasks`,
:mod:`~opentinker_client.client_data`, :mod:`~opentinker_client.client_serving`) each receive
it; none of them reaches into another. Every error a call raises is an
:class:`~opentinker_client.errors.OpenTinkerError` (:func:`~opentinker_client.errors.from_rpc_error`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import threading
import time
from importlib import metadata as _metadata
from typing import Any, Iterable, Iterator

import grpc

from opentinker.scheduler.v1 import admin_pb2_grpc, scheduler_pb2_grpc
from opentinker_client._reach import accepts_connections, explain_unreachable
from opentinker_client.errors import (
    SCHEDULER_PLAINTEXT_HINT,
    DeadlineExceededError,
    OpenTinkerError,
    UnavailableError,
    from_rpc_error,
)
from opentinker_common.net.bearer import bearer_metadata, clean_api_key
from opentinker_common.net.call_budget import budget_metadata
from opentinker_common.net.grpc_options import client_keepalive, message_limits
from opentinker_common.net.tls import channel_credentials
from opentinker_common.net.leader import FAILOVER_BACKOFF_MAX_S, SchedulerTargets, parse_scheduler_urls

__all__ = ["SchedulerConnection", "StreamResponses", "resolve_api_key"]

_SERVICE = "opentinker.scheduler.v1.SchedulerService"

log = logging.getLogger("opentinker_client")

#: Seconds a unary call waits before it warns (``logging``, once per call; the CLI prints it on
#: stderr) that the scheduler has not answered yet and is still waited on: a stopped (SIGSTOP)
#: or overloaded scheduler accepts the connection and says nothing until the call's timeout. (An
#: address where nothing listens gets no such warning: its UNAVAILABLE says so.)
WAITING_NOTICE_S = 3.0

# Unary RPCs are retried by gRPC itself on UNAVAILABLE (scheduler restarting, connection refused);
# all of them are idempotent. SubmitTask is retried by TaskCalls.submit instead (made idempotent by
# the request_id the client always sends): each attempt must carry its own budget (call_budget),
# and it also retries an overloaded scheduler's refusal and a call cut off with CANCELLED.
_RETRIED = ("GetTask", "ListTasks", "CancelTask", "GetMetrics", "ListNodes", "ListCheckpoints")
_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": _SERVICE, "method": m} for m in _RETRIED],
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.2s",
                    "maxBackoff": f"{FAILOVER_BACKOFF_MAX_S:g}s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)


def _channel_options(*, retries: bool = True) -> list[tuple[str, Any]]:
    """Channel options; ``retries``: gRPC retries UNAVAILABLE itself (one scheduler address; with
    several, :meth:`SchedulerConnection.unary` moves to the next address instead of waiting)."""
    try:
        version = _metadata.version("opentinker")
    except _metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
        version = "dev"
    return [
        # Keepalive only while a call is open (a watch stream); the scheduler permits pings every 10 s.
        *client_keepalive(),
        # Keep pinging on a quiet watch stream (the default stops after 2 pings without data).
        ("grpc.http2.max_pings_without_data", 0),
        *message_limits(),
        ("grpc.enable_retries", 1 if retries else 0),
        # A scheduler that was down (a dead leader, restarted as a follower) is dialled again
        # within a second, not after gRPC's growing reconnect backoff (up to 120 s).
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", int(FAILOVER_BACKOFF_MAX_S * 1000)),
        ("grpc.service_config", _SERVICE_CONFIG),
        ("grpc.primary_user_agent", f"opentinker-client/{version}"),
    ]


def resolve_api_key(api_key: str | None) -> str:
    """The key to send: ``api_key``, or ``$OPENTINKER_API_KEY`` when it is ``None``; ``""`` sends
    none. Surrounding whitespace (the newline of a key read from a file) is stripped.

    Raises:
        ValueError: inner whitespace or control characters (naming ``api_key``, never the key).
    """
    if api_key is None:
        api_key = os.environ.get("OPENTINKER_API_KEY") or ""
    return clean_api_key(api_key)  # gRPC would refuse a key ending in "\n" as metadata


class SchedulerConnection:
    """A channel to ``SchedulerService`` with the caller's API key on every call.

    Args:
        scheduler_url: ``http://host:port``, ``grpc://host:port``, ``host:port``, ``[::1]:port``;
            ``https://`` or ``grpcs://`` mean TLS (see
            :func:`~opentinker_common.net.url.parse_scheduler_address`). Several schedulers
            (one leader, :mod:`opentinker_common.net.leader`): their URLs separated by commas,
            ``host-a:8888,host-b:8888``; calls go to the leader, found from a follower's
            UNAVAILABLE (NOT_LEADER) or by trying the next URL when one cannot be reached, with
            backoff, within the call's timeout.
        timeout: default deadline of a unary call, in seconds (gRPC's own retries included).
        api_key: as :func:`resolve_api_key` takes it.
        root_certificates, client_cert, client_key: PEM files (``None``: ``$OPENTINKER_TLS_CA``,
            ``$OPENTINKER_TLS_CERT``, ``$OPENTINKER_TLS_KEY``); a CA turns TLS on, the pair is mTLS.

    Raises:
        ValueError: a bad address, TLS file or API key (naming the argument, never the key).

    Attributes:
        target: the ``host:port`` dialled now (the leader, as far as known).
        targets: every address given, and the one in use (:class:`~opentinker_common.net.leader.SchedulerTargets`).
        api_key: the key sent (``""``: none); never shown in a repr or an error.
        metadata: the call metadata that carries it.
        root_certificates: the ``root_certificates`` argument, handed on to inference clients.
        channel, stub: the gRPC channel and its ``SchedulerServiceStub``.
        closed: :meth:`close` was called; calls then raise :class:`OpenTinkerError`.

    The channel connects lazily; an unreachable scheduler shows up as
    :class:`~opentinker_client.errors.UnavailableError` on the first call. Safe to share between
    threads.
    """

    def __init__(
        self,
        scheduler_url: str,
        *,
        timeout: float,
        api_key: str | None = None,
        root_certificates: str | os.PathLike | None = None,
        client_cert: str | os.PathLike | None = None,
        client_key: str | os.PathLike | None = None,
    ) -> None:
        addresses = parse_scheduler_urls(scheduler_url)  # https:// / grpcs://: TLS even without a CA (system roots)
        self.targets = SchedulerTargets([a.target for a in addresses])
        self.timeout = float(timeout)
        self.api_key: str = resolve_api_key(api_key)
        self.metadata: tuple[tuple[str, str], ...] = bearer_metadata(self.api_key)
        self._creds = channel_credentials(root_certificates, client_cert, client_key, tls=addresses[0].tls)
        # Plaintext: an UNAVAILABLE "Socket closed" gets a hint that the scheduler may serve TLS.
        self._plaintext_hint = SCHEDULER_PLAINTEXT_HINT if self._creds is None else ""
        self.root_certificates = root_certificates
        self._ca_given = bool(root_certificates or os.environ.get("OPENTINKER_TLS_CA"))
        self._channels: dict[str, tuple[grpc.Channel, scheduler_pb2_grpc.SchedulerServiceStub]] = {}
        self._channels_lock = threading.Lock()
        #: target -> the connectivity callback its channel was subscribed with (unsubscribed on close).
        self._watchers: dict[str, Any] = {}
        #: target -> monotonic time its channel last failed to connect (TRANSIENT_FAILURE: refused,
        #: a TLS handshake that failed): a call that waits after that is not a silent scheduler.
        self._failed_at: dict[str, float] = {}
        self._admin_stubs: dict[str, Any] = {}
        self.closed = False
        self._open(self.targets.current)

    def _open(self, target: str) -> tuple[grpc.Channel, Any]:
        """The channel and stub of ``target`` (made on first use; kept until :meth:`close`)."""
        with self._channels_lock:
            found = self._channels.get(target)
            if found is None:
                options = _channel_options(retries=not self.targets.several)
                if self._creds is None:
                    channel = grpc.insecure_channel(target, options=options)
                else:
                    channel = grpc.secure_channel(target, self._creds, options=options)
                found = self._channels[target] = (channel, scheduler_pb2_grpc.SchedulerServiceStub(channel))
            return found

    def _used(self, target: str) -> tuple[grpc.Channel, Any]:
        """:meth:`_open`, and watch the channel's connectivity from its first use (not before: a
        client closed unused, as a CLI refusing a bad file is, leaves no gRPC polling thread to
        trip over the closed channel)."""
        found = self._open(target)
        with self._channels_lock:
            if target not in self._watchers and not self.closed:
                watcher = self._watchers[target] = lambda state, t=target: self._seen_state(t, state)
                found[0].subscribe(watcher)
        return found

    @property
    def target(self) -> str:
        return self.targets.current

    def _seen_state(self, target: str, state: grpc.ChannelConnectivity) -> None:
        if state == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            self._failed_at[target] = time.monotonic()

    @property
    def channel(self) -> grpc.Channel:
        """The channel to the scheduler in use."""
        return self._used(self.targets.current)[0]

    @property
    def stub(self) -> Any:
        """``SchedulerServiceStub`` of the scheduler in use."""
        return self._used(self.targets.current)[1]

    def moved(self, err: grpc.RpcError) -> bool:
        """After an UNAVAILABLE ``err``: go to the leader a follower named, or to the next address
        (:meth:`SchedulerTargets.moved`); False when there is nowhere else to try."""
        if err.code() != grpc.StatusCode.UNAVAILABLE:
            return False
        before = self.targets.current
        moved = self.targets.moved(err)
        if moved and self.targets.current != before:
            import logging

            logging.getLogger("opentinker.client").info(
                "scheduler %s is not the leader or cannot be reached; now using %s", before, self.targets.current
            )
        return moved

    def __repr__(self) -> str:
        return f"SchedulerConnection(target={self.target!r})"

    def __enter__(self) -> SchedulerConnection:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close the channels; open streams end with an error. Idempotent."""
        if not self.closed:
            self.closed = True
            with self._channels_lock:
                for target, (channel, _) in self._channels.items():
                    # Unsubscribed first: gRPC's polling thread then ends at its next wake-up
                    # instead of watching a closed channel ("Cannot monitor channel state").
                    watcher = self._watchers.pop(target, None)
                    if watcher is not None:
                        channel.unsubscribe(watcher)
                    channel.close()

    def check_open(self) -> None:
        """Raises :class:`OpenTinkerError` ("this RLClient is closed") after :meth:`close`."""
        if self.closed:
            raise OpenTinkerError("this RLClient is closed")

    def error(self, err: grpc.RpcError, *, plaintext_hint: bool = True) -> OpenTinkerError:
        """``err`` as the client's :class:`OpenTinkerError` subclass; on a plaintext channel an
        ``UNAVAILABLE`` from a server that closed the connection carries a TLS hint, unless
        ``plaintext_hint`` is false."""
        mapped = from_rpc_error(err, plaintext_hint=self._plaintext_hint if plaintext_hint else "")
        # "nothing is listening", "that is the HTTP port", "pass its CA: --tls-ca" ...
        return explain_unreachable(mapped, self.target, tls=self._creds is not None, ca_given=self._ca_given)

    def unary(
        self,
        method: str,
        request: Any,
        *,
        timeout: float | None = None,
        service: str = "scheduler",
        retry: bool = True,
    ) -> Any:
        """Call the unary RPC ``method`` (``"GetTask"`` ...) and return its response. The call
        carries its budget (``opentinker-timeout-ms``), so the scheduler can tell how long it
        waited before being taken up (:mod:`opentinker_common.net.call_budget`).

        Args:
            timeout: seconds; ``None`` is the connection's ``timeout``.
            service: ``"scheduler"`` (SchedulerService) or ``"admin"`` (AdminService: keys,
                queues); both follow the leader and explain an unreachable address alike.
            retry: False for a call that is not idempotent (creating or rotating a key): it goes
                once; after a follower's refusal the next call goes to the leader.

        Raises:
            OpenTinkerError: closed, or the subclass for the status the call ended with.
        """
        self.check_open()
        budget = self.timeout if timeout is None else timeout
        started = time.monotonic()
        deadline = started + budget
        delay = 0.05
        noticed = False
        silent = False  # it took the connection and said nothing for WAITING_NOTICE_S
        while True:
            left = max(0.05, deadline - time.monotonic())
            target = self.targets.current
            try:
                stub = self.stub if service == "scheduler" else self._admin_stub()
                metadata = self.metadata + budget_metadata(left)
                call = getattr(stub, method).future(request, timeout=left, metadata=metadata)
                if not noticed and deadline - time.monotonic() > WAITING_NOTICE_S:
                    try:
                        return call.result(timeout=max(0.0, started + WAITING_NOTICE_S - time.monotonic()))
                    except grpc.FutureTimeoutError:  # still running: say so once, then wait on
                        noticed = True
                    # There, but silent: it took the connection and says nothing. Not when nothing
                    # listens or the connection fails (a TLS mismatch): gRPC says why soon.
                    silent = self._failed_at.get(target, 0.0) < started and accepts_connections(target)
                    if silent:
                        log.warning(
                            "the scheduler at %s has not answered %s in %.0f s; still waiting for it (up to %.0f s "
                            "in all: the call's timeout, opentinker --timeout or RLClient(timeout=))",
                            target,
                            method,
                            WAITING_NOTICE_S,
                            budget,
                        )
                return call.result()
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() >= deadline - 0.05:
                    mapped = self.error(err)  # nothing listening there: _reach says so
                    if mapped.details != "Deadline Exceeded":
                        raise mapped from err
                    raise DeadlineExceededError(  # it is there and took the call, but never answered
                        f"the scheduler at {target} did not answer {method} within {budget:g} s (the call's timeout: "
                        "opentinker --timeout, RLClient(timeout=)); it may be stopped (SIGSTOP, a debugger), "
                        "overloaded, or behind a firewall that drops its packets"
                    ) from err
                if (
                    err.code() == grpc.StatusCode.UNAVAILABLE
                    and silent
                    and "failed to connect" in (err.details() or "")  # gRPC's own words, not the scheduler's answer
                    and accepts_connections(target)
                ):
                    # gRPC gave up on a connection the scheduler accepted but never answered (its
                    # HTTP/2 handshake timed out) and names the last address it tried: with
                    # localhost, often ::1 refusing. The scheduler is there and silent.
                    out = UnavailableError(
                        f"the scheduler at {target} took the connection but did not answer {method} in "
                        f"{time.monotonic() - started:.0f} s (gRPC gave up on the connection before the call's "
                        f"{budget:g} s timeout); it may be stopped (SIGSTOP, a debugger), overloaded, or behind a "
                        "firewall that drops its packets",
                        code=err.code(),
                    )
                    out.raw_details = err.details()
                    raise out from err
                # Several schedulers: a follower's refusal, or an address that cannot be reached,
                # moves to the leader (or the next address) and the call goes again (every unary
                # RPC is idempotent; SubmitTask by its request_id), within the call's timeout.
                pause = random.uniform(delay / 2, delay)
                if not self.moved(err) or not retry or time.monotonic() + pause >= deadline - 0.05:
                    raise self.error(err) from err
                time.sleep(pause)
                delay = min(FAILOVER_BACKOFF_MAX_S, delay * 2)

    def _admin_stub(self) -> Any:
        """``AdminServiceStub`` on the channel in use (made on first use per address)."""
        target = self.targets.current
        stub = self._admin_stubs.get(target)
        if stub is None:
            stub = self._admin_stubs[target] = admin_pb2_grpc.AdminServiceStub(self._used(target)[0])
        return stub

    def upload(self, method: str, requests: Iterable[Any], *, timeout: float | None = None) -> Any:
        """Call the client-streaming RPC ``method`` with ``requests``; ``timeout`` in seconds for
        the whole call, ``None`` for none. Errors as :meth:`unary`, without the TLS hint."""
        self.check_open()
        try:
            return getattr(self.stub, method)(requests, timeout=timeout, metadata=self.metadata)
        except grpc.RpcError as err:
            self.moved(err)  # the requests are spent: the next call goes to the leader
            raise self.error(err, plaintext_hint=False) from err

    @contextlib.contextmanager
    def stream(
        self,
        method: str,
        request: Any,
        *,
        timeout: float | None = None,
        answer_timeout: float | None = None,
        plaintext_hint: bool = True,
    ) -> Iterator[StreamResponses]:
        """Open the server-streaming RPC ``method``; the ``with`` block gets an iterator of its
        responses (a :class:`StreamResponses`) and leaving the block cancels the call::

            with connection.stream("WatchTask", request) as responses:
                for response in responses:
                    ...

        Args:
            timeout: seconds for the whole stream; ``None`` for none.
            answer_timeout: seconds the server has to answer at all (its response headers or a
                first message); unanswered by then, the call is cancelled and iterating raises
                :class:`~opentinker_client.errors.DeadlineExceededError`. This bounds a frozen
                server (connection accepted, nothing sent) without limiting a quiet stream that
                did answer. ``None``: no such bound.
            plaintext_hint: as for :meth:`error`.

        Raises:
            OpenTinkerError: closed (on entering); the subclass for the status the stream ended
                with (while iterating); DeadlineExceededError as ``answer_timeout`` says.
        """
        self.check_open()
        call = getattr(self.stub, method)(request, timeout=timeout, metadata=self.metadata)
        responses = StreamResponses(self, method, call, answer_timeout=answer_timeout, plaintext_hint=plaintext_hint)
        try:
            yield responses
        finally:
            responses.close()


class StreamResponses:
    """The responses of one stream opened by :meth:`SchedulerConnection.stream`, as an iterator.

    Attributes:
        answered: whether the server has answered: sent a message, or sent its headers and kept
            the call open until ``answer_timeout``.
    """

    def __init__(
        self,
        connection: SchedulerConnection,
        method: str,
        call: Any,
        *,
        answer_timeout: float | None,
        plaintext_hint: bool,
    ) -> None:
        self._connection = connection
        self._method = method
        self._call = call
        self._answer_timeout = answer_timeout
        self._plaintext_hint = plaintext_hint
        self._answered = threading.Event()
        self._headers = threading.Event()
        self._expired = threading.Event()
        self._timer: threading.Timer | None = None
        self._iterator = self._responses()
        if answer_timeout is not None:
            # initial_metadata() blocks until the headers come or the call ends (cancel included).
            threading.Thread(target=self._await_headers, name=f"{method}-headers", daemon=True).start()
            self._timer = threading.Timer(max(0.0, answer_timeout), self._expire)
            self._timer.daemon = True
            self._timer.start()

    @property
    def answered(self) -> bool:
        return self._answered.is_set()

    def _await_headers(self) -> None:
        try:
            self._call.initial_metadata()  # also returns (empty) when the call fails unanswered
        except Exception:  # noqa: BLE001 - the iterating thread sees the call's own error
            return
        self._headers.set()

    def _expire(self) -> None:
        # Headers on a call still open at the bound are an answer: a quiet stream that is alive.
        # (Headers alone prove nothing sooner: a call that fails to connect reports empty ones.)
        if self._answered.is_set() or self._call.done():
            return
        if self._headers.is_set():
            self._answered.set()
        else:
            self._expired.set()
            self._call.cancel()

    def _responses(self) -> Iterator[Any]:
        try:
            for response in self._call:
                self._answered.set()
                yield response
        except grpc.RpcError as err:
            self._connection.moved(err)  # a reopened stream goes to the leader (or the next address)
            if self._expired.is_set():  # cancelled by _expire, unanswered
                raise DeadlineExceededError(
                    f"{self._method}: the scheduler did not answer within {self._answer_timeout:g} s"
                ) from err
            raise self._connection.error(err, plaintext_hint=self._plaintext_hint) from err

    def __iter__(self) -> StreamResponses:
        return self

    def __next__(self) -> Any:
        return next(self._iterator)

    def close(self) -> None:
        """Cancel the call (idempotent)."""
        if self._timer is not None:
            self._timer.cancel()
        self._call.cancel()
