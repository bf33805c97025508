"""Domain errors of the scheduler core; the gRPC servicers map each to its status code."""

from __future__ import annotations


class SchedulerError(Exception):
    """Base of the scheduler's domain errors."""


class NotFound(SchedulerError):
    """NOT_FOUND: no such task (or not visible to the caller)."""


class InvalidArgument(SchedulerError):
    """INVALID_ARGUMENT: a request field is bad; the message names its path."""


class FailedPrecondition(SchedulerError):
    """FAILED_PRECONDITION: valid, but cannot be done in this cluster (e.g. too many GPUs)."""


class PermissionDenied(SchedulerError):
    """PERMISSION_DENIED: e.g. a node id outside the resource pool while unknown nodes are refused."""


class ResourceExhausted(SchedulerError):
    """RESOURCE_EXHAUSTED: a limit was hit; the message names it."""


class AlreadyExists(SchedulerError):
    """ALREADY_EXISTS: a node id already connected, or a request id reused for another spec."""
