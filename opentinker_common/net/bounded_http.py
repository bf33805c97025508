"""A bounded HTTP/1.1 server for the side ports: uvicorn's h11 protocol with an ASGI app (Starlette).

The scheduler's HTTP port, the trainer's side port and the Tinker API gateway serve through it, so
that no client holds any of them. Bounds:

* a request head is at most :data:`MAX_HEAD_BYTES` (431 or 400 beyond);
* a body is checked against ``Content-Length`` before anything is read (413 beyond the app's limit);
  a negative or non-numeric ``Content-Length`` is a 400, and so is one sent with
  ``Transfer-Encoding``; the connection is closed after each refusal (:func:`framing_refusal`);
* a request's head and body must arrive within ``head_timeout_s`` seconds of the connection or of
  its previous answer, or the connection is closed: a client trickling a byte every few seconds
  holds nothing (:class:`BoundedH11`). A port that takes large bodies gives each body a deadline
  of its own, set as its head arrives (``endpoint.body_timeout_s``);
* a request refused before its body was read is answered, then its connection is half-closed and
  what the client still sends is read and dropped for at most :data:`LINGER_S` seconds (a lingering
  close, as nginx does): closed at once with unread bytes, the socket would send a reset, and the
  client, still sending its body, would lose the answer;
* a TLS handshake must end within ``head_timeout_s`` seconds (asyncio's default is a minute);
* at most :data:`MAX_CONNECTIONS` requests and connections at once; more get 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl

import h11
import uvicorn
from starlette.responses import Response
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = [
    "KEEP_ALIVE_S",
    "LINGER_S",
    "MAX_CONNECTIONS",
    "MAX_HEAD_BYTES",
    "BoundedH11",
    "BoundedServer",
    "bounded_server",
    "framing_refusal",
    "listen",
    "refusal",
]

#: Most bytes of a request head (request line and headers) before it is refused.
MAX_HEAD_BYTES = 16384
#: Most connections and requests served at once; more are answered 503.
MAX_CONNECTIONS = 1024
#: Seconds an idle keep-alive connection stays open after an answer.
KEEP_ALIVE_S = 5
#: Most seconds a connection whose request was refused before its body was read goes on reading
#: and dropping that body after the answer, so that the client reads the answer.
LINGER_S = 10.0


class _LingeringClose:
    """A transport whose ``close`` lingers while the client still sends a body nobody will read
    (:meth:`BoundedH11.linger`); everything else is the wrapped transport's."""

    def __init__(self, transport: asyncio.Transport, protocol: "BoundedH11") -> None:
        self._transport = transport
        self._protocol = protocol

    def __getattr__(self, name: str):
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self._protocol.lingering or self._transport.is_closing()

    def close(self) -> None:
        transport = self._transport
        unread_body = self._protocol.conn.their_state is h11.SEND_BODY
        if unread_body and not transport.is_closing() and transport.can_write_eof():
            self._protocol.linger()
        else:
            transport.close()


class BoundedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request: its head and body must arrive within
    ``endpoint.head_timeout_s`` seconds of the connection or of the previous answer, or the
    connection is closed. uvicorn itself bounds only the idle time between requests.

    ``endpoint`` is a class attribute: any object with ``head_timeout_s``, read as each deadline is set.
    An endpoint with a ``body_timeout_s(scope)`` method gives each body that many seconds from the
    arrival of its head instead: a large upload takes longer than a head.
    """

    endpoint: object

    def connection_made(self, transport) -> None:
        self._deadline: asyncio.TimerHandle | None = None
        self._raw = transport
        self.lingering = False
        super().connection_made(_LingeringClose(transport, self))
        self._arm()

    def data_received(self, data: bytes) -> None:
        if not self.lingering:  # lingering: the refused request's body, dropped
            super().data_received(data)

    def eof_received(self) -> bool | None:
        return False if self.lingering else super().eof_received()  # False: the transport closes

    def linger(self) -> None:
        """Half-close after the answer and drop what the client still sends, for at most
        :data:`LINGER_S` seconds or until it closes its side."""
        self.lingering = True
        self._raw.write_eof()
        self._raw.resume_reading()
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(LINGER_S, self._raw.close)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        body_timeout_s = getattr(self.endpoint, "body_timeout_s", None)
        started = self.cycle is not cycle  # a new request's head arrived
        if body_timeout_s is not None and started and self.conn.their_state is h11.SEND_BODY:
            self._arm(body_timeout_s(self.scope))

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        super().connection_lost(exc)

    def _arm(self, seconds: float | None = None) -> None:
        if self.lingering:  # its deadline is the linger's
            return
        if self._deadline is not None:
            self._deadline.cancel()
        if not self.transport.is_closing():
            self._deadline = self.loop.call_later(
                self.endpoint.head_timeout_s if seconds is None else seconds, self._expire
            )

    def _expire(self) -> None:
        self._deadline = None
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            self._raw.close()  # still waiting for (part of) a request: closed, not lingering


class BoundedServer(uvicorn.Server):
    """A uvicorn server that leaves signals to its owner and bounds the TLS handshake by
    ``handshake_timeout_s`` seconds."""

    handshake_timeout_s = 10.0

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's startup for given sockets and no lifespan, with the handshake timeout."""
        config, loop = self.config, asyncio.get_running_loop()

        def create_protocol(_loop=None):
            return config.http_protocol_class(
                config=config, server_state=self.server_state, app_state=self.lifespan.state, _loop=_loop
            )

        timeout = {} if config.ssl is None else {"ssl_handshake_timeout": self.handshake_timeout_s}
        self.servers = [
            await loop.create_server(create_protocol, sock=sock, ssl=config.ssl, backlog=config.backlog, **timeout)
            for sock in sockets or ()
        ]
        self.started = True


def bounded_server(app, endpoint, *, ssl_context: ssl.SSLContext | None = None) -> BoundedServer:
    """A :class:`BoundedServer` for the ASGI ``app``; ``endpoint.head_timeout_s`` bounds each request
    and the TLS handshake. Serve it with ``await server.serve(sockets=[listen(host, port)])``."""
    config = uvicorn.Config(
        app,
        http=type("BoundedH11", (BoundedH11,), {"endpoint": endpoint}),
        interface="asgi3",
        lifespan="off",
        proxy_headers=False,
        log_config=None,
        log_level="error",
        access_log=False,
        server_header=False,
        limit_concurrency=MAX_CONNECTIONS,
        timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=1,
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        ssl_context_factory=None if ssl_context is None else (lambda _config, _default: ssl_context),
    )
    server = BoundedServer(config)
    server.handshake_timeout_s = endpoint.head_timeout_s
    return server


def refusal(status: int, message: str) -> Response:
    """A JSON ``{"error": message}`` answer to a request that is not read any further; the
    connection closes after it."""
    body = json.dumps({"error": message}).encode()
    return Response(body, status, headers={"Connection": "close"}, media_type="application/json")


def framing_refusal(headers: list[tuple[bytes, bytes]], max_body_bytes: int) -> Response | None:
    """The refusal of a request with these ASGI ``headers`` before its body is read, or None: a head
    over :data:`MAX_HEAD_BYTES` (431), ``Content-Length`` with ``Transfer-Encoding`` (400), a
    ``Content-Length`` that is not a whole number (400) or is over ``max_body_bytes`` (413)."""
    lengths = [v for k, v in headers if k == b"content-length"]
    if sum(len(k) + len(v) + 4 for k, v in headers) > MAX_HEAD_BYTES:
        # h11 bounds a head that arrives in pieces; one that arrives whole is counted here.
        return refusal(431, f"request head too large: at most {MAX_HEAD_BYTES} bytes of headers")
    if lengths and any(k == b"transfer-encoding" for k, _ in headers):
        # Both framings at once: a proxy in front may frame the body otherwise (RFC 9112 6.1).
        return refusal(400, "expected Content-Length or Transfer-Encoding, not both")
    if lengths and not lengths[0].isdigit():  # h11 refuses these first; this holds without it
        return refusal(400, "Content-Length: expected a whole number of bytes")
    if lengths and int(lengths[0]) > max_body_bytes:
        return refusal(413, f"body too large: at most {max_body_bytes} bytes")
    return None


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (0: a free port), IPv6 when ``host`` has a colon.

    Raises:
        OSError: the port cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=128)
