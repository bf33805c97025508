"""Reading gRPC's transport errors: was the connection closed by the peer, did a TLS handshake
fail. Used to add hints to client errors and to word a trainer node's refusal."""

from __future__ import annotations

import re

__all__ = ["closed_by_peer", "tls_handshake_failed"]

# How gRPC words a connection that the server closed before any HTTP/2 frame: what a plaintext
# client sees from a TLS port (the server reads a TLS record header, gets garbage and hangs up).
_CLOSED = re.compile(
    r"socket closed|connection reset|end of tcp stream|broken pipe|wrong_version_number|connection closed",
    re.IGNORECASE,
)
# Words that only come once HTTP/2 ran on the connection: a stream the server dropped, its GOAWAY.
# A TLS port never gets that far with a plaintext client.
_AFTER_HTTP2 = re.compile(r"stream removed|goaway", re.IGNORECASE)
# How gRPC (BoringSSL) words a failed TLS handshake.
_HANDSHAKE = re.compile(r"handshake|ssl|tls|certificate|x509|alert", re.IGNORECASE)


def closed_by_peer(details: str | None) -> bool:
    """``details`` of an UNAVAILABLE status say the server closed the connection early
    (``Socket closed``, ``Connection reset``): a TLS port dialled in plaintext, or a TLS handshake
    the server refused (a client certificate it does not accept). False once HTTP/2 ran on the
    connection (``Stream removed``, ``GOAWAY``): a server that stopped or died mid-call."""
    return bool(details and _CLOSED.search(details) and not _AFTER_HTTP2.search(details))


def tls_handshake_failed(details: str | None) -> bool:
    """``details`` of an UNAVAILABLE/UNKNOWN status mention a TLS handshake failure."""
    return bool(details and _HANDSHAKE.search(details))
