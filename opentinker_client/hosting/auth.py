"""Access control of a client-hosted environment server: the bearer token and TLS files.

Every ``EnvironmentService`` call must carry the metadata ``authorization: Bearer <token>``
(RFC 6750 bearer scheme); the token is compared with :func:`hmac.compare_digest` (constant time).
A call without it, with another token, or with an ``authorization`` value in another form
("malformed authorization metadata: expected 'Bearer <token>', got a 'Basic' value", worded as
the scheduler words it) is answered ``UNAUTHENTICATED`` before the servicer runs.
``grpc.health.v1.Health`` and server reflection stay open (they reveal nothing but the
service names). The token itself never appears in a log line or an error message.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import threading
from typing import Any, Callable

import grpc

from opentinker_client.errors import InvalidArgumentError
from opentinker_common.spec import SpecError
from opentinker_common.spec.client_env import ROOT_CERTIFICATES_MAX_BYTES, check_token
from opentinker_common.net.bearer import authorization_problem

__all__ = ["TokenInterceptor", "new_token", "checked_token", "read_pem", "server_credentials"]

log = logging.getLogger("opentinker_client.hosting.server")

#: Methods under this prefix need the token; everything else (Health, reflection) is open.
PROTECTED_PREFIX = "/opentinker.environment.v1.EnvironmentService/"

MISSING_TOKEN = (
    "missing access token: EnvironmentService calls must carry the metadata 'authorization: Bearer <token>' "
    "(the token is env_config.token of the task; RLClient fills it in)"
)
WRONG_TOKEN = (
    "access token does not match this environment server (env_config.token must be the token of the "
    "EnvironmentServer serving at this endpoint; a restarted server has a new random token)"
)


def new_token() -> str:
    """A random access token: 32 bytes from :func:`secrets.token_urlsafe` (43 url-safe characters)."""
    return secrets.token_urlsafe(32)


def checked_token(token: str | None) -> str:
    """``token``, or a new random one when ``None``.

    Raises:
        InvalidArgumentError: field ``token``; not 16..256 url-safe characters (the message does
            not contain the token).
    """
    if token is None:
        return new_token()
    try:
        check_token(token, "token")
        if token == "":
            raise SpecError(
                "token",
                "a token of 16..256 url-safe characters (or None for a random one; "
                "require_token=False serves without one)",
            )
    except SpecError as err:
        raise InvalidArgumentError(str(err), field="token") from None
    return token


def _bearer(metadata: Any) -> str | None:
    """The token of the first ``authorization: Bearer <token>`` entry, or None."""
    for key, value in metadata or ():
        if key == "authorization":
            if isinstance(value, bytes):
                value = value.decode("latin-1")
            scheme, _, rest = value.strip().partition(" ")
            if scheme.lower() == "bearer" and rest.strip():
                return rest.strip()
            return ""
    return None


class TokenInterceptor(grpc.ServerInterceptor):
    """Answer ``UNAUTHENTICATED`` to an ``EnvironmentService`` call without the right bearer token.

    Attributes:
        refused: how many calls were refused (for tests and operators).
    """

    def __init__(self, token: str, name: str = "environment") -> None:
        self._token = token.encode("ascii")
        self._name = name
        self._lock = threading.Lock()
        self.refused = 0

    def __repr__(self) -> str:  # never show the token
        return f"TokenInterceptor({self._name}, refused={self.refused})"

    def _deny(self, message: str) -> grpc.RpcMethodHandler:
        with self._lock:
            self.refused += 1
            first = self.refused == 1

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            # The first refusal at warning, the rest at debug: a port scan must not flood the log.
            (log.warning if first else log.debug)(
                "refused an EnvironmentService call to %s from %s: %s",
                self._name,
                context.peer(),
                message.split(":")[0],
            )
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        return grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if not handler_call_details.method.startswith(PROTECTED_PREFIX):
            return continuation(handler_call_details)
        metadata = handler_call_details.invocation_metadata
        given = _bearer(metadata)
        if not given:
            problem = authorization_problem(metadata, expected="Bearer <token>")  # never echoes the value
            return self._deny(
                f"{problem} (the access token is env_config.token of the task; RLClient fills it in)"
                if problem
                else MISSING_TOKEN
            )
        if not hmac.compare_digest(given.encode("utf-8", "replace"), self._token):
            return self._deny(WRONG_TOKEN)
        return continuation(handler_call_details)


def read_pem(path: str | os.PathLike[str], what: str, *, max_bytes: int = 1024 * 1024) -> bytes:
    """The bytes of PEM file ``path``.

    Raises:
        InvalidArgumentError: field ``what``; the file cannot be read, is larger than
            ``max_bytes`` or is not PEM (no ``-----BEGIN`` line).
    """
    from opentinker_common.net.tls import read_pem_file  # regular files only, read with a bound

    try:
        data = read_pem_file(path, what)
    except ValueError as exc:
        raise InvalidArgumentError(str(exc), field=what) from None
    if len(data) > max_bytes:
        raise InvalidArgumentError(
            f"{what}: {os.fspath(path)!r} is {len(data)} bytes, more than {max_bytes}", field=what
        )
    if b"-----BEGIN " not in data:
        raise InvalidArgumentError(f"{what}: {os.fspath(path)!r} is not a PEM file (no -----BEGIN line)", field=what)
    return data


def server_credentials(
    tls_cert: str | os.PathLike[str] | None,
    tls_key: str | os.PathLike[str] | None,
    tls_ca: str | os.PathLike[str] | None,
) -> tuple[grpc.ServerCredentials | None, str]:
    """TLS credentials for the environment server and the root certificates trainers must trust.

    Args:
        tls_cert, tls_key: PEM paths of the server's certificate (chain) and private key; both
            or neither.
        tls_ca: PEM path of the CA that signed ``tls_cert``, sent to trainers as
            ``env_config.tls_root_certificates`` (at most 64 KiB); ``None`` = the system's roots.

    Returns:
        ``(credentials, root_certificates_pem_text)``; ``(None, "")`` without TLS.

    Raises:
        InvalidArgumentError: one of cert/key without the other, ``tls_ca`` without a
            certificate, or a file that cannot be read or is not PEM (the field is named).
    """
    given = (tls_cert is not None, tls_key is not None)
    if given[0] != given[1]:
        missing = "tls_key" if given[0] else "tls_cert"
        raise InvalidArgumentError(
            f"{missing}: expected both tls_cert and tls_key (PEM paths of the server's certificate and its key) "
            "or neither",
            field=missing,
        )
    if tls_cert is None:
        if tls_ca is not None:
            raise InvalidArgumentError(
                "tls_ca: only with tls_cert and tls_key (the CA that signed that certificate)", field="tls_ca"
            )
        return None, ""
    cert = read_pem(tls_cert, "tls_cert")
    key = read_pem(tls_key, "tls_key")  # type: ignore[arg-type]
    if b"PRIVATE KEY-----" not in key:
        raise InvalidArgumentError(f"tls_key: {os.fspath(tls_key)!r} holds no PRIVATE KEY block", field="tls_key")  # type: ignore[arg-type]
    roots = ""
    if tls_ca is not None:
        data = read_pem(tls_ca, "tls_ca", max_bytes=ROOT_CERTIFICATES_MAX_BYTES)
        if b"PRIVATE KEY-----" in data:
            raise InvalidArgumentError(
                f"tls_ca: {os.fspath(tls_ca)!r} contains a private key; give the CA certificate only (it is "
                "sent to trainers)",
                field="tls_ca",
            )
        roots = data.decode("ascii", "replace")
    return grpc.ssl_server_credentials([(key, cert)]), roots
