"""The one way a servicer answers: domain errors become status codes, answers wait for the group
commit, audited actions are recorded with the status code's name.

:func:`rpc` decorates every unary handler of SchedulerService, NodeService and AdminService;
streaming handlers use :func:`abort_mapped` and :func:`record` for the same mapping and audit.
Status codes come from :func:`opentinker_scheduler.errors.status_code` (one table); a
``sqlite3.Error`` is UNAVAILABLE ("state store unavailable: ..."), as is the PostgreSQL store's
:class:`~opentinker_scheduler.errors.StoreUnavailable`; anything else is re-raised (gRPC answers
UNKNOWN) and audited as ``INTERNAL``. An INVALID_ARGUMENT whose message names a field
(:attr:`~opentinker_scheduler.errors.InvalidArgument.field`) also carries it as a
``google.rpc.BadRequest`` detail, so clients read the field path without parsing the message. A
follower's :class:`~opentinker_scheduler.errors.NotLeader` is UNAVAILABLE with a
``google.rpc.ErrorInfo`` (reason ``NOT_LEADER``, domain ``opentinker``, metadata ``leader``: the
leader's ``host:port`` when known) that clients and trainers follow (:func:`not_leader_status`).
"""

from __future__ import annotations

import collections
import functools
import sqlite3
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from opentinker_common.net.leader import ERROR_DOMAIN, NOT_LEADER_REASON
from opentinker_scheduler.errors import InvalidArgument, NotLeader, status_code
from opentinker_scheduler.security.auth import caller
from opentinker_scheduler.security.bundle import Security
from opentinker_scheduler.security.keys import Principal

__all__ = ["Call", "abort_mapped", "bad_request_status", "not_leader_status", "outcome", "record", "refusal", "rpc"]

#: gRPC's own retries (A6) stop at a negative pushback: a follower's refusal goes straight back
#: to the caller, which follows the leader it names (opentinker_common/net/leader.py).
_NO_RETRY = (("grpc-retry-pushback-ms", "-1"),)


class _Status(collections.namedtuple("_Status", ("code", "details", "trailing_metadata")), grpc.Status):
    pass


#: Longest ``error`` kept in an audit record's detail (characters).
MAX_AUDIT_ERROR = 500


def refusal(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """``(status code, message)`` to abort with for ``exc``, or None when it is not a refusal
    (a bug: let it propagate)."""
    code = status_code(exc)
    if code is not None:
        return code, str(exc)
    if isinstance(exc, sqlite3.Error):
        return grpc.StatusCode.UNAVAILABLE, f"state store unavailable: {exc}"
    return None


def outcome(exc: BaseException | None) -> str:
    """An audit record's outcome: ``OK``, the status code's name (``PERMISSION_DENIED``), or
    ``INTERNAL`` for an error that is no refusal."""
    if exc is None:
        return "OK"
    mapped = refusal(exc)
    return mapped[0].name if mapped is not None else grpc.StatusCode.INTERNAL.name


def bad_request_status(exc: InvalidArgument) -> grpc.Status | None:
    """The INVALID_ARGUMENT status of ``exc`` with one ``google.rpc.BadRequest`` field violation
    (``field``: the path its message starts with; ``description``: the rest of the message), or
    None when the message names no field."""
    path = exc.field
    if path is None:
        return None
    message = str(exc)
    violation = error_details_pb2.BadRequest.FieldViolation(field=path, description=message[len(path) + 2 :])
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.BadRequest(field_violations=[violation]))
    code = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    return rpc_status.to_status(status_pb2.Status(code=code, message=message, details=[detail]))


def not_leader_status(exc: NotLeader) -> grpc.Status:
    """The UNAVAILABLE status of a follower's refusal, with a ``google.rpc.ErrorInfo`` (reason
    ``NOT_LEADER``, domain ``opentinker``, metadata ``leader`` = the leader's ``host:port``, or
    ``""`` while none is known)."""
    detail = any_pb2.Any()
    detail.Pack(
        error_details_pb2.ErrorInfo(reason=NOT_LEADER_REASON, domain=ERROR_DOMAIN, metadata={"leader": exc.leader})
    )
    code = grpc.StatusCode.UNAVAILABLE.value[0]
    return rpc_status.to_status(status_pb2.Status(code=code, message=str(exc), details=[detail]))


async def abort_mapped(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """Abort the RPC with the status code of a refusal (:func:`refusal`), a field-naming
    INVALID_ARGUMENT with its BadRequest detail (:func:`bad_request_status`), a follower's
    UNAVAILABLE with its ErrorInfo (:func:`not_leader_status`); re-raise anything else."""
    mapped = refusal(exc)
    if mapped is None:
        raise exc
    if isinstance(exc, NotLeader):
        await context.abort_with_status(not_leader_status(exc))
    status = bad_request_status(exc) if isinstance(exc, InvalidArgument) else None
    if status is not None:
        await context.abort_with_status(status)
    await context.abort(*mapped)


def record(security: Security | None, action: str, who: Principal, exc: BaseException | None, **detail: Any) -> None:
    """Write one audit record of ``action`` by ``who`` (none without ``security``: bare unit
    tests). A refusal adds ``error`` (its message, at most :data:`MAX_AUDIT_ERROR` characters)
    to ``detail``; ``task_id`` in ``detail`` fills the record's task id."""
    if security is None:
        return
    if exc is not None:
        detail["error"] = str(exc)[:MAX_AUDIT_ERROR]
    security.audit.record(
        action, owner=who.owner, role=who.role, key_prefix=who.key_prefix, outcome=outcome(exc), **detail
    )


@dataclass
class Call:
    """What a handler decorated with :func:`rpc` gets besides its request."""

    #: The caller (set by the auth interceptor; ``anonymous`` admin with auth off).
    who: Principal
    context: grpc.aio.ServicerContext
    #: The audit record's detail: what is in it when the handler raises goes into the refusal's
    #: record, what is in it when it returns into the OK record.
    detail: dict[str, Any] = field(default_factory=dict)


Handler = Callable[[Any, Any, Call], Awaitable[Any]]


def rpc(*, action: str | None = None) -> Callable[[Handler], Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable]]:
    """Decorate ``async def Method(self, request, call: Call)`` into a gRPC unary handler.

    * A refusal the handler raises (a :class:`~opentinker_scheduler.errors.SchedulerError`, a
      store error) aborts the RPC with its status code and message (:func:`refusal`), and a
      field-naming INVALID_ARGUMENT with its BadRequest detail too (:func:`abort_mapped`).
    * ``action`` (one of :data:`~opentinker_scheduler.security.audit.ACTIONS`): the call is
      audited, refused (outcome = the status code's name) or not (``OK``), with ``call.detail``.
    * The answer leaves only once everything written so far is committed (``await
      self.durable()``): also for reads, which may show what this loop turn changed.

    The servicer provides ``security`` (a :class:`~opentinker_scheduler.security.bundle.Security`
    or None) and ``async durable()``.
    """

    def decorate(fn: Handler):
        @functools.wraps(fn)
        async def handler(self, request, context):
            call = Call(caller(), context)
            try:
                response = await fn(self, request, call)
            except Exception as exc:  # noqa: BLE001 - audited, then mapped or re-raised
                if action is not None:
                    record(self.security, action, call.who, exc, **call.detail)
                await abort_mapped(context, exc)
            if action is not None:
                record(self.security, action, call.who, None, **call.detail)
            try:
                await self.durable()
            except Exception as exc:  # noqa: BLE001 - mapped or re-raised
                await abort_mapped(context, exc)
            return response

        return handler

    return decorate
