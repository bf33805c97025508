"""What a trainer node's ``Connect`` stream does to the scheduler's state: registration
(re-announced and finished attempts), heartbeats with telemetry, task reports with attempt
fencing, and streams that end. :class:`NodeProtocol` is a part of
:class:`~opentinker_scheduler.state.core.SchedulerCore`: it owns the message counters and reaches
the tasks, nodes and transitions only through what :class:`NodeHost` declares (the task table)."""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Protocol, Sequence

import structlog
from opentinker.common.v1 import common_pb2
from opentinker.node.v1 import node_pb2
from opentinker_common.spec import control_character_problem

from opentinker_scheduler.config import PoolNode, SchedulerConfig
from opentinker_scheduler.config.usage import check_node_class
from opentinker_scheduler.errors import AlreadyExists, InvalidArgument, PermissionDenied
from opentinker_scheduler.state.gangs import FailOrRetry, Requeue
from opentinker_scheduler.state.ledger import NodeLedger
from opentinker_scheduler.state.nodes import NodeSession
from opentinker_scheduler.state.preemption_tracker import PreemptionTracker
from opentinker_scheduler.state.queue import LiveTasks
from opentinker_scheduler.state.store import STATE_NAMES, TERMINAL_STATES, StateStore, TaskRow

log = structlog.get_logger("opentinker.scheduler")

S = common_pb2  # TaskState constants: S.TASK_STATE_PENDING ...


class NodeHost(Protocol):
    """What :class:`NodeProtocol` uses of the task table (:class:`~.task_table.TaskTable`)."""

    config: SchedulerConfig
    store: StateStore
    #: Monotonic seconds of ``last_seen`` and the lease checks.
    clock: Callable[[], float]
    tasks: LiveTasks
    ledger: NodeLedger
    preemptions: PreemptionTracker
    #: Tasks ended by the scheduler (cancel, max_runtime) whose worker is still stopping: task id ->
    #: (attempt, node id).
    stopping: dict[str, tuple[int, str]]

    def write(self, task: TaskRow, events: list[common_pb2.TaskEvent]) -> None: ...
    def notify(self) -> None: ...
    def transition(
        self,
        task: TaskRow,
        to_state: int,
        reason: str,
        message: str,
        *,
        extra: Sequence[common_pb2.TaskEvent] = (),
        end: bool = False,
        keep_node: bool = False,
    ) -> None: ...

    requeue: Requeue
    fail_or_retry: FailOrRetry

    def lose_allocation(self, node: NodeSession, task_id: str, attempt: int, reason: str, message: str) -> None: ...
    def stop_confirmed(self, task_id: str, attempt: int) -> None: ...
    def lose_node(self, node: NodeSession, why: str) -> None: ...


class NodeProtocol:
    """What a trainer node's ``Connect`` stream does to the scheduler's state.

    Args:
        core: the tasks, nodes and transitions it acts on (:class:`NodeHost`).

    Attributes:
        messages: messages received on node streams, by kind (``register``, ``heartbeat``,
            ``task_report``; exported on /metrics).
        duplicates: metric points and checkpoints in resent reports that were already applied.
    """

    def __init__(self, core: NodeHost) -> None:
        self.core = core
        self.messages: dict[str, int] = {"register": 0, "heartbeat": 0, "task_report": 0}
        #: Metric points and checkpoints skipped because they had been applied already.
        self.duplicates = 0
        #: Called with ``(task_id, checkpoint)`` after a checkpoint in the artifact store was
        #: recorded (committed) as a task's latest; the server applies retention there. A
        #: listener must not block (hand store I/O to a thread) and must not raise.
        self.checkpoint_listeners: list[Callable[[str, common_pb2.Checkpoint], None]] = []
        #: The newest checkpoint failure recorded per running task, ``(attempt, step, failures
        #: in a row)``: the same report resent after a reconnect is not a second event.
        self._failures: dict[str, tuple[int, int, int]] = {}
        #: The GPU-count warning last given per node id (:meth:`_warn_gpu_count_mismatch`).
        self._gpu_warned: dict[str, str] = {}

    def node_register(self, reg: node_pb2.Register) -> tuple[NodeSession, node_pb2.Registered]:
        """A node opened its stream. Re-announced tasks that are still its own continue.

        Raises:
            InvalidArgument: empty node id; control characters in the node id, hostname, version or
                GPU note (``register.node_id: expected text on one line without control characters,
                got U+001B (ESC) at character 4``: they reach logs, pending reasons and terminals).
            PermissionDenied: node not in resource_pool while unknown nodes are refused.
        """
        node_id = reg.node_id
        if not node_id or len(node_id) > 128:
            raise InvalidArgument("register.node_id: expected a non-empty id of at most 128 characters")
        for name in ("node_id", "hostname", "version", "gpu_note"):
            problem = control_character_problem(getattr(reg, name))
            if problem is not None:
                raise InvalidArgument(
                    f"register.{name}: expected text on one line without control characters, got {problem}"
                )
        if reg.node_class and check_node_class(reg.node_class):
            raise InvalidArgument(
                f"register.node_class: expected {check_node_class(reg.node_class)}, got {reg.node_class[:80]!r}"
            )
        pool = self.core.config.pool_node(node_id)
        if pool is None and not self.core.config.allow_unknown_nodes:
            raise PermissionDenied(
                f"node {node_id!r} is not in resource_pool "
                f"({', '.join(n.node_id for n in self.core.config.resource_pool) or 'empty'}) "
                "and allow_unknown_nodes is false"
            )
        gpu_count, max_tasks, notes = node_size(
            reg, pool, unknown_node_max_tasks=self.core.config.unknown_node_max_tasks
        )
        self.messages["register"] += 1
        node = self.core.ledger.nodes.get(node_id)
        if node is None:
            node = self.core.ledger.node(node_id)
        elif node.connected:
            silent = self.core.clock() - node.last_seen
            if silent <= self.core.config.lease_s:
                raise AlreadyExists(
                    f"node id {node_id!r} is already connected (last heard {silent:.1f} s ago); "
                    "give each trainer its own --node-id, or wait for the old stream's lease to run out"
                )
            log.warning("node reconnected while its old, silent stream was open; replacing it", node_id=node_id)
            node.push(None)  # ends the old stream's writer
        node.generation += 1
        node.outbox = asyncio.Queue()
        node.register = reg
        node.gpu_count, node.max_tasks = gpu_count, max_tasks
        node.connected, node.draining = True, False
        node.last_seen = self.core.clock()
        node.notes = notes
        self._warn_gpu_count_mismatch(reg, pool)  # a registration refused above says nothing
        self.core.ledger.changed(node, membership=True)
        self.core.store.upsert_node(node_id, reg.SerializeToString())

        # Reports the node sent but never saw acknowledged (the stream broke, or the scheduler
        # died before committing them), in the order written; then final reports of attempts
        # that ended while the node was cut off (e.g. the scheduler was down). Both before
        # deciding which tasks the node lost.
        resent = set()
        for report in reg.pending:
            self.node_report(node, report)
            resent.add(report.seq)
        for report in reg.finished:
            if not (report.seq and report.seq in resent):
                self.node_report(node, report)
        announced = {(r.task_id, r.attempt) for r in reg.running}
        stale = []
        for r in reg.running:
            held = node.allocations.get(r.task_id)
            if held is None or held[0] != r.attempt:
                stale.append(node_pb2.RunningTask(task_id=r.task_id, attempt=r.attempt))
        # Tasks we think run here but the node does not know: the worker is gone.
        for task_id, (attempt, _) in list(node.allocations.items()):
            if (task_id, attempt) not in announced:
                self.core.lose_allocation(
                    node, task_id, attempt, "NODE_LOST", f"node {node_id} reconnected without the task (worker gone)"
                )
        log.info(
            "node registered",
            node_id=node_id,
            gpus=gpu_count,
            max_tasks=max_tasks,
            running=len(announced),
            stale=len(stale),
            resent_reports=len(reg.pending) or None,
            notes=notes,
        )
        registered = node_pb2.Registered(
            node_id=node_id,
            gpu_count=gpu_count,
            max_tasks=max_tasks,
            stale=stale,
            report_ack=max(resent, default=0),
        )
        registered.heartbeat_interval.FromNanoseconds(int(self.core.config.heartbeat_interval_s * 1e9))
        registered.lease.FromNanoseconds(int(self.core.config.lease_s * 1e9))
        return node, registered

    def _warn_gpu_count_mismatch(self, reg: node_pb2.Register, pool: PoolNode | None) -> None:
        """Warn once per node and mismatch (:func:`gpu_count_mismatch`): a trainer that reconnects,
        or re-registers after a scheduler restart, with the same devices is not warned of again;
        a node whose devices or entry change is (and one that comes to agree clears it)."""
        source = self.core.config.source
        advice = gpu_count_mismatch(
            reg, pool, config=source if source and not source.startswith("<") else "the scheduler config"
        )
        if advice is None:
            self._gpu_warned.pop(reg.node_id, None)
            return
        if self._gpu_warned.get(reg.node_id) == advice:
            return
        self._gpu_warned[reg.node_id] = advice
        log.warning(
            "resource_pool gpu_count differs from the GPUs the node reports",
            node_id=reg.node_id,
            config_gpu_count=pool.gpu_count if pool is not None else None,
            reported_gpus=len(reg.devices),
            advice=advice,
        )

    def node_heartbeat(self, node: NodeSession, hb: node_pb2.Heartbeat) -> None:
        """Memory only (no store write): liveness, drain flag and the latest telemetry."""
        self.messages["heartbeat"] += 1
        if hb.draining != node.draining:
            if hb.draining:
                log.info("node draining; no new tasks go there", node_id=node.node_id)
            node.draining = hb.draining
            self.core.ledger.changed(node)
        node.last_seen = self.core.clock()
        node.last_heartbeat_time = time.time()
        del node.telemetry[:]
        node.telemetry.extend(hb.devices)
        node.host = hb.host if hb.HasField("host") else None
        node.model_hosts = list(hb.model_hosts)

    def node_report(self, node: NodeSession, rep: node_pb2.TaskReport) -> bool:
        """Apply a task report. Returns False when refused (unknown task or stale attempt).

        Applies each (task, attempt, step) once: a metric point at or below the highest step the
        current attempt has reported (``TaskRow.attempt_step``, kept in the store) and a
        checkpoint equal to the task's latest are duplicates a node resent after a reconnect
        (``Register.pending``), and are skipped; a repeated start or end changes nothing either.
        """
        self.messages["task_report"] += 1
        node.last_seen = self.core.clock()
        task = self.core.tasks.get(rep.task_id) or self.core.store.get_task(rep.task_id)
        if task is None:
            log.warning(
                "report for unknown task refused", task_id=rep.task_id, node_id=node.node_id, attempt=rep.attempt
            )
            return False
        gangs = getattr(self.core, "gangs", None)
        if gangs is not None and gangs.member_report(node, rep, task):
            return True  # a gang member other than member 0 (its start or end; state/gangs.py)
        held = node.allocations.get(rep.task_id)
        ends = rep.state in TERMINAL_STATES
        if task.terminal:
            stopping = self.core.stopping.get(rep.task_id)
            if stopping == (rep.attempt, node.node_id) and task.attempt == rep.attempt:
                # Cancelled or max_runtime ended it while a step was running: the worker finishes
                # that step and checkpoints it (on SIGTERM). Both still count, so the task's step
                # and its last checkpoint's step agree (`opentinker get`: step 9, checkpoint step 9).
                self._record_stopping(node, rep, task)
            if ends and rep.task_id in self.core.stopping:
                if stopping == (rep.attempt, node.node_id):
                    self.core.stop_confirmed(rep.task_id, rep.attempt)  # its usage ends now
                else:
                    self.core.stopping.pop(rep.task_id, None)
            # Cancelled (or already finished) while the worker ran: only release its GPUs.
            if ends and held is not None and held[0] == rep.attempt:
                node.release(rep.task_id)
                log.info(
                    "worker of finished task ended; GPUs released",
                    task_id=rep.task_id,
                    node_id=node.node_id,
                    attempt=rep.attempt,
                    state=STATE_NAMES[rep.state],
                )
            return False
        if rep.attempt != task.attempt or task.node_id != node.node_id or held is None or held[0] != rep.attempt:
            log.warning(
                "stale report refused (fencing)",
                task_id=rep.task_id,
                node_id=node.node_id,
                attempt=rep.attempt,
                current_attempt=task.attempt,
                current_node=task.node_id,
            )
            if not ends:
                node.push(
                    node_pb2.ConnectResponse(
                        cancel_task=node_pb2.CancelTask(
                            task_id=rep.task_id, attempt=rep.attempt, reason="stale attempt"
                        )
                    )
                )
            elif held is not None and held[0] == rep.attempt:
                node.release(rep.task_id)
            return False

        if rep.endpoint:  # an inference server of this attempt listens there (Task.endpoint)
            self.core.store.set_endpoint(task.task_id, rep.attempt, rep.endpoint, rep.openai_endpoint)
            self.core.notify()
        events: list[common_pb2.TaskEvent] = []
        if rep.HasField("phase") and rep.phase.phase:
            phase = common_pb2.TaskPhase()
            phase.CopyFrom(rep.phase)
            phase.attempt = task.attempt
            events.append(common_pb2.TaskEvent(phase=phase))
        for point in rep.metrics:
            if point.step <= task.attempt_step:
                self.duplicates += 1
                continue
            task.attempt_step = point.step
            events.append(common_pb2.TaskEvent(metric=_of_attempt(point, rep.attempt)))
            self.core.usage.metric(task.task_id, rep.attempt, point.values)
            # The current attempt's progress: after a requeue its steps may be below the last attempt's.
            task.latest_step = point.step
            task.latest_metrics = dict(point.values)
        recorded: common_pb2.Checkpoint | None = None
        if rep.HasField("checkpoint") and rep.checkpoint.path:
            ck = _checkpoint_of(rep, task, node)
            if _same_checkpoint(ck, task.latest_checkpoint):
                self.duplicates += 1
            else:
                task.latest_checkpoint = recorded = ck
                events.append(common_pb2.TaskEvent(checkpoint=ck))
        failure_seen = (rep.attempt, rep.checkpoint_failed.step, rep.checkpoint_failed.failures_in_a_row)
        if rep.HasField("checkpoint_failed") and self._failures.get(task.task_id) == failure_seen:
            self.duplicates += 1  # resent after a reconnect
        elif rep.HasField("checkpoint_failed"):
            # Not stored after its retries: an event; the latest complete checkpoint stays as it was.
            self._failures[task.task_id] = failure_seen
            failure = common_pb2.CheckpointFailure()
            failure.CopyFrom(rep.checkpoint_failed)
            failure.attempt, failure.node_id = task.attempt, node.node_id
            events.append(common_pb2.TaskEvent(checkpoint_failed=failure))
            log.warning(
                "checkpoint could not be stored",
                task_id=task.task_id,
                attempt=task.attempt,
                node_id=node.node_id,
                step=failure.step,
                fatal=failure.fatal,
                failures_in_a_row=failure.failures_in_a_row,
                error=failure.error[:500],
            )

        preempted = self.core.preemptions.victim_ended(task.task_id) if ends else None
        if rep.state == S.TASK_STATE_RUNNING and task.state == S.TASK_STATE_ASSIGNED:
            task.start_time = time.time()
            self.core.transition(
                task, S.TASK_STATE_RUNNING, "STARTED", f"worker started on {node.node_id}", extra=events, keep_node=True
            )
        elif rep.state == S.TASK_STATE_SUCCEEDED:
            self.core.transition(
                task, S.TASK_STATE_SUCCEEDED, "COMPLETED", "finished", extra=events, end=True, keep_node=True
            )
            node.release(task.task_id)  # after the commit: a failed write leaves the ledger as the store has it
        elif rep.state == S.TASK_STATE_FAILED:
            reason = "ATTEMPT_FAILED" if rep.retryable else "USER_ERROR"
            self.core.fail_or_retry(task, reason, rep.error or "worker failed", retryable=rep.retryable, extra=events)
            node.release(task.task_id)
        elif rep.state == S.TASK_STATE_CANCELLED and (preempted is not None or rep.error == "PREEMPTED"):
            # Told to make room for a higher-priority task: it checkpointed and stopped. A
            # hand-back, not a failure; it resumes from its newest checkpoint.
            waiter = f" to make room for {preempted.for_task}" if preempted is not None else ""
            self.core.requeue(
                task, "PREEMPTED", f"preempted on {node.node_id}{waiter}", extra=events, backoff=False, failure=False
            )
            node.release(task.task_id)
        elif rep.state == S.TASK_STATE_CANCELLED:
            # The node stopped it on its own (drain): hand it back to the queue.
            self.core.requeue(
                task,
                "HANDED_BACK",
                rep.error or f"node {node.node_id} stopped the task",
                extra=events,
                backoff=False,
                failure=False,
            )
            node.release(task.task_id)
        elif events:
            task.update_time = time.time()
            self.core.write(task, events)
            self.core.notify()
        if recorded is not None:
            self._recorded(task.task_id, recorded)
        if ends:
            self._failures.pop(task.task_id, None)
        return True

    def _record_stopping(self, node: NodeSession, rep: node_pb2.TaskReport, task: TaskRow) -> None:
        """Apply what the stopping worker of an ended task (cancel, max_runtime) still reports:
        the metric points of steps it finished after the end (``latest_step`` and
        ``latest_metrics`` follow them) and its last checkpoint, as events after the terminal one.
        Duplicates (a resent report) are skipped as for a running task. A phase it reports (the
        trainer's ``killed``: ``--kill-grace`` ended the worker before its exit checkpoint) is
        kept too, before its final report ends the stop."""
        events: list[common_pb2.TaskEvent] = []
        if rep.HasField("phase") and rep.phase.phase:
            phase = common_pb2.TaskPhase()
            phase.CopyFrom(rep.phase)
            phase.attempt = task.attempt
            events.append(common_pb2.TaskEvent(phase=phase))
        for point in rep.metrics:
            if point.step <= task.attempt_step:
                self.duplicates += 1
                continue
            task.attempt_step = task.latest_step = point.step
            task.latest_metrics = dict(point.values)
            events.append(common_pb2.TaskEvent(metric=_of_attempt(point, rep.attempt)))
            self.core.usage.metric(task.task_id, rep.attempt, point.values)
        ck = None
        if rep.HasField("checkpoint") and rep.checkpoint.path:
            ck = _checkpoint_of(rep, task, node)
            if _same_checkpoint(ck, task.latest_checkpoint):
                self.duplicates += 1
                ck = None
            else:
                task.latest_checkpoint = ck
                events.append(common_pb2.TaskEvent(checkpoint=ck))
        if not events:
            return
        task.update_time = time.time()
        self.core.write(task, events)
        self.core.notify()
        if ck is not None:
            self._recorded(task.task_id, ck)
            log.info(
                "last checkpoint of a stopping task recorded",
                task_id=task.task_id,
                attempt=rep.attempt,
                step=ck.step,
                task_step=task.latest_step,
                path=ck.path,
            )

    def _recorded(self, task_id: str, ck: common_pb2.Checkpoint) -> None:
        if not ck.artifact.key:
            return
        for listener in self.checkpoint_listeners:
            try:
                listener(task_id, ck)
            except Exception:  # noqa: BLE001 - a listener's fault is not the report's
                log.exception("checkpoint listener failed", task_id=task_id, step=ck.step)

    def node_disconnected(self, node: NodeSession, generation: int, *, goodbye: bool) -> None:
        """The stream ended. Without a goodbye the node may come back within its lease."""
        if node.generation != generation or not node.connected:
            return
        node.connected = False
        self.core.ledger.changed(node, membership=True)
        log.warning("node stream ended", node_id=node.node_id, goodbye=goodbye, tasks=len(node.allocations))
        if goodbye:
            self.core.lose_node(node, "node left")


def _checkpoint_of(rep: node_pb2.TaskReport, task: TaskRow, node: NodeSession) -> common_pb2.Checkpoint:
    """The report's checkpoint, stamped with the task, attempt and node it belongs to."""
    ck = common_pb2.Checkpoint()
    ck.CopyFrom(rep.checkpoint)
    ck.task_id, ck.attempt, ck.node_id = task.task_id, task.attempt, node.node_id
    if not ck.HasField("create_time"):
        ck.create_time.GetCurrentTime()
    return ck


def _same_checkpoint(ck: common_pb2.Checkpoint, latest: common_pb2.Checkpoint | None) -> bool:
    """Whether ``ck`` is the checkpoint already recorded as the latest (a resent report)."""
    return latest is not None and (latest.attempt, latest.step, latest.path, latest.final) == (
        ck.attempt,
        ck.step,
        ck.path,
        ck.final,
    )


def node_size(
    reg: node_pb2.Register, pool: PoolNode | None, *, unknown_node_max_tasks: int
) -> tuple[int, int, list[str]]:
    """``(gpu_count, max_tasks, notes)`` of a registering node: its resource_pool entry, never
    more GPUs than it found nor more tasks than its own ``--max-tasks``; else what it announced
    (``unknown_node_max_tasks`` when it announced no limit). Pure: it logs nothing (the warning
    for a GPU count that differs from the config is :func:`gpu_count_mismatch`'s, said once)."""
    found = len(reg.devices)
    notes: list[str] = []
    if pool is not None:
        gpu_count = min(pool.gpu_count, found)
        # The pool entry is an upper bound, as for GPUs: never more tasks than the node offers.
        max_tasks = min(pool.max_tasks, reg.max_tasks) if reg.max_tasks > 0 else pool.max_tasks
        if max_tasks != pool.max_tasks:
            notes.append(
                f"config max_tasks {pool.max_tasks} but the node runs at most {reg.max_tasks}; using {max_tasks}"
            )
        if pool.gpu_count != found:
            notes.append(f"config gpu_count {pool.gpu_count} but node found {found} GPU(s); using {gpu_count}")
    else:
        gpu_count = found
        max_tasks = reg.max_tasks or unknown_node_max_tasks
        notes.append("not in resource_pool (joined dynamically)")
    if reg.devices and all(d.simulated for d in reg.devices):
        notes.append(f"{found} SIMULATED GPU(s)")
    if not reg.devices:
        notes.append("CPU only" + (f": {reg.gpu_note}" if reg.gpu_note else ""))
    return gpu_count, max_tasks, notes


def gpu_count_mismatch(reg: node_pb2.Register, pool: PoolNode | None, *, config: str) -> str | None:
    """What to tell the operator when a resource_pool node registers with another number of GPUs
    than ``config`` (the config file's name) declares for it, or None when they agree (or the node
    is not in resource_pool). Names both numbers, which one the scheduler uses (the smaller:
    resource_pool is an upper bound) and which to change.

    Pure, so :class:`NodeProtocol` can say it once per node and mismatch, not at each
    re-registration."""
    found = len(reg.devices)
    if pool is None or pool.gpu_count == found:
        return None
    node = reg.node_id
    declared = f"{config} declares {node} with gpu_count {pool.gpu_count}"
    if found == 0:
        why = f" ({reg.gpu_note})" if reg.gpu_note else ""
        return (
            f"{declared}, but the node reports no GPU{why}, so it takes only CPU tasks (gpu_count 0). "
            f"If that machine has GPUs, make them visible to the trainer (nvidia-smi, the driver, "
            f"CUDA_VISIBLE_DEVICES); if it is a CPU machine, set gpu_count: 0 for {node} in {config}, "
            "or start the trainer with a --node-id that is not in resource_pool"
        )
    simulated = " simulated" if all(d.simulated for d in reg.devices) else ""
    if found < pool.gpu_count:
        return (
            f"{declared}, but the node reports {found}{simulated} GPU(s); using {found}. If that machine has "
            f"{pool.gpu_count}, make them all visible to the trainer (nvidia-smi, CUDA_VISIBLE_DEVICES"
            f"{', --simulate-gpus' if simulated else ''}); else set gpu_count: {found} for {node} in {config}"
        )
    return (
        f"{declared}, but the node reports {found}{simulated} GPU(s); using {pool.gpu_count} (resource_pool "
        f"is an upper bound). To use all {found}, set gpu_count: {found} for {node} in {config}"
    )


def _of_attempt(point: common_pb2.MetricPoint, attempt: int) -> common_pb2.MetricPoint:
    """``point`` as recorded: stamped with the attempt that reported it."""
    out = common_pb2.MetricPoint()
    out.CopyFrom(point)
    out.attempt = attempt
    return out
