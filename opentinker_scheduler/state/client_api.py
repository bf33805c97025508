"""The operations of the client API on the scheduler's state: submit (validation, the dry run
of ``EstimateTask``, adapter imports), cancel, and the reads of tasks.

:class:`ClientApi` receives its collaborators, not the core: the config and the store, the live
tasks, the quota queues, the task table (the one writer of live rows, which also holds the
nodes, preemptions and gangs of the current leadership term), the group commit and the placement
round to run after a grouped submit is written. The servicers in :mod:`opentinker_scheduler.api`
call it as ``core.api``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import secrets
import time
from typing import Callable

import structlog
from opentinker.common.v1 import common_pb2
from opentinker_common.spec import (
    SpecError,
    TaskSpecModel,
    control_character_problem,
    spec_from_proto,
    task_uses_model,
)
from opentinker_common.spec.structs import struct_to_dict, update_struct
from opentinker_common.spec.tracking import EXTRAS as TRACKING_LOGGERS

from opentinker_scheduler.config import SchedulerConfig
from opentinker_scheduler.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, StoreUnavailable
from opentinker_scheduler.policy.gang import gang_never_fits
from opentinker_scheduler.policy.placement import PendingTask, why_pending
from opentinker_scheduler.policy.tracking import unwritable_logger
from opentinker_scheduler.state.commit import GroupCommit
from opentinker_scheduler.state.gangs import gang_nodes
from opentinker_scheduler.state.queue import LiveTasks
from opentinker_scheduler.state.quota_queues import QuotaQueues, quota_need
from opentinker_scheduler.state.store import (
    ACTIVE_STATES,
    STATE_NAMES,
    StateStore,
    TaskRow,
)
from opentinker_scheduler.state.task_table import TaskTable, short_id
from opentinker_scheduler.state.worker_credentials import AttemptScope

log = structlog.get_logger("opentinker.scheduler")

S = common_pb2  # TaskState constants: S.TASK_STATE_PENDING ...


class ClientApi:
    """Submits, cancels and reads of tasks; call from the scheduler's event loop.

    Args:
        config: the scheduler config (workload types, defaults, limits).
        store: where tasks are inserted and finished ones read.
        tasks: the unfinished tasks (read; new ones join it once written).
        queues: the quota queues (a dry run says when its queue's quota would hold it back).
        table: the task table; cancel is a transition there.
        commits: the group commit that writes grouped submits.
        schedule: runs a placement round (after a group's submits were written).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        store: StateStore,
        *,
        tasks: LiveTasks,
        queues: QuotaQueues,
        table: TaskTable,
        commits: GroupCommit,
        schedule: Callable[[], int],
    ) -> None:
        self.config = config
        self.store = store
        self._tasks = tasks
        self._queues = queues
        self._table = table
        self._commits = commits
        self._schedule = schedule
        #: Submits waiting for their group commit to write them (:meth:`submit_grouped`).
        self._new_tasks = _NewTasks()

    def abandon_new_tasks(self) -> None:
        """Forget the submits waiting for the open group: it was rolled back and they got its error."""
        self._new_tasks = _NewTasks()

    def _as_stored(
        self, spec: common_pb2.TaskSpec, *, model: TaskSpecModel | None = None, default_model: str = ""
    ) -> common_pb2.TaskSpec:
        """``spec`` as the store keeps it: resolved, so every value the task runs with is written
        down at submit (``opentinker get`` shows them; a later release's defaults change nothing):
        the hyper-parameters with their defaults filled in, ``max_attempts`` with the config's
        default. ``model``: the validated spec (parsed here when None; a spec that does not parse,
        or a missing model filled from ``default_model``, is returned as given)."""
        out = common_pb2.TaskSpec()
        out.CopyFrom(spec)
        if not out.model and default_model:
            out.model = default_model
        if model is None:
            try:
                model = spec_from_proto(out, allowed_workloads=self.config.workload_names)
            except SpecError:
                return out
        out.hyperparameters.Clear()
        update_struct(out.hyperparameters, model.hyperparameters)  # = .update(plain(...)), in one pass
        out.limits.max_attempts = out.limits.max_attempts or self.config.default_max_attempts
        return out

    def submit(self, spec: common_pb2.TaskSpec, *, owner: str, request_id: str = "") -> TaskRow:
        """Validate and store a new PENDING task (written at once; a server's submits go through
        :meth:`submit_grouped`).

        Raises:
            InvalidArgument: bad spec (message names the field path).
            FailedPrecondition: no node in the pool could ever hold it, or it names a
                ``spec.tracking`` logger that no connected node can write
                (:func:`~opentinker_scheduler.policy.tracking.unwritable_logger`).
            AlreadyExists: ``request_id`` was used for a task with a different spec.
        """
        task, ev, retried = self._submitted_row(spec, owner=owner, request_id=request_id)
        if retried is not None:
            return retried
        return self._stored(task, spec, self._table.insert_new(task, ev))

    async def submit_grouped(self, spec: common_pb2.TaskSpec, *, owner: str, request_id: str = "") -> TaskRow:
        """:meth:`submit`, with the row written by the group commit (:mod:`.commit`) together
        with the other submits of its group: when the group's window ends, one ``INSERT`` for all
        of them (on PostgreSQL one round trip instead of one per submit), each joins memory in
        submit order, one placement round runs for them, and the group commits a loop turn later
        (so what the caller writes next, its audit record, joins the same commit). Returns once
        the row is written and in memory, not yet committed: as after :meth:`submit`, await
        ``core.durable()`` before acknowledging. Until then the task is in no list and placed by
        nothing. With group commit off (no running loop), as :meth:`submit`.

        Raises:
            as :meth:`submit`; also the group's error when it failed or was abandoned before
            writing the row (``sqlite3.Error``, StoreUnavailable; NotLeader when this scheduler
            stepped down): nothing of the submit was kept.
        """
        task, ev, retried = self._submitted_row(spec, owner=owner, request_id=request_id)
        if retried is not None:
            return retried
        group = self._commits.group()
        if group is None:
            stored = self._stored(task, spec, self._table.insert_new(task, ev))
            self._schedule()
            return stored
        if self._new_tasks.group is not group:  # the group's first submit
            self._new_tasks = _NewTasks(group=group)
            self._commits.before_commit(self._write_new_tasks)
        stored: asyncio.Future = asyncio.get_running_loop().create_future()
        self._new_tasks.rows.append((task, ev, spec, stored))
        group.add_done_callback(functools.partial(_fail_with_group, stored))
        # Awaited directly: this call resumes on the loop turn after the row is written, before
        # the group's commit (one turn later), so what the caller writes next joins that commit.
        return await stored

    def _write_new_tasks(self):
        """In the group commit, before it ends: every new task of the group in one statement
        (:meth:`~.store.StateStore.insert_new_tasks`), then into memory in submit order. Where the
        store sends the statement off the event loop (:meth:`~.store.StateStore.send_new_tasks`),
        returns ``(future, then)`` for the group commit to finish with once it is done."""
        rows, self._new_tasks = self._new_tasks.rows, _NewTasks()
        items = [(task, ev) for task, ev, _, _ in rows]
        sent = self._table.send_new_group(items)
        if sent is None:
            self._new_tasks_written(rows, self._table.insert_new_group(items))
            return None
        return sent, lambda done: self._new_tasks_written(rows, self._table.new_group_sent(items, done))

    def _new_tasks_written(self, rows: list, results: list) -> None:
        for (task, _, spec, stored), existing in zip(rows, results):
            try:
                if isinstance(existing, Exception):
                    raise existing
                outcome = self._stored(task, spec, existing)
            except (AlreadyExists, StoreUnavailable) as exc:
                stored.set_exception(exc)
                stored.add_done_callback(lambda f: f.exception())
            else:
                stored.set_result(outcome)
        self._schedule()  # their assignments join this group, as a submit's did when written at once

    def waiting_new_tasks(self, owner: str) -> int:
        """How many of ``owner``'s submits wait for their group commit (PENDING, not stored yet)."""
        return sum(1 for task, _, _, _ in self._new_tasks.rows if task.owner == owner)

    def _submitted_row(
        self, spec: common_pb2.TaskSpec, *, owner: str, request_id: str
    ) -> tuple[TaskRow | None, common_pb2.TaskEvent | None, TaskRow | None]:
        """The new PENDING row and its first event; or, for a retry of a submit accepted before
        the config or the cluster changed (validation refuses it now), that task (third)."""
        if len(request_id) > 128:
            raise InvalidArgument("request_id: expected at most 128 characters")
        try:
            task, ev, _ = self._new_task(spec, owner=owner, request_id=request_id)
        except (InvalidArgument, FailedPrecondition):
            existing = self.store.find_by_request(owner, request_id) if request_id else None
            if existing is not None and self._same_request(existing, spec):
                return None, None, self._tasks.get(existing.task_id) or existing
            raise
        return task, ev, None

    def _stored(self, task: TaskRow, spec: common_pb2.TaskSpec, existing: TaskRow | None) -> TaskRow:
        """After the insert: ``task`` joins memory (``existing`` None), or the retried request's
        task is returned (same spec).

        Raises:
            AlreadyExists: the request id named a task with a different spec.
        """
        if existing is not None:
            if self._same_request(existing, spec):
                return self._tasks.get(existing.task_id) or existing
            raise AlreadyExists(
                f"request_id {task.request_id!r} was already used for task {existing.task_id} with a different spec"
            )
        # No log line here: the servicer's audit record (``action="task.submit"``) is the
        # submission's one line, with task id, owner, workload type, GPUs and priority.
        self._table.added(task)
        return task

    def _same_request(self, existing: TaskRow, spec: common_pb2.TaskSpec) -> bool:
        """Whether ``spec`` is what ``existing`` was submitted with (a retried submit)."""
        return existing.spec.SerializeToString(deterministic=True) == self._as_stored(
            spec, default_model=existing.spec.model
        ).SerializeToString(deterministic=True)

    def _new_task(
        self, spec: common_pb2.TaskSpec, *, owner: str, request_id: str
    ) -> tuple[TaskRow, common_pb2.TaskEvent, TaskSpecModel]:
        """The PENDING row of a new submit, its first event and its parsed spec, validated
        (nothing stored; :meth:`submit` and :meth:`estimate` share it).

        Raises:
            InvalidArgument, FailedPrecondition: as :meth:`submit`.
        """
        spec_copy = common_pb2.TaskSpec()
        spec_copy.CopyFrom(spec)
        if not spec_copy.model and task_uses_model(spec_copy.workload_type, _struct_dict(spec_copy, "env_config")):
            if not self.config.default_model:
                raise InvalidArgument(
                    "spec.model: expected a model folder or hub id "
                    "(the scheduler config has no default_model to fall back on)"
                )
            spec_copy.model = self.config.default_model
        try:
            model = spec_from_proto(spec_copy, allowed_workloads=self.config.workload_names)
        except SpecError as exc:
            raise InvalidArgument.from_spec(exc) from None
        spec_copy = self._as_stored(spec_copy, model=model)
        most = self._table.ledger.max_possible_gpus()
        if model.gpu_count > most:
            raise FailedPrecondition(
                f"spec.resources.gpu_count: {model.gpu_count} GPU(s) asked, but no node in the resource pool "
                f"could ever offer more than {most} (gang placement needs all GPUs on one node)"
            )
        if model.nodes > 1:
            never = gang_never_fits(model.nodes, model.gpu_count, self._table.ledger.sizes())
            if never is not None:
                raise FailedPrecondition(never)
        named = [k for k in TRACKING_LOGGERS if getattr(model.tracking, k, None)]
        if named:
            refusal = unwritable_logger(named, self._table.ledger.node_loggers())
            if refusal is not None:
                raise FailedPrecondition(refusal)
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
                from_state=S.TASK_STATE_UNSPECIFIED,
                to_state=S.TASK_STATE_PENDING,
                attempt=1,
                reason="SUBMITTED",
                message=f"{model.workload_type} on {model.model or model.env.env_id} ({model.gpu_count} GPU(s)) "
                f"submitted by {owner}",
            )
        )
        return task, ev, model

    def import_adapter(
        self, *, task_id: str, owner: str, model: str, name: str, checkpoint: common_pb2.Checkpoint
    ) -> TaskRow:
        """Record an adapter folder made elsewhere, already in the artifact store, as a finished
        ``lora_finetune`` task of ``owner`` on ``model`` (``SchedulerService.ImportAdapter``):
        SUCCEEDED at once, ``checkpoint`` (final, ``peft_lora``, step 0) its latest, so its id
        works as ``init_from``, as an adapter to serve and for downloads. Nothing runs.

        Raises:
            InvalidArgument: ``model`` or ``name`` does not make a valid spec (field path named).
        """
        spec = common_pb2.TaskSpec(workload_type="lora_finetune", model=model, name=name)
        try:
            parsed = spec_from_proto(spec, allowed_workloads=self.config.workload_names)
        except SpecError as exc:
            raise InvalidArgument.from_spec(exc) from None
        spec = self._as_stored(spec, model=parsed)
        now = time.time()
        task = TaskRow(
            task_id=task_id,
            owner=owner,
            spec=spec,
            state=S.TASK_STATE_SUCCEEDED,
            attempt=1,
            priority=0,
            gpu_count=0,
            max_attempts=spec.limits.max_attempts,
            max_runtime_s=None,
            create_time=now,
            update_time=now,
            start_time=now,
            end_time=now,
            latest_checkpoint=checkpoint,
        )
        ev = common_pb2.TaskEvent(
            state_change=common_pb2.StateChange(
                from_state=S.TASK_STATE_UNSPECIFIED,
                to_state=S.TASK_STATE_SUCCEEDED,
                attempt=1,
                reason="IMPORTED",
                message=f"LoRA adapter on {model} imported by {owner} ({checkpoint.artifact.total_bytes} bytes)",
            )
        )
        self._table.insert_finished(task, [ev, common_pb2.TaskEvent(checkpoint=checkpoint)])
        log.info("adapter imported", task_id=task_id, owner=owner, model=model, key=checkpoint.artifact.key)
        self._table.notify()
        return task

    def estimate(self, spec: common_pb2.TaskSpec, *, owner: str) -> tuple[TaskRow, common_pb2.Usage, str]:
        """What ``spec`` would be stored as (no id, nothing written), what it would use and how
        that was estimated: the spec's ``steps`` times the mean seconds per step of the newest
        recorded attempts of the same workload type and model (at most 20), times its GPUs, at
        the price of ``usage.default_node_class``. The row's ``error`` says when its queue's quota,
        or the nodes connected now, would hold it back (:meth:`_placement_outlook`).

        Raises:
            InvalidArgument, FailedPrecondition: as :meth:`submit` (its checks: the default model,
                the whole spec, a GPU count and gang some node could ever hold).
        """
        row, _, model = self._new_task(spec, owner=owner, request_id="")
        row.task_id, row.attempt, row.max_attempts = "", 0, spec.limits.max_attempts
        spec_copy = row.spec
        queue = self._queues.book.queue_of(owner)
        row.error = self._queues.book.why_not(queue, quota_need(row)) or self._placement_outlook(row)
        steps = int(getattr(model.hyperparameters, "steps", 0) or 0)
        gpus = quota_need(row)[0]
        recent = self.store.recent_step_seconds(spec_copy.workload_type, spec_copy.model)
        what = f"{spec_copy.workload_type} on {spec_copy.model or model.env.env_id}"
        if not recent or not steps:
            why = "the spec has no steps" if not steps else f"no recorded attempt of {what} that reported steps"
            return row, common_pb2.Usage(), f"no estimate: {why}"
        per_step = sum(r[0] for r in recent) / max(1, sum(r[1] for r in recent))
        seconds = per_step * steps
        node_class = self.config.usage.default_node_class
        price = self.config.usage.price(node_class)
        usage = common_pb2.Usage(
            gpu_seconds=gpus * seconds,
            cpu_task_seconds=seconds if gpus == 0 else 0.0,
            cost=gpus * seconds / 3600.0 * price,
            attempts=1,  # the estimate is of one attempt that runs every step: no retry, no resume
        )
        basis = (
            f"one attempt of {steps} steps x {per_step:.2f} s per step (mean of the {len(recent)} newest attempts "
            f"of {what}) x {gpus} GPU(s) at {price:g} {self.config.usage.currency} per GPU-hour ({node_class})"
        )
        return row, usage, basis

    def _placement_outlook(self, row: TaskRow) -> str:
        """Why a task like ``row`` would wait if submitted now, or ``""`` when a connected node
        has room for it at once: the cluster as it is, what submit would then face."""
        if gang_nodes(row) > 1:
            return ""  # a gang's room is the placement round's to find
        memory = row.memory_need
        if self._table.ledger.free.best_fit_for(row.gpu_count, row.share_key, need=memory) is not None:
            return ""
        caps = [n.capacity() for n in self._table.ledger.nodes.values()]
        pending = PendingTask("", row.priority, row.create_time, row.gpu_count, 0.0, row.share_key, memory)
        return why_pending(pending, caps, len(self._tasks.queue) + 1, len(self._tasks.queue) + 1)

    def get(self, task_id: str, *, owner: str | None = None) -> TaskRow:
        """The task as committed. An unfinished task's row is the core's own: read, don't change.

        Raises NotFound (also for another owner's task, without confirming it exists)."""
        if not task_id:
            raise InvalidArgument("task_id: expected a task id, got ''")
        task = self._tasks.get(task_id) or self.store.get_task(task_id)
        if task is None or (owner is not None and task.owner != owner):
            raise NotFound(f"task {short_id(task_id)} not found")
        return task

    def cancel(self, task_id: str, *, owner: str | None = None, reason: str = "") -> TaskRow:
        """Cancel a pending or running task. Idempotent: a finished task is returned unchanged.

        Its ``error`` says who and why (:func:`~.store.cancel_error`: ``"cancelled by user: <reason>"``,
        or ``"cancelled by user"`` when ``reason`` is ""); the CANCELLED event's message is ``reason``
        (or ``"cancelled by user"``).

        A running task's GPUs stay in the ledger until its node confirms the process is gone; the
        checkpoint its worker writes on the way out (within the node's grace period) is recorded
        as the task's latest, so ``init_from``, serving and downloads can use the work done.

        Raises:
            InvalidArgument: ``reason`` holds control characters (``reason: expected text on one
                line without control characters, got U+001B (ESC) at character 0``); nothing changes.
        """
        problem = control_character_problem(reason)
        if problem is not None:
            raise InvalidArgument(f"reason: expected text on one line without control characters, got {problem}")
        task = self.get(task_id, owner=owner)
        if task.terminal:
            return task
        self._table.cancel(task, reason)
        return task

    def artifacts_deletable(self, task_id: str, *, owner: str | None = None) -> TaskRow:
        """The task whose artifacts may be deleted now (``DeleteTaskArtifacts``).

        Raises:
            NotFound: no such task, or another owner's (``owner`` set).
            FailedPrecondition: the task has not ended, its worker is still stopping (its last
                checkpoint may still arrive), or an unfinished task names it as ``init_from``.
        """
        task = self.get(task_id, owner=owner)
        if not task.terminal:
            raise FailedPrecondition(
                f"task {short_id(task.task_id)} is {STATE_NAMES[task.state]}: its artifacts can be deleted once it "
                "has ended (cancel it first)"
            )
        if task.task_id in self._table.stopping:
            raise FailedPrecondition(
                f"task {short_id(task.task_id)} was cancelled but its worker is still stopping (its last checkpoint "
                "may still arrive); try again once the node reports it gone"
            )
        live = [*self._tasks.queue, *self._tasks.active.values()]
        users = sorted(t.task_id for t in live if t.spec.init_from == task_id)
        if users:
            raise FailedPrecondition(
                f"task {short_id(task.task_id)} is the init_from of unfinished task(s) "
                f"{', '.join(short_id(u) for u in users[:5])}: delete its artifacts once they have ended"
            )
        return task

    def task_owner(self, task_id: str) -> str | None:
        """The owner of ``task_id``, or None when there is no such task."""
        if not task_id:
            return None
        try:
            return self.get(task_id).owner
        except NotFound:
            return None

    def attempt_refusal(self, scope: AttemptScope) -> str | None:
        """Why the worker of ``scope`` may not write now, or None when it may: its attempt is the
        task's current one, assigned or running on ``scope.node_id``, or a cancelled or timed-out
        attempt whose worker is still stopping there (its last checkpoint is kept)."""
        if self._table.stopping.get(scope.task_id) == (scope.attempt, scope.node_id):
            return None
        try:
            task = self.get(scope.task_id)
        except NotFound:
            return f"{scope.describe()} has ended"
        if task.attempt != scope.attempt:
            return f"{scope.describe()} was superseded by attempt {task.attempt}"
        if task.state not in ACTIVE_STATES:
            return f"{scope.describe()} has ended"
        gang = self._table.gangs.live.get(task.task_id)
        on_node = gang.index_of(scope.node_id) is not None if gang is not None else task.node_id == scope.node_id
        if not on_node:
            return f"{scope.describe()} is not assigned to that node"
        return None


def _fail_with_group(stored: asyncio.Future, group: asyncio.Future) -> None:
    """A group ended before it wrote a submit's row (it failed or was abandoned): the submit
    gets the group's error."""
    if not stored.done():
        stored.set_exception(
            group.exception() or StoreUnavailable("state store unavailable: the submit was not written")
        )
        stored.add_done_callback(lambda f: f.exception())


@dataclasses.dataclass
class _NewTasks:
    """The submits of one open group commit, waiting to be written (:meth:`ClientApi.submit_grouped`):
    per submit its row, first event, spec and the future its result goes to."""

    group: asyncio.Future | None = None
    rows: list[tuple[TaskRow, common_pb2.TaskEvent, common_pb2.TaskSpec, asyncio.Future]] = dataclasses.field(
        default_factory=list
    )


def _struct_dict(spec: common_pb2.TaskSpec, name: str) -> dict:
    """A ``google.protobuf.Struct`` field of a spec as a plain dict ({} when unset)."""
    return struct_to_dict(getattr(spec, name)) if spec.HasField(name) else {}


def new_task_id() -> str:
    """``task-`` + 19 hex digits: milliseconds since the epoch, then 32 random bits. Ids sort by
    creation time, so recent tasks' rows and events share database pages (cheaper commits)."""
    return f"task-{time.time_ns() // 1_000_000:011x}{secrets.randbits(32):08x}"
