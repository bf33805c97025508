"""One-line explanations of why the scheduler could not be reached.

gRPC's own ``UNAVAILABLE`` details name the address percent-encoded and say nothing of the likely
mistake (``failed to connect to all addresses; last error: UNKNOWN: ipv6:%5B::1%5D:22999: Failed
to connect to remote host: Connection refused``; ``Failed parsing HTTP/2 (Expected SETTINGS
frame ...)`` from an HTTP/1.1 port). :func:`explain_unreachable` rewrites those into a line that
names the address dialled and tried and what is probably wrong: nothing listening there, an HTTP
port rather than the gRPC one (asking that port which gRPC port it belongs to), a host name that
does not resolve, a connection that timed out, and on a TLS channel (``https://``, ``--tls-ca``) a
handshake that failed: a plaintext scheduler, a certificate no trusted CA signed (the
``--tls-ca`` fix), one that does not name the host dialled.
"""

from __future__ import annotations

import re
import socket
from urllib.parse import unquote

from opentinker_client.errors import DeadlineExceededError, OpenTinkerError, UnavailableError

__all__ = ["GRPC_PORT_HEADER", "accepts_connections", "explain_unreachable"]

#: The header the scheduler's HTTP answers carry: its gRPC port (read by :func:`explain_unreachable`).
GRPC_PORT_HEADER = "X-OpenTinker-Grpc-Port"

# "ipv6:%5B::1%5D:22999: Failed ..." -> "%5B::1%5D:22999"
_ADDRESS = re.compile(r"\b(?:ipv4|ipv6):(\S+?):\s")


def _tried(details: str) -> str:
    """The address gRPC last tried, decoded (``[::1]:22999``), or ``""``."""
    m = _ADDRESS.search(details)
    return unquote(m.group(1)) if m else ""


def accepts_connections(target: str, timeout: float = 1.0) -> bool:
    """Whether some address ``target`` (``host:port``) resolves to accepts a TCP connection within
    ``timeout`` seconds: a scheduler that is there but does not answer (stopped, overloaded) does;
    a port with nothing listening, or a host that does not resolve, does not."""
    host, _, port = target.rpartition(":")
    try:
        infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except (OSError, ValueError):
        return False
    for family, kind, proto, _name, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.settimeout(timeout)
                sock.connect(sockaddr)
                return True
        except OSError:
            continue
    return False


def _probe(target: str, timeout: float = 1.0) -> tuple[list[str], list[tuple[str, int | None]]]:
    """What listens at each address ``target`` resolves to: (the addresses that refused the
    connection, [(address, gRPC port or None)] of those that answered ``GET /health`` in HTTP/1.x).

    An OpenTinker scheduler's HTTP answers name its gRPC port (:data:`GRPC_PORT_HEADER`)."""
    host, _, port = target.rpartition(":")
    host = host.strip("[]")
    refused: list[str] = []
    http: list[tuple[str, int | None]] = []
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (OSError, ValueError):
        return refused, http
    for family, kind, proto, _name, sockaddr in infos:
        shown = f"[{sockaddr[0]}]:{sockaddr[1]}" if family == socket.AF_INET6 else f"{sockaddr[0]}:{sockaddr[1]}"
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.settimeout(timeout)
                sock.connect(sockaddr)
                sock.sendall(f"GET /health HTTP/1.0\r\nHost: {target}\r\n\r\n".encode())
                head = b""
                while b"\r\n\r\n" not in head and len(head) < 8192:
                    chunk = sock.recv(4096)
                    if not chunk:
                        break
                    head += chunk
        except ConnectionRefusedError:
            refused.append(shown)
            continue
        except OSError:
            continue
        if head.startswith(b"HTTP/1."):
            m = re.search(rb"(?im)^" + GRPC_PORT_HEADER.encode() + rb":\s*(\d+)\s*$", head)
            http.append((shown, int(m.group(1)) if m else None))
    return refused, http


def _with_port(target: str, port: int) -> str:
    host = target.rsplit(":", 1)[0] if ":" in target else target
    return f"{host}:{port}"


# "...CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate: OK" -> the reason in words.
_VERIFY_REASON = re.compile(r"CERTIFICATE_VERIFY_FAILED:\s*([^:]+)")


def _tls_mistake(details: str, target: str, ca_given: bool) -> str | None:
    """The words for a failed TLS handshake with ``target`` (gRPC's ``details``), naming the fix
    (``--tls-ca`` / ``$OPENTINKER_TLS_CA``, ``http://``), or None when it is no TLS failure."""
    where = f"cannot talk TLS to the scheduler at {target}"
    if "WRONG_VERSION_NUMBER" in details or "PACKET_LENGTH_TOO_LONG" in details or "HTTP_REQUEST" in details:
        return (
            f"{where}: it answered without TLS (the scheduler serves plaintext when its config has no tls:); "
            f"use http://{target} (or {target}), or turn tls: on in the scheduler's config"
        )
    if "Hostname Verification" in details or "not in peer certificate" in details:
        host = target.rpartition(":")[0].strip("[]")
        return (
            f"{where}: its certificate does not name {host!r}; dial the host name (or IP) the certificate was "
            "issued for (its subjectAltName), or issue one that names this one"
        )
    if "CERTIFICATE_VERIFY_FAILED" in details:
        m = _VERIFY_REASON.search(details)
        reason = f" ({m.group(1).strip()})" if m else ""
        trusted = "the CA given (--tls-ca / $OPENTINKER_TLS_CA)" if ca_given else "a CA this client trusts"
        return (
            f"{where}: its certificate is not signed by {trusted}{reason}; pass the CA that signed the "
            "scheduler's certificate: --tls-ca CA.pem or $OPENTINKER_TLS_CA (RLClient(root_certificates=...))"
        )
    if "handshake failed" in details.lower():
        reason = re.sub(r":\s*OK$", "", details).rsplit(": ", 1)[-1]
        return (
            f"{where}: the TLS handshake failed ({reason}); "
            "check the scheduler's CA (--tls-ca / $OPENTINKER_TLS_CA) and, for mTLS, --tls-cert / --tls-key"
        )
    return None


def explain_unreachable(
    err: OpenTinkerError, target: str, *, tls: bool = False, ca_given: bool = False
) -> OpenTinkerError:
    """``err`` with a one-line explanation when it is an ``UNAVAILABLE`` whose cause can be told
    (``target`` is the ``host:port`` dialled; ``tls``: the channel is TLS, ``ca_given``: with a CA
    the caller named); any other error is returned unchanged. The raw gRPC details stay in
    ``raw_details``."""
    if isinstance(err, DeadlineExceededError) and err.details == "Deadline Exceeded":
        return _explain_deadline(err, target)
    if not isinstance(err, UnavailableError):
        return err
    details = err.details
    message = _tls_mistake(details, target, ca_given) if tls else None
    if message is None:
        message = _plain_mistake(details, target)
    if message is None:
        return err
    out = UnavailableError(message, code=err.code, status=err.status)
    out.raw_details = details
    return out


def _plain_mistake(details: str, target: str) -> str | None:
    """The words for gRPC's ``details`` of an unreachable ``target`` that are no TLS failure:
    nothing listening, an HTTP port, a name that does not resolve, a timeout (None: none of those)."""
    host, _, port = target.rpartition(":")
    message = None
    if "Failed parsing HTTP/2" in details or "Expected SETTINGS frame" in details or "Connection refused" in details:
        # gRPC reports only the last address it tried; ask each address what listens there.
        refused, http = _probe(target)
        wrong = [(a, p) for a, p in http if p is None or str(p) != port]
        if wrong:
            address, grpc_port = wrong[0]
            if grpc_port is not None:
                why = (
                    f"that is the scheduler's HTTP port (/health, /metrics); its gRPC port is {grpc_port}: "
                    f"use {_with_port(target, grpc_port)}"
                )
            else:
                why = (
                    "that is an HTTP/1.1 port, not gRPC: the scheduler's HTTP port (/health, /metrics; by default its "
                    "gRPC port + 1) or a trainer's; point the client at the scheduler's gRPC port (its --port)"
                )
            shown = target if address == target else f"{target} ({address} answered HTTP/1.1)"
            message = f"cannot talk gRPC to {shown}: {why}"
        elif refused and not http:
            message = _nothing_listening(target, refused)
    elif "Domain name not found" in details or "lookup error" in details or "DNS resolution failed" in details:
        message = f"cannot reach the scheduler at {target}: the host name {host.strip('[]')!r} does not resolve"
    elif "timed out" in details.lower() or "Timeout occurred" in details:
        tried = _tried(details)
        message = (
            f"cannot reach the scheduler at {target}{f' (tried {tried})' if tried else ''}: the connection timed out "
            "(the wrong host, or a firewall between here and it)"
        )
    return message


def _explain_deadline(err: DeadlineExceededError, target: str) -> OpenTinkerError:
    """A bare ``DEADLINE_EXCEEDED`` (gRPC kept retrying a connection until the call's timeout):
    when nothing listens at ``target`` the error says so, still a deadline error (its class, its
    exit code); otherwise it is returned unchanged (the scheduler is there but slow)."""
    refused, http = _probe(target)
    if not refused or http:
        return err
    out = DeadlineExceededError(
        f"no answer within the call's timeout: {_nothing_listening(target, refused)}", code=err.code, status=err.status
    )
    out.raw_details = err.details
    return out


def _nothing_listening(target: str, refused: list[str]) -> str:
    """The words for ``target`` (``host:port``) whose addresses ``refused`` all refused the connection."""
    port = target.rpartition(":")[2]
    return (
        f"cannot reach the scheduler at {target}: nothing is listening on {', '.join(refused)} "
        f"(connection refused); is the scheduler running, and is {port} its gRPC port "
        "(its --port, 8888 by default)?"
    )
