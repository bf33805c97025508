"""The one way a servicer answers: domain errors become status codes, answers wait for the group
commit, audited actions are recorded with the status code's name.

:func:`rpc` decorates every unary handler of SchedulerService, NodeService and AdminService;
streaming handlers use :func:`abort_mapped` and :func:`record` for the same mapping and audit.
Status codes come from :func:`opentinker_scheduler.errors.status_code` (one table); a
``sqlite3.Error`` is UNAVAILABLE ("state store unavailable: ..."); anything else is re-raised
(gRPC answers UNKNOWN) and audited as ``INTERNAL``. An INVALID_ARGUMENT whose message names a
field (:attr:`~opentinker_scheduler.errors.InvalidArgument.field`) also carries it as a
``google.rpc.BadRequest`` detail, so clients read the field path without parsing the message.
A refusal that says when to retry (``retry_after``: an overloaded or stopping scheduler, a rate
limit) carries a ``google.rpc.RetryInfo`` detail and the ``grpc-retry-pushback-ms`` trailer that
gRPC's own retries obey; one with a ``reason`` a ``google.rpc.ErrorInfo`` (domain
``opentinker.scheduler``). A store error is ``STORE_UNAVAILABLE``: its writes were rolled back.
A follower's :class:`~opentinker_scheduler.errors.NotLeader` (reason ``NOT_LEADER``) carries
the leader's ``host:port`` in the ErrorInfo's metadata ``leader`` and ``grpc-retry-pushback-ms:
-1``, so gRPC does not retry the follower itself; clients and trainers go to the leader
(:mod:`opentinker_common.net.leader`).
"""

from __future__ import annotations

import collections
import functools
import sqlite3
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from opentinker_scheduler.errors import ERROR_DOMAIN, InvalidArgument, NotLeader, SchedulerError, status_code
from opentinker_scheduler.security.auth import caller
from opentinker_scheduler.security.bundle import Security
from opentinker_scheduler.security.keys import Principal
from opentinker_scheduler.security.limits import hold_rate_refusal

__all__ = ["Call", "abort_mapped", "bad_request_status", "outcome", "record", "refusal", "refusal_status", "rpc"]

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
    if exc.field is None:
        return None
    return refusal_status(exc)


def _pack(message) -> any_pb2.Any:
    detail = any_pb2.Any()
    detail.Pack(message)
    return detail


def refusal_status(exc: BaseException) -> grpc.Status | None:
    """The rich status of a refusal, or None when a plain code and message say it all (and for
    anything that is no refusal). Its details, in this order, each when it applies:

    * ``google.rpc.BadRequest``: an INVALID_ARGUMENT whose message names a field (``field``: the
      path its message starts with; ``description``: the rest of the message), or one violation
      per bad field when the refusal lists them (``InvalidArgument.violations``: a spec check
      that found several);
    * ``google.rpc.RetryInfo``: ``retry_after`` seconds (also as the ``grpc-retry-pushback-ms``
      trailer, which gRPC's retry policy obeys);
    * ``google.rpc.ErrorInfo``: ``reason`` (domain :data:`~opentinker_scheduler.errors.ERROR_DOMAIN`);
      a store error is ``STORE_UNAVAILABLE``.
    """
    mapped = refusal(exc)
    if mapped is None:
        return None
    code, message = mapped
    details = []
    field = exc.field if isinstance(exc, InvalidArgument) else None
    if isinstance(exc, InvalidArgument) and exc.violations:
        violations = [
            error_details_pb2.BadRequest.FieldViolation(field=name, description=description)
            for name, description in exc.violations
        ]
        details.append(_pack(error_details_pb2.BadRequest(field_violations=violations)))
    elif field is not None:
        violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=message[len(field) + 2 :])
        details.append(_pack(error_details_pb2.BadRequest(field_violations=[violation])))
    retry_after = exc.retry_after if isinstance(exc, SchedulerError) else None
    if retry_after is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(max(0.0, retry_after) * 1e9))
        details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
    reason = exc.reason if isinstance(exc, SchedulerError) else "STORE_UNAVAILABLE"
    if reason:
        # A follower names the leader, for clients and trainers to go there.
        metadata = {"leader": exc.leader} if isinstance(exc, NotLeader) else {}
        details.append(_pack(error_details_pb2.ErrorInfo(reason=reason, domain=ERROR_DOMAIN, metadata=metadata)))
    if not details:
        return None
    status = rpc_status.to_status(status_pb2.Status(code=code.value[0], message=message, details=details))
    if retry_after is not None:
        pushback = ("grpc-retry-pushback-ms", str(int(max(0.0, retry_after) * 1000)))
        status = _Status(status.code, status.details, (*status.trailing_metadata, pushback))
    elif isinstance(exc, NotLeader):
        # gRPC's own retries (A6) stop at a negative pushback: the refusal goes straight back to
        # the caller, which follows the leader it names instead of asking this follower again.
        status = _Status(status.code, status.details, (*status.trailing_metadata, ("grpc-retry-pushback-ms", "-1")))
    return status


class _Status(collections.namedtuple("_Status", ("code", "details", "trailing_metadata")), grpc.Status):
    """A ``grpc.Status`` (as ``rpc_status.to_status`` makes them) with more trailers."""


async def abort_mapped(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """Abort the RPC with the status code and message of a refusal (:func:`refusal`) and its
    details (:func:`refusal_status`); re-raise anything else. A refusal for a rate is sent after
    :func:`~opentinker_scheduler.security.limits.hold_rate_refusal`."""
    mapped = refusal(exc)
    if mapped is None:
        raise exc
    await hold_rate_refusal()
    status = refusal_status(exc)
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


def rpc(
    *, action: str | None = None, gate: str | None = None
) -> Callable[[Handler], Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable]]:
    """Decorate ``async def Method(self, request, call: Call)`` into a gRPC unary handler.

    * ``gate``: the name of the servicer's :class:`~opentinker_scheduler.admission.load.SubmitGate`
      attribute. The call passes it first (refused there: the refusal's status at once, before
      anything else, never audited) and counts as in progress until its answer leaves.

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
            admitted = None
            if gate is not None:
                try:
                    admitted = getattr(self, gate).enter(context)
                except Exception as exc:  # noqa: BLE001 - mapped (a refusal) or re-raised
                    await abort_mapped(context, exc)
            try:
                call = Call(caller(), context)
                try:
                    response = await fn(self, request, call)
                except Exception as exc:  # noqa: BLE001 - audited, then mapped or re-raised
                    if action is not None:
                        record(self.security, action, call.who, exc, **call.detail)
                    if admitted is not None:  # its work is over: a held refusal holds no submit slot
                        getattr(self, gate).leave(admitted)
                        admitted = None
                    await abort_mapped(context, exc)
                if action is not None:
                    record(self.security, action, call.who, None, **call.detail)
                try:
                    await self.durable()
                except Exception as exc:  # noqa: BLE001 - mapped or re-raised
                    await abort_mapped(context, exc)
                return response
            finally:
                if admitted is not None:
                    getattr(self, gate).leave(admitted)

        return handler

    return decorate
