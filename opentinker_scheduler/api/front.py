"""The public gRPC port, plaintext: HTTP/1.1 ``GET /health`` and ``/metrics`` there too.

The seed checks the scheduler with ``curl http://scheduler-host:8888/health``, on the gRPC port,
and gRPC's server cannot answer HTTP/1.1 (curl gets ``Received HTTP/0.9 when not allowed``). So
when the scheduler runs without ``tls:``, an asyncio TCP front listens on the public port and
looks at the first bytes of each connection:

* the HTTP/2 client preface (``PRI * HTTP/2.0\\r\\n\\r\\nSM\\r\\n\\r\\n``, which every gRPC client
  sends first) -> the connection is spliced, byte for byte, to the real gRPC server on a private
  loopback port (:attr:`PortFront.upstream`);
* a TLS handshake (an ``https://`` URL to this plaintext port) -> answered at once with a
  plaintext HTTP 400 and closed (the client's TLS library then reports a wrong version number);
* anything else is read as an HTTP/1.x request and answered from the same handlers as the HTTP
  side port (:meth:`~opentinker_scheduler.api.http.HttpEndpoint.answer`), then closed.

The gRPC server sees every spliced connection coming from loopback; :meth:`PortFront.peer_of` maps
the peer it reports back to the client's own address (audit records and open streams name the real
client). With ``tls:`` there is no front: the gRPC server owns the public port, and its TLS
(mTLS peer identity included) ends in gRPC itself; health is then on the HTTP(S) side port only.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Callable

import structlog

__all__ = ["PREFACE", "PortFront"]

log = structlog.get_logger("opentinker.scheduler")

#: What an HTTP/2 client (every gRPC client) sends first (RFC 9113, section 3.4).
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
#: The first byte of a TLS handshake record (RFC 8446, section 5.1: content type 22).
TLS_HANDSHAKE = b"\x16"
#: Most bytes of an HTTP/1.x request head read before answering 431.
MAX_HEAD = 8192
#: Seconds a new connection may take to show which protocol it speaks (and to send its HTTP head).
FIRST_BYTES_TIMEOUT_S = 10.0
#: Bytes buffered towards a side that does not read, before the other side is paused.
HIGH_WATER = 1 << 20

_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 431: "Request Header Fields Too Large"}
_REASONS[400] = "Bad Request"
_REASONS[503] = "Service Unavailable"
_REASONS[401] = "Unauthorized"

#: (method, path, authorization) -> (status, headers, body): the HTTP handlers (HttpEndpoint.answer).
Answer = Callable[[str, str, str], tuple[int, list[tuple[str, str]], bytes]]


def grpc_peer(sockname) -> str:
    """A socket address as gRPC's ``context.peer()`` spells it: ``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``."""
    host, port = sockname[0], sockname[1]
    return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"


class _Client(asyncio.Protocol):
    """One accepted connection on the public port."""

    def __init__(self, front: PortFront) -> None:
        self.front = front
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.upstream: _Upstream | None = None
        self.mode = "peek"  # -> "connecting" -> "splice", or "http"; "closed"
        self.timer: asyncio.TimerHandle | None = None
        self.peer = ""

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        peername = transport.get_extra_info("peername")
        self.peer = grpc_peer(peername) if peername else ""
        self.timer = asyncio.get_running_loop().call_later(FIRST_BYTES_TIMEOUT_S, self._too_slow)

    def data_received(self, data: bytes) -> None:
        if self.mode == "splice":
            self.upstream.transport.write(data)
            return
        self.buffer += data
        if self.mode == "peek" and self.buffer[:1] == TLS_HANDSHAKE:
            # A TLS ClientHello (an https:// URL to this plaintext port): no request head will
            # follow, so answer now instead of waiting for one. Plaintext bytes where a TLS record
            # should be make the client's TLS library fail at once with "wrong version number",
            # which the client reads as "use http://" (opentinker_client/_reach.py).
            self._respond(400, [], b"this port speaks plaintext gRPC and HTTP/1.1, not TLS: use http://\n")
            return
        if self.mode == "peek":
            head = bytes(self.buffer[: len(PREFACE)])
            if head == PREFACE:
                self.mode = "connecting"
                asyncio.ensure_future(self._connect())
            elif not PREFACE.startswith(head):
                self.mode = "http"
        if self.mode == "connecting" and len(self.buffer) > HIGH_WATER:
            self.transport.pause_reading()
        if self.mode == "http":
            self._http()

    def eof_received(self):
        if self.mode == "splice" and self.upstream.transport.can_write_eof():
            self.upstream.transport.write_eof()
            return True  # keep the other direction open until the server closes
        return False

    def connection_lost(self, exc) -> None:
        self.mode = "closed"
        if self.timer is not None:
            self.timer.cancel()
        if self.upstream is not None:
            self.front.forget(self.upstream.local)
            if self.upstream.transport is not None:
                self.upstream.transport.close()

    def pause_writing(self) -> None:  # the client reads slower than the server sends
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.resume_reading()

    # -- the two protocols --------------------------------------------------------------------

    def _too_slow(self) -> None:
        if self.mode in ("peek", "http"):
            self.transport.close()

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, upstream = await loop.create_connection(lambda: _Upstream(self), *self.front.upstream)
        except OSError as exc:
            log.warning("grpc front: cannot reach the gRPC server", error=str(exc))
            self.transport.close()
            return
        if self.mode == "closed":  # the client went away meanwhile
            upstream.transport.close()
            return
        if self.timer is not None:
            self.timer.cancel()
        self.upstream = upstream
        self.front.remember(upstream.local, self.peer)
        self.mode = "splice"
        upstream.transport.write(bytes(self.buffer))
        self.buffer.clear()
        self.transport.resume_reading()

    def _http(self) -> None:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > MAX_HEAD:
                self._respond(431, [], b"request head too large\n")
            return
        line = bytes(self.buffer[: self.buffer.find(b"\r\n")]).decode("latin-1")
        parts = line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            self._respond(400, [], b"expected an HTTP/1.1 request (GET /health, GET /metrics) or gRPC\n")
            return
        method, target, _ = parts
        if method not in ("GET", "HEAD"):
            self._respond(405, [("Allow", "GET, HEAD")], b"only GET and HEAD\n")
            return
        authorization = ""
        for raw in bytes(self.buffer[:end]).decode("latin-1").split("\r\n")[1:]:
            name, _, value = raw.partition(":")
            if name.strip().lower() == "authorization":
                authorization = value.strip()
        status, headers, body = self.front.answer(method, target.split("?", 1)[0], authorization)
        self._respond(status, headers, b"" if method == "HEAD" else body, length=len(body))

    def _respond(self, status: int, headers: list[tuple[str, str]], body: bytes, length: int | None = None) -> None:
        if self.mode == "closed":
            return
        names = {k.lower() for k, _ in headers}
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, '')}"]
        lines += [f"{k}: {v}" for k, v in headers]
        if "content-type" not in names:
            lines.append("Content-Type: text/plain; charset=utf-8")
        lines += [f"Content-Length: {len(body) if length is None else length}", "Connection: close", "", ""]
        self.transport.write("\r\n".join(lines).encode("latin-1") + body)
        self.mode = "closed"
        self.transport.close()  # after the buffered answer is written


class _Upstream(asyncio.Protocol):
    """The connection to the private gRPC server for one spliced client."""

    def __init__(self, client: _Client) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.local = ""

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.local = grpc_peer(transport.get_extra_info("sockname"))

    def data_received(self, data: bytes) -> None:
        self.client.transport.write(data)

    def eof_received(self):
        if self.client.transport.can_write_eof():
            self.client.transport.write_eof()
        return False

    def connection_lost(self, exc) -> None:
        self.client.transport.close()

    def pause_writing(self) -> None:  # the gRPC server reads slower than the client sends
        self.client.transport.pause_reading()

    def resume_writing(self) -> None:
        self.client.transport.resume_reading()


class PortFront:
    """The public plaintext gRPC port: splices gRPC to ``upstream`` (``(host, port)`` of the real
    gRPC server), answers HTTP/1.x with ``answer``.

    Start with :meth:`start`; :attr:`port` is then the bound port; :meth:`stop` closes it.
    """

    def __init__(self, upstream: tuple[str, int], answer: Answer) -> None:
        self.upstream = upstream
        self.answer = answer
        self.server: asyncio.Server | None = None
        self.server_v6: asyncio.Server | None = None  # the IPv6 wildcard beside an IPv4 one
        self.port = 0
        self._peers: dict[str, str] = {}  # the front's own end towards gRPC -> the client's address

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: any free port); returns the bound port. The IPv4 wildcard
        (``0.0.0.0``, or empty) also listens on IPv6's (``::``) at the same port where the host
        has IPv6, as gRPC's own wildcard does: ``localhost`` often resolves to ``::1`` first.

        Raises:
            OSError: the port cannot be bound (on IPv6 alone: not raised, IPv4 is served).
        """
        loop = asyncio.get_running_loop()
        factory = lambda: _Client(self)  # noqa: E731
        self.server = await loop.create_server(factory, host or "0.0.0.0", port, reuse_address=True, backlog=1024)
        self.port = self.server.sockets[0].getsockname()[1]
        if host in ("0.0.0.0", "") and socket.has_ipv6:
            try:  # asyncio sets IPV6_V6ONLY: this socket takes IPv6 alone, beside the IPv4 one
                self.server_v6 = await loop.create_server(factory, "::", self.port, reuse_address=True, backlog=1024)
            except OSError as exc:  # no IPv6 here (disabled, or the port taken on IPv6 only)
                log.info("port front: IPv4 only", port=self.port, why=exc.strerror or str(exc))
        return self.port

    async def stop(self) -> None:
        for server in (self.server, self.server_v6):
            if server is not None:
                server.close()
        self.server = self.server_v6 = None

    def remember(self, local: str, peer: str) -> None:
        self._peers[local] = peer

    def forget(self, local: str) -> None:
        self._peers.pop(local, None)

    def peer_of(self, peer: str) -> str:
        """The client's address for a peer the gRPC server reports (``context.peer()``): the
        front's loopback end is replaced by whom it splices; any other peer is returned as is."""
        return self._peers.get(peer, peer)
