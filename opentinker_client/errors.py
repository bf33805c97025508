"""Typed exceptions of the OpenTinker client.

Every error the client raises is an :class:`OpenTinkerError`. Errors that come from the scheduler
carry the gRPC status code (``err.code``, a :class:`grpc.StatusCode`) and its message
(``err.details``); each status code the scheduler uses on purpose has its own subclass, so callers
catch what they can handle::

    try:
        task_id = client.submit_task(env_config=env.to_dict(), workload_type="lora_finetune")
    except InvalidArgumentError as err:      # bad spec: err.field names the offending field
        print(err.field, err.details)
    except UnavailableError:                 # scheduler unreachable; safe to retry
        ...

``str(err)`` reads ``INVALID_ARGUMENT: spec.workload_type: expected one of ...``.

A refusal that says when to retry carries ``err.retry_after`` (seconds, from a
``google.rpc.RetryInfo``); an overloaded scheduler's is an :class:`OverloadedError`. An error from
a submit says whether the task was created (``err.task_created``: ``False``, or ``None`` when it
cannot be told, e.g. the call ended ``DEADLINE_EXCEEDED``; submitting again with the same
``request_id`` then returns the task if it was).

Validation done locally (before anything is sent) raises the same :class:`InvalidArgumentError`
the scheduler would return, with ``code == grpc.StatusCode.INVALID_ARGUMENT``.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Sequence

import grpc

from opentinker_common.spec import SpecError
from opentinker_common.net.transport import closed_by_peer, tls_handshake_failed  # noqa: F401 - re-exported

if TYPE_CHECKING:  # pragma: no cover
    from opentinker_client.types import TaskInfo

#: The exception classes, base first: ``opentinker_client`` exports every one of them.
EXCEPTIONS = [
    "OpenTinkerError",
    "InvalidArgumentError",
    "ConfigError",
    "NotFoundError",
    "FailedPreconditionError",
    "OutOfOrderError",
    "AlreadyExistsError",
    "UnauthenticatedError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "OverloadedError",
    "UnavailableError",
    "DeadlineExceededError",
    "TaskFailedError",
]

__all__ = [
    *EXCEPTIONS,
    "from_rpc_error",
    "from_spec_error",
    "closed_by_peer",
    "tls_handshake_failed",
    "SCHEDULER_PLAINTEXT_HINT",
    "INFERENCE_PLAINTEXT_HINT",
]

# Status code -> the class that stands for it; filled by the classes themselves (``code=``).
_BY_CODE: dict[grpc.StatusCode, type[OpenTinkerError]] = {}


class OpenTinkerError(Exception):
    """Base of every error raised by the OpenTinker client.

    A subclass declared with ``code=grpc.StatusCode.X`` stands for that status:
    :func:`from_rpc_error` gives it for every error the server returns with that code.

    Attributes:
        code: the gRPC status code, or ``None`` for errors that did not come from a status
            (for example :class:`TaskFailedError`).
        details: the human-readable message (the gRPC status details for server errors).
        status: the decoded ``google.rpc.Status`` when the server sent rich details, else ``None``.
        retry_after: seconds the server said to wait before retrying (``google.rpc.RetryInfo``),
            else ``None``.
        reason: the ``google.rpc.ErrorInfo`` reason of an OpenTinker scheduler's refusal
            (``OVERLOADED``, ``SHUTTING_DOWN``, ``STORE_UNAVAILABLE``), else ``None``.
        task_created: set on errors of a submit: ``False`` when the scheduler refused the call
            and created no task; ``None`` when it cannot be told (the call was cut off, or timed
            out, after it may have reached the scheduler); for other calls always ``None``.
        request_id: set on errors of a submit: the idempotency key it was sent with (submit
            again with it to learn whether the task exists).
    """

    #: The status code this class stands for; ``None`` on the base class.
    grpc_code: grpc.StatusCode | None = None

    def __init_subclass__(cls, *, code: grpc.StatusCode | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.grpc_code = code
            _BY_CODE[code] = cls

    def __init__(self, details: str, *, code: grpc.StatusCode | None = None, status: Any = None) -> None:
        self.details = details
        self.code = code if code is not None else type(self).grpc_code
        self.status = status
        self.retry_after, self.reason = _retry_and_reason(status)
        self.task_created: bool | None = None
        self.request_id: str | None = None
        super().__init__(details)

    def __str__(self) -> str:
        if self.code is not None:
            return f"{self.code.name}: {self.details}"
        return self.details

    def __repr__(self) -> str:
        code = self.code.name if self.code is not None else None
        return f"{type(self).__name__}(code={code}, details={self.details!r})"


class InvalidArgumentError(OpenTinkerError, code=grpc.StatusCode.INVALID_ARGUMENT):
    """The request is malformed: a bad task spec, an empty task id, a bad page size.

    Raised by the scheduler, and locally, before anything is sent, for what the client can
    check itself (the task spec, arguments).

    Attributes:
        field: dotted path of the offending field (``spec.hyperparameters.learning_rate``) when
            known, else ``None``.
        violations: every bad field the check found, as ``(field, description)`` pairs, the
            first being ``field``'s (the scheduler's ``google.rpc.BadRequest`` field violations;
            for a local check, the spec refusal's problems); ``()`` when none is named.
    """

    def __init__(
        self,
        details: str,
        *,
        code: grpc.StatusCode | None = None,
        status: Any = None,
        field: str | None = None,
        violations: "Sequence[tuple[str, str]]" = (),
    ) -> None:
        super().__init__(details, code=code, status=status)
        self.field = field
        self.violations: tuple[tuple[str, str], ...] = tuple(violations) or _violations_from_status(status)


class ConfigError(InvalidArgumentError):
    """A task config file is not valid: unknown key, wrong type, bad value, or not YAML.

    ``str(err)`` reads
    ``INVALID_ARGUMENT: task.yaml:7:3: hyperparameters.lr: expected one of the known keys (...)``
    (``file:line:column``; the column is left out when not given).

    Attributes:
        source: the file name (or ``"<string>"``).
        line: 1-based line number of the offending key, or ``None`` when it cannot be told.
        column: 1-based column of the offending key on that line, or ``None``.
        key: dotted path of the offending key inside the file (``hyperparameters.lr``), or ``None``.
        field: as for :class:`InvalidArgumentError`: the key path.
    """

    def __init__(
        self,
        message: str,
        *,
        source: str,
        line: int | None = None,
        column: int | None = None,
        key: str | None = None,
    ) -> None:
        where = source if line is None else f"{source}:{line}" if column is None else f"{source}:{line}:{column}"
        prefix = f"{where}: {key}: " if key else f"{where}: "
        super().__init__(prefix + message, field=key)
        self.source = source
        self.line = line
        self.column = column
        self.key = key
        self.problems: tuple[ConfigError, ...] = (self,)

    @classmethod
    def combine(cls, problems: "Sequence[ConfigError]") -> "ConfigError":
        """One error for every problem found in one pass over a file, ordered by line and column
        (those without a line keep their order, after the others; one message said twice is said
        once). Its ``source``, ``line``, ``column``, ``key`` and ``field`` are the first problem's;
        ``details`` is each problem's on a line of its own; ``problems`` holds them all.
        ``problems`` must not be empty."""
        unique: list[ConfigError] = []
        for problem in problems:
            if all(problem.details != seen.details for seen in unique):
                unique.append(problem)
        ordered = sorted(unique, key=lambda p: (p.line is None, p.line or 0, p.column or 0))
        if len(ordered) == 1:
            return ordered[0]
        first = ordered[0]
        out = type(first).__new__(type(first))  # copy.copy would call the constructor with args
        out.__dict__.update(first.__dict__)
        out.details = "\n".join(p.details for p in ordered)
        out.problems = tuple(ordered)
        out.args = (out.details,)
        return out


class NotFoundError(OpenTinkerError, code=grpc.StatusCode.NOT_FOUND):
    """No task (or node) with that id exists, or it is not visible to this API key."""


class FailedPreconditionError(OpenTinkerError, code=grpc.StatusCode.FAILED_PRECONDITION):
    """The request is well formed but cannot be met, e.g. ``gpu_count`` larger than any node offers."""


class OutOfOrderError(FailedPreconditionError):
    """A training-session call whose sequence number was not the one the session expected next
    (``expected_sequence``; ``opentinker_client.training``). The call did not apply."""

    #: The sequence number the session expects (from the refusal's ``google.rpc.ErrorInfo``).
    expected_sequence: int | None = None


class AlreadyExistsError(OpenTinkerError, code=grpc.StatusCode.ALREADY_EXISTS):
    """The thing to create exists already."""


class UnauthenticatedError(OpenTinkerError, code=grpc.StatusCode.UNAUTHENTICATED):
    """No API key, or an unknown one. Pass ``api_key=`` or set ``OPENTINKER_API_KEY``.

    An inference server answers it too, for a key the scheduler does not know (or has revoked,
    or that has expired).
    """


class PermissionDeniedError(OpenTinkerError, code=grpc.StatusCode.PERMISSION_DENIED):
    """The API key is valid but its role may not do this (e.g. cancel another user's task)."""


class ResourceExhaustedError(OpenTinkerError, code=grpc.StatusCode.RESOURCE_EXHAUSTED):
    """A limit was reached: message size, spec size, tasks per owner, open streams.

    Waiting may help (open streams, tasks per owner); a smaller request does for sizes.
    """


class OverloadedError(ResourceExhaustedError):
    """The scheduler is overloaded and refused the call at once, before doing anything: a submit
    created no task (``task_created`` is ``False``). ``retry_after`` says when to try again;
    :meth:`RLClient.submit_task` does so by itself while its ``timeout`` allows, and raises this
    only when it does not."""


class UnavailableError(OpenTinkerError, code=grpc.StatusCode.UNAVAILABLE):
    """The scheduler cannot be reached (down, restarting, wrong address). Safe to retry.

    On a plaintext channel to a server that closed the connection, ``details`` ends with a hint
    that it may serve TLS (:data:`SCHEDULER_PLAINTEXT_HINT`, :data:`INFERENCE_PLAINTEXT_HINT`).
    """


class DeadlineExceededError(OpenTinkerError, TimeoutError, code=grpc.StatusCode.DEADLINE_EXCEEDED):
    """A call or a :meth:`RLClient.wait` did not finish in time. Also a :class:`TimeoutError`."""


class TaskFailedError(OpenTinkerError):
    """Raised by :meth:`RLClient.wait` when the task ended ``FAILED`` or ``CANCELLED``.

    Attributes:
        task: the final :class:`~opentinker_client.types.TaskInfo`; ``task.state`` is
            ``"failed"`` or ``"cancelled"`` and ``task.error`` says why.
    """

    def __init__(self, task: "TaskInfo") -> None:
        reason = task.error or "no reason given"
        super().__init__(f"task {task.task_id} {task.state.upper()}: {reason}")
        self.task = task


#: Appended to UNAVAILABLE on a plaintext channel to the scheduler that the server closed.
SCHEDULER_PLAINTEXT_HINT = (
    "(if the scheduler serves TLS, use https://host:port or pass its CA: --tls-ca / $OPENTINKER_TLS_CA)"
)
#: The same for an InferenceClient dialling a ``host:port`` endpoint in plaintext.
INFERENCE_PLAINTEXT_HINT = (
    "(if the inference server serves TLS, use its https://host:port endpoint, the one the inference task reports, "
    "and pass its CA: root_certificates / $OPENTINKER_TLS_CA)"
)
# "spec.hyperparameters.lr: expected ..." -> the field path at the start of a details message.
_FIELD_PREFIX = re.compile(r"^((?:spec|env_config|hyperparameters)(?:\.[A-Za-z0-9_]+|\[\d+\])*): ")


def _rich_status(err: grpc.RpcError) -> Any:
    """The ``google.rpc.Status`` from the trailers, when the server sent one."""
    try:
        from grpc_status import rpc_status
    except ImportError:  # pragma: no cover - grpcio-status is a dependency, but stay usable without it
        return None
    try:
        return rpc_status.from_call(err)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - malformed or mismatched details are not worth failing over
        return None


#: ``google.rpc.ErrorInfo.domain`` of the OpenTinker scheduler's refusals.
SCHEDULER_ERROR_DOMAIN = "opentinker.scheduler"


def _retry_and_reason(status: Any) -> tuple[float | None, str | None]:
    """``(RetryInfo delay in seconds, ErrorInfo reason of the scheduler)`` of a rich status."""
    if status is None:
        return None, None
    try:
        from google.rpc import error_details_pb2
    except ImportError:  # pragma: no cover
        return None, None
    retry_after = reason = None
    for any_msg in getattr(status, "details", ()):
        if any_msg.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            any_msg.Unpack(info)
            retry_after = max(0.0, info.retry_delay.ToNanoseconds() / 1e9)
        elif any_msg.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            any_msg.Unpack(info)
            if info.domain == SCHEDULER_ERROR_DOMAIN:
                reason = info.reason or None
    return retry_after, reason


def _violations_from_status(status: Any) -> tuple[tuple[str, str], ...]:
    """The ``(field, description)`` pairs of a ``google.rpc.BadRequest`` detail of ``status``."""
    if status is None:
        return ()
    try:
        from google.rpc import error_details_pb2
    except ImportError:  # pragma: no cover
        return ()
    for any_msg in status.details:
        if any_msg.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            any_msg.Unpack(bad)
            return tuple((v.field, v.description) for v in bad.field_violations)
    return ()


def _field_from_status(status: Any) -> str | None:
    if status is None:
        return None
    try:
        from google.rpc import error_details_pb2
    except ImportError:  # pragma: no cover
        return None
    for any_msg in status.details:
        if any_msg.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            any_msg.Unpack(bad)
            if bad.field_violations:
                return bad.field_violations[0].field or None
    return None


def from_rpc_error(err: grpc.RpcError, *, plaintext_hint: str = "") -> OpenTinkerError:
    """Map a :class:`grpc.RpcError` to the matching :class:`OpenTinkerError` subclass.

    Codes without a subclass of their own (``INTERNAL``, ``UNKNOWN``, ``UNIMPLEMENTED``,
    ``CANCELLED``, ...) give a plain :class:`OpenTinkerError` carrying that code. For
    ``INVALID_ARGUMENT`` the field path is taken from a ``google.rpc.BadRequest`` detail when
    present, else from the start of the message (``spec.x.y: ...``).

    Args:
        plaintext_hint: the call went over a plaintext channel; appended to an ``UNAVAILABLE``
            whose details say the server closed the connection (:func:`closed_by_peer`), which is
            how a TLS port answers plaintext (:data:`SCHEDULER_PLAINTEXT_HINT`,
            :data:`INFERENCE_PLAINTEXT_HINT`).
    """
    code_fn = getattr(err, "code", None)
    details_fn = getattr(err, "details", None)
    code = code_fn() if callable(code_fn) else None
    details = details_fn() if callable(details_fn) else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
        details = details or str(err)
    if not details:
        details = code.name.lower().replace("_", " ")
    if plaintext_hint and code == grpc.StatusCode.UNAVAILABLE and closed_by_peer(details):
        details = f"{details} {plaintext_hint}"
    status = _rich_status(err)
    cls = _BY_CODE.get(code, OpenTinkerError)
    if cls is ResourceExhaustedError and _retry_and_reason(status)[1] == "OVERLOADED":
        cls = OverloadedError
    if cls is InvalidArgumentError:
        field = _field_from_status(status)
        if field is None:
            m = _FIELD_PREFIX.match(details)
            field = m.group(1) if m else None
        return InvalidArgumentError(details, code=code, status=status, field=field)
    return cls(details, code=code, status=status)


def from_spec_error(err: SpecError) -> InvalidArgumentError:
    """Turn a local :class:`~opentinker_common.spec.SpecError` into the
    :class:`InvalidArgumentError` the scheduler would have returned (same message, same field)."""
    message = str(err)
    prefix = f"{err.field}: "
    if err.expected.startswith("one of the known keys") and message.startswith(prefix):
        message = f"{prefix}unknown key, {message[len(prefix) :]}"
    violations = [(p.field, p.detail.removeprefix(f"{p.field}: ")) for p in err.problems]
    return InvalidArgumentError(message, field=err.field, violations=violations)
