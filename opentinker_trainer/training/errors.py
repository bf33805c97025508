"""Refusals of a training session. Each leaves the session exactly as it was.

======================  ======================================================================
error                   gRPC status
======================  ======================================================================
:class:`BadRequest`     INVALID_ARGUMENT (the message names ``datums[i].field`` and the numbers)
:class:`OutOfOrder`     FAILED_PRECONDITION (``expected``: the sequence number the session wants)
:class:`NotReady`       FAILED_PRECONDITION (e.g. OptimStep with no gradient accumulated)
:class:`StateNotFound`  NOT_FOUND
:class:`OverLimit`      RESOURCE_EXHAUSTED (the message gives the bound and the number asked)
:class:`Stopping`       UNAVAILABLE
======================  ======================================================================
"""

from __future__ import annotations

__all__ = ["BadRequest", "NotReady", "OutOfOrder", "OverLimit", "SessionError", "StateNotFound", "Stopping", "STATUS"]


class SessionError(Exception):
    """Base of the refusals; ``status`` is the gRPC status code's name."""

    status = "INTERNAL"


class BadRequest(SessionError):
    status = "INVALID_ARGUMENT"


class OutOfOrder(SessionError):
    """A call whose sequence number is not the one the session expects next."""

    status = "FAILED_PRECONDITION"

    def __init__(self, got: int, expected: int, why: str = "") -> None:
        self.got, self.expected = int(got), int(expected)
        super().__init__(
            f"sequence {got}: expected {expected}"
            + (f" ({why})" if why else " (calls of a session apply in the order of their sequence numbers)")
        )


class NotReady(SessionError):
    status = "FAILED_PRECONDITION"


class StateNotFound(SessionError):
    status = "NOT_FOUND"


class OverLimit(SessionError):
    status = "RESOURCE_EXHAUSTED"


class Stopping(SessionError):
    status = "UNAVAILABLE"


#: error class -> gRPC status code name, for the servicer.
STATUS: dict[type[SessionError], str] = {
    cls: cls.status for cls in (BadRequest, OutOfOrder, NotReady, StateNotFound, OverLimit, Stopping)
}
