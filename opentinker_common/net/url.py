"""Scheduler addresses: the seed's ``http://scheduler-host:8888``, plain ``host:port``, and
``https://host:port`` for a scheduler that speaks TLS.

Used by the client, the CLI and the trainer nodes (``SCHEDULER_URL``), so that every part of
OpenTinker accepts the same spellings and refuses the same mistakes.

TLS rule (:func:`parse_scheduler_address`): ``https://`` and ``grpcs://`` always mean TLS (with
the CA given by ``root_certificates`` / ``--tls-ca`` / ``$OPENTINKER_TLS_CA``, else the system's
trusted roots); ``http://``, ``grpc://`` and no scheme mean TLS exactly when a CA is given.

A user-info part (``https://user:password@host:1``) is refused, and never echoed: error messages
show the URL with it replaced by ``***@`` (:func:`redact_userinfo`).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

__all__ = ["SchedulerAddress", "parse_scheduler_address", "parse_scheduler_url", "redact_userinfo"]

_PLAIN_SCHEMES = ("http", "grpc")
_TLS_SCHEMES = ("https", "grpcs")
_SCHEME = re.compile(r"^\s*[A-Za-z][A-Za-z0-9+.-]*$")
_HOST_LABEL = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")
_EXAMPLE = (
    "expected host:port, e.g. http://scheduler-host:8888, https://scheduler-host:8888, "
    "scheduler-host:8888 or [::1]:8888"
)


def redact_userinfo(url: str) -> str:
    """``url`` with any user-info part (``user:password@``) replaced by ``***@``, for messages.

    Everything between the scheme's ``://`` (or the start) and the last ``@`` is replaced, so a
    password holding ``/``, ``?``, ``#`` or ``@`` is hidden too (a path with an ``@`` is hidden
    with it, which errs on the safe side).

    >>> redact_userinfo("https://user:pw@host:1")
    'https://***@host:1'
    """
    head, sep, rest = url.partition("://")
    if not sep or not _SCHEME.match(head):  # "user:p://w@host": no scheme, all of it is user info
        head, sep, rest = "", "", url
    at = rest.rfind("@")
    if at < 0:
        return url
    return f"{head}{sep}***@{rest[at + 1 :]}"


def _bad(url: str, why: str) -> ValueError:
    return ValueError(f"bad scheduler URL {redact_userinfo(url)!r}: {why}; {_EXAMPLE}")


@dataclass(frozen=True)
class SchedulerAddress:
    """A parsed scheduler URL."""

    #: ``host:port`` for a gRPC channel (IPv6 in brackets, host names lowercased).
    target: str
    #: The URL asks for TLS (``https://``, ``grpcs://``): TLS even when no CA is given, checked
    #: against the system roots. False: TLS only when a CA is given.
    tls: bool = False
    #: The scheme as written, lowercased ("" for plain ``host:port``).
    scheme: str = ""


def parse_scheduler_url(url: str) -> str:
    """Turn a scheduler URL into the ``host:port`` target a gRPC channel wants.

    Accepted: ``http://host:port`` (the seed's form), ``grpc://host:port``, ``https://host:port``,
    ``grpcs://host:port``, ``host:port``, IPv6 as ``[::1]:8888`` (with or without a scheme). A
    single trailing ``/`` is ignored. The port is required (there is no default) and must be in
    1..65535. Whether to use TLS is not part of the answer: callers that open a channel use
    :func:`parse_scheduler_address`.

    Returns:
        ``"host:port"``, with IPv6 hosts in brackets (``"[::1]:8888"``); host names are lowercased.

    Raises:
        ValueError: empty, no port, bad port, a path/query/user part, or an unknown scheme. The
            message quotes the URL (with any ``user:password@`` shown as ``***@``) and shows a
            valid example.
    """
    return parse_scheduler_address(url).target


def parse_scheduler_address(url: str) -> SchedulerAddress:
    """Parse a scheduler URL into its ``host:port`` target and whether it asks for TLS.

    Same spellings and errors as :func:`parse_scheduler_url`; ``https://`` and ``grpcs://`` set
    :attr:`SchedulerAddress.tls`.

    >>> parse_scheduler_address("https://Sched.example:443")
    SchedulerAddress(target='sched.example:443', tls=True, scheme='https')

    Raises:
        TypeError: ``url`` is not a string.
        ValueError: as :func:`parse_scheduler_url`.
    """
    if not isinstance(url, str):
        raise TypeError(f"scheduler URL must be a string, got {type(url).__name__}")
    text = url.strip()
    if not text:
        raise _bad(url, "it is empty")
    if "@" in text:  # before anything else looks at the text: no message may quote a password
        raise _bad(url, "it has a user name ('@'); only host and port are allowed")
    rest, scheme = text, ""
    if "://" in text:
        scheme, rest = text.split("://", 1)
        scheme = scheme.lower()
        if scheme not in _PLAIN_SCHEMES + _TLS_SCHEMES:
            raise _bad(url, f"unknown scheme {scheme + '://'!r} (use http://, https://, grpc:// or grpcs://, or none)")
    if rest.endswith("/"):
        rest = rest[:-1]
    for sep, what in (("/", "a path"), ("?", "a query"), ("#", "a fragment")):
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
    return SchedulerAddress(target=f"{host_out}:{port}", tls=scheme in _TLS_SCHEMES, scheme=scheme)
