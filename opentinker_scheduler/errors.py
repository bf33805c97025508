"""Domain errors of the scheduler core; the gRPC servicers map each to its status code
(:func:`status_code`)."""

from __future__ import annotations

import re

import grpc

from opentinker_common import artifacts as art
from opentinker_common.artifacts.local import UploadIncomplete, UploadOffsetMismatch

#: A message that names a request field starts with its path and ": " (``spec.hyperparameters.lr: ``,
#: ``spec.datasets[0].uri: ``, ``page_size: ``).
#: The ``domain`` of the ``google.rpc.ErrorInfo`` the scheduler sends with a ``reason``.
ERROR_DOMAIN = "opentinker.scheduler"

#: Most field violations one INVALID_ARGUMENT carries (each under ~1 KB: the status details
#: travel as trailing metadata, whose size gRPC limits).
MAX_VIOLATIONS = 8

_FIELD_PATH = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+|\[\d+\])*): ")


class SchedulerError(Exception):
    """Base of the scheduler's domain errors.

    Args:
        retry_after: seconds after which the same call may succeed; sent to the client as a
            ``google.rpc.RetryInfo`` detail (and ``grpc-retry-pushback-ms``). None: no advice.
        reason: a machine-readable reason in UPPER_SNAKE_CASE, sent as a ``google.rpc.ErrorInfo``
            detail (domain :data:`ERROR_DOMAIN`) when given, e.g. ``OVERLOADED``.
    """

    def __init__(self, message: str = "", *, retry_after: float | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.reason = reason


class NotFound(SchedulerError):
    """NOT_FOUND: no such task (or not visible to the caller)."""


class InvalidArgument(SchedulerError):
    """INVALID_ARGUMENT: a request field is bad; the message names its path.

    Args:
        violations: every bad field, as ``(field, description)`` pairs, the first the message's;
            sent as the ``google.rpc.BadRequest`` detail's field violations (at most
            :data:`MAX_VIOLATIONS`). ``()``: the one field the message starts with.
    """

    def __init__(self, message: str = "", *, violations=(), **kwargs) -> None:
        super().__init__(message, **kwargs)
        self.violations: tuple[tuple[str, str], ...] = tuple(violations)[:MAX_VIOLATIONS]

    @classmethod
    def from_spec(cls, exc) -> "InvalidArgument":
        """The refusal of a :class:`~opentinker_common.spec.SpecError`: its message, and each of
        its problems (``exc.problems``) as a violation."""
        return cls(str(exc), violations=[(p.field, p.detail.removeprefix(f"{p.field}: ")) for p in exc.problems])

    @property
    def field(self) -> str | None:
        """The field path the message starts with (``"spec.hyperparameters.learning_rate"`` of
        ``"spec.hyperparameters.learning_rate: expected ..."``), or None when it names none."""
        m = _FIELD_PATH.match(str(self))
        return m.group(1) if m else None


class FailedPrecondition(SchedulerError):
    """FAILED_PRECONDITION: valid, but cannot be done in this cluster (e.g. too many GPUs)."""


class PermissionDenied(SchedulerError):
    """PERMISSION_DENIED: e.g. a node id outside the resource pool while unknown nodes are refused."""


class ResourceExhausted(SchedulerError):
    """RESOURCE_EXHAUSTED: a limit was hit; the message names it."""


class DeadlineExceeded(SchedulerError):
    """DEADLINE_EXCEEDED: the scheduler stopped waiting for the caller (an upload stream that went
    idle or stayed open past its deadline); the message names the limit and its config key."""


class Unavailable(SchedulerError):
    """UNAVAILABLE: the scheduler cannot take the call now (it is shutting down); nothing was
    done, and the same call may be made again (``retry_after``)."""


class AlreadyExists(SchedulerError):
    """ALREADY_EXISTS: a node id already connected, or a request id reused for another spec."""


class StoreUnavailable(Unavailable):
    """UNAVAILABLE: the state store cannot be reached or written now (a database restarting, a
    broken connection, a write that timed out); nothing of the call was committed (ErrorInfo
    reason ``STORE_UNAVAILABLE``, as for SQLite's errors)."""

    def __init__(self, message: str = "", **kw) -> None:
        kw.setdefault("reason", "STORE_UNAVAILABLE")
        super().__init__(message, **kw)


class NotLeader(Unavailable):
    """UNAVAILABLE: only the leader of several schedulers does this (writes, node streams), and
    this one is not it. ``leader`` is the leader's ``host:port`` when known (``""`` while an
    election is under way); it travels as a ``google.rpc.ErrorInfo`` (reason ``NOT_LEADER``,
    metadata ``leader``) so clients and trainers follow it."""

    def __init__(self, leader: str = "", message: str = "") -> None:
        self.leader = leader
        super().__init__(
            message
            or (
                f"this scheduler is a follower; the leader is {leader}"
                if leader
                else "this scheduler is a follower and no leader is known yet (an election is under way); retry"
            ),
            reason="NOT_LEADER",
        )


class Fenced(NotLeader):
    """UNAVAILABLE: the database refused a write of this scheduler because a newer leader epoch
    holds the lease (this one lost it, e.g. while it was stopped); it has stepped down."""

    def __init__(self, detail: str, leader: str = "") -> None:
        super().__init__(leader, f"this scheduler lost the leader lease and stepped down ({detail})")


_STATUS_CODES = {
    # the artifact store's errors (opentinker_common.artifacts), first the more specific ones
    UploadOffsetMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    UploadIncomplete: grpc.StatusCode.FAILED_PRECONDITION,
    art.InvalidArtifact: grpc.StatusCode.INVALID_ARGUMENT,
    art.ArtifactNotFound: grpc.StatusCode.NOT_FOUND,
    art.ArtifactCorrupt: grpc.StatusCode.DATA_LOSS,
    art.ArtifactExists: grpc.StatusCode.ALREADY_EXISTS,
    art.StoreFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    art.StoreAuthError: grpc.StatusCode.FAILED_PRECONDITION,
    art.StoreUnavailable: grpc.StatusCode.UNAVAILABLE,
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
}


def status_code(exc: BaseException) -> grpc.StatusCode | None:
    """The gRPC status of a domain error, or None for any other exception."""
    for cls, code in _STATUS_CODES.items():
        if isinstance(exc, cls):
            return code
    return None
