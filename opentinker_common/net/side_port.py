"""The HTTP side port of the scheduler and the trainer (``/health``, ``/metrics``): a bounded,
threaded wsgiref server, HTTPS when given an :class:`ssl.SSLContext`
(:func:`opentinker_common.net.tls.server_ssl_context`)."""

from __future__ import annotations

import ssl
import sys
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

__all__ = ["SidePortServer", "make_side_port_server"]


class SidePortServer(ThreadingMixIn, WSGIServer):
    """The HTTP side port of the scheduler and the trainer (``/health``, ``/metrics``): wsgiref,
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
