"""The trainer's HTTP side port (``/health``, ``/metrics``): a bounded, threaded wsgiref server,
HTTPS when given an :class:`ssl.SSLContext` (:func:`opentinker_common.net.tls.server_ssl_context`),
and optionally a bearer token for scraping (:func:`require_scrape_token`,
:func:`read_scrape_token`; the scheduler's HTTP port uses the token checks too)."""

from __future__ import annotations

import hmac
import json
import os
import ssl
import stat
import sys
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

__all__ = [
    "OPEN_PATHS",
    "SidePortServer",
    "make_side_port_server",
    "read_scrape_token",
    "require_scrape_token",
    "scrape_refusal",
]

#: Paths a scrape token does not guard: health probes (orchestrators and load balancers send no
#: token; the answers carry no task, owner or node detail beyond a reason).
OPEN_PATHS = frozenset({"/health", "/live", "/ready"})
#: Bounds on a scrape token file: at least 16 characters (a guessable token is no guard), at most 4 KiB.
MIN_TOKEN_CHARS, MAX_TOKEN_BYTES = 16, 4096


def read_scrape_token(path: str | os.PathLike, name: str) -> str:
    """The bearer token in the file at ``path`` (one line; surrounding whitespace dropped), as
    Prometheus reads ``authorization: {credentials_file: ...}``.

    Args:
        name: how to call the file in errors (the flag or config key).

    Raises:
        ValueError: ``<name>: expected ...`` for a missing, unreadable, non-regular, oversized file,
            or a token shorter than 16 characters or with spaces or control characters in it.
    """
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{name}: expected a regular file holding the scrape token, got {os.fspath(path)!r}")
        if st.st_size > MAX_TOKEN_BYTES:
            raise ValueError(f"{name}: expected a token file of at most {MAX_TOKEN_BYTES} bytes, got {st.st_size}")
        with open(path, encoding="utf-8") as fh:
            token = fh.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        why = getattr(exc, "strerror", None) or exc
        raise ValueError(f"{name}: expected a readable token file, got {os.fspath(path)!r} ({why})") from None
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() or not c.isprintable() for c in token):
        raise ValueError(
            f"{name}: expected a token of at least {MIN_TOKEN_CHARS} printable characters without spaces "
            f"(e.g. `openssl rand -hex 32`), got {len(token)} characters in {os.fspath(path)!r}"
        )
    return token


#: The header a 401 of a guarded side port carries.
SCRAPE_CHALLENGE = ("WWW-Authenticate", 'Bearer realm="opentinker-metrics"')


def scrape_refusal(token: str | None, path: str, authorization: str, *, open_paths=OPEN_PATHS) -> bytes | None:
    """None when a request for ``path`` with this ``Authorization`` header value may be answered
    (no token set, an open path, or ``Bearer <token>``, compared in constant time); else the JSON
    body of its 401, which never echoes what was sent."""
    if not token or path in open_paths:
        return None
    if hmac.compare_digest(authorization.encode("latin-1", "replace"), f"Bearer {token}".encode()):
        return None
    why = "wrong bearer token" if authorization else "missing bearer token"
    return json.dumps({"error": f"{why}: send 'Authorization: Bearer <scrape token>' (see docs/security.md)"}).encode()


def require_scrape_token(app, token: str | None, *, open_paths=OPEN_PATHS):
    """Wrap the WSGI ``app`` so that every path but ``open_paths`` answers only a request with
    ``Authorization: Bearer <token>`` (:func:`scrape_refusal`); others get 401 with
    ``WWW-Authenticate: Bearer``. ``token`` None: ``app`` itself."""
    if not token:
        return app

    def guarded(environ, start_response):
        refusal = scrape_refusal(
            token, environ.get("PATH_INFO", "/"), environ.get("HTTP_AUTHORIZATION", ""), open_paths=open_paths
        )
        if refusal is None:
            return app(environ, start_response)
        start_response(
            "401 Unauthorized",
            [("Content-Type", "application/json"), ("Content-Length", str(len(refusal))), SCRAPE_CHALLENGE],
        )
        return [refusal]

    return guarded


class SidePortServer(ThreadingMixIn, WSGIServer):
    """The trainer's HTTP side port (``/health``, ``/metrics``): wsgiref,
    one daemon thread per connection, HTTPS when given an :class:`ssl.SSLContext`.

    The TLS handshake runs in the connection's own thread with a timeout, never in the accept
    loop, so a client that connects and never finishes its handshake (or never sends its
    request) holds one thread for at most ``timeout_s`` seconds and blocks nobody else. At most
    ``max_connections`` connections are served at once; more are closed at once.
    """

    daemon_threads = True
    block_on_close = False
    #: Seconds a connection may take for its handshake and for each read or write.
    timeout_s = 10.0
    max_connections = 64

    def __init__(self, address, handler_class, *, ssl_context: ssl.SSLContext | None = None) -> None:
        self.ssl_context = ssl_context
        self._slots = threading.BoundedSemaphore(self.max_connections)
        super().__init__(address, handler_class)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            self._slots.release()
            raise

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], OSError):  # a timeout or a reset: the client's doing, not worth a traceback
            return
        super().handle_error(request, client_address)

    def process_request_thread(self, request, client_address) -> None:  # the connection's thread
        try:
            request.settimeout(self.timeout_s)
            if self.ssl_context is not None:
                try:
                    request = self.ssl_context.wrap_socket(
                        request, server_side=True
                    )  # handshake, bounded by the timeout
                except (ssl.SSLError, OSError):  # plain HTTP, a scanner, a stalled client: drop it
                    self.shutdown_request(request)
                    return
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _TimeoutHandler(WSGIRequestHandler):
    timeout = SidePortServer.timeout_s


def make_side_port_server(
    host: str,
    port: int,
    app,
    handler_class: type[WSGIRequestHandler] = _TimeoutHandler,
    *,
    ssl_context: ssl.SSLContext | None = None,
) -> SidePortServer:
    """Bind a :class:`SidePortServer` serving the WSGI ``app`` on ``host:port`` (0 = a free port).

    Raises:
        OSError: the port cannot be bound.
    """
    if not getattr(handler_class, "timeout", None):
        handler_class = type(handler_class.__name__, (handler_class,), {"timeout": SidePortServer.timeout_s})
    server = SidePortServer((host, port), handler_class, ssl_context=ssl_context)
    server.set_app(app)
    return server
