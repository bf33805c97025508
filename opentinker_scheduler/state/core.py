"""The scheduler's state machine: tasks, attempts, nodes, the GPU ledger. No gRPC in here.

The servicers in :mod:`opentinker_scheduler.api.service` translate protobuf requests into calls on
:class:`SchedulerCore`, which is driven from one asyncio event loop. Every transition is
committed to the :class:`~opentinker_scheduler.state.store.StateStore` before it is acknowledged or
pushed down a node stream.

Task states: PENDING -> ASSIGNED -> RUNNING -> SUCCEEDED | FAILED | CANCELLED. A lost node puts
its tasks back to PENDING with attempt + 1 (they resume from their newest checkpoint); a report
from any attempt but the current one is refused (fencing).

Preemption (:meth:`SchedulerCore.preempt`, each tick): a blocked task with a strictly higher
priority than running ones has victims chosen on one node (:mod:`..policy.preemption`, the bookkeeping
of preemptions in flight in :mod:`.preemption_tracker`); they are told to
checkpoint and stop, keep their GPUs until the node confirms, then go back to PENDING (attempt + 1,
reason PREEMPTED, a hand-back that does not use up max_attempts). ``max_runtime`` ends a task
FAILED/TIMEOUT at once and cancels its worker; the checkpoint the worker writes on SIGTERM is
still recorded until the node reports the worker gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import secrets
import time
from typing import Callable

import structlog
from opentinker.common.v1 import common_pb2
from opentinker.node.v1 import node_pb2
from opentinker_common.artifacts.checkpoint_lists import resumable, sampler_saves
from opentinker_common.spec.structs import struct_to_dict, update_struct
from opentinker_common.spec.tracking import EXTRAS as TRACKING_LOGGERS
from opentinker_common.spec import (
    SpecError,
    TaskSpecModel,
    control_character_problem,
    spec_from_proto,
    task_uses_model,
)

from opentinker_scheduler.state.commit import GroupCommit
from opentinker_scheduler.config import PoolNode, SchedulerConfig
from opentinker_scheduler.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    NotLeader,
    StoreUnavailable,
)
from opentinker_scheduler.state.node_protocol import NodeProtocol, node_size
from opentinker_scheduler.state.nodes import NodeSession
from opentinker_scheduler.policy.placement import (
    PendingTask,
    place_round,
    reserved_reason,
    why_pending,
    with_left_out,
)
from opentinker_scheduler.policy.gang import gang_never_fits
from opentinker_scheduler.policy.tracking import unwritable_logger
from opentinker_scheduler.policy.quota import QueueQuota, QuotaBook, task_need
from opentinker_scheduler.policy.scale import ClassNode, Demand, desired_trainers
from opentinker_scheduler.state.gangs import Gangs, gang_nodes
from opentinker_scheduler.state.ledger import NodeLedger
from opentinker_scheduler.state.placement_round import RoundBook
from opentinker_scheduler.state.preemption_tracker import PreemptionTracker
from opentinker_scheduler.state.usage import UsageMeters, usage_proto
from opentinker_scheduler.state.worker_credentials import AttemptScope, WorkerCredentials
from opentinker_scheduler.state.queue import (
    LiveTasks,
    PendingQueue,
    QueueKey,
    ReasonsView,
    queue_key,
)
from opentinker_scheduler.state.store import (  # noqa: F401  (STATE_NAMES re-exported)
    ACTIVE_STATES,
    CANCELLED_BY_USER,
    STATE_NAMES,
    QueueOverride,
    StateStore,
    TaskRow,
    cancel_error,
)

log = structlog.get_logger("opentinker.scheduler")

S = common_pb2  # TaskState constants: S.TASK_STATE_PENDING ...

#: Seconds between retries after a failed attempt: min(MAX, BASE * 2 ** (attempt - 1)).
RETRY_BACKOFF_BASE_S = 2.0
RETRY_BACKOFF_MAX_S = 60.0


class SchedulerCore:
    """Tasks, nodes and placement. Call from a single event loop.

    Collaborators it holds, each owning its own state: :attr:`preemptions` (preemptions in
    flight), :attr:`node_protocol` (what node streams do; it calls back the public transitions
    below), :attr:`commits` (group commit).

    In memory, written through to the store: every unfinished task's row (``tasks``: the
    PENDING ones in ``queue``, in placement order, the ASSIGNED and RUNNING ones in ``active``),
    the GPU ledger of each node and the index of nodes with room (``free``). A row changes only
    in :meth:`_transition` (or a metrics-only write); membership follows once it is written, and
    a failed write reloads it from the store. Finished tasks are read from the store. With group
    commit on (the server), writes share commits and callers await :meth:`durable`.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        store: StateStore,
        *,
        clock: Callable[[], float] = time.monotonic,
        leading: bool = True,
    ) -> None:
        self.config = config
        self.store = store
        #: Monotonic seconds the liveness checks of :meth:`tick` read (tests move it by hand).
        self.clock = clock
        #: Whether this scheduler leads: places, preempts, runs timeouts and node streams, writes.
        #: A follower (several schedulers on PostgreSQL) keeps no tasks in memory and answers
        #: reads from the store; :meth:`promote` and :meth:`demote` switch (state/leadership.py).
        self.leading = leading
        #: Called with a reason when this core had to step down on its own (its memory could not
        #: be made the store's again); the leadership hands the lease back and takes it anew.
        self.on_step_down: Callable[[str], None] | None = None
        self.changed = asyncio.Condition()
        self.placement_latencies: list[float] = []  # seconds from submit/requeue to assign (drained by metrics)
        self._watchers = 0  # WatchTask streams waiting in wait_changed()
        self._wake_pending = False
        #: Registration, heartbeats and task reports of node streams (:class:`~.node_protocol.NodeProtocol`).
        self.node_protocol = NodeProtocol(self)
        #: Queues changed at run time (:meth:`set_queue`), oldest first, as the store keeps them.
        self.queue_overrides: list[QueueOverride] = []
        #: Quota queues and their usage (:mod:`..policy.quota`): the config's ``queues:`` with
        #: :attr:`queue_overrides` applied over them (read from the store at every start).
        self.quotas = self._quota_book([])
        #: Signs each assignment's attempt credential; None with authentication off (the server sets it).
        self.worker_credentials: WorkerCredentials | None = None
        self.commits = GroupCommit(store, on_failure=self._rebuild)
        self._init_memory()
        #: Submits waiting for their group commit to write them (:meth:`submit_grouped`).
        self._new_tasks = _NewTasks()
        if leading:
            self._recover()
        else:  # a follower answers ListQueues from the store's overrides too
            self._use_queue_overrides(store.queue_overrides())

    def _init_memory(self) -> None:
        """Empty the leader's memory: nodes, live tasks, the ledger and its indexes, preemptions."""
        #: Until then (``clock`` seconds) no node is declared lost: the scheduler's own loop stalled.
        self._liveness_grace_until = float("-inf")
        #: Checkpoints with an expiry (:meth:`expired`); None until first read from the store.
        self._expiring_keys: dict[str, tuple[str, float]] | None = None
        #: Nodes and their GPU and tenant bookings (:class:`~.ledger.NodeLedger`).
        self.ledger = NodeLedger(
            self.clock,
            self.commits.hold,
            self.config.max_tasks_per_gpu,
            self.config.resource_pool,
            self._cluster_changed,
        )
        self.nodes = self.ledger.nodes
        self.free = self.ledger.free
        self.tasks = LiveTasks(self.quotas.queue_of)
        self.quotas.clear_usage()
        #: Meters of the live attempts; ended ones are rows of the store (:mod:`.usage`).
        self.usage = UsageMeters(self.store, self.config.usage, self.node_class)
        self.pending_reasons = ReasonsView(self.tasks, self.pending_reason)  # task id -> why pending
        self._queued_at: dict[str, float] = {}
        #: Preemptions in flight (memory only; :class:`~.preemption_tracker.PreemptionTracker`).
        self.preemptions = PreemptionTracker(
            tasks=self.tasks,
            nodes=self.nodes,
            free=self.free,
            config=self.config,
            notify=self.notify,
            quotas=lambda: self.quotas,
        )
        #: Gang tasks' members, rendezvous and ends (also in the store; :class:`~.gangs.Gangs`).
        self.gangs = Gangs(
            ledger=self.ledger,
            store=self.store,
            rendezvous_ports=self.config.gang_rendezvous_ports,
            tasks=self.tasks,
            quotas=lambda: self.quotas,
            need=self.need,
            preemptions=self.preemptions,
            requeue=self.requeue,
            fail_or_retry=self.fail_or_retry,
        )
        #: Tasks ended by the scheduler (cancel, max_runtime) whose worker is still stopping: task id ->
        #: (attempt, node id). The worker checkpoints on SIGTERM within the node's grace period; that
        #: final checkpoint report is still recorded for them (the node protocol reads it).
        self.stopping: dict[str, tuple[int, str]] = {}
        self._reservation: tuple[QueueKey, str] | None = None  # (queue key, node id) of the last round

    # ------------------------------------------------------------------ leadership
    def require_leader(self) -> None:
        """Raises NotLeader (naming the leader when known) on a follower."""
        if not self.leading:
            raise NotLeader(self.store.leader_address)

    def promote(self) -> None:
        """Lead from now on: memory read from the store as after a restart (running tasks keep
        their GPUs until their nodes re-announce them, within ``restart_grace``).

        Raises:
            sqlite3.Error, StoreUnavailable: the store cannot be read (still a follower).
        """
        self._init_memory()
        self._recover()
        self.leading = True
        log.info("leading", tasks_active=len(self.active), tasks_pending=len(self.queue))
        self.notify()

    def demote(self, reason: str) -> None:
        """Stop leading at once: the open group commit is rolled back (its waiters get
        NotLeader, its held commands are dropped), every node stream is ended (the trainers
        reconnect, to the new leader) and memory is emptied. Idempotent."""
        if not self.leading:
            return
        self.leading = False
        self.commits.abandon(NotLeader(self.store.leader_address))
        self._new_tasks = _NewTasks()  # their group was rolled back: its submits got NotLeader
        for node in self.nodes.values():
            node.generation += 1  # what the old streams still send is ignored
            if node.connected:
                node.outbox.put_nowait(None)  # ends the stream now (not held for a commit)
        log.warning("stepped down; no longer leading", reason=reason, nodes=len(self.nodes))
        self._init_memory()
        self.notify()

    def _memory_lost(self, reason: str) -> None:
        """Memory could not be made the store's again: step down (the leadership takes the lease
        anew and :meth:`promote` reloads everything)."""
        self.demote(reason)
        if self.on_step_down is not None:
            self.on_step_down(reason)

    # ------------------------------------------------------------------ durability
    def enable_group_commit(self) -> None:
        """Gather the writes of concurrent requests into shared commits (the server turns this
        on; see :mod:`opentinker_scheduler.state.commit`)."""
        self.commits.enable()

    async def durable(self) -> None:
        """Return once everything written so far is committed; RPCs await this before answering.

        Raises:
            sqlite3.Error: the commit failed (memory was rebuilt from the store).
        """
        await self.commits.durable()

    def flush(self) -> None:
        """Commit any open group now (shutdown)."""
        self.commits.commit()

    def _rebuild(self) -> None:
        """After a failed commit: drop the in-memory tasks and ledger, read them from the store;
        when that fails too (the database is down), step down until it can be read again."""
        if not self.leading:
            return
        for node in self.nodes.values():
            for task_id in list(node.allocations):
                node.release(task_id)
        self.gangs.forget_all()
        try:
            self._recover()
        except Exception as exc:  # noqa: BLE001 - sqlite3.Error, StoreUnavailable: memory is unusable
            self._memory_lost(f"memory could not be reloaded from the state store: {exc}")

    @property
    def queue(self) -> PendingQueue:
        return self.tasks.queue

    @property
    def active(self) -> dict[str, TaskRow]:
        return self.tasks.active

    @property
    def state_counts(self) -> dict[int, int]:
        return self.tasks.counts

    # ------------------------------------------------------------------ start-up
    def _recover(self) -> None:
        """Rebuild memory from the store: the queue from PENDING rows, the ledger from active
        ones. They keep their node's GPUs until the node re-announces them, or until
        ``restart_grace`` passes without it (a trainer may be a few reconnect backoffs away from
        noticing the restart), so a scheduler restart kills no running work."""
        self._use_queue_overrides(self.store.queue_overrides(), start=True)
        self.tasks.load(self.store)
        self._recount_usage()
        for task in self.active.values():  # meters run again from the attempt's start (see state/usage.py)
            if task.task_id in self.usage.live:
                continue  # reloaded after a failed commit: the meter runs on
            self.usage.start(task, queue=self.quotas.queue_of(task.owner), gpus=self.need(task)[0],
                             start_time=task.start_time or task.update_time)  # fmt: skip
        grace = max(0.0, self.config.restart_grace_s - self.config.lease_s)
        holdings = [(t.node_id, t, tuple(t.device_indices), t.share_key) for t in self.active.values()]
        # A gang's other members (member 0 is the row's node): each holds its GPUs within the grace.
        holdings += [(n, t, devices, None) for n, t, devices in self.gangs.recover(self.active)]
        for node_id, task, devices, share in holdings:
            if node_id not in self.nodes:
                self._recover_node(node_id)
            node = self.ledger.node(node_id)
            node.allocate(task.task_id, task.attempt, devices, share, task.memory_need if share else None)
            if not node.connected:
                node.last_seen = self.clock() + grace
        self._queued_at = {t.task_id: time.monotonic() for t in self.queue}
        if self.nodes:
            log.info(
                "recovered active tasks",
                nodes=sorted(self.nodes),
                tasks=sum(len(n.allocations) for n in self.nodes.values()),
            )

    def _recover_node(self, node_id: str) -> None:
        """Know a node that holds active tasks, before it reconnects, by the size it last
        registered with (so ListNodes shows its GPUs, not 0/0); it stays disconnected and takes
        no new work until it connects again."""
        node = self.ledger.node(node_id)
        info = self.store.node_register(node_id)
        if info is None:
            return
        try:
            reg = node_pb2.Register.FromString(info)
        except Exception:  # noqa: BLE001 - an unreadable row: the node re-registers anyway
            return
        node.register = reg
        node.gpu_count, node.max_tasks, node.notes = node_size(
            reg, self.config.pool_node(node_id), unknown_node_max_tasks=self.config.unknown_node_max_tasks
        )
        node.notes = [
            *node.notes,
            "known from the state directory; waiting for it to reconnect after a scheduler restart",
        ]
        self.ledger.changed(node)

    # ------------------------------------------------------------------ client API
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
        return self._stored(task, spec, self.store.insert_new_task(task, ev))

    async def submit_grouped(self, spec: common_pb2.TaskSpec, *, owner: str, request_id: str = "") -> TaskRow:
        """:meth:`submit`, with the row written by the group commit (:mod:`.commit`) together
        with the other submits of its group: when the group's window ends, one ``INSERT`` for all
        of them (on PostgreSQL one round trip instead of one per submit), each joins memory in
        submit order, one placement round runs for them, and the group commits a loop turn later
        (so what the caller writes next, its audit record, joins the same commit). Returns once
        the row is written and in memory, not yet committed: as after :meth:`submit`, await
        :meth:`durable` before acknowledging. Until then the task is in no list and placed by
        nothing. With group commit off (no running loop), as :meth:`submit`.

        Raises:
            as :meth:`submit`; also the group's error when it failed or was abandoned before
            writing the row (``sqlite3.Error``, StoreUnavailable; NotLeader when this scheduler
            stepped down): nothing of the submit was kept.
        """
        task, ev, retried = self._submitted_row(spec, owner=owner, request_id=request_id)
        if retried is not None:
            return retried
        group = self.commits.group()
        if group is None:
            stored = self._stored(task, spec, self.store.insert_new_task(task, ev))
            self.schedule()
            return stored
        if self._new_tasks.group is not group:  # the group's first submit
            self._new_tasks = _NewTasks(group=group)
            self.commits.before_commit(self._write_new_tasks)
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
        sent = self.store.send_new_tasks(items)
        if sent is None:
            self._new_tasks_written(rows, self.store.insert_new_tasks(items))
            return None
        return sent, lambda done: self._new_tasks_written(rows, self.store.new_tasks_sent(items, done))

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
        self.schedule()  # their assignments join this group, as a submit's did when written at once

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
                return None, None, self.tasks.get(existing.task_id) or existing
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
                return self.tasks.get(existing.task_id) or existing
            raise AlreadyExists(
                f"request_id {task.request_id!r} was already used for task {existing.task_id} with a different spec"
            )
        self.tasks.added(task)
        self._queued_at[task.task_id] = time.monotonic()
        # No log line here: the servicer's audit record (``action="task.submit"``) is the
        # submission's one line, with task id, owner, workload type, GPUs and priority.
        self.notify()
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
        most = self.ledger.max_possible_gpus()
        if model.gpu_count > most:
            raise FailedPrecondition(
                f"spec.resources.gpu_count: {model.gpu_count} GPU(s) asked, but no node in the resource pool "
                f"could ever offer more than {most} (gang placement needs all GPUs on one node)"
            )
        if model.nodes > 1:
            never = gang_never_fits(model.nodes, model.gpu_count, self.ledger.sizes())
            if never is not None:
                raise FailedPrecondition(never)
        named = [k for k in TRACKING_LOGGERS if getattr(model.tracking, k, None)]
        if named:
            refusal = unwritable_logger(named, self.ledger.node_loggers())
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
        self.store.insert_task(task, ev)
        self.store.update_task(task, [common_pb2.TaskEvent(checkpoint=checkpoint)])
        log.info("adapter imported", task_id=task_id, owner=owner, model=model, key=checkpoint.artifact.key)
        self.notify()
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
        queue = self.quotas.queue_of(owner)
        row.error = self.quotas.why_not(queue, self.need(row)) or self._placement_outlook(row)
        steps = int(getattr(model.hyperparameters, "steps", 0) or 0)
        gpus = self.need(row)[0]
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
        if self.free.best_fit_for(row.gpu_count, row.share_key, need=memory) is not None:
            return ""
        caps = [n.capacity() for n in self.nodes.values()]
        pending = PendingTask("", row.priority, row.create_time, row.gpu_count, 0.0, row.share_key, memory)
        return why_pending(pending, caps, len(self.queue) + 1, len(self.queue) + 1)

    def get(self, task_id: str, *, owner: str | None = None) -> TaskRow:
        """The task as committed. An unfinished task's row is the core's own: read, don't change.

        Raises NotFound (also for another owner's task, without confirming it exists)."""
        if not task_id:
            raise InvalidArgument("task_id: expected a task id, got ''")
        task = self.tasks.get(task_id) or self.store.get_task(task_id)
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
        was_active = task.state in ACTIVE_STATES
        node_id, attempt = task.node_id, task.attempt
        stops = was_active and node_id in self.nodes  # its worker is told to stop, and confirms
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
        self._queued_at.pop(task_id, None)
        self.preemptions.forget(task_id)
        if stops:
            # The worker checkpoints on SIGTERM (as on a drain); that checkpoint is still recorded
            # (node_report) until the node reports the worker gone, so cancelling keeps the work.
            self.stopping[task_id] = (attempt, node_id)
            self.nodes[node_id].seal(task_id)
            self.nodes[node_id].push(
                node_pb2.ConnectResponse(
                    cancel_task=node_pb2.CancelTask(
                        task_id=task_id, attempt=attempt, reason=reason or CANCELLED_BY_USER
                    )
                )
            )
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
        if task.task_id in self.stopping:
            raise FailedPrecondition(
                f"task {short_id(task.task_id)} was cancelled but its worker is still stopping (its last checkpoint "
                "may still arrive); try again once the node reports it gone"
            )
        live = [*self.tasks.queue, *self.tasks.active.values()]
        users = sorted(t.task_id for t in live if t.spec.init_from == task_id)
        if users:
            raise FailedPrecondition(
                f"task {short_id(task.task_id)} is the init_from of unfinished task(s) "
                f"{', '.join(short_id(u) for u in users[:5])}: delete its artifacts once they have ended"
            )
        return task

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

    def checkpoint_expiry(self, task_id: str, key: str, expire_time: float | None) -> None:
        """Record that the checkpoint with artifact ``key`` of ``task_id`` expires at
        ``expire_time`` (epoch seconds; None: never), a ``checkpoint_expiry`` event;
        :meth:`expired` names it from then on."""
        expiry = common_pb2.CheckpointExpiry(key=key)
        if expire_time is not None:
            expiry.expire_time.FromNanoseconds(int(expire_time * 1e9))
        event = common_pb2.TaskEvent(checkpoint_expiry=expiry)
        live = self.tasks.get(task_id)
        task = live if live is not None else self.store.get_task(task_id)
        if task is None:
            raise NotFound(f"task {short_id(task_id)} not found")
        if live is not None:
            self.write(task, [event])
        else:
            self.store.update_task(task, [event])
        expiring = self._expiring()
        if expire_time is None:
            expiring.pop(key, None)
        else:
            expiring[key] = (task_id, expire_time)

    def expired(self, now: float) -> list[tuple[str, str]]:
        """``(task id, artifact key)`` of the checkpoints whose expiry has come; none on a
        scheduler that does not lead."""
        if not self.leading:
            return []
        return [(task_id, key) for key, (task_id, at) in self._expiring().items() if at <= now]

    def _expiring(self) -> dict[str, tuple[str, float]]:
        """Artifact key -> ``(task id, expire time)``, read from the store at first use."""
        if self._expiring_keys is None:
            self._expiring_keys = {key: (task_id, at) for task_id, key, at in self.store.expiring_checkpoints()}
        return self._expiring_keys

    def checkpoint_deleted(self, task_id: str, key: str, *, size_bytes: int = 0, by: str = "") -> None:
        """Record that the checkpoint with artifact ``key`` of ``task_id`` is gone
        (``DeleteCheckpoint``): an ``artifacts_deleted`` event naming its key, so it is listed no
        more and no attempt resumes from it. When it was the task's latest checkpoint, the newest
        one left takes its place (none: no latest checkpoint)."""
        if self._expiring_keys is not None:
            self._expiring_keys.pop(key, None)
        gone = common_pb2.ArtifactsDeleted(deleted_keys=1, deleted_bytes=size_bytes, deleted_by=by, keys=[key])
        event = common_pb2.TaskEvent(artifacts_deleted=gone)
        live = self.tasks.get(task_id)
        task = live if live is not None else self.store.get_task(task_id)
        if task is None:
            raise NotFound(f"task {short_id(task_id)} not found")
        if task.latest_checkpoint is not None and task.latest_checkpoint.artifact.key == key:
            left = [c for c in self.store.checkpoints(task_id) if c.artifact.key != key]
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
        recorded for no keys, a task gone, or a scheduler that does not lead."""
        if not keys or not self.leading:
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

    def pending_reason(self, task_id: str) -> str:
        """Why a PENDING task has not started, for a person to read ("" when it is not pending).

        Worked out when asked, from the ledger as it is now, so placement rounds do not spend
        time writing reasons for thousands of queued tasks nobody reads."""
        task = self.queue.get(task_id)
        if task is None:
            return ""
        now = time.time()
        if task.not_before > now:
            return (
                f"waiting {task.not_before - now:.0f} s more before retrying as attempt {task.attempt} "
                f"(backoff after attempt {task.attempt - 1} failed)"
            )
        position, length = self.queue.position(task_id), len(self.queue)
        waiting = self.preemptions.waiting_on(task_id)
        if waiting is not None:
            node_id, left = waiting
            return (
                f"preempting {', '.join(left)} on {node_id} to make room (waiting for the node to confirm they "
                f"checkpointed and stopped; queue position {position} of {length})"
            )
        over = self.quotas.why_not(self.quotas.queue_of(task.owner), self.need(task))
        if over is not None:
            return f"{over} (queue position {position} of {length})"
        if gang_nodes(task) > 1:
            return self.gangs.why(task, [n.capacity() for n in self.nodes.values()], position, length)
        reserver, reserved = self._reservation_ahead_of(task)
        closed = self.free.closed_to(task.gpu_count, reserved)
        memory = task.memory_need
        unable = self.ledger.nodes_without(task.tracking_loggers)
        if self.free.best_fit_for(task.gpu_count, task.share_key, with_left_out(closed, unable), memory) is not None:
            return f"waiting for the next placement round (queue position {position} of {length})"
        if unable and self.free.best_fit_for(task.gpu_count, task.share_key, closed, memory) is not None:
            named = sorted(task.tracking_loggers)
            extras = ", ".join(f"opentinker[{TRACKING_LOGGERS[k][1]}]" for k in named)
            return (
                f"waiting for a node that can write its spec.tracking loggers ({', '.join(named)}): "
                f"the nodes with room cannot ({', '.join(sorted(unable))}; install {extras} there) "
                f"(queue position {position} of {length})"
            )
        if (
            reserver is not None
            and reserved is not None
            and self.free.best_fit_for(task.gpu_count, task.share_key, need=memory)
        ):
            return reserved_reason(reserved, reserver, position, length)  # room only on the reserved node
        pending = PendingTask(
            task.task_id, task.priority, task.create_time, task.gpu_count, task.not_before, task.share_key, memory
        )
        why = why_pending(pending, self.ledger.capacities(), position, length)
        if self._reservation is not None and self._reservation[0][2] == task_id:
            why += (
                f"; {self._reservation[1]} is reserved for it (no task behind it starts there, "
                "except CPU tasks in max_tasks slots it does not need)"
            )
        return why

    def _reservation_ahead_of(self, task: TaskRow) -> tuple[PendingTask | None, str | None]:
        """The last round's reserving task and node when that task is still pending and ahead of
        ``task`` in queue order (so the reservation holds ``task`` back), else (None, None)."""
        if self._reservation is None:
            return None, None
        key, node_id = self._reservation
        row = self.queue.get(key[2])
        if row is None or queue_key(row) != key or not key < queue_key(task):
            return None, None
        return PendingTask(row.task_id, row.priority, row.create_time, row.gpu_count, row.not_before), node_id

    def tick(self, *, stalled_s: float = 0.0) -> None:
        """Periodic work: lost nodes, runtime limits, then placement.

        Args:
            stalled_s: seconds the caller's loop could not run before this tick, beyond its
                interval (the process was stopped, or the event loop blocked). Longer than the
                lease, nobody could be heard meanwhile, so every node gets ``restart_grace`` (at
                least one lease) from now to be heard again before it is declared lost, as after
                a restart.
        """
        if not self.leading:
            return
        now_m = self.clock()
        if stalled_s > self.config.lease_s:
            grace = max(self.config.restart_grace_s, self.config.lease_s)
            self._liveness_grace_until = max(self._liveness_grace_until, now_m + grace)
            log.warning(
                "scheduler loop stalled longer than the lease; no node is declared lost during the grace",
                stalled_s=round(stalled_s, 1),
                lease_s=self.config.lease_s,
                grace_s=grace,
            )
        in_grace = now_m <= self._liveness_grace_until
        for node in list(self.nodes.values()):
            silent = now_m - node.last_seen > self.config.lease_s
            if silent and not in_grace and (node.connected or node.allocations):
                if node.connected:
                    node.connected = False
                    self.ledger.changed(node, membership=True)
                    node.push(None)
                self.lose_node(node, f"no heartbeat for {self.config.lease_s:.0f} s (lease)")
        for node in list(self.nodes.values()):
            forget_in = self.forget_in(node)
            if forget_in is not None and forget_in <= 0:
                self.forget_node(node)
        now = time.time()
        for task in [t for t in self.active.values() if t.state == S.TASK_STATE_RUNNING and t.max_runtime_s]:
            if task.max_runtime_s and task.start_time and now - task.start_time > task.max_runtime_s:
                node = self.nodes.get(task.node_id)
                attempt = task.attempt
                task.error = f"max_runtime of {task.max_runtime_s:.0f} s exceeded"
                self.transition(
                    task,
                    S.TASK_STATE_FAILED,
                    "TIMEOUT",
                    task.error,
                    end=True,
                    keep_node=True,
                    until_confirmed=node is not None,
                )
                self.preemptions.victim_ended(task.task_id)
                if node is not None:
                    # The worker checkpoints on SIGTERM; that final checkpoint is still recorded
                    # (see node_report) until the node reports the worker gone.
                    self.stopping[task.task_id] = (attempt, node.node_id)
                    node.seal(task.task_id)
                    node.push(
                        node_pb2.ConnectResponse(
                            cancel_task=node_pb2.CancelTask(task_id=task.task_id, attempt=attempt, reason="TIMEOUT")
                        )
                    )
        self.schedule()
        self.preempt()

    def forget_in(self, node: NodeSession) -> float | None:
        """Seconds until ``node`` is forgotten (<= 0: due), or None while it never will be: it is
        connected, in resource_pool, or still holds tasks (its ledger is not empty). A node is
        forgotten ``forget_disconnected_after`` seconds after it was last heard."""
        if node.connected or node.allocations or self.config.pool_node(node.node_id) is not None:
            return None
        return node.last_seen + self.config.forget_disconnected_after_s - self.clock()

    def forget_node(self, node: NodeSession) -> None:
        """Drop a disconnected node from memory and the store (ListNodes stops listing it)."""
        log.info(
            "disconnected node forgotten",
            node_id=node.node_id,
            forget_disconnected_after_s=self.config.forget_disconnected_after_s,
        )
        self.store.forget_node(node.node_id)
        self.ledger.forget(node.node_id)

    def node_notes(self, node: NodeSession) -> list[str]:
        """What ListNodes says of ``node``: its registration notes, and when it will be forgotten."""
        forget_in = self.forget_in(node)
        if forget_in is None:
            return list(node.notes)
        return [
            *node.notes,
            f"disconnected; forgotten in {max(0, round(forget_in))} s unless it reconnects (forget_disconnected_after)",
        ]

    def pool_nodes_not_seen(self) -> list[PoolNode]:
        """The ``resource_pool`` nodes that have not connected since this scheduler started
        leading (ListNodes lists them as not connected, so a node that never came is seen)."""
        return [p for p in self.config.resource_pool if p.node_id not in self.nodes]

    # ------------------------------------------------------------------ node streams
    @property
    def node_messages(self) -> dict[str, int]:
        """Messages received on node streams, by kind (the live counters; exported on /metrics)."""
        return self.node_protocol.messages

    def node_register(self, reg: node_pb2.Register) -> tuple[NodeSession, node_pb2.Registered]:
        """A node opened its stream (:meth:`NodeProtocol.node_register`: errors there; NotLeader
        on a follower)."""
        self.require_leader()
        return self.node_protocol.node_register(reg)

    def node_heartbeat(self, node: NodeSession, hb: node_pb2.Heartbeat) -> None:
        """Liveness, drain flag and telemetry, memory only (:meth:`NodeProtocol.node_heartbeat`)."""
        self.node_protocol.node_heartbeat(node, hb)

    def node_report(self, node: NodeSession, rep: node_pb2.TaskReport) -> bool:
        """Apply a task report; False when refused (:meth:`NodeProtocol.node_report`)."""
        return self.node_protocol.node_report(node, rep)

    def node_disconnected(self, node: NodeSession, generation: int, *, goodbye: bool) -> None:
        """The stream of ``generation`` ended (:meth:`NodeProtocol.node_disconnected`)."""
        self.node_protocol.node_disconnected(node, generation, goodbye=goodbye)

    def preempt(self) -> int:
        """Start preemptions for blocked higher-priority tasks; returns how many got victims
        (:meth:`PreemptionTracker.preempt`)."""
        if not self.leading:
            return 0
        return self.preemptions.preempt()

    # ------------------------------------------------------------------ quotas
    @staticmethod
    def need(task: TaskRow) -> tuple[int, int]:
        """What ``task`` takes of its queue's quota while active: (GPUs, CPU-task slots)."""
        return task_need(task.gpu_count, gang_nodes(task))

    def _recount_usage(self) -> None:
        """Quota usage from the active tasks (after a reload, or owners moved between queues)."""
        self.quotas.clear_usage()
        for task in self.active.values():
            self.quotas.add(self.quotas.queue_of(task.owner), self.need(task))

    def _cluster_changed(self) -> None:
        """The cluster's size, the dominant-share denominator of queues with no quota."""
        live = [n for n in self.nodes.values() if n.connected]
        self.quotas.cluster = (max(1, sum(n.gpu_count for n in live)), max(1, sum(n.max_tasks for n in live)))

    # ------------------------------------------------------------------ the scale signal
    def desired_trainers(self) -> list[ClassDemand]:
        """Trainers each node class needs now (:func:`~..policy.scale.desired_trainers`): pending
        tasks that their queue's quota admits (booked in queue order on a copy of the quotas),
        packed into connected nodes' free room, the rest into new trainers of
        ``usage.default_node_class`` sized like the largest node of that class (else of any)."""
        live = [n for n in self.nodes.values() if n.connected]
        nodes = []
        for n in live:
            cap = n.capacity()
            free = len(cap.free_gpus) if cap.accepting else 0
            slots = cap.free_slots if cap.accepting else 0
            nodes.append(ClassNode(n.node_id, self.node_class(n.node_id), free, slots, len(n.allocations)))
        book = QuotaBook(self.quotas.queues, self.quotas.default_queue, self.quotas.cluster,
                         {k: list(v) for k, v in self.quotas.used.items()})  # fmt: skip
        counts: dict[tuple[int, int], int] = {}
        pending_gpus: dict[str, int] = {}
        # Usage only grows below, so a (queue, need) refused once stays refused: one quota verdict
        # each, not one per pending task (a deep queue over its quota cost O(tasks x queues)).
        refused: set[tuple[str, tuple[int, int]]] = set()
        for key in self.queue.ordered_keys():
            task = self.queue.row(key)
            queue, need = book.queue_of(task.owner), self.need(task)
            if book.queues and ((queue, need) in refused or not book.admits(queue, need)):
                refused.add((queue, need))
                continue
            book.add(queue, need)
            size = (task.gpu_count, gang_nodes(task))
            counts[size] = counts.get(size, 0) + 1
        scale_class = self.config.usage.default_node_class
        same = [n for n in live if self.node_class(n.node_id) == scale_class] or live
        sizes = [(n.gpu_count, n.max_tasks) for n in same] or [
            (p.gpu_count, p.max_tasks) for p in self.config.resource_pool
        ]
        template = max(sizes, default=(0, 0))
        pending_gpus[scale_class] = sum(g * m * c for (g, m), c in counts.items())
        want = desired_trainers(
            nodes, [Demand(g, m, c) for (g, m), c in counts.items()], scale_class=scale_class, template=template
        )
        connected: dict[str, int] = {}
        for n in nodes:
            connected[n.node_class] = connected.get(n.node_class, 0) + 1
        return [ClassDemand(c, want[c], connected.get(c, 0), pending_gpus.get(c, 0)) for c in sorted(want)]

    # ------------------------------------------------------------------ usage accounting
    def node_class(self, node_id: str) -> str:
        """The class ``node_id`` announced (``--node-class``), else ``usage.default_node_class``."""
        node = self.nodes.get(node_id)
        reg = node.register if node is not None else None
        return (reg.node_class if reg is not None else "") or self.config.usage.default_node_class

    def task_usage(self, task: TaskRow) -> common_pb2.Usage:
        """What ``task`` used, all attempts, the running one up to now."""
        return usage_proto(self.store.task_usage(task.task_id), self.usage.so_far(task))

    def usage_rollup(
        self, *, owner: str | None = None, since: float | None = None
    ) -> tuple[dict[str, common_pb2.Usage], dict[str, common_pb2.Usage], dict[str, str]]:
        """``(per owner, per queue, owner -> queue)`` of recorded attempts plus the running ones
        (assigned at or after ``since`` when given; only ``owner``'s when given)."""
        by_owner = {k: usage_proto(v) for k, v in self.store.usage_by("owner", owner=owner, since=since).items()}
        by_queue = {k: usage_proto(v) for k, v in self.store.usage_by("queue", owner=owner, since=since).items()}
        queues = self.store.owner_queues(owner=owner, since=since)
        for task in self.active.values():
            if owner is not None and task.owner != owner:
                continue
            live = self.usage.so_far(task)
            if live is None or (since is not None and live.start_time < since):
                continue
            for table, key in ((by_owner, live.owner), (by_queue, live.queue)):
                table[key] = usage_proto(_usage_sums(table.get(key)), live)
            queues[live.owner] = live.queue
        return by_owner, by_queue, queues

    def set_queue(self, quota: QueueQuota, *, by: str = "") -> QueueQuota | None:
        """Add or change a quota queue now (no restart): its quota, borrowing limits and owners
        (owners listed move to it from any other queue). The change is a runtime override, written
        to the store first (nothing changes when that fails) and applied over the config at every
        start until :meth:`reset_queue`. Pending tasks are regrouped and usage recounted; the next
        placement round decides with it. ``by``: who set it (an API key owner). Returns the queue
        as it was (None: new). The caller audits the change."""
        self.require_leader()
        before = self.quotas.queues.get(quota.name)
        row = QueueOverride(quota.name, quota.gpus, quota.cpu_tasks, quota.borrowing_gpus,
                            quota.borrowing_cpu_tasks, tuple(quota.owners), time.time(), by)  # fmt: skip
        self.store.set_queue_override(row)
        self._use_queue_overrides([*(o for o in self.queue_overrides if o.name != quota.name), row])
        log.info(
            "queue quota set (runtime override)",
            queue=quota.name,
            gpus=quota.gpus,
            cpu_tasks=quota.cpu_tasks,
            owners=quota.owners,
            by=by,
        )
        self.notify()
        return before

    def reset_queue(self, name: str) -> tuple[QueueQuota | None, QueueOverride | None]:
        """Remove queue ``name``'s runtime override now: it goes back to the config's values, or
        is removed when the config has no such queue (its owners go back to where the config and
        the other overrides put them). Returns ``(the queue now or None, the override removed or
        None)``; a configured queue with no override is returned as it is. The caller audits it.

        Raises:
            NotFound: ``name`` is neither overridden nor in the config.
        """
        self.require_leader()
        removed = self.queue_override(name)
        if removed is None and all(q.name != name for q in self.config.queues):
            known = sorted({q.name for q in self.config.queues} | {o.name for o in self.queue_overrides})
            raise NotFound(
                f"queue {name!r} has no runtime override and is not in the scheduler config "
                f"(queues: {', '.join(known) or 'none'})"
            )
        if removed is not None:
            self.store.delete_queue_override(name)
            self._use_queue_overrides([o for o in self.queue_overrides if o.name != name])
            log.info("queue override removed", queue=name, configured=self.quotas.queues.get(name) is not None)
            self.notify()
        return self.quotas.queues.get(name), removed

    def queue_override(self, name: str) -> QueueOverride | None:
        """The runtime override of queue ``name``, or None."""
        return next((o for o in self.queue_overrides if o.name == name), None)

    def _quota_book(self, overrides: list[QueueOverride]) -> QuotaBook:
        """The config's queues with ``overrides`` applied over them in order (no usage)."""
        book = QuotaBook.of(
            (
                QueueQuota(q.name, q.gpus, q.cpu_tasks, q.borrowing_gpus, q.borrowing_cpu_tasks, q.owners)
                for q in self.config.queues
            ),
            self.config.default_queue,
        )
        for o in overrides:
            book = book.with_queue(
                QueueQuota(o.name, o.gpus, o.cpu_tasks, o.borrowing_gpus, o.borrowing_cpu_tasks, o.owners)
            )
        return book

    def _use_queue_overrides(self, overrides: list[QueueOverride], *, start: bool = False) -> None:
        """Decide with the config's queues and ``overrides`` from now on: pending tasks regrouped,
        usage recounted. ``start``: read from the store (start, promotion, reload); each override
        that changes what the config says is logged."""
        if start and overrides and overrides != self.queue_overrides:
            configured = {q.name: q for q in self.config.queues}
            for o in overrides:
                was = configured.get(o.name)
                log.info(
                    "quota queue override applied over the config",
                    queue=o.name,
                    gpus=o.gpus,
                    cpu_tasks=o.cpu_tasks,
                    borrowing_gpus=o.borrowing_gpus,
                    borrowing_cpu_tasks=o.borrowing_cpu_tasks,
                    owners=o.owners,
                    config=None
                    if was is None
                    else {"gpus": was.gpus, "cpu_tasks": was.cpu_tasks, "owners": was.owners},
                    set_by=o.set_by,
                    set_time=o.set_time,
                )
        book = self._quota_book(overrides)
        book.cluster = self.quotas.cluster
        self.quotas, self.queue_overrides = book, list(overrides)
        self.tasks.regroup(book.queue_of)
        self._recount_usage()

    def queue_config(self, owner: str):
        """``(index, QueueConfig)`` of the configured queue ``owner``'s tasks go to, when it sets
        per-owner limits (``queues[i].limits``), else None."""
        name = self.quotas.queue_of(owner)
        for i, q in enumerate(self.config.queues):
            if q.name == name and (
                q.max_pending_per_owner is not None or q.submit_rate is not None or q.submit_burst is not None
            ):
                return i, q
        return None

    def queue_rows(self) -> list[tuple[str, QueueQuota | None, tuple[int, int], int, float]]:
        """Every queue with a quota or with tasks now: ``(name, quota or None, usage (GPUs,
        CPU tasks), pending tasks, dominant share)``, by name. A follower reads the overrides
        from the store first (the leader may have changed them since)."""
        if not self.leading:
            overrides = self.store.queue_overrides()
            if overrides != self.queue_overrides:
                self._use_queue_overrides(overrides)
        pending: dict[str, int] = {}
        for task in self.queue:
            q = self.quotas.queue_of(task.owner)
            pending[q] = pending.get(q, 0) + 1
        names = sorted(set(self.quotas.queues) | set(self.quotas.used) | set(pending))
        return [
            (
                n,
                self.quotas.queues.get(n),
                self.quotas.usage(n),
                pending.get(n, 0),
                self.quotas.dominant_share(n),
            )
            for n in names
        ]

    # ------------------------------------------------------------------ placement
    def schedule(self) -> int:
        """Place what fits now; push assignments. Returns the number placed.

        Cheap when nothing can move (no pending task, or no node with room). A round decides
        from the in-memory indexes (:func:`~opentinker_scheduler.policy.placement.place_round`), books
        the GPUs in the ledger, commits all of its assignments in one transaction and only then
        pushes them to the nodes. If a write fails, memory is rebuilt from the store and the
        error raised.
        """
        if not self.leading or not self.queue or not self.free:
            return 0
        gangs: list = []
        book = RoundBook(self.queue, self.nodes, self.quotas, self.ledger.nodes_without)
        hooks = book.hooks()
        self._reservation = None
        now = time.time()
        gang_keys = [k for k in self.queue.gang_keys() if self.queue.row(k).not_before <= now]
        try:
            if not gang_keys:
                place_round(self.queue.groups(), self.free, now, hooks)
            else:
                # Tasks ahead of the first gang, then the gangs, then the tasks behind it (kept off
                # the nodes a blocked gang reserved).
                ahead, behind = self.gangs.split(self.queue.groups(), gang_keys[0])
                place_round(ahead, self.free, now, hooks)
                gangs, reserved = self.gangs.place(gang_keys, now)
                for node_id in reserved:
                    self.free.remove(node_id)
                try:
                    place_round(behind, self.free, now, hooks)
                finally:
                    for node_id in reserved:
                        self.ledger.changed(self.nodes[node_id])
        finally:
            self._reservation = book.reservation
        book.unbook()  # the transitions below book them for good
        decided = book.decided
        if not decided and not gangs:
            return 0
        try:
            with self.store.batch():
                for task, node, devices in decided:
                    task.device_indices = list(devices)
                    task.node_id = node.node_id
                    where = f" GPUs {list(devices)}" if devices else " (CPU)"
                    self.transition(
                        task, S.TASK_STATE_ASSIGNED, "ASSIGNED", f"placed on {node.node_id}{where}", keep_node=True
                    )
                for task, gang in gangs:
                    task.node_id, task.device_indices = gang.members[0][0], list(gang.members[0][1])
                    self.transition(
                        task,
                        S.TASK_STATE_ASSIGNED,
                        "ASSIGNED",
                        f"placed as {self.gangs.describe(gang)}",
                        keep_node=True,
                    )
                    self.gangs.assigned(task, gang)
        except BaseException:
            self._rebuild()  # the round's rows, ledger entries and counts all go back to the store's
            raise
        now_m = time.monotonic()
        for task, gang in gangs:
            queued = self._queued_at.pop(task.task_id, None)
            if queued is not None:
                self.placement_latencies.append(now_m - queued)
            for node, assign in self.gangs.assignments(gang, self._assignment(task, ())):
                self._sign_assignment(assign, task, node.node_id)
                node.push(node_pb2.ConnectResponse(assign_task=assign))
        for task, node, devices in decided:
            queued = self._queued_at.pop(task.task_id, None)
            if queued is not None:
                self.placement_latencies.append(now_m - queued)
            assign = self._assignment(task, devices)
            self._sign_assignment(assign, task, node.node_id)
            node.push(node_pb2.ConnectResponse(assign_task=assign))
        return len(decided) + len(gangs)

    def _sign_assignment(self, assign: node_pb2.AssignTask, task: TaskRow, node_id: str) -> None:
        """Give ``assign`` the credential of its attempt on ``node_id`` (authentication on)."""
        if self.worker_credentials is not None:
            scope = AttemptScope(task.task_id, task.attempt, node_id, task.owner)
            assign.worker_credential = self.worker_credentials.issue(scope)

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
        if self.stopping.get(scope.task_id) == (scope.attempt, scope.node_id):
            return None
        try:
            task = self.get(scope.task_id)
        except NotFound:
            return f"{scope.describe()} has ended"
        if task.attempt != scope.attempt:
            return f"{scope.describe()} was superseded by attempt {task.attempt}"
        if task.state not in ACTIVE_STATES:
            return f"{scope.describe()} has ended"
        gang = self.gangs.live.get(task.task_id)
        on_node = gang.index_of(scope.node_id) is not None if gang is not None else task.node_id == scope.node_id
        if not on_node:
            return f"{scope.describe()} is not assigned to that node"
        return None

    def _resume_checkpoint(self, task: TaskRow) -> common_pb2.Checkpoint | None:
        """The checkpoint ``task``'s next attempt resumes from: its newest, unless that is a
        training session's sampler save, which holds weights alone (no optimizer, step or
        sequence number): then its newest state (``SaveState``), or None."""
        resume = task.latest_checkpoint
        if resume is not None and sampler_saves([resume]):
            resume = resumable(self.store.checkpoints(task.task_id))
        return resume

    def _assignment(self, task: TaskRow, devices: tuple[int, ...]) -> node_pb2.AssignTask:
        """The ``AssignTask`` of ``task``'s current attempt on ``devices``."""
        assign = node_pb2.AssignTask(
            task_id=task.task_id, attempt=task.attempt, spec=task.spec, device_indices=devices, owner=task.owner
        )
        # paths.model_dirs in force (default_model exempt): the worker refuses hub-id-shaped names
        # found in its folder.
        assign.local_paths_restricted = (
            self.config.paths.allowed("model_dirs", auth_enabled=self.config.auth.enabled) is not None
            and task.spec.model != self.config.default_model
        )
        resume = self._resume_checkpoint(task)
        if resume is not None:
            assign.resume_from.CopyFrom(resume)
        init = init_checkpoint(self.store, task.spec)  # spec.init_from's final checkpoint
        if init is not None:
            assign.init_checkpoint.CopyFrom(init)
        return assign

    # ------------------------------------------------------------------ transitions (also the node protocol's)
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
        task = self.active.get(task_id)
        if task is not None and task.attempt == attempt:
            log.warning("task attempt lost", task_id=task_id, attempt=attempt, node_id=node.node_id, why=message)
            self.hand_back_lost(task, reason, message)
        node.release(task_id)

    def hand_back_lost(self, task: TaskRow, reason: str, message: str) -> None:
        """The node of ``task``'s current attempt is gone: hand the attempt back, as a drain does
        (not counted against ``max_attempts``), unless this is the task's ``max_node_losses``-th
        node loss; then it ends FAILED, so a task that keeps taking its node down ends."""
        losses = 1 + self.node_losses(task.task_id)
        limit = self.config.max_node_losses
        if losses < limit:
            self.requeue(task, reason, message, backoff=False, failure=False)
            return
        task.error = (
            f"{message}; its attempts lost their node {losses} times, max_node_losses ({limit}) reached: "
            "look for what takes the node down (memory, disk, the host's logs)"
        )
        self.transition(task, S.TASK_STATE_FAILED, reason, task.error, end=True, keep_node=True)

    def node_losses(self, task_id: str) -> int:
        """How many of ``task_id``'s attempts ended in a node loss: its stored ``NODE_LOST`` state
        changes (rare, so they are counted when one more happens)."""
        count, seq = 0, 0
        while events := self.store.events_after(task_id, seq):
            seq = events[-1].sequence
            count += sum(e.HasField("state_change") and e.state_change.reason == "NODE_LOST" for e in events)
        return count

    def stop_confirmed(self, task_id: str, attempt: int) -> None:
        """The worker of ``task_id``'s ``attempt``, which the scheduler ended (cancel,
        max_runtime), is gone: its node reported it ended, or the node was declared lost. The
        attempt's usage ends now (GPU-seconds run from assignment to confirmed stop)."""
        self.stopping.pop(task_id, None)
        self.usage.confirmed(task_id, attempt)
        self.notify()  # a WatchTask stream held open for its last checkpoint can end now

    def fail_or_retry(self, task: TaskRow, reason: str, message: str, *, retryable: bool, extra=()) -> None:
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
        self, task: TaskRow, reason: str, message: str, *, extra=(), backoff: bool, failure: bool = True
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
        resume_from = self._resume_checkpoint(task)
        task.latest_step = resume_from.step if resume_from is not None else 0
        task.latest_metrics = {}
        task.node_id = ""
        task.device_indices = []
        task.not_before = time.time() + delay
        self._queued_at[task.task_id] = time.monotonic()
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
        extra=(),
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
            queue, need = self.quotas.queue_of(task.owner), self.need(task)
            self.quotas.add(queue, need, 1 if now_active else -1)
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

    async def wait_changed(self, timeout: float) -> None:
        """Wait until some task changes (or ``timeout`` seconds pass); for WatchTask."""
        self._watchers += 1
        try:
            async with self.changed:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), timeout=timeout)
        finally:
            self._watchers -= 1

    def notify(self) -> None:
        """Wake waiting WatchTask streams (once per loop turn, however many transitions)."""
        if self._wake_pending or not self._watchers:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (unit tests of the core)
        self._wake_pending = True
        loop.create_task(self._wake())

    async def _wake(self) -> None:
        self._wake_pending = False
        async with self.changed:
            self.changed.notify_all()


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
    """The submits of one open group commit, waiting to be written (:meth:`SchedulerCore.submit_grouped`):
    per submit its row, first event, spec and the future its result goes to."""

    group: asyncio.Future | None = None
    rows: list[tuple[TaskRow, common_pb2.TaskEvent, common_pb2.TaskSpec, asyncio.Future]] = dataclasses.field(
        default_factory=list
    )


@dataclasses.dataclass(frozen=True)
class ClassDemand:
    """One node class in the scale signal: trainers needed, connected now, pending GPUs admitted."""

    node_class: str
    desired: int
    connected: int
    pending_gpus: int


def _usage_sums(u: common_pb2.Usage | None) -> tuple:
    """A ``Usage`` as the sums tuple of :meth:`~.store.StateStore.task_usage` (zeros for None)."""
    if u is None:
        return (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0)
    return (u.gpu_seconds, u.cpu_task_seconds, u.tokens_generated, u.tokens_trained, u.env_steps, u.cost, u.attempts)


def _struct_dict(spec: common_pb2.TaskSpec, name: str) -> dict:
    """A ``google.protobuf.Struct`` field of a spec as a plain dict ({} when unset)."""
    return struct_to_dict(getattr(spec, name)) if spec.HasField(name) else {}


def init_checkpoint(store: StateStore, spec: common_pb2.TaskSpec) -> common_pb2.Checkpoint | None:
    """The final checkpoint of ``spec.init_from`` (None when unset or gone from the store)."""
    if not spec.init_from:
        return None
    source = store.get_task(spec.init_from)
    if source is None:
        return None
    return source.latest_checkpoint


def short_id(task_id: str, limit: int = 80) -> str:
    """``task_id`` quoted for a message, cut to ``limit`` characters (ids come from callers)."""
    return repr(task_id[:limit]) + ("..." if len(task_id) > limit else "")


def new_task_id() -> str:
    """``task-`` + 19 hex digits: milliseconds since the epoch, then 32 random bits. Ids sort by
    creation time, so recent tasks' rows and events share database pages (cheaper commits)."""
    return f"task-{time.time_ns() // 1_000_000:011x}{secrets.randbits(32):08x}"
