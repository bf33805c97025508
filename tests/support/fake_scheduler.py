"""TEST DOUBLE — not the real scheduler.

A minimal in-process ``SchedulerService`` that stores tasks in memory and replays a scripted event
log, so that ``RLClient`` and the CLI can be tested without the real scheduler. It implements
only what these tests need; the real scheduler's behaviour is tested against the real server.
"""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest
from google.protobuf import timestamp_pb2

from opentinker.common.v1 import common_pb2
from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

S = common_pb2  # short alias for states
TERMINAL = {S.TASK_STATE_SUCCEEDED, S.TASK_STATE_FAILED, S.TASK_STATE_CANCELLED}


def ts(seconds: int) -> timestamp_pb2.Timestamp:
    return timestamp_pb2.Timestamp(seconds=seconds)


class FakeScheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    """In-memory test double of SchedulerService."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.tasks: dict[str, common_pb2.Task] = {}
        self.events: dict[str, list[common_pb2.TaskEvent]] = {}
        self.points: dict[str, list[common_pb2.MetricPoint]] = {}
        self.nodes: list[scheduler_pb2.Node] = []
        self.submits: list[scheduler_pb2.SubmitTaskRequest] = []
        self.by_request_id: dict[str, str] = {}
        self.metadata: list[dict[str, str]] = []
        self.watch_requests: list[int] = []  # after_sequence of each WatchTask call
        # Fault injection for WatchTask: for the first len(list) calls, send at most N events
        # and then abort with UNAVAILABLE.
        self.watch_fail_after: list[int] = []
        # When true, a WatchTask call resends the event *at* after_sequence too (overlap),
        # to check that the client drops duplicates.
        self.watch_overlap = False
        self.history_page = 2  # metric points per GetMetrics response
        self.max_page_size = 1000  # tasks per ListTasks response
        self.get_task_calls = 0
        # Fault injection for SubmitTask: the first len(list) calls store the task as usual, then
        # end with that status code instead of the answer (the answer lost on the way back).
        self.submit_faults: list[grpc.StatusCode] = []
        self._next = 1

    # -- helpers for tests ------------------------------------------------------------------

    def add_task(self, state=S.TASK_STATE_PENDING, *, task_id=None, **kw) -> common_pb2.Task:
        with self.lock:
            if task_id is None:
                task_id = f"task-{self._next:04d}"
                self._next += 1
            spec = kw.pop("spec", common_pb2.TaskSpec(workload_type="lora_finetune", model="m"))
            task = common_pb2.Task(
                task_id=task_id, state=state, spec=spec, attempt=1, create_time=ts(1_700_000_000), **kw
            )
            self.tasks[task_id] = task
            self.events.setdefault(task_id, [])
            self.points.setdefault(task_id, [])
            return task

    def add_state(self, task_id, to_state, reason="", message="", error="", at: int = 1_700_000_100) -> None:
        with self.lock:
            task = self.tasks[task_id]
            ev = common_pb2.TaskEvent(
                task_id=task_id,
                sequence=len(self.events[task_id]) + 1,
                time=ts(at),
                state_change=common_pb2.StateChange(
                    from_state=task.state, to_state=to_state, attempt=task.attempt, reason=reason, message=message
                ),
            )
            task.state = to_state
            if error:
                task.error = error
            self.events[task_id].append(ev)
            self.lock.notify_all()

    def add_metric(self, task_id, step, loss, reward, *, at: int | None = None, **values: float) -> None:
        """A metric point (``at``: its time, epoch seconds; ``values``: more keys than loss and reward)."""
        with self.lock:
            point = common_pb2.MetricPoint(
                step=step,
                time=ts(1_700_000_200 + step if at is None else at),
                values={"loss": loss, "reward": reward, **values},
            )
            self.points[task_id].append(point)
            task = self.tasks[task_id]
            task.latest_step = step
            task.latest_metrics.clear()
            task.latest_metrics.update(point.values)
            self.events[task_id].append(
                common_pb2.TaskEvent(
                    task_id=task_id, sequence=len(self.events[task_id]) + 1, time=point.time, metric=point
                )
            )
            self.lock.notify_all()

    def add_checkpoint(self, task_id, step, path, final=False) -> None:
        with self.lock:
            ck = common_pb2.Checkpoint(
                task_id=task_id, attempt=1, step=step, path=path, format="peft_lora", final=final
            )
            self.tasks[task_id].latest_checkpoint.CopyFrom(ck)
            self.events[task_id].append(
                common_pb2.TaskEvent(
                    task_id=task_id, sequence=len(self.events[task_id]) + 1, time=ts(1_700_000_300), checkpoint=ck
                )
            )
            self.lock.notify_all()

    def _record(self, context) -> None:
        self.metadata.append(dict(context.invocation_metadata()))

    def _task(self, task_id, context) -> common_pb2.Task:
        if not task_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "task_id: expected a non-empty task id")
        task = self.tasks.get(task_id)
        if task is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no task {task_id}")
        return task

    # -- RPCs -------------------------------------------------------------------------------

    def SubmitTask(self, request, context):
        self._record(context)
        self.submits.append(request)
        if request.spec.name == "rich-error":  # a google.rpc.Status with a BadRequest detail
            from google.protobuf import any_pb2
            from google.rpc import code_pb2, error_details_pb2, status_pb2
            from grpc_status import rpc_status

            detail = any_pb2.Any()
            detail.Pack(
                error_details_pb2.BadRequest(field_violations=[{"field": "spec.name", "description": "reserved"}])
            )
            status = status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message="spec.name: reserved", details=[detail])
            context.abort_with_status(rpc_status.to_status(status))
        if request.spec.resources.gpu_count > 8:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no node could ever hold 9 GPUs; the largest has 8")
        with self.lock:
            if request.request_id in self.by_request_id:  # idempotency
                task = self.tasks[self.by_request_id[request.request_id]]
            else:
                task = self.add_task(spec=request.spec, pending_reason="waiting for a node")
                if request.request_id:
                    self.by_request_id[request.request_id] = task.task_id
                self.add_state(task.task_id, S.TASK_STATE_PENDING, reason="SUBMITTED")
            fault = self.submit_faults.pop(0) if self.submit_faults else None
        if fault is not None:
            context.abort(fault, "cut off by the test double")
        return scheduler_pb2.SubmitTaskResponse(task=task)

    def GetTask(self, request, context):
        self._record(context)
        self.get_task_calls += 1
        with self.lock:
            return scheduler_pb2.GetTaskResponse(task=self._task(request.task_id, context))

    def ListTasks(self, request, context):
        self._record(context)
        with self.lock:
            tasks = [t for t in reversed(list(self.tasks.values())) if not request.states or t.state in request.states]
        start = int(request.page_token or 0)
        size = min(request.page_size or 100, self.max_page_size)
        page = tasks[start : start + size]
        token = str(start + size) if start + size < len(tasks) else ""
        return scheduler_pb2.ListTasksResponse(tasks=page, next_page_token=token)

    def CancelTask(self, request, context):
        self._record(context)
        with self.lock:
            task = self._task(request.task_id, context)
            if task.state not in TERMINAL:
                self.add_state(task.task_id, S.TASK_STATE_CANCELLED, reason="CANCELLED", message=request.reason)
                task.error = f"cancelled by user: {request.reason}" if request.reason else "cancelled by user"
            return scheduler_pb2.CancelTaskResponse(task=task)

    def WatchTask(self, request, context):
        self._record(context)
        call_no = len(self.watch_requests)
        self.watch_requests.append(request.after_sequence)
        limit = self.watch_fail_after[call_no] if call_no < len(self.watch_fail_after) else None
        with self.lock:
            self._task(request.task_id, context)
        seq = (
            request.after_sequence - 1 if self.watch_overlap and request.after_sequence > 0 else request.after_sequence
        )
        sent = 0
        while context.is_active():
            with self.lock:
                events = self.events[request.task_id]
                pending = [e for e in events if e.sequence > seq]
                if not pending:
                    if self.tasks[request.task_id].state in TERMINAL:
                        return
                    self.lock.wait(timeout=0.1)
                    continue
            for ev in pending:
                if limit is not None and sent >= limit:
                    context.abort(grpc.StatusCode.UNAVAILABLE, "test double: connection dropped")
                yield scheduler_pb2.WatchTaskResponse(event=ev)
                sent += 1
                seq = ev.sequence

    def GetMetrics(self, request, context):
        self._record(context)
        with self.lock:
            task = self._task(request.task_id, context)
            resp = scheduler_pb2.GetMetricsResponse(
                task_id=task.task_id, latest=task.latest_metrics, latest_step=task.latest_step
            )
            if request.include_history:
                pts = [p for p in self.points[task.task_id] if p.step > request.after_step]
                resp.points.extend(pts[: self.history_page])
            return resp

    def ListNodes(self, request, context):
        self._record(context)
        return scheduler_pb2.ListNodesResponse(nodes=self.nodes)


class Server:
    """Runs a FakeScheduler on 127.0.0.1; restartable on the same port."""

    def __init__(self, servicer: FakeScheduler) -> None:
        self.servicer = servicer
        self.port = 0
        self.server = None
        self.start()

    def start(self) -> None:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(self.servicer, server)
        self.port = server.add_insecure_port(f"127.0.0.1:{self.port}")
        server.start()
        self.server = server

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(grace=None)
            self.server = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def finished_task(servicer: FakeScheduler, final=S.TASK_STATE_SUCCEEDED, steps: int = 3) -> str:
    """A task that ran ``steps`` steps with metrics and a final checkpoint, then ended in ``final``."""
    task_id = servicer.add_task(S.TASK_STATE_PENDING).task_id
    servicer.add_state(task_id, S.TASK_STATE_PENDING, reason="SUBMITTED")
    servicer.add_state(task_id, S.TASK_STATE_RUNNING, reason="STARTED")
    for step in range(1, steps + 1):
        servicer.add_metric(task_id, step, 1.0 / step, step / 10)
    servicer.add_checkpoint(task_id, steps, "/ckpt/final", final=True)
    servicer.add_state(task_id, final, reason="COMPLETED", error="boom" if final == S.TASK_STATE_FAILED else "")
    return task_id


@pytest.fixture
def fake():
    """A running TEST DOUBLE of the scheduler: yields (servicer, server)."""
    servicer = FakeScheduler()
    server = Server(servicer)
    try:
        yield servicer, server
    finally:
        server.stop()
