"""The task part of :class:`~opentinker_client.RLClient`: submit, read, follow and cancel tasks,
over the :class:`~opentinker_client.connection.SchedulerConnection` it is given.

``RLClient`` checks its arguments and documents each call; :class:`TaskCalls` makes them.
Errors are :class:`~opentinker_client.errors.OpenTinkerError` subclasses, as ``RLClient`` says.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
import uuid
from typing import Any, Iterable, Iterator

from opentinker.common.v1 import common_pb2
from opentinker.scheduler.v1 import scheduler_pb2
from opentinker_client._convert import (
    event_from_proto,
    node_from_proto,
    state_enum,
    task_from_proto,
    timed_metric_points,
    usage_dict,
)
from opentinker_client.connection import SchedulerConnection
import grpc

from opentinker_client.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    OpenTinkerError,
    OverloadedError,
    TaskFailedError,
    UnavailableError,
)
from opentinker_client.types import NodeInfo, TaskEvent, TaskInfo
from opentinker_common.net.leader import FAILOVER_BACKOFF_MAX_S

__all__ = ["TaskCalls", "PendingWarner", "PollPacer", "check_task_id"]

log = logging.getLogger("opentinker_client")

#: Seconds :meth:`TaskCalls.wait` rides out ``UNAVAILABLE`` in a row before it gives up.
WAIT_OUTAGE_S = 300.0
#: Attempts of a submit cut off (``CANCELLED``) or unreachable (``UNAVAILABLE``) before it gives up
#: (gRPC's own retry policy for the other calls makes as many); an overloaded or stopping
#: scheduler's refusals are retried, after the delay it asks for, while the timeout allows.
SUBMIT_ATTEMPTS = 5
#: Seconds a retried submit must have left for the scheduler to answer (or the wait it asked for,
#: or :data:`ANSWER_MARGIN` times the slowest answer so far, when longer). With less, the refusal
#: in hand is the answer: definite ("no task was created"), where an attempt cut short by the
#: timeout leaves the outcome unknown.
MIN_ATTEMPT_S = 0.5
#: How many times its slowest answer so far a retried submit must have left: on a loaded
#: machine a refusal that took 0.4 s is given 1.2 s, not the bare :data:`MIN_ATTEMPT_S`.
ANSWER_MARGIN = 3.0
#: Status codes with which the scheduler refuses a submit before writing anything.
_REFUSALS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)


def submit_outcome(err: OpenTinkerError) -> bool | None:
    """Whether a submit that ended with ``err`` created its task: ``False`` for a refusal (the
    status codes of :data:`_REFUSALS`, or any error the scheduler marked with its reason: it
    refuses before it writes, and a failed write is rolled back); ``None`` when it cannot be told
    (cut off, timed out, or unreachable after the request may have arrived)."""
    if err.code in _REFUSALS or err.reason is not None:
        return False
    return None


def check_task_id(task_id: Any) -> str:
    """``task_id`` when it is a non-empty string.

    Raises:
        InvalidArgumentError: anything else (``field="task_id"``), before anything is sent.
    """
    if not isinstance(task_id, str) or not task_id.strip():
        raise InvalidArgumentError(f"task_id: expected a non-empty task id, got {task_id!r}", field="task_id")
    return task_id


class _Backoff:
    """Exponential backoff with +-20 % jitter, in seconds."""

    def __init__(self, initial: float, maximum: float) -> None:
        self.initial, self.maximum = initial, maximum
        self.current = initial

    def reset(self) -> None:
        self.current = self.initial

    def next(self) -> float:
        delay = self.current * random.uniform(0.8, 1.2)
        self.current = min(self.current * 2, self.maximum)
        return delay


class PollPacer:
    """Keeps calls about the same key at least ``interval`` seconds apart, by sleeping the rest
    of the interval (the seed's tight ``while not client.is_task_complete(...)`` loop). Safe to
    share between threads; it forgets all keys past 10,000."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def pace(self, key: str, interval: float) -> None:
        """Sleep until ``interval`` seconds have passed since the last call for ``key``; an
        ``interval`` <= 0 returns at once."""
        if interval <= 0:
            return
        with self._lock:
            last = self._last.get(key)
        if last is not None:
            wait = last + interval - time.monotonic()
            if wait > 0:
                time.sleep(wait)
        with self._lock:
            if len(self._last) > 10_000:
                self._last.clear()
            self._last[key] = time.monotonic()


class PendingWarner:
    """Says through :mod:`logging` (logger ``opentinker_client``, level WARNING) why a task is
    still pending, once it has been seen PENDING for ``after`` seconds in a row: the seed's loop
    otherwise prints ``Loss: nan, Reward: nan`` forever with the reason only in ``opentinker get``.

    Once per pending spell of a task: again only after it left PENDING and came back (a requeue).
    ``after`` <= 0 or ``None`` turns it off. Safe to share between threads; it forgets tasks past
    10,000."""

    def __init__(self, after: float | None) -> None:
        self.after = after
        self._since: dict[str, float] = {}  # task id -> when first seen pending (monotonic)
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def observe(self, info: TaskInfo) -> None:
        if not self.after or self.after <= 0:
            return
        now = time.monotonic()
        with self._lock:
            if info.state != "pending":
                self._since.pop(info.task_id, None)
                self._warned.discard(info.task_id)
                return
            if len(self._since) > 10_000:
                self._since.clear()
                self._warned.clear()
            since = self._since.setdefault(info.task_id, now)
            if now - since < self.after or info.task_id in self._warned:
                return
            self._warned.add(info.task_id)
        log.warning(
            "task %s has been pending for %.0f s: %s (RLClient.pending_reason(task_id), or: opentinker get %s)",
            info.task_id,
            now - since,
            info.pending_reason or "the scheduler gave no reason",
            info.task_id,
        )


class TaskCalls:
    """``SchedulerService`` task calls over ``connection`` (see the ``RLClient`` method of each
    name for arguments, results and errors). Task ids are taken as checked. Every task read
    (:meth:`get`, so ``is_task_complete`` and ``wait`` too) goes past ``pending`` (a
    :class:`PendingWarner`)."""

    def __init__(self, connection: SchedulerConnection, *, pending_warning_after: float | None = None) -> None:
        self.connection = connection
        self.pending = PendingWarner(pending_warning_after)

    # -- submit and change --------------------------------------------------------------------

    def submit(self, spec: common_pb2.TaskSpec, *, request_id: str | None = None) -> str:
        """Submit ``spec``; returns the new task's id. ``request_id`` (idempotency key) defaults
        to a random one, so that the call may be made again: within the connection's timeout it
        is, after the delay the scheduler asks for when it refused as overloaded
        (:class:`OverloadedError`) or stopping (``UNAVAILABLE``), and with backoff, at most
        :data:`SUBMIT_ATTEMPTS` times, when it was cut off (``CANCELLED``) or unreachable.

        Raises:
            OpenTinkerError: the subclass of the last attempt's status, with ``task_created``
                (:func:`submit_outcome`) and ``request_id`` set; when the outcome cannot be
                told, the message says to submit again with the same ``request_id``.
        """
        request = scheduler_pb2.SubmitTaskRequest(spec=spec, request_id=request_id or uuid.uuid4().hex)
        deadline = time.monotonic() + self.connection.timeout
        backoff = _Backoff(0.2, FAILOVER_BACKOFF_MAX_S)
        cut_off = 0
        slowest = 0.0  # seconds the slowest answered attempt took
        while True:
            started = time.monotonic()
            try:
                left = max(0.001, deadline - started)
                return self.connection.unary("SubmitTask", request, timeout=left).task.task_id
            except OpenTinkerError as err:
                if err.code != grpc.StatusCode.DEADLINE_EXCEEDED:
                    slowest = max(slowest, time.monotonic() - started)
                err.task_created = submit_outcome(err)
                err.request_id = request.request_id
                wait = None
                if isinstance(err, OverloadedError) or (err.code == grpc.StatusCode.UNAVAILABLE and err.retry_after):
                    wait = (err.retry_after or 0.0) * random.uniform(1.0, 1.2)
                elif err.code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE):
                    cut_off += 1
                    wait = backoff.next() if cut_off < SUBMIT_ATTEMPTS else None
                needed = max(wait or 0.0, MIN_ATTEMPT_S, ANSWER_MARGIN * slowest)
                if wait is None or time.monotonic() + wait + needed >= deadline:
                    if err.task_created is None:
                        err.details += (
                            f" (the task may or may not have been created: submit again with "
                            f"request_id={request.request_id!r}, which returns it if it was)"
                        )
                    raise
                log.info("submit refused or cut off (%s); retrying in %.2f s with the same request_id", err, wait)
                time.sleep(wait)

    def estimate(
        self, spec: common_pb2.TaskSpec, *, dataset_uploaded_at_submit: bool = False
    ) -> tuple[TaskInfo, dict[str, float], str]:
        """A dry-run submit (``RLClient.estimate``): ``(the task as it would be stored, expected
        usage, how it was estimated)``; nothing is created. ``dataset_uploaded_at_submit``: the
        spec's ``dataset_id`` is a local file's, checked here and not uploaded."""
        request = scheduler_pb2.SubmitTaskRequest(
            spec=spec, dry_run=True, dataset_uploaded_at_submit=dataset_uploaded_at_submit
        )
        response = self.connection.unary("SubmitTask", request)
        return task_from_proto(response.task), usage_dict(response.estimate), response.estimate_basis

    def usage(self, *, owner: str = "", since: float | None = None) -> dict[str, Any]:
        """Accounted usage per owner and queue (``RLClient.usage``)."""
        request = scheduler_pb2.GetUsageRequest(owner=owner)
        if since is not None:
            request.since.FromNanoseconds(int(since * 1e9))
        response = self.connection.unary("GetUsage", request)
        return {
            "currency": response.currency,
            "owners": {r.name: {"queue": r.queue, **usage_dict(r.usage)} for r in response.owners},
            "queues": {r.name: usage_dict(r.usage) for r in response.queues},
        }

    def cancel(self, task_id: str, *, reason: str = "") -> TaskInfo:
        """Cancel; returns the task after it (``RLClient.cancel``)."""
        response = self.connection.unary("CancelTask", scheduler_pb2.CancelTaskRequest(task_id=task_id, reason=reason))
        return task_from_proto(response.task)

    def delete_artifacts(self, task_id: str) -> tuple[TaskInfo, list[str], int]:
        """Delete a finished task's artifacts (``RLClient.delete_artifacts``)."""
        response = self.connection.unary(
            "DeleteTaskArtifacts", scheduler_pb2.DeleteTaskArtifactsRequest(task_id=task_id)
        )
        return task_from_proto(response.task), list(response.deleted_keys), response.deleted_bytes

    # -- read ---------------------------------------------------------------------------------

    def get(self, task_id: str, *, timeout: float | None = None) -> TaskInfo:
        """The task now; ``timeout`` in seconds (``None``: the connection's)."""
        response = self.connection.unary("GetTask", scheduler_pb2.GetTaskRequest(task_id=task_id), timeout=timeout)
        info = task_from_proto(response.task)
        self.pending.observe(info)
        return info

    def list(self, *, states: Iterable[str | int] | str | None, limit: int | None) -> list[TaskInfo]:
        """Tasks newest first, fetched a page of at most 1000 at a time (``RLClient.list_tasks``)."""
        if isinstance(states, (str, int)):
            states = [states]
        try:
            state_values = [state_enum(s) for s in (states or ())]
        except ValueError as err:
            raise InvalidArgumentError(f"states: {err}", field="states") from None
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise InvalidArgumentError(f"limit: expected an integer >= 1 or None, got {limit!r}", field="limit")
        out: list[TaskInfo] = []
        token = ""
        while True:
            page_size = 1000 if limit is None else min(1000, limit - len(out))
            response = self.connection.unary(
                "ListTasks", scheduler_pb2.ListTasksRequest(states=state_values, page_size=page_size, page_token=token)
            )
            out.extend(task_from_proto(t) for t in response.tasks)
            token = response.next_page_token
            if not token or not response.tasks or (limit is not None and len(out) >= limit):
                break
        return out if limit is None else out[:limit]

    def metrics(self, task_id: str) -> dict[str, float]:
        """The newest step's metrics with ``loss``, ``reward`` (NaN before step 1) and ``step``."""
        request = scheduler_pb2.GetMetricsRequest(task_id=task_id, include_history=False)
        response = self.connection.unary("GetMetrics", request)
        metrics: dict[str, Any] = {"loss": math.nan, "reward": math.nan}
        metrics.update(response.latest)
        metrics["step"] = int(response.latest_step)
        return metrics

    def metric_history(self, task_id: str, *, after_step: int = 0) -> list[tuple[int, dict[str, float]]]:
        """``(step, values)`` after ``after_step``, oldest first, each step once (its newest report)."""
        return [(s, v) for s, _, v in self.timed_metric_history(task_id, after_step=after_step)]

    def timed_metric_history(self, task_id: str, *, after_step: int = 0) -> list[tuple[int, float, dict[str, float]]]:
        """``(step, unix seconds, values)`` after ``after_step``, oldest first, each step once (its
        newest report: the scheduler leaves out an earlier attempt's report of a step run again)."""
        out: list[tuple[int, float, dict[str, float]]] = []
        step = int(after_step)
        while True:
            response = self.connection.unary(
                "GetMetrics", scheduler_pb2.GetMetricsRequest(task_id=task_id, after_step=step, include_history=True)
            )
            points = [p for p in timed_metric_points(response.points) if p[0] > step]
            if not points:
                break
            out.extend(points)
            step = max(p[0] for p in points)
            if step >= response.latest_step:
                break
        return out

    def nodes(self) -> list[NodeInfo]:
        """The trainer nodes (``RLClient.list_nodes``)."""
        response = self.connection.unary("ListNodes", scheduler_pb2.ListNodesRequest())
        return [node_from_proto(n) for n in response.nodes]

    # -- follow -------------------------------------------------------------------------------

    def watch(
        self,
        task_id: str,
        *,
        after_sequence: int,
        follow: bool,
        reconnect_timeout: float | None,
        backoff: tuple[float, float],
        timeout: float | None = None,
    ) -> Iterator[TaskEvent]:
        """The task's events after ``after_sequence``, resuming after the last one seen when the
        stream drops; ``backoff`` is (first, largest) reconnect delay in seconds, ``timeout`` the
        seconds for the whole watch (``None``: none) (``RLClient.watch``).

        The scheduler is "down" from the moment a stream is opened or lost until it answers
        (stream headers, an event, or a ``GetTask``); every try while down (each open, the
        ``GetTask`` check, each backoff sleep) is bounded by what is left of
        ``reconnect_timeout``, so a frozen scheduler ends the watch at ``reconnect_timeout``.
        """
        last = int(after_sequence)
        delays = _Backoff(*backoff)
        deadline = None if timeout is None else time.monotonic() + timeout
        down_since: float | None = None

        def left(share: float = 1.0) -> float:
            """Seconds this try may take: the connection's timeout, capped by ``share`` of what is
            left of the reconnect window and by what is left of ``timeout``; raises once either
            has run out."""
            now = time.monotonic()
            bound = self.connection.timeout
            if deadline is not None:
                if now >= deadline:
                    raise DeadlineExceededError(f"watch of task {task_id} did not end within {timeout:g} s")
                bound = min(bound, deadline - now)
            if reconnect_timeout is not None and down_since is not None:
                if now - down_since >= reconnect_timeout:
                    raise UnavailableError(
                        f"lost the watch stream of task {task_id} and could not reconnect for "
                        f"{reconnect_timeout:g} s: {failure.details if failure is not None else 'no answer'}"
                    ) from failure
                bound = min(bound, share * (down_since + reconnect_timeout - now))
            return max(0.01, bound)

        failure: OpenTinkerError | None = None
        ended = False  # the terminal event was yielded
        while True:
            if down_since is None:
                down_since = time.monotonic()  # until this stream answers
            # Half of the window left: an unanswered stream may be a quiet one from a scheduler
            # that sends no headers before the first event, so a GetTask gets the other half.
            answer_timeout = left(0.5)
            request = scheduler_pb2.WatchTaskRequest(task_id=task_id, after_sequence=last, history_only=not follow)
            failure = None
            answered = False
            try:
                stream_timeout = None if deadline is None else max(0.01, deadline - time.monotonic())
                with self.connection.stream(
                    "WatchTask", request, timeout=stream_timeout, answer_timeout=answer_timeout
                ) as responses:
                    try:
                        for response in responses:
                            if response.event.sequence <= last:
                                continue  # already yielded before a reconnect
                            last = response.event.sequence
                            down_since = None
                            delays.reset()
                            event = event_from_proto(response.event)
                            yield event
                            # What the ended task still records comes after its terminal event
                            # (a cancelled worker's last checkpoint): the scheduler ends the
                            # stream once nothing more can come.
                            ended = ended or event.is_terminal
                    finally:
                        answered = responses.answered
            except (UnavailableError, DeadlineExceededError) as err:
                if ended:
                    return  # the terminal event was seen; what follows it is not worth a reconnect
                if self.connection.closed:
                    raise
                failure = err
            if ended:
                return
            if answered:
                down_since = None
                delays.reset()
            left()  # the whole watch's timeout, checked before anything else is tried

            if failure is None and not follow:
                return  # the history so far was sent whole
            if not isinstance(failure, UnavailableError):
                # The scheduler ended the stream (when the task has ended: make sure it did) or
                # did not answer it in time: ask whether it answers at all.
                try:
                    if self.get(task_id, timeout=left()).done:
                        return
                    down_since = None
                    failure = None
                except (UnavailableError, DeadlineExceededError) as err:
                    failure = err
            if failure is not None:
                down_since = down_since if down_since is not None else time.monotonic()
            delay = delays.next()
            # A quiet stream the scheduler sent no headers on is reopened after a GetTask proved
            # it alive: routine, so not a warning.
            log.log(
                logging.WARNING if failure is not None else logging.DEBUG,
                "watch of task %s interrupted (%s); resuming after sequence %d in %.1f s",
                task_id,
                failure.details if failure is not None else "stream ended early or did not answer",
                last,
                delay,
            )
            time.sleep(min(delay, left()))

    def wait(self, task_id: str, *, timeout: float | None, poll_interval: float) -> TaskInfo:
        """Poll every ``poll_interval`` seconds until the task ends; the final task if it
        SUCCEEDED (``RLClient.wait``)."""
        if poll_interval <= 0:
            raise ValueError(f"poll_interval must be > 0 seconds, got {poll_interval!r}")
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        down_since: float | None = None
        state = "unknown"
        while True:
            call_timeout = self.connection.timeout
            if deadline is not None:
                call_timeout = max(0.1, min(call_timeout, deadline - time.monotonic()))
            try:
                info = self.get(task_id, timeout=call_timeout)
            except (UnavailableError, DeadlineExceededError) as err:
                now = time.monotonic()
                down_since = down_since if down_since is not None else now
                if now - down_since > WAIT_OUTAGE_S and isinstance(err, UnavailableError):
                    raise
            else:
                down_since = None
                state = info.state
                if info.done:
                    if info.state != "succeeded":
                        raise TaskFailedError(info)
                    return info
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise DeadlineExceededError(f"task {task_id} did not end within {timeout:g} s (last state: {state})")
            time.sleep(poll_interval if deadline is None else max(0.0, min(poll_interval, deadline - now)))

    def wait_for_endpoint(self, task_id: str, *, timeout: float, poll_interval: float = 0.25) -> str:
        """The endpoint (``host:port`` or ``https://host:port``) of :meth:`wait_serving`'s task."""
        return self.wait_serving(task_id, timeout=timeout, poll_interval=poll_interval).endpoint

    def wait_serving(self, task_id: str, *, timeout: float, poll_interval: float = 0.25) -> TaskInfo:
        """Poll an ``inference`` or ``lora_session`` task every ``poll_interval`` seconds until it
        is RUNNING with an endpoint; return it then (``endpoint``, ``openai_endpoint`` set).
        A task not serving by the deadline is left as it is (the message says it is still queued
        and how to cancel it).

        Raises:
            InvalidArgumentError: an empty ``task_id``. NotFoundError: no such task.
            TaskFailedError: it ended first. DeadlineExceededError: no endpoint within
            ``timeout`` seconds.
        """
        check_task_id(task_id)
        deadline = time.monotonic() + timeout
        state, workload = "unknown", ""
        while True:
            # Each GetTask gets what is left of ``timeout`` at most, so a frozen scheduler cannot
            # hold this past it; a call that ran out of it is the DeadlineExceededError below.
            call_timeout = max(0.1, min(self.connection.timeout, deadline - time.monotonic()))
            try:
                info = self.get(task_id, timeout=call_timeout)
            except DeadlineExceededError:
                if time.monotonic() < deadline:
                    raise
            else:
                state, workload = info.state, info.workload_type
                if info.state == "running" and info.endpoint:
                    return info
                if info.done:
                    raise TaskFailedError(info)
            now = time.monotonic()
            if now >= deadline:
                kind = {"lora_session": "training session", "inference": "inference task"}.get(workload, "task")
                still = (
                    f"; it is still {state} on the scheduler: wait for it with a longer timeout, or "
                    f"opentinker cancel {task_id}"
                    if state in ("pending", "assigned", "running")
                    else ""
                )
                raise DeadlineExceededError(
                    f"{kind} {task_id} did not start serving within {timeout:.3g} s (state: {state}){still}"
                )
            time.sleep(max(0.0, min(poll_interval, deadline - now)))
