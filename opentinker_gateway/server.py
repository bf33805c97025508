"""The gateway's HTTP server: the Tinker API app behind the bounds of
:mod:`opentinker_common.net.bounded_http`, so that no client holds the port.

* A request head is at most 16 KiB and must arrive within :attr:`GatewayServer.head_timeout_s`.
* ``Content-Length`` is checked before anything is read: over ``max_body_bytes`` is a 413, a
  negative or non-numeric one a 400, and so is one sent with ``Transfer-Encoding``.
* A body must arrive within :meth:`GatewayServer.body_timeout_s` of its head: the head timeout
  plus its length at :data:`MIN_BODY_BYTES_PER_S`.
* At most 1024 connections and requests at once; more get 503.

Every refusal here is Tinker-shaped (``detail``, ``error``, ``category``) and closes the connection.
"""

from __future__ import annotations

import json

from starlette.responses import JSONResponse

from opentinker_common.net.bounded_http import bounded_server, framing_refusal, listen
from opentinker_gateway.app import KEYLESS_ROUTES, MAX_KEYLESS_BODY_BYTES, GatewayConfig, create_app
from opentinker_gateway.errors import ApiError

__all__ = ["GatewayServer", "HEAD_TIMEOUT_S", "MIN_BODY_BYTES_PER_S"]

#: Seconds a request head may take to arrive: a client trickling one holds the connection no longer.
HEAD_TIMEOUT_S = 10.0
#: Slowest upload the gateway waits for, in bytes per second: a 256 MiB batch gets 1034 s, enough
#: for a 2 Mbit/s link; a 64 KiB telemetry body gets 10.25 s.
MIN_BODY_BYTES_PER_S = 256 * 1024


class GatewayServer:
    """The Tinker API on ``host:port`` (0: a free one, then :attr:`port`)."""

    def __init__(self, config: GatewayConfig, host: str, port: int) -> None:
        self.app = create_app(config)
        self.gateway = self.app.state.gateway
        self.max_body_bytes = config.max_body_bytes
        #: Seconds a request head may take; read as each connection's deadline is set.
        self.head_timeout_s = HEAD_TIMEOUT_S
        self._socket = listen(host, port)
        self.port = self._socket.getsockname()[1]
        self.server = bounded_server(self._guarded, self)

    def body_timeout_s(self, scope: dict) -> float:
        """Seconds the body of the request ``scope`` may take from its head: the head timeout plus
        its ``Content-Length`` (else its route's largest body) at :data:`MIN_BODY_BYTES_PER_S`."""
        length = next((v for k, v in scope["headers"] if k == b"content-length"), b"")
        if length.isdigit():
            size = int(length)
        else:
            size = MAX_KEYLESS_BODY_BYTES if scope["path"] in KEYLESS_ROUTES else self.max_body_bytes
        return self.head_timeout_s + size / MIN_BODY_BYTES_PER_S

    async def serve(self) -> None:
        """Serve until :meth:`stop`; the gateway's connections open before and close after."""
        await self.gateway.start()
        try:
            await self.server.serve(sockets=[self._socket])
        finally:
            await self.gateway.stop()

    def stop(self) -> None:
        """Make :meth:`serve` return: open connections are closed, answers get a second to finish."""
        self.server.should_exit = True

    async def _guarded(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        refusal = framing_refusal(scope["headers"], self.max_body_bytes)
        if refusal is not None:
            error = ApiError(json.loads(refusal.body)["error"], status=refusal.status_code)
            refusal = JSONResponse(error.body(), status_code=error.status, headers={"Connection": "close"})
        await (refusal or self.app)(scope, receive, send)
