"""Scheduler addresses: the seed's ``http://scheduler-host:8888`` and plain ``host:port``.

Used by the client, the CLI and the trainer nodes (``SCHEDULER_URL``), so that every part of
OpenTinker accepts the same spellings and refuses the same mistakes.
"""

from __future__ import annotations

import ipaddress
import re

__all__ = ["parse_scheduler_url"]

_PLAIN_SCHEMES = ("http", "grpc")
_TLS_SCHEMES = ("https", "grpcs")
_HOST_LABEL = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")
_EXAMPLE = "expected host:port, e.g. http://scheduler-host:8888, scheduler-host:8888 or [::1]:8888"


def _bad(url: str, why: str) -> ValueError:
    return ValueError(f"bad scheduler URL {url!r}: {why}; {_EXAMPLE}")


def parse_scheduler_url(url: str) -> str:
    """Turn a scheduler URL into the ``host:port`` target a gRPC channel wants.

    Accepted: ``http://host:port`` (the seed's form), ``grpc://host:port``, ``host:port``,
    IPv6 as ``[::1]:8888`` (with or without a scheme). A single trailing ``/`` is ignored.
    The port is required (there is no default) and must be in 1..65535.

    Returns:
        ``"host:port"``, with IPv6 hosts in brackets (``"[::1]:8888"``); host names are lowercased.

    Raises:
        ValueError: empty, no port, bad port, a path/query/user part, an unknown scheme, or
            ``https://`` / ``grpcs://`` (TLS is not configured yet in this client). The message
            quotes the URL and shows a valid example.
    """
    if not isinstance(url, str):
        raise TypeError(f"scheduler URL must be a string, got {type(url).__name__}")
    text = url.strip()
    if not text:
        raise _bad(url, "it is empty")
    rest = text
    if "://" in text:
        scheme, rest = text.split("://", 1)
        scheme = scheme.lower()
        if scheme in _TLS_SCHEMES:
            raise ValueError(
                f"bad scheduler URL {url!r}: TLS ({scheme}://) is not configured yet in this client; "
                f"use http://host:port or host:port"
            )
        if scheme not in _PLAIN_SCHEMES:
            raise _bad(url, f"unknown scheme {scheme + '://'!r} (use http:// or grpc://, or none)")
    if rest.endswith("/"):
        rest = rest[:-1]
    for sep, what in (("/", "a path"), ("?", "a query"), ("#", "a fragment"), ("@", "a user name")):
        if sep in rest:
            raise _bad(url, f"it has {what} ({sep!r}); only host and port are allowed")
    if not rest:
        raise _bad(url, "the host is missing")

    if rest.startswith("["):
        end = rest.find("]")
        if end < 0:
            raise _bad(url, "unclosed '[' around an IPv6 address")
        host = rest[1:end]
        after = rest[end + 1 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise _bad(url, f"{host!r} is not an IPv6 address") from None
        if not after:
            raise _bad(url, "the port is missing")
        if not after.startswith(":"):
            raise _bad(url, f"unexpected {after!r} after the IPv6 address")
        port_text = after[1:]
        host_out = f"[{host.lower()}]"
    else:
        if ":" not in rest:
            raise _bad(url, "the port is missing")
        host, port_text = rest.rsplit(":", 1)
        if ":" in host:
            raise _bad(url, "an IPv6 address must be written in brackets, e.g. [::1]:8888")
        if not host:
            raise _bad(url, "the host is missing")
        if len(host) > 253 or not all(_HOST_LABEL.match(label) for label in host.rstrip(".").split(".")):
            raise _bad(url, f"{host!r} is not a valid host name or IPv4 address")
        host_out = host.lower()

    if not port_text:
        raise _bad(url, "the port is missing")
    if not port_text.isascii() or not port_text.isdigit():
        raise _bad(url, f"port {port_text!r} is not a number")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise _bad(url, f"port {port} is out of range 1..65535")
    return f"{host_out}:{port}"
