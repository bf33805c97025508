"""Tinker-shaped errors: what the SDK reads from a refused request or a failed future.

A refused request is an HTTP error whose JSON body names the field; a failed future is a
``RequestFailedResponse`` (``{"error": ..., "category": "user" | "server" | "unknown"}``) that
``retrieve_future`` answers with status 200. gRPC refusals of the scheduler or a session worker
map to both through :func:`from_rpc`.
"""

from __future__ import annotations

import grpc

__all__ = ["ApiError", "from_rpc", "USER", "SERVER"]

USER = "user"
SERVER = "server"

#: HTTP status of each gRPC code. 408, 429 and 5xx make the SDK retry; 4xx others are final.
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}

#: gRPC codes that are the caller's doing: category ``user``.
_USER_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
    }
)


class ApiError(Exception):
    """A refusal: HTTP ``status``, Tinker ``category`` and a message that starts with the field.

    Args:
        message: ``field: what was expected, what came``.
        status: the HTTP status of a refused request (400 bad input, 401 no key, 404 unknown id ...).
        category: ``user`` when the caller can fix it, else ``server``.
    """

    def __init__(self, message: str, *, status: int = 400, category: str = USER) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.category = category

    def body(self) -> dict:
        """The JSON body of a refused request."""
        return {"detail": self.message, "error": self.message, "category": self.category}

    def failed(self) -> dict:
        """The ``RequestFailedResponse`` of a failed future."""
        return {"error": self.message, "category": self.category}


def from_rpc(exc: grpc.RpcError, what: str) -> ApiError:
    """The :class:`ApiError` of a refused gRPC call ``what`` (``forward_backward``, ``the scheduler``)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    category = USER if code in _USER_CODES else SERVER
    return ApiError(f"{what}: {details}", status=_HTTP_STATUS.get(code, 500), category=category)
