"""The scheduler's core: it composes the parts that hold the state and drives them. No gRPC in here.

The servicers in :mod:`opentinker_scheduler.api` call it from one asyncio event loop. Its parts,
each with narrow collaborators and none holding the core:

* :class:`~.task_table.TaskTable` (``core.table``): the one writer of live task rows and their
  events (transitions, requeues, retries, lost attempts).
* :class:`~.ledger.NodeLedger` (``core.ledger``): the nodes and their GPU and tenant bookings.
* The placement round (:meth:`SchedulerCore.schedule`): :func:`~..policy.placement.place_round`
  over typed groups, with the named hooks of :class:`~.placement_round.RoundBook`.
* :class:`~.client_api.ClientApi` (``core.api``): submit, dry run, cancel and the reads of tasks.
* :class:`~.quota_queues.QuotaQueues` (``core.queues``), :class:`~.usage.UsageMeters`
  (``core.usage``), :mod:`.scale_signal`, :class:`~.pending_reasons.PendingReasons`,
  :class:`~.gangs.Gangs`, :class:`~.preemption_tracker.PreemptionTracker` and
  :class:`~.node_protocol.NodeProtocol`.

Every transition is committed to the :class:`~.store.StateStore` before it is acknowledged or
pushed down a node stream. Task states: PENDING -> ASSIGNED -> RUNNING -> SUCCEEDED | FAILED |
CANCELLED. A lost node puts its tasks back to PENDING with attempt + 1 (they resume from their
newest checkpoint); a report from any attempt but the current one is refused (fencing).

Each tick: lost nodes, ``max_runtime`` (the task ends FAILED/TIMEOUT at once and its worker is
told to stop; the checkpoint it writes on SIGTERM is still recorded until the node reports it
gone), placement, then preemption (:mod:`..policy.preemption`, :mod:`.preemption_tracker`): a
blocked task with a strictly higher priority than running ones has victims chosen on one node;
they checkpoint and stop, keep their GPUs until the node confirms, then go back to PENDING.
"""

from __future__ import annotations

import time
from typing import Callable

import structlog
from opentinker.common.v1 import common_pb2
from opentinker.node.v1 import node_pb2
from opentinker_common.artifacts.checkpoint_lists import named_state
from opentinker_common.spec.session import init_state

from opentinker_scheduler.config import PoolNode, SchedulerConfig
from opentinker_scheduler.errors import NotLeader
from opentinker_scheduler.policy.placement import place_round
from opentinker_scheduler.state.changes import Changes
from opentinker_scheduler.state.client_api import ClientApi
from opentinker_scheduler.state.commit import GroupCommit
from opentinker_scheduler.state.gangs import Gangs
from opentinker_scheduler.state.ledger import NodeLedger
from opentinker_scheduler.state.node_protocol import NodeProtocol, node_size
from opentinker_scheduler.state.nodes import NodeSession
from opentinker_scheduler.state.pending_reasons import PendingReasons
from opentinker_scheduler.state.placement_round import RoundBook
from opentinker_scheduler.state.preemption_tracker import PreemptionTracker
from opentinker_scheduler.state.queue import LiveTasks, PendingQueue, ReasonsView
from opentinker_scheduler.state.quota_queues import QuotaQueues, quota_need
from opentinker_scheduler.state.store import StateStore, TaskRow
from opentinker_scheduler.state.task_table import TaskTable
from opentinker_scheduler.state.usage import UsageMeters
from opentinker_scheduler.state.worker_credentials import AttemptScope, WorkerCredentials

log = structlog.get_logger("opentinker.scheduler")

S = common_pb2  # TaskState constants: S.TASK_STATE_PENDING ...


class SchedulerCore:
    """Tasks, nodes and placement. Call from a single event loop.

    In memory, written through to the store: every unfinished task's row (``tasks``: the
    PENDING ones in ``queue``, in placement order, the ASSIGNED and RUNNING ones in ``active``)
    and the ledger of nodes. A row changes only in the task table; a failed write reloads it from
    the store. Finished tasks are read from the store. With group commit on (the server), writes
    share commits and callers await :meth:`durable`.
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
        self.placement_latencies: list[float] = []  # seconds from submit/requeue to assign (drained by metrics)
        #: Wakes WatchTask streams (:mod:`.changes`).
        self.changes = Changes()
        #: Every unfinished task's row (empty on a follower).
        self.tasks = LiveTasks()
        #: Quota queues and their usage (:mod:`..policy.quota`): the config's ``queues:`` with
        #: runtime overrides applied over them (read from the store at every start).
        self.queues = QuotaQueues(config, store, self.tasks, self.changes, self.require_leader)
        #: Signs each assignment's attempt credential; None with authentication off (the server sets it).
        self.worker_credentials: WorkerCredentials | None = None
        self.commits = GroupCommit(store, on_failure=self._rebuild)
        #: The one writer of live rows and their events (:class:`~.task_table.TaskTable`).
        self.table = TaskTable(
            config,
            store,
            clock=clock,
            tasks=self.tasks,
            queues=self.queues,
            changes=self.changes,
            memory_lost=self._memory_lost,
        )
        #: Registration, heartbeats and task reports of node streams; acts on the task table.
        self.node_protocol = NodeProtocol(self.table)
        #: Submits, cancels and reads of tasks (:class:`~.client_api.ClientApi`).
        self.api = ClientApi(
            config,
            store,
            tasks=self.tasks,
            queues=self.queues,
            table=self.table,
            commits=self.commits,
            schedule=self.schedule,
        )
        #: Why each pending task waits (:class:`~.pending_reasons.PendingReasons`).
        self.reasons = PendingReasons(self.tasks, self.queues, self.table)
        self.pending_reasons = ReasonsView(self.tasks, self.reasons.reason)  # task id -> why pending
        self._init_memory()
        if leading:
            self._recover()
        else:  # a follower answers ListQueues from the store's overrides too
            self.queues.use(store.queue_overrides())

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
            self.config.usage.default_node_class,
        )
        self.tasks.clear()
        self.queues.book.clear_usage()
        #: Meters of the live attempts; ended ones are rows of the store (:mod:`.usage`).
        self.usage = UsageMeters(self.store, self.config.usage, self.ledger.node_class)
        #: Preemptions in flight (memory only; :class:`~.preemption_tracker.PreemptionTracker`).
        self.preemptions = PreemptionTracker(
            tasks=self.tasks,
            nodes=self.ledger.nodes,
            free=self.ledger.free,
            config=self.config,
            notify=self.changes.notify,
            quotas=self.queues.current,
        )
        #: Gang tasks' members, rendezvous and ends (also in the store; :class:`~.gangs.Gangs`).
        self.gangs = Gangs(
            ledger=self.ledger,
            store=self.store,
            rendezvous_ports=self.config.gang_rendezvous_ports,
            tasks=self.tasks,
            quotas=self.queues.current,
            need=quota_need,
            preemptions=self.preemptions,
            requeue=self.table.requeue,
            fail_or_retry=self.table.fail_or_retry,
        )
        self.table.use(ledger=self.ledger, usage=self.usage, preemptions=self.preemptions, gangs=self.gangs)
        self.reasons.reservation = None

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
        self.changes.notify()

    def demote(self, reason: str) -> None:
        """Stop leading at once: the open group commit is rolled back (its waiters get
        NotLeader, its held commands are dropped), every node stream is ended (the trainers
        reconnect, to the new leader) and memory is emptied. Idempotent."""
        if not self.leading:
            return
        self.leading = False
        self.commits.abandon(NotLeader(self.store.leader_address))
        self.api.abandon_new_tasks()  # their group was rolled back: its submits got NotLeader
        for node in self.ledger.nodes.values():
            node.generation += 1  # what the old streams still send is ignored
            if node.connected:
                node.outbox.put_nowait(None)  # ends the stream now (not held for a commit)
        log.warning("stepped down; no longer leading", reason=reason, nodes=len(self.ledger.nodes))
        self._init_memory()
        self.changes.notify()

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
        for node in self.ledger.nodes.values():
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

    def _cluster_changed(self) -> None:
        """A node connected, left or changed size: the quotas' cluster size follows."""
        self.queues.cluster_changed(self.ledger.nodes.values())

    def checkpoint_deleted(self, task_id: str, key: str, *, size_bytes: int = 0, by: str = "") -> None:
        """Record that the checkpoint stored as ``key`` is gone (:meth:`TaskTable.checkpoint_deleted`);
        it expires no more."""
        if self._expiring_keys is not None:
            self._expiring_keys.pop(key, None)
        self.table.checkpoint_deleted(task_id, key, size_bytes=size_bytes, by=by)

    def checkpoint_expiry(self, task_id: str, key: str, expire_time: float | None) -> None:
        """Record when the checkpoint stored as ``key`` expires (epoch seconds; None: never;
        :meth:`TaskTable.checkpoint_expiry`); :meth:`expired` names it from then on."""
        self.table.checkpoint_expiry(task_id, key, expire_time)
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

    def checkpoints_retired(self, task_id: str, keys: list[str]) -> None:
        """Record that retention deleted ``keys`` of ``task_id`` (:meth:`TaskTable.checkpoints_retired`),
        when this scheduler leads."""
        if self.leading:
            self.table.checkpoints_retired(task_id, keys)

    # ------------------------------------------------------------------ start-up
    def _recover(self) -> None:
        """Rebuild memory from the store: the queue from PENDING rows, the ledger from active
        ones. They keep their node's GPUs until the node re-announces them, or until
        ``restart_grace`` passes without it (a trainer may be a few reconnect backoffs away from
        noticing the restart), so a scheduler restart kills no running work."""
        self.queues.use(self.store.queue_overrides(), start=True)
        self.tasks.load(self.store)
        self.queues.recount()
        for task in self.active.values():  # meters run again from the attempt's start (see state/usage.py)
            if task.task_id in self.usage.live:
                continue  # reloaded after a failed commit: the meter runs on
            self.usage.start(task, queue=self.queues.book.queue_of(task.owner), gpus=quota_need(task)[0],
                             start_time=task.start_time or task.update_time)  # fmt: skip
        grace = max(0.0, self.config.restart_grace_s - self.config.lease_s)
        holdings = [(t.node_id, t, tuple(t.device_indices), t.share_key) for t in self.active.values()]
        # A gang's other members (member 0 is the row's node): each holds its GPUs within the grace.
        holdings += [(n, t, devices, None) for n, t, devices in self.gangs.recover(self.active)]
        for node_id, task, devices, share in holdings:
            if node_id not in self.ledger.nodes:
                self._recover_node(node_id)
            node = self.ledger.node(node_id)
            node.allocate(task.task_id, task.attempt, devices, share, task.memory_need if share else None)
            if not node.connected:
                node.last_seen = self.clock() + grace
        self.table.queued_at = {t.task_id: time.monotonic() for t in self.queue}
        if self.ledger.nodes:
            log.info(
                "recovered active tasks",
                nodes=sorted(self.ledger.nodes),
                tasks=sum(len(n.allocations) for n in self.ledger.nodes.values()),
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

    # ------------------------------------------------------------------ periodic work
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
        for node in list(self.ledger.nodes.values()):
            silent = now_m - node.last_seen > self.config.lease_s
            if silent and not in_grace and (node.connected or node.allocations):
                if node.connected:
                    node.connected = False
                    self.ledger.changed(node, membership=True)
                    node.push(None)
                self.table.lose_node(node, f"no heartbeat for {self.config.lease_s:.0f} s (lease)")
        for node in list(self.ledger.nodes.values()):
            forget_in = self.forget_in(node)
            if forget_in is not None and forget_in <= 0:
                self.forget_node(node)
        now = time.time()
        for task in [t for t in self.active.values() if t.state == S.TASK_STATE_RUNNING and t.max_runtime_s]:
            if task.max_runtime_s and task.start_time and now - task.start_time > task.max_runtime_s:
                node = self.ledger.nodes.get(task.node_id)
                attempt = task.attempt
                task.error = f"max_runtime of {task.max_runtime_s:.0f} s exceeded"
                self.table.transition(
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
                    self.table.stop_worker(task, attempt, node, "TIMEOUT")
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
        return [p for p in self.config.resource_pool if p.node_id not in self.ledger.nodes]

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

    # ------------------------------------------------------------------ placement
    def schedule(self) -> int:
        """Place what fits now; push assignments. Returns the number placed.

        Cheap when nothing can move (no pending task, or no node with room). A round decides
        from the in-memory indexes (:func:`~opentinker_scheduler.policy.placement.place_round`), books
        the GPUs in the ledger, commits all of its assignments in one transaction and only then
        pushes them to the nodes. If a write fails, memory is rebuilt from the store and the
        error raised.
        """
        if not self.leading or not self.queue or not self.ledger.free:
            return 0
        gangs: list = []
        book = RoundBook(self.queue, self.ledger.nodes, self.queues.book, self.ledger.nodes_without)
        hooks = book.hooks()
        self.reasons.reservation = None
        now = time.time()
        gang_keys = [k for k in self.queue.gang_keys() if self.queue.row(k).not_before <= now]
        try:
            if not gang_keys:
                place_round(self.queue.groups(), self.ledger.free, now, hooks)
            else:
                # Tasks ahead of the first gang, then the gangs, then the tasks behind it (kept off
                # the nodes a blocked gang reserved).
                ahead, behind = self.gangs.split(self.queue.groups(), gang_keys[0])
                place_round(ahead, self.ledger.free, now, hooks)
                gangs, reserved = self.gangs.place(gang_keys, now)
                for node_id in reserved:
                    self.ledger.free.remove(node_id)
                try:
                    place_round(behind, self.ledger.free, now, hooks)
                finally:
                    for node_id in reserved:
                        self.ledger.changed(self.ledger.nodes[node_id])
        finally:
            self.reasons.reservation = book.reservation
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
                    self.table.transition(
                        task, S.TASK_STATE_ASSIGNED, "ASSIGNED", f"placed on {node.node_id}{where}", keep_node=True
                    )
                for task, gang in gangs:
                    task.node_id, task.device_indices = gang.members[0][0], list(gang.members[0][1])
                    self.table.transition(
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
            queued = self.table.queued_at.pop(task.task_id, None)
            if queued is not None:
                self.placement_latencies.append(now_m - queued)
            for node, assign in self.gangs.assignments(gang, self._assignment(task, ())):
                self._sign_assignment(assign, task, node.node_id)
                node.push(node_pb2.ConnectResponse(assign_task=assign))
        for task, node, devices in decided:
            queued = self.table.queued_at.pop(task.task_id, None)
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
        resume = self.table.resume_checkpoint(task)
        if resume is not None:
            assign.resume_from.CopyFrom(resume)
        init = init_checkpoint(self.store, task.spec)  # spec.init_from's final checkpoint
        if init is not None:
            assign.init_checkpoint.CopyFrom(init)
        return assign


def init_checkpoint(store: StateStore, spec: common_pb2.TaskSpec) -> common_pb2.Checkpoint | None:
    """The final checkpoint of ``spec.init_from``, or its state ``hyperparameters.init_state``
    (None when unset or gone from the store)."""
    if not spec.init_from:
        return None
    name = init_state(spec)
    if name:
        return named_state(store.checkpoints(spec.init_from), name)
    source = store.get_task(spec.init_from)
    if source is None:
        return None
    return source.latest_checkpoint
