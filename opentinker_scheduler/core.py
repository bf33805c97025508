"""The scheduler's state machine: tasks, attempts, nodes, the GPU ledger. No gRPC in here.

The servicers in :mod:`opentinker_scheduler.service` translate protobuf requests into calls on
:class:`SchedulerCore`, which is driven from one asyncio event loop. Every transition is
committed to the :class:`~opentinker_scheduler.store.Store` before it is acknowledged or
pushed down a node stream.

Task states: PENDING -> ASSIGNED -> RUNNING -> SUCCEEDED | FAILED | CANCELLED. A lost node puts
its tasks back to PENDING with attempt + 1 (they resume from their newest checkpoint); a report
from any attempt but the current one is refused (fencing).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

import structlog
from opentinker.common.v1 import common_pb2
from opentinker.node.v1 import node_pb2
from opentinker_client.spec import SpecError, spec_from_proto

from .config import SchedulerConfig
from .errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from .placement import NodeCapacity, PendingTask, plan
from .store import ACTIVE_STATES, TERMINAL_STATES, Store, TaskRow

log = structlog.get_logger("opentinker.scheduler")

S = common_pb2  # TaskState constants: S.TASK_STATE_PENDING ...
STATE_NAMES = {v: k.removeprefix("TASK_STATE_") for k, v in common_pb2.TaskState.items()}

#: Seconds between retries after a failed attempt: min(MAX, BASE * 2 ** (attempt - 1)).
RETRY_BACKOFF_BASE_S = 2.0
RETRY_BACKOFF_MAX_S = 60.0


@dataclass
class NodeSession:
    """A trainer node as the scheduler tracks it, connected or not."""

    node_id: str
    register: node_pb2.Register = field(default_factory=node_pb2.Register)
    gpu_count: int = 0
    max_tasks: int = 1
    connected: bool = False
    draining: bool = False
    last_seen: float = field(default_factory=time.monotonic)  # monotonic seconds
    last_heartbeat_time: float = 0.0  # unix seconds
    telemetry: list[common_pb2.DeviceTelemetry] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # The GPU ledger: task_id -> (attempt, device indices) of everything occupying this node,
    # including cancelled tasks whose process the node has not yet confirmed gone.
    allocations: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    generation: int = 0  # bumps on every (re)connect; stale streams' events are ignored

    def used_gpus(self) -> set[int]:
        return {d for _, devs in self.allocations.values() for d in devs}

    def capacity(self) -> NodeCapacity:
        used = self.used_gpus()
        return NodeCapacity(
            node_id=self.node_id,
            gpu_count=self.gpu_count,
            max_tasks=self.max_tasks,
            running=len(self.allocations),
            free_gpus=[i for i in range(self.gpu_count) if i not in used],
            accepting=self.connected and not self.draining,
        )

    def push(self, command: node_pb2.ConnectResponse) -> None:
        self.outbox.put_nowait(command)


class SchedulerCore:
    """Tasks, nodes and placement. Call from a single event loop."""

    def __init__(self, config: SchedulerConfig, store: Store) -> None:
        self.config = config
        self.store = store
        self.nodes: dict[str, NodeSession] = {}
        self.pending_reasons: dict[str, str] = {}
        self.changed = asyncio.Condition()
        self.placement_latencies: list[float] = []  # seconds from submit/requeue to assign (drained by metrics)
        self._queued_at: dict[str, float] = {}
        self._recover()

    # ------------------------------------------------------------------ start-up
    def _recover(self) -> None:
        """Rebuild the ledger from the store: active tasks keep their node's GPUs until the node
        re-announces them or its lease runs out (so a scheduler restart kills no running work)."""
        for task in self.store.tasks_in_states(ACTIVE_STATES):
            node = self.nodes.setdefault(task.node_id, NodeSession(node_id=task.node_id))
            node.allocations[task.task_id] = (task.attempt, tuple(task.device_indices))
        for task in self.store.tasks_in_states([S.TASK_STATE_PENDING]):
            self._queued_at[task.task_id] = time.monotonic()
        if self.nodes:
            log.info("recovered active tasks", nodes=sorted(self.nodes), tasks=sum(len(n.allocations) for n in self.nodes.values()))

    # ------------------------------------------------------------------ client API
    def submit(self, spec: common_pb2.TaskSpec, *, owner: str, request_id: str = "") -> TaskRow:
        """Validate and store a new PENDING task.

        Raises:
            InvalidArgument: bad spec (message names the field path).
            FailedPrecondition: no node in the pool could ever hold it.
        """
        if len(request_id) > 128:
            raise InvalidArgument("request_id: expected at most 128 characters")
        if request_id:
            existing = self.store.find_by_request(owner, request_id)
            if existing is not None:
                return existing
        spec_copy = common_pb2.TaskSpec()
        spec_copy.CopyFrom(spec)
        if not spec_copy.model and self.config.default_model:
            spec_copy.model = self.config.default_model
        try:
            model = spec_from_proto(spec_copy, allowed_workloads=self.config.workload_names)
        except SpecError as exc:
            raise InvalidArgument(str(exc)) from None
        most = self.max_possible_gpus()
        if model.gpu_count > most:
            raise FailedPrecondition(
                f"spec.resources.gpu_count: {model.gpu_count} GPU(s) asked, but no node in the resource pool "
                f"could ever offer more than {most} (gang placement needs all GPUs on one node)"
            )
        priority = model.priority if model.priority is not None else self.config.priority_of(model.workload_type)
        max_attempts = spec.limits.max_attempts or self.config.default_max_attempts
        now = time.time()
        task = TaskRow(
            task_id=new_task_id(),
            owner=owner,
            request_id=request_id or None,
            spec=spec_copy,
            state=S.TASK_STATE_PENDING,
            attempt=1,
            priority=int(priority or 0),
            gpu_count=model.gpu_count,
            max_attempts=max_attempts,
            max_runtime_s=model.max_runtime_s,
            create_time=now,
            update_time=now,
        )
        ev = common_pb2.TaskEvent(
            state_change=common_pb2.StateChange(
                from_state=S.TASK_STATE_UNSPECIFIED, to_state=S.TASK_STATE_PENDING, attempt=1, reason="SUBMITTED",
                message=f"{model.workload_type} on {model.model} ({model.gpu_count} GPU(s)) submitted by {owner}",
            )
        )
        self.store.insert_task(task, ev)
        self._queued_at[task.task_id] = time.monotonic()
        log.info("task submitted", task_id=task.task_id, owner=owner, workload_type=model.workload_type, gpu_count=model.gpu_count, priority=task.priority)
        self._notify()
        return task

    def get(self, task_id: str, *, owner: str | None = None) -> TaskRow:
        """Raises NotFound (also for another owner's task, without confirming it exists)."""
        if not task_id:
            raise InvalidArgument("task_id: expected a task id, got ''")
        task = self.store.get_task(task_id)
        if task is None or (owner is not None and task.owner != owner):
            raise NotFound(f"task {task_id!r} not found")
        return task

    def cancel(self, task_id: str, *, owner: str | None = None, reason: str = "") -> TaskRow:
        """Cancel a pending or running task. Idempotent: a finished task is returned unchanged.

        A running task's GPUs stay in the ledger until its node confirms the process is gone.
        """
        task = self.get(task_id, owner=owner)
        if task.terminal:
            return task
        was_active = task.state in ACTIVE_STATES
        node_id, attempt = task.node_id, task.attempt
        self._transition(task, S.TASK_STATE_CANCELLED, "CANCELLED", reason or "cancelled by user", end=True, keep_node=True)
        self.pending_reasons.pop(task_id, None)
        self._queued_at.pop(task_id, None)
        if was_active and node_id in self.nodes:
            self.nodes[node_id].push(
                node_pb2.ConnectResponse(cancel_task=node_pb2.CancelTask(task_id=task_id, attempt=attempt, reason=reason or "cancelled by user"))
            )
        return task

    def max_possible_gpus(self) -> int:
        """Most GPUs any one node could ever offer: pool entries and connected nodes."""
        sizes = [n.gpu_count for n in self.config.resource_pool]
        sizes += [n.gpu_count for n in self.nodes.values() if n.connected]
        return max(sizes, default=0)

    # ------------------------------------------------------------------ node protocol
    def node_register(self, reg: node_pb2.Register) -> tuple[NodeSession, node_pb2.Registered]:
        """A node opened its stream. Re-announced tasks that are still its own continue.

        Raises:
            InvalidArgument: empty node id.
            PermissionDenied: node not in resource_pool while unknown nodes are refused.
        """
        node_id = reg.node_id
        if not node_id or len(node_id) > 128:
            raise InvalidArgument("register.node_id: expected a non-empty id of at most 128 characters")
        pool = self.config.pool_node(node_id)
        if pool is None and not self.config.allow_unknown_nodes:
            raise PermissionDenied(
                f"node {node_id!r} is not in resource_pool ({', '.join(n.node_id for n in self.config.resource_pool) or 'empty'}) "
                "and allow_unknown_nodes is false"
            )
        found = len(reg.devices)
        notes: list[str] = []
        if pool is not None:
            gpu_count = min(pool.gpu_count, found)
            max_tasks = pool.max_tasks
            if pool.gpu_count != found:
                notes.append(f"config gpu_count {pool.gpu_count} but node found {found} GPU(s); using {gpu_count}")
                log.warning("gpu_count disagrees with devices", node_id=node_id, config_gpu_count=pool.gpu_count, devices=found, using=gpu_count)
        else:
            gpu_count = found
            max_tasks = reg.max_tasks or self.config.unknown_node_max_tasks
            notes.append("not in resource_pool (joined dynamically)")
        if reg.devices and all(d.simulated for d in reg.devices):
            notes.append(f"{found} SIMULATED GPU(s)")
        if not reg.devices:
            notes.append("CPU only" + (f": {reg.gpu_note}" if reg.gpu_note else ""))

        node = self.nodes.get(node_id)
        if node is None:
            node = self.nodes[node_id] = NodeSession(node_id=node_id)
        elif node.connected:
            log.warning("node reconnected while its old stream was open; replacing it", node_id=node_id)
            node.push(None)  # ends the old stream's writer
        node.generation += 1
        node.outbox = asyncio.Queue()
        node.register = reg
        node.gpu_count, node.max_tasks = gpu_count, max_tasks
        node.connected, node.draining = True, False
        node.last_seen = time.monotonic()
        node.notes = notes
        self.store.upsert_node(node_id, reg.SerializeToString())

        announced = {(r.task_id, r.attempt) for r in reg.running}
        stale = []
        for r in reg.running:
            held = node.allocations.get(r.task_id)
            if held is None or held[0] != r.attempt:
                stale.append(node_pb2.RunningTask(task_id=r.task_id, attempt=r.attempt))
        # Tasks we think run here but the node does not know: the worker is gone.
        for task_id, (attempt, _) in list(node.allocations.items()):
            if (task_id, attempt) not in announced:
                self._lose_allocation(node, task_id, attempt, "NODE_LOST", f"node {node_id} reconnected without the task (worker gone)")
        log.info("node registered", node_id=node_id, gpus=gpu_count, max_tasks=max_tasks, running=len(announced), stale=len(stale), notes=notes)
        registered = node_pb2.Registered(node_id=node_id, gpu_count=gpu_count, max_tasks=max_tasks, stale=stale)
        registered.heartbeat_interval.FromNanoseconds(int(self.config.heartbeat_interval_s * 1e9))
        registered.lease.FromNanoseconds(int(self.config.lease_s * 1e9))
        return node, registered

    def node_heartbeat(self, node: NodeSession, hb: node_pb2.Heartbeat) -> None:
        node.last_seen = time.monotonic()
        node.last_heartbeat_time = time.time()
        del node.telemetry[:]
        node.telemetry.extend(hb.devices)

    def node_report(self, node: NodeSession, rep: node_pb2.TaskReport) -> bool:
        """Apply a task report. Returns False when refused (unknown task or stale attempt)."""
        node.last_seen = time.monotonic()
        bound = log.bind(task_id=rep.task_id, node_id=node.node_id, attempt=rep.attempt)
        task = self.store.get_task(rep.task_id)
        if task is None:
            bound.warning("report for unknown task refused")
            return False
        held = node.allocations.get(rep.task_id)
        ends = rep.state in TERMINAL_STATES
        if task.terminal:
            # Cancelled (or already finished) while the worker ran: only release its GPUs.
            if ends and held is not None and held[0] == rep.attempt:
                del node.allocations[rep.task_id]
                bound.info("worker of finished task ended; GPUs released", state=STATE_NAMES[rep.state])
            return False
        if rep.attempt != task.attempt or task.node_id != node.node_id or held is None or held[0] != rep.attempt:
            bound.warning("stale report refused (fencing)", current_attempt=task.attempt, current_node=task.node_id)
            if not ends:
                node.push(node_pb2.ConnectResponse(cancel_task=node_pb2.CancelTask(task_id=rep.task_id, attempt=rep.attempt, reason="stale attempt")))
            elif held is not None and held[0] == rep.attempt:
                del node.allocations[rep.task_id]
            return False

        events: list[common_pb2.TaskEvent] = []
        for point in rep.metrics:
            events.append(common_pb2.TaskEvent(metric=point))
            if point.step >= task.latest_step:
                task.latest_step = point.step
                task.latest_metrics = dict(point.values)
        if rep.HasField("checkpoint") and rep.checkpoint.path:
            ck = common_pb2.Checkpoint()
            ck.CopyFrom(rep.checkpoint)
            ck.task_id, ck.attempt, ck.node_id = task.task_id, task.attempt, node.node_id
            if not ck.HasField("create_time"):
                ck.create_time.GetCurrentTime()
            task.latest_checkpoint = ck
            events.append(common_pb2.TaskEvent(checkpoint=ck))

        if rep.state == S.TASK_STATE_RUNNING and task.state == S.TASK_STATE_ASSIGNED:
            task.start_time = time.time()
            self._transition(task, S.TASK_STATE_RUNNING, "STARTED", f"worker started on {node.node_id}", extra=events, keep_node=True)
        elif rep.state == S.TASK_STATE_SUCCEEDED:
            del node.allocations[task.task_id]
            self._transition(task, S.TASK_STATE_SUCCEEDED, "COMPLETED", "finished", extra=events, end=True, keep_node=True)
        elif rep.state == S.TASK_STATE_FAILED:
            del node.allocations[task.task_id]
            reason = "ATTEMPT_FAILED" if rep.retryable else "USER_ERROR"
            self._fail_or_retry(task, reason, rep.error or "worker failed", retryable=rep.retryable, extra=events)
        elif rep.state == S.TASK_STATE_CANCELLED:
            # The node stopped it on its own (drain): hand it back to the queue.
            del node.allocations[task.task_id]
            self._requeue(task, "HANDED_BACK", rep.error or f"node {node.node_id} stopped the task", extra=events, backoff=False)
        elif events:
            task.update_time = time.time()
            self.store.update_task(task, events)
            self._notify()
        return True

    def node_disconnected(self, node: NodeSession, generation: int, *, goodbye: bool) -> None:
        """The stream ended. Without a goodbye the node may come back within its lease."""
        if node.generation != generation or not node.connected:
            return
        node.connected = False
        log.warning("node stream ended", node_id=node.node_id, goodbye=goodbye, tasks=len(node.allocations))
        if goodbye:
            self._lose_node(node, "node left")

    def tick(self) -> None:
        """Periodic work: lost nodes, runtime limits, then placement."""
        now_m = time.monotonic()
        for node in list(self.nodes.values()):
            if now_m - node.last_seen > self.config.lease_s and (node.connected or node.allocations):
                if node.connected:
                    node.connected = False
                    node.push(None)
                self._lose_node(node, f"no heartbeat for {self.config.lease_s:.0f} s (lease)")
        now = time.time()
        for task in self.store.tasks_in_states([S.TASK_STATE_RUNNING]):
            if task.max_runtime_s and task.start_time and now - task.start_time > task.max_runtime_s:
                node = self.nodes.get(task.node_id)
                attempt = task.attempt
                self._transition(task, S.TASK_STATE_FAILED, "TIMEOUT", f"max_runtime of {task.max_runtime_s:.0f} s exceeded", end=True, keep_node=True)
                if node is not None:
                    node.push(node_pb2.ConnectResponse(cancel_task=node_pb2.CancelTask(task_id=task.task_id, attempt=attempt, reason="TIMEOUT")))
        self.schedule()

    # ------------------------------------------------------------------ placement
    def schedule(self) -> int:
        """Place what fits now; push assignments. Returns the number placed."""
        pending = self.store.tasks_in_states([S.TASK_STATE_PENDING])
        if not pending:
            self.pending_reasons.clear()
            return 0
        by_id = {t.task_id: t for t in pending}
        placements, reasons = plan(
            [PendingTask(t.task_id, t.priority, t.create_time, t.gpu_count, t.not_before) for t in pending],
            [n.capacity() for n in self.nodes.values()],
            time.time(),
        )
        self.pending_reasons = reasons
        for p in placements:
            task = by_id[p.task_id]
            node = self.nodes[p.node_id]
            node.allocations[task.task_id] = (task.attempt, p.device_indices)
            task.device_indices = list(p.device_indices)
            task.node_id = node.node_id
            self._transition(task, S.TASK_STATE_ASSIGNED, "ASSIGNED", f"placed on {node.node_id}" + (f" GPUs {list(p.device_indices)}" if p.device_indices else " (CPU)"), keep_node=True)
            queued = self._queued_at.pop(task.task_id, None)
            if queued is not None:
                self.placement_latencies.append(time.monotonic() - queued)
            assign = node_pb2.AssignTask(task_id=task.task_id, attempt=task.attempt, spec=task.spec, device_indices=p.device_indices, owner=task.owner)
            if task.latest_checkpoint is not None:
                assign.resume_from.CopyFrom(task.latest_checkpoint)
            node.push(node_pb2.ConnectResponse(assign_task=assign))
            log.info("task assigned", task_id=task.task_id, attempt=task.attempt, node_id=node.node_id, devices=list(p.device_indices))
        return len(placements)

    # ------------------------------------------------------------------ internals
    def _lose_node(self, node: NodeSession, why: str) -> None:
        for task_id, (attempt, _) in list(node.allocations.items()):
            self._lose_allocation(node, task_id, attempt, "NODE_LOST", f"node {node.node_id} lost: {why}")

    def _lose_allocation(self, node: NodeSession, task_id: str, attempt: int, reason: str, message: str) -> None:
        node.allocations.pop(task_id, None)
        task = self.store.get_task(task_id)
        if task is None or task.terminal or task.attempt != attempt or task.state not in ACTIVE_STATES:
            return
        log.warning("task attempt lost", task_id=task_id, attempt=attempt, node_id=node.node_id, why=message)
        self._requeue(task, reason, message, backoff=False)

    def _fail_or_retry(self, task: TaskRow, reason: str, message: str, *, retryable: bool, extra=()) -> None:
        if retryable and task.attempt < task.max_attempts:
            self._requeue(task, reason, message, extra=extra, backoff=True)
        else:
            if retryable:
                message = f"{message} (max_attempts {task.max_attempts} used)"
            task.error = message
            self._transition(task, S.TASK_STATE_FAILED, reason, message, extra=extra, end=True, keep_node=True)

    def _requeue(self, task: TaskRow, reason: str, message: str, *, extra=(), backoff: bool) -> None:
        if task.attempt >= task.max_attempts:
            task.error = f"{message}; max_attempts ({task.max_attempts}) exhausted"
            self._transition(task, S.TASK_STATE_FAILED, reason, task.error, extra=extra, end=True, keep_node=True)
            return
        task.attempt += 1
        task.node_id = ""
        task.device_indices = []
        task.not_before = time.time() + (min(RETRY_BACKOFF_MAX_S, RETRY_BACKOFF_BASE_S * 2 ** (task.attempt - 2)) if backoff else 0.0)
        self._queued_at[task.task_id] = time.monotonic()
        resume = f"; resumes from step {task.latest_checkpoint.step}" if task.latest_checkpoint is not None else ""
        self._transition(task, S.TASK_STATE_PENDING, reason, f"{message}; attempt {task.attempt} queued{resume}", extra=extra, keep_node=True)

    def _transition(
        self,
        task: TaskRow,
        to_state: int,
        reason: str,
        message: str,
        *,
        extra=(),
        end: bool = False,
        keep_node: bool = False,
    ) -> None:
        """Commit ``task`` in ``to_state`` with a state-change event (after ``extra`` events)."""
        from_state = task.state
        now = time.time()
        task.state = to_state
        task.update_time = now
        if end:
            task.end_time = now
        ev = common_pb2.TaskEvent(
            state_change=common_pb2.StateChange(
                from_state=from_state, to_state=to_state, attempt=task.attempt, reason=reason, message=message, node_id=task.node_id
            )
        )
        self.store.update_task(task, [*extra, ev])
        if to_state != S.TASK_STATE_PENDING:
            self.pending_reasons.pop(task.task_id, None)
        log.info("task state", task_id=task.task_id, attempt=task.attempt, from_state=STATE_NAMES[from_state], to_state=STATE_NAMES[to_state], reason=reason, detail=message)
        self._notify()

    def _notify(self) -> None:
        async def _wake() -> None:
            async with self.changed:
                self.changed.notify_all()

        try:
            asyncio.get_running_loop().create_task(_wake())
        except RuntimeError:
            pass  # no loop (unit tests of the core)


def new_task_id() -> str:
    return "task-" + uuid.uuid4().hex[:12]
