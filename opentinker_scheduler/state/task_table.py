"""The task table: the one writer of task rows and their events.

A live row (PENDING, ASSIGNED, RUNNING) changes only here: :meth:`TaskTable.transition` commits
it in its new state with a state-change event, then moves it between the queue and the active
rows, books or frees its queue's quota and starts or ends its usage meter. :meth:`TaskTable.write`
writes a row with other events (metrics, checkpoints); a failed write puts the row back as the
store has it. Requeues, retries and lost attempts are transitions too. Every change wakes the
WatchTask streams (:mod:`.changes`).

The table holds no placement logic. It receives the store, the config, a clock, the live tasks,
the quota queues and, per leadership term, the nodes, meters, preemptions and gangs
(:meth:`TaskTable.use`); the trainer
nodes' protocol (:class:`~opentinker_scheduler.state.node_protocol.NodeProtocol`) acts on it.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import structlog
from opentinker.common.v1 import common_pb2
from opentinker.node.v1 import node_pb2
from opentinker_common.artifacts.checkpoint_lists import resumable, sampler_saves

from opentinker_scheduler.config import SchedulerConfig
from opentinker_scheduler.errors import NotFound
from opentinker_scheduler.state.changes import Changes
from opentinker_scheduler.state.gangs import Gangs
from opentinker_scheduler.state.ledger import NodeLedger
from opentinker_scheduler.state.nodes import NodeSession
from opentinker_scheduler.state.preemption_tracker import PreemptionTracker
from opentinker_scheduler.state.quota_queues import QuotaQueues, quota_need
from opentinker_scheduler.state.queue import LiveTasks
from opentinker_scheduler.state.store import (
    ACTIVE_STATES,
    CANCELLED_BY_USER,
    STATE_NAMES,
    StateStore,
    TaskRow,
    cancel_error,
)
from opentinker_scheduler.state.usage import UsageMeters

log = structlog.get_logger("opentinker.scheduler")

S = common_pb2  # TaskState constants: S.TASK_STATE_PENDING ...

#: Seconds between retries after a failed attempt: min(MAX, BASE * 2 ** (attempt - 1)).
RETRY_BACKOFF_BASE_S = 2.0
RETRY_BACKOFF_MAX_S = 60.0


class TaskTable:
    """Live task rows, written through to the store; call from the scheduler's event loop.

    Args:
        config: the scheduler config (``max_node_losses``, and what node streams read).
        store: where rows and events are written.
        clock: monotonic seconds of node liveness (tests move it by hand).
        tasks: every unfinished task's row; a transition moves it between the queue and the active rows.
        queues: the quota queues; a transition in or out of the active states books its task.
        changes: woken after every change.
        memory_lost: called with a reason when memory cannot be made the store's again.

    Attributes:
        stopping: tasks ended by the scheduler (cancel, max_runtime) whose worker is still
            stopping: task id -> (attempt, node id). The worker checkpoints on SIGTERM within the
            node's grace period; that final checkpoint report is still recorded for them.
        queued_at: task id -> monotonic seconds it was last queued (placement latency).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        store: StateStore,
        *,
        clock: Callable[[], float],
        tasks: LiveTasks,
        queues: QuotaQueues,
        changes: Changes,
        memory_lost: Callable[[str], None],
    ) -> None:
        self.config = config
        self.store = store
        self.clock = clock
        self.tasks = tasks
        self._queues = queues
        self._memory_lost = memory_lost
        self._changes = changes
        self.stopping: dict[str, tuple[int, str]] = {}
        self.queued_at: dict[str, float] = {}

    def use(
        self,
        *,
        ledger: NodeLedger,
        usage: UsageMeters,
        preemptions: PreemptionTracker,
        gangs: Gangs,
    ) -> None:
        """Act on a new memory from now on (a start, a promotion, a demotion): its nodes, usage
        meters, preemptions and gangs. Nothing is stopping or queued yet."""
        self.ledger = ledger
        self.usage = usage
        self.preemptions = preemptions
        self.gangs = gangs
        self.stopping = {}
        self.queued_at = {}

    # ------------------------------------------------------------------ transitions
    def lose_node(self, node: NodeSession, why: str) -> None:
        """Requeue every attempt ``node`` holds (NODE_LOST, ``why`` in the message) and free its ledger."""
        for task_id, (attempt, _) in list(node.allocations.items()):
            self.lose_allocation(node, task_id, attempt, "NODE_LOST", f"node {node.node_id} lost: {why}")

    def lose_allocation(self, node: NodeSession, task_id: str, attempt: int, reason: str, message: str) -> None:
        """``task_id``'s ``attempt`` on ``node`` is gone: end its preemption or timeout record,
        requeue it when it is still the current attempt, release its GPUs."""
        self.preemptions.victim_ended(task_id)  # a preemption in flight ends with the node
        if task_id in self.stopping:  # ended by the scheduler; the node is gone before confirming the stop
            self.stop_confirmed(task_id, self.stopping[task_id][0])
        task = self.tasks.active.get(task_id)
        if task is not None and task.attempt == attempt:
            log.warning("task attempt lost", task_id=task_id, attempt=attempt, node_id=node.node_id, why=message)
            self._hand_back_lost(task, reason, message)
        node.release(task_id)

    def _hand_back_lost(self, task: TaskRow, reason: str, message: str) -> None:
        """The node of ``task``'s current attempt is gone: hand the attempt back, as a drain does
        (not counted against ``max_attempts``), unless this is the task's ``max_node_losses``-th
        node loss; then it ends FAILED, so a task that keeps taking its node down ends."""
        losses = 1 + self._node_losses(task.task_id)
        limit = self.config.max_node_losses
        if losses < limit:
            self.requeue(task, reason, message, backoff=False, failure=False)
            return
        task.error = (
            f"{message}; its attempts lost their node {losses} times, max_node_losses ({limit}) reached: "
            "look for what takes the node down (memory, disk, the host's logs)"
        )
        self.transition(task, S.TASK_STATE_FAILED, reason, task.error, end=True, keep_node=True)

    def _node_losses(self, task_id: str) -> int:
        """How many of ``task_id``'s attempts ended in a node loss: its stored ``NODE_LOST`` state
        changes (rare, so they are counted when one more happens)."""
        count, seq = 0, 0
        while events := self.store.events_after(task_id, seq):
            seq = events[-1].sequence
            count += sum(e.HasField("state_change") and e.state_change.reason == "NODE_LOST" for e in events)
        return count

    def cancel(self, task: TaskRow, reason: str) -> None:
        """End unfinished ``task`` CANCELLED, with ``reason`` (or ``"cancelled by user"``) as its
        event's message and :func:`~.store.cancel_error` as its error. A running attempt's worker
        is told to stop; its GPUs stay booked until the node confirms."""
        was_active = task.state in ACTIVE_STATES
        node_id, attempt = task.node_id, task.attempt
        stops = was_active and node_id in self.ledger.nodes  # its worker is told to stop, and confirms
        task.error = cancel_error(reason)
        self.transition(
            task,
            S.TASK_STATE_CANCELLED,
            "CANCELLED",
            reason or CANCELLED_BY_USER,
            end=True,
            keep_node=True,
            until_confirmed=stops,
        )
        self.queued_at.pop(task.task_id, None)
        self.preemptions.forget(task.task_id)
        if stops:
            # The worker checkpoints on SIGTERM (as on a drain); that checkpoint is still recorded
            # (node_report) until the node reports the worker gone, so cancelling keeps the work.
            self.stop_worker(task, attempt, self.ledger.nodes[node_id], reason or CANCELLED_BY_USER)

    def stop_worker(self, task: TaskRow, attempt: int, node: NodeSession, reason: str) -> None:
        """Tell ``node`` to stop the worker of ``task``'s ``attempt``, which the scheduler ended
        (cancel, max_runtime). Its GPUs stay booked until the node confirms; the checkpoint the
        worker writes on SIGTERM is still recorded until then."""
        self.stopping[task.task_id] = (attempt, node.node_id)
        node.seal(task.task_id)
        node.push(
            node_pb2.ConnectResponse(
                cancel_task=node_pb2.CancelTask(task_id=task.task_id, attempt=attempt, reason=reason)
            )
        )

    def stop_confirmed(self, task_id: str, attempt: int) -> None:
        """The worker of ``task_id``'s ``attempt``, which the scheduler ended (cancel,
        max_runtime), is gone: its node reported it ended, or the node was declared lost. The
        attempt's usage ends now (GPU-seconds run from assignment to confirmed stop)."""
        self.stopping.pop(task_id, None)
        self.usage.confirmed(task_id, attempt)
        self.notify()  # a WatchTask stream held open for its last checkpoint can end now

    def fail_or_retry(
        self, task: TaskRow, reason: str, message: str, *, retryable: bool, extra: Sequence[common_pb2.TaskEvent] = ()
    ) -> None:
        """A failed attempt: requeued with backoff while ``retryable`` and attempts are left, else
        FAILED with ``message`` as its error."""
        if retryable and task.attempt < task.max_attempts:
            self.requeue(task, reason, message, extra=extra, backoff=True)
        else:
            if retryable:
                message = f"{message} ({_attempts_used(task)})"
            task.error = message
            self.transition(task, S.TASK_STATE_FAILED, reason, message, extra=extra, end=True, keep_node=True)

    def requeue(
        self,
        task: TaskRow,
        reason: str,
        message: str,
        *,
        extra: Sequence[common_pb2.TaskEvent] = (),
        backoff: bool,
        failure: bool = True,
    ) -> None:
        """Back to PENDING as attempt + 1. A hand-back (drain, preemption, a lost node) is not a
        failure: it grants one more attempt, so only failures use up ``max_attempts``.

        With ``backoff`` the task is not placed for ``min(RETRY_BACKOFF_MAX_S, RETRY_BACKOFF_BASE_S
        * 2 ** (failed attempt - 1))`` seconds and the event says so: ``"attempt 2 queued; retrying
        in 2 s (backoff after attempt 1 failed: <message>)"``; without it, ``"<message>; attempt 2
        queued"``. Either ends in ``"; resumes from step N"`` when there is a checkpoint, else in
        ``"; no checkpoint: starts from scratch"``."""
        if not failure:
            task.max_attempts += 1
        if task.attempt >= task.max_attempts:
            task.error = f"{message}; {_attempts_used(task)}"
            self.transition(task, S.TASK_STATE_FAILED, reason, task.error, extra=extra, end=True, keep_node=True)
            return
        failed = task.attempt
        delay = min(RETRY_BACKOFF_MAX_S, RETRY_BACKOFF_BASE_S * 2 ** (failed - 1)) if backoff else 0.0
        task.attempt += 1
        task.attempt_step = 0
        # Progress is the new attempt's: it starts where its checkpoint is (or at step 0), with
        # no metrics of its own yet (the old attempt's steps past the checkpoint run again).
        resume_from = self.resume_checkpoint(task)
        task.latest_step = resume_from.step if resume_from is not None else 0
        task.latest_metrics = {}
        task.node_id = ""
        task.device_indices = []
        task.not_before = time.time() + delay
        self.queued_at[task.task_id] = time.monotonic()
        if backoff:
            queued = (
                f"attempt {task.attempt} queued; retrying in {delay:.0f} s "
                f"(backoff after attempt {failed} failed: {message})"
            )
        else:
            queued = f"{message}; attempt {task.attempt} queued"
        if resume_from is not None:
            resume = f"; resumes from step {resume_from.step}"
        else:
            resume = "; no checkpoint: starts from scratch"
        self.transition(task, S.TASK_STATE_PENDING, reason, queued + resume, extra=extra, keep_node=True)

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
        until_confirmed: bool = False,
    ) -> None:
        """Commit ``task`` in ``to_state`` with a state-change event (after ``extra`` events).

        ``until_confirmed``: the scheduler ends an active attempt whose worker it tells to stop
        (cancel, max_runtime); its usage runs on until :meth:`stop_confirmed`."""
        from_state = task.state
        now = time.time()
        task.state = to_state
        task.update_time = now
        if end:
            task.end_time = now
        ev = common_pb2.TaskEvent(
            state_change=common_pb2.StateChange(
                from_state=from_state,
                to_state=to_state,
                attempt=task.attempt,
                reason=reason,
                message=message,
                node_id=task.node_id,
            )
        )
        self.write(task, [*extra, ev])
        self.tasks.moved(task, from_state)
        was, now_active = from_state in ACTIVE_STATES, to_state in ACTIVE_STATES
        if was != now_active:
            quotas = self._queues.book
            queue, need = quotas.queue_of(task.owner), quota_need(task)
            quotas.add(queue, need, 1 if now_active else -1)
            if now_active:
                self.usage.start(task, queue=queue, gpus=need[0], start_time=now)
            else:
                self.usage.end(task, end_time=now, until_confirmed=until_confirmed)
        if task.task_id in self.gangs.live:
            self.gangs.task_moved(task)
        log.info(
            "task state",
            task_id=task.task_id,
            attempt=task.attempt,
            from_state=STATE_NAMES[from_state],
            to_state=STATE_NAMES[to_state],
            reason=reason,
            detail=message,
        )
        self.notify()

    def write(self, task: TaskRow, events: list[common_pb2.TaskEvent]) -> None:
        """Write a live row back with its events; if that fails, memory goes back to the store's."""
        try:
            self.store.update_task(task, events)
        except BaseException as exc:
            try:
                self.tasks.reload(task.task_id, self.store)
            except Exception as again:  # noqa: BLE001 - the store is gone: memory cannot follow it
                self._memory_lost(f"a write failed ({exc}) and the row could not be read back ({again})")
            raise

    def notify(self) -> None:
        """Wake the WatchTask streams: a task changed."""
        self._changes.notify()

    # ------------------------------------------------------------------ new rows
    def insert_new(self, task: TaskRow, event: common_pb2.TaskEvent) -> TaskRow | None:
        """Write a new PENDING ``task`` with its first event now. Returns the task already stored
        under its request id (nothing written), or None; :meth:`added` then takes it in."""
        return self.store.insert_new_task(task, event)

    def insert_new_group(self, items: list[tuple[TaskRow, common_pb2.TaskEvent]]) -> list:
        """Write a group commit's new tasks in one statement (:meth:`~.store.StateStore.insert_new_tasks`)."""
        return self.store.insert_new_tasks(items)

    def send_new_group(self, items: list[tuple[TaskRow, common_pb2.TaskEvent]]):
        """Send that statement off the event loop where the store can
        (:meth:`~.store.StateStore.send_new_tasks`); None where it cannot."""
        return self.store.send_new_tasks(items)

    def new_group_sent(self, items: list[tuple[TaskRow, common_pb2.TaskEvent]], done) -> list:
        """The outcome of a statement :meth:`send_new_group` sent (:meth:`~.store.StateStore.new_tasks_sent`)."""
        return self.store.new_tasks_sent(items, done)

    def added(self, task: TaskRow) -> None:
        """A new task was written as PENDING: it joins the queue and waits for placement."""
        self.tasks.added(task)
        self.queued_at[task.task_id] = time.monotonic()
        self.notify()

    # ------------------------------------------------------------------ rows of finished tasks
    def insert_finished(self, task: TaskRow, events: list[common_pb2.TaskEvent]) -> None:
        """Store a task that is finished from the start (an imported adapter) with its events."""
        self.store.insert_task(task, events[0])
        self.store.update_task(task, events[1:])

    def artifacts_deleting(self, task_id: str) -> None:
        """Before the store deletes ``task_id``'s artifacts: from now on it has no latest
        checkpoint, so no submit naming it as ``init_from`` is admitted and no assignment carries
        a checkpoint that is being deleted (the deletion runs in a thread, other calls meanwhile)."""
        task = self.store.get_task(task_id)
        if task is not None and task.latest_checkpoint is not None:
            task.latest_checkpoint = None
            task.update_time = time.time()
            self.store.update_task(task, [])
            self.notify()

    def artifacts_deleted(self, task_id: str, *, keys: int = 0, size_bytes: int = 0, by: str = "") -> TaskRow:
        """Record that ``task_id``'s artifacts are gone: it has no latest checkpoint any more (so
        it is no ``init_from``, nothing to serve or download), and an ``artifacts_deleted`` event
        (``keys`` deleted, ``size_bytes``, ``by`` whom) ends the list of its checkpoints
        (``StateStore.checkpoints``). A call that deleted nothing from a task with no checkpoint listed
        (a second ``opentinker rm``) records nothing."""
        task = self.store.get_task(task_id)
        if task is None:
            raise NotFound(f"task {short_id(task_id)} not found")
        if task.latest_checkpoint is not None or keys or self.store.checkpoints(task_id):
            task.latest_checkpoint = None
            task.update_time = time.time()
            gone = common_pb2.ArtifactsDeleted(deleted_keys=keys, deleted_bytes=size_bytes, deleted_by=by)
            self.store.update_task(task, [common_pb2.TaskEvent(artifacts_deleted=gone)])
            self.notify()
        return task

    def checkpoint_deleted(self, task_id: str, key: str, *, size_bytes: int = 0, by: str = "") -> None:
        """Record that the checkpoint with artifact ``key`` of ``task_id`` is gone
        (``DeleteCheckpoint``, an expiry): an ``artifacts_deleted`` event naming its key, so it is
        listed no more and no attempt resumes from it. When it was the task's latest checkpoint,
        the newest one left takes its place (none: no latest checkpoint)."""
        gone = common_pb2.ArtifactsDeleted(deleted_keys=1, deleted_bytes=size_bytes, deleted_by=by, keys=[key])
        self._write_checkpoint_event(task_id, common_pb2.TaskEvent(artifacts_deleted=gone), latest_gone=key)

    def checkpoint_expiry(self, task_id: str, key: str, expire_time: float | None) -> None:
        """Record that the checkpoint with artifact ``key`` of ``task_id`` expires at
        ``expire_time`` (epoch seconds; None: never): a ``checkpoint_expiry`` event."""
        expiry = common_pb2.CheckpointExpiry(key=key)
        if expire_time is not None:
            expiry.expire_time.FromNanoseconds(int(expire_time * 1e9))
        self._write_checkpoint_event(task_id, common_pb2.TaskEvent(checkpoint_expiry=expiry))

    def _write_checkpoint_event(self, task_id: str, event: common_pb2.TaskEvent, *, latest_gone: str = "") -> None:
        live = self.tasks.get(task_id)
        task = live if live is not None else self.store.get_task(task_id)
        if task is None:
            raise NotFound(f"task {short_id(task_id)} not found")
        if latest_gone and task.latest_checkpoint is not None and task.latest_checkpoint.artifact.key == latest_gone:
            left = [c for c in self.store.checkpoints(task_id) if c.artifact.key != latest_gone]
            task.latest_checkpoint = left[-1] if left else None
            task.update_time = time.time()
        if live is not None:  # a live task: the core's own row, written through
            self.write(task, [event])
        else:
            self.store.update_task(task, [event])
        self.notify()

    def checkpoints_retired(self, task_id: str, keys: list[str]) -> None:
        """Record that retention deleted the checkpoints with artifact ``keys`` of ``task_id``
        (an ``artifacts_deleted`` event ``by_retention``): they are listed no more. Nothing is
        recorded for no keys or a task gone; the caller checks that this scheduler leads."""
        if not keys:
            return
        task = self.tasks.get(task_id)
        gone = common_pb2.ArtifactsDeleted(deleted_keys=len(keys), deleted_by="retention", by_retention=True, keys=keys)
        event = common_pb2.TaskEvent(artifacts_deleted=gone)
        if task is not None:  # a live task: the core's own row, written through
            self.write(task, [event])
        else:
            stored = self.store.get_task(task_id)
            if stored is None:
                return
            self.store.update_task(stored, [event])
        self.notify()

    def resume_checkpoint(self, task: TaskRow) -> common_pb2.Checkpoint | None:
        """The checkpoint ``task``'s next attempt resumes from: its newest, unless that is a
        training session's sampler save, which holds weights alone (no optimizer, step or
        sequence number): then its newest state (``SaveState``), or None."""
        resume = task.latest_checkpoint
        if resume is not None and sampler_saves([resume]):
            resume = resumable(self.store.checkpoints(task.task_id))
        return resume


def _attempts_used(task: TaskRow) -> str:
    """Why no attempt is left, in the spec's terms (hand-backs raise the row's ``max_attempts``
    but are not counted): ``"max_attempts (3) exhausted"``, or ``"max_attempts (3) exhausted;
    1 more attempt was handed back (preempted, drained or node lost; not counted)"``."""
    back = task.handed_back
    text = f"max_attempts ({task.max_attempts - back}) exhausted"
    if back:
        text += (
            f"; {back} more attempt{'s were' if back > 1 else ' was'} handed back "
            "(preempted, drained or node lost; not counted)"
        )
    return text


def short_id(task_id: str, limit: int = 80) -> str:
    """``task_id`` quoted for a message, cut to ``limit`` characters (ids come from callers)."""
    return repr(task_id[:limit]) + ("..." if len(task_id) > limit else "")
