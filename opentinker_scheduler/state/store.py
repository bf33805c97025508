"""Durable scheduler state: the store interface (:class:`StateStore`) and its embedded backend,
SQLite in WAL mode under the configured state directory (:class:`SqliteStore`). The PostgreSQL backend
for several schedulers is :class:`~opentinker_scheduler.state.pg_store.PostgresStore`; which one
runs is the config's ``store:`` (:func:`~.backends.open_store`).

Every task transition is one transaction that updates the ``tasks`` row and appends its event;
it commits before the scheduler acknowledges the RPC or pushes a command, so ``kill -9`` of the
scheduler loses nothing that was acknowledged. Inside a transaction (a group commit's) the row,
event and usage-record writes wait until it ends and then go in one ``executemany`` each, a task's
row once however often it moved (:meth:`StateStore.update_task`); reads on the store write them first.
WAL with ``synchronous=NORMAL`` survives process crashes (a power loss may drop the last
transactions; set ``synchronous=FULL`` to cover that).

Events are stored as serialized ``opentinker.common.v1.TaskEvent`` messages with a per-task
sequence number starting at 1; metric points are events of kind ``metric``. The tables and their
versions: :mod:`.schema` (one list of migrations for both backends).

Roles (:attr:`StateStore.role`): a store writes only as the ``leader``. On SQLite it always is (the
state directory's lock keeps every other scheduler out); on PostgreSQL the leader lease decides
(:mod:`.leadership`), and every write transaction of a leader carries its epoch, refused by the
database once a newer epoch holds the lease (:class:`~opentinker_scheduler.errors.Fenced`). A
``follower`` reads; its writes raise :class:`~opentinker_scheduler.errors.NotLeader` before any
SQL runs. ``setup`` (start-up, before the first election) writes without an epoch.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import functools
import json
import os
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

from opentinker.common.v1 import common_pb2

from opentinker_scheduler.errors import NotLeader, StoreUnavailable
from opentinker_common.spec.tracking import EXTRAS as TRACKING_EXTRAS
from opentinker_scheduler.policy.placement import MemoryNeed, share_key
from opentinker_scheduler.state.tenant_memory import memory_need, serves_own_weights, trains_all_weights
from opentinker_scheduler.state import schema
from opentinker_scheduler.state.schema import LEASE_NAME, SchemaTooNew  # noqa: F401  (re-exported)

#: TaskState value -> name without the prefix ("PENDING" ...), for logs and metrics.
STATE_NAMES = {v: k.removeprefix("TASK_STATE_") for k, v in common_pb2.TaskState.items()}

ACTIVE_STATES = (
    common_pb2.TASK_STATE_ASSIGNED,
    common_pb2.TASK_STATE_RUNNING,
)
TERMINAL_STATES = (
    common_pb2.TASK_STATE_SUCCEEDED,
    common_pb2.TASK_STATE_FAILED,
    common_pb2.TASK_STATE_CANCELLED,
)

#: Who cancels a task through CancelTask; the state event's message when no reason is given.
CANCELLED_BY_USER = "cancelled by user"


def cancel_error(reason: str) -> str:
    """``Task.error`` of a task cancelled with ``reason`` (its CANCELLED event's message; "" or
    :data:`CANCELLED_BY_USER` when none was given): who cancelled it, then why, e.g.
    ``"cancelled by user: enough"``, or just ``"cancelled by user"``."""
    return f"{CANCELLED_BY_USER}: {reason}" if reason and reason != CANCELLED_BY_USER else CANCELLED_BY_USER


@dataclass
class TaskRow:
    """One task as stored. Mutable copy; write changes back with :meth:`Store.transition`."""

    task_id: str
    owner: str
    spec: common_pb2.TaskSpec
    state: int
    attempt: int
    priority: int
    gpu_count: int
    max_attempts: int
    max_runtime_s: float | None
    create_time: float
    update_time: float
    start_time: float | None = None
    end_time: float | None = None
    not_before: float = 0.0
    node_id: str = ""
    device_indices: list[int] = field(default_factory=list)
    error: str = ""
    latest_step: int = 0
    latest_metrics: dict[str, float] = field(default_factory=dict)
    latest_checkpoint: common_pb2.Checkpoint | None = None
    request_id: str | None = None
    #: Highest metric step the current attempt has reported (0 before its first, and again on
    #: every requeue): a point at or below it is a resent duplicate and is not applied twice.
    attempt_step: int = 0

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def workload_type(self) -> str:
        return self.spec.workload_type

    @property
    def handed_back(self) -> int:
        """Attempts handed back (preemption, drain), each of which raised ``max_attempts`` by one
        above the spec's (0 for a spec stored without its limit)."""
        limit = self.spec.limits.max_attempts
        return max(0, self.max_attempts - limit) if limit else 0

    @functools.cached_property
    def share_key(self) -> str | None:
        """GPU-sharing key (:func:`~opentinker_scheduler.policy.placement.share_key`): the base model of
        a LoRA task on GPUs, None for a task that needs its GPUs to itself."""
        own = serves_own_weights(self.spec) or trains_all_weights(self.spec)
        return share_key(self.spec.workload_type, self.spec.model, self.gpu_count, own_weights=own)

    @functools.cached_property
    def tracking_loggers(self) -> frozenset[str]:
        """The ``spec.tracking`` loggers the task names (``"tensorboard"``, ``"mlflow"``,
        ``"wandb"``): a node must be able to write them to run it."""
        return frozenset(k for k in self.spec.tracking.fields if k in TRACKING_EXTRAS)

    @functools.cached_property
    def memory_need(self) -> MemoryNeed | None:
        """GPU memory estimate of a shareable LoRA task (:func:`.tenant_memory.memory_need`; the
        spec never changes, so it is worked out once), None when it is counted in tasks only."""
        return memory_need(self.spec, self.share_key)


_COLUMNS = (
    "task_id, owner, request_id, spec, state, attempt, priority, gpu_count, max_attempts, max_runtime_s, "
    "create_time, update_time, start_time, end_time, not_before, node_id, device_indices, error, "
    "latest_step, latest_metrics, latest_checkpoint, attempt_step"
)
#: A task row written back (every column but ``task_id`` and ``spec``), ``next_seq`` as a value.
_AUDIT_COLUMNS = "time, owner, role, key_prefix, action, task_id, outcome, detail"
_UPDATE_TASK_SQL = (
    "UPDATE tasks SET owner=?, request_id=?, state=?, attempt=?, priority=?, gpu_count=?, "
    "max_attempts=?, max_runtime_s=?, create_time=?, update_time=?, start_time=?, end_time=?, "
    "not_before=?, node_id=?, device_indices=?, error=?, latest_step=?, latest_metrics=?, "
    "latest_checkpoint=?, attempt_step=?, next_seq=? WHERE task_id=?"
)
#: The same, for a task whose ``next_seq`` this store does not know: moves it past ``?`` new
#: events and reads where it ends.
_UPDATE_TASK_RETURNING_SQL = _UPDATE_TASK_SQL.replace("next_seq=?", "next_seq=next_seq+?") + " RETURNING next_seq"
_INSERT_EVENT_SQL = "INSERT INTO events (task_id, seq, time, kind, step, payload) VALUES (?,?,?,?,?,?)"
#: An attempt's usage record, replacing the one of the same task and attempt (:meth:`StateStore.record_usage`).
_RECORD_USAGE_SQL = (
    "INSERT INTO attempt_usage (task_id, attempt, owner, queue, node_id, node_class, workload_type, "
    "model, gpus, start_time, end_time, gpu_seconds, cpu_task_seconds, tokens_generated, tokens_trained, "
    "env_steps, steps, cost) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?) "
    "ON CONFLICT(task_id, attempt) DO UPDATE SET end_time=excluded.end_time, "
    "gpu_seconds=excluded.gpu_seconds, cpu_task_seconds=excluded.cpu_task_seconds, "
    "tokens_generated=excluded.tokens_generated, tokens_trained=excluded.tokens_trained, "
    "env_steps=excluded.env_steps, steps=excluded.steps, cost=excluded.cost"
)


def list_tasks_query(
    states: Iterable[int], limit: int, before: tuple[float, str] | None, owner: str | None
) -> tuple[str, list]:
    """The SQL and parameters of :meth:`StateStore.list_tasks`. It walks the index of schema
    migration 10 (``tasks_owner_created`` for one owner's tasks, ``tasks_created`` for all), so
    a page costs its rows, not the table."""
    sql = f"SELECT {_COLUMNS} FROM tasks"
    where, args = [], []
    if owner is not None:
        where.append("owner = ?")
        args.append(owner)
    states = list(states)
    if states:
        where.append(f"state IN ({','.join('?' * len(states))})")
        args.extend(states)
    if before is not None:
        where.append("(create_time, task_id) < (?, ?)")  # a row value: a range of the index
        args.extend(before)
    if where:
        sql += " WHERE " + " AND ".join(where)
    return sql + " ORDER BY create_time DESC, task_id DESC LIMIT ?", [*args, limit]


def _row_to_task(r) -> TaskRow:
    spec = common_pb2.TaskSpec.FromString(r["spec"])
    ckpt = common_pb2.Checkpoint.FromString(r["latest_checkpoint"]) if r["latest_checkpoint"] else None
    return TaskRow(
        task_id=r["task_id"],
        owner=r["owner"],
        request_id=r["request_id"],
        spec=spec,
        state=r["state"],
        attempt=r["attempt"],
        priority=r["priority"],
        gpu_count=r["gpu_count"],
        max_attempts=r["max_attempts"],
        max_runtime_s=r["max_runtime_s"],
        create_time=r["create_time"],
        update_time=r["update_time"],
        start_time=r["start_time"],
        end_time=r["end_time"],
        not_before=r["not_before"],
        node_id=r["node_id"],
        device_indices=json.loads(r["device_indices"]),
        error=r["error"],
        latest_step=r["latest_step"],
        latest_metrics=json.loads(r["latest_metrics"]),
        latest_checkpoint=ckpt,
        attempt_step=r["attempt_step"],
    )


@dataclass(frozen=True)
class Lease:
    """The leader lease row as read (or just written)."""

    epoch: int
    holder: str  # instance id ("" = never held)
    address: str  # host:port of the leader
    expire_time: float  # unix seconds, the database's clock
    #: Whether the lease is still held: unexpired by the database's clock and, on PostgreSQL, its
    #: leader's lock session alive when it names one (a leader killed is no longer valid at once).
    valid: bool


def _int_or_none(v) -> int | None:
    return None if v is None else int(v)


def _sums(r) -> tuple[float, float, float, float, float, float, int]:
    if r is None:
        return (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0)
    return (*(float(v or 0.0) for v in r[:6]), int(r[6] or 0))


@dataclass(frozen=True)
class UsageRecord:
    """One attempt's accounted usage, as :meth:`StateStore.record_usage` writes it (units: seconds,
    GPUs, tokens, env steps; cost in ``usage.currency``)."""

    task_id: str
    attempt: int
    owner: str
    queue: str
    node_id: str
    node_class: str
    workload_type: str
    model: str
    gpus: int
    start_time: float
    end_time: float
    gpu_seconds: float
    cpu_task_seconds: float
    tokens_generated: float
    tokens_trained: float
    env_steps: float
    steps: int
    cost: float


@dataclass(frozen=True)
class QueueOverride:
    """A quota queue set at run time (``SetQueueQuota``), as :meth:`StateStore.set_queue_override`
    keeps it: applied over the config's ``queues:`` at every start, in ``set_time`` order.
    ``borrowing_*`` None: may borrow any idle quota."""

    name: str
    gpus: int
    cpu_tasks: int
    borrowing_gpus: int | None
    borrowing_cpu_tasks: int | None
    owners: tuple[str, ...]
    set_time: float  # unix seconds
    set_by: str  # owner of the admin key that set it


class StateStore:
    """The state store's interface: everything the scheduler reads and writes, one method per
    question, in SQL shared by both backends (SQLite's dialect: ``?`` placeholders, translated
    for PostgreSQL). Single-threaded use from the event loop.

    A backend provides the connection :attr:`db` (``execute(sql, params)`` returning rows that
    index by position and by column name, and ``executemany(sql, rows)``; the security room
    keeps its tables through it) and
    the transaction hooks ``_begin``/``_commit``/``_commit_writes``/``_rollback``/``_in_transaction``, plus
    :meth:`close` and :meth:`writable`.

    Raises:
        sqlite3.Error, StoreUnavailable: on I/O failure or a database that cannot be reached;
            callers turn it into UNAVAILABLE.
        NotLeader: a write on a store that is not the leader's (a follower; or the leader's after
            it lost its lease: :class:`~opentinker_scheduler.errors.Fenced`).
    """

    #: "sqlite" or "postgres".
    kind = "sql"
    #: SQL expression of the database's clock in unix seconds (float).
    _NOW = ""

    def _setup(self) -> None:
        """Common start: transaction state, roles, the legacy repair of cancelled rows."""
        self._tx_depth = 0
        self._tx_failed = False
        self._tx_fenced = True
        self._audit_rows: list[tuple] = []
        #: Task rows (``task_id`` -> the values of :data:`_UPDATE_TASK_SQL`) and events
        #: (:data:`_INSERT_EVENT_SQL`) of the open transaction not written yet (:meth:`update_task`).
        self._pending_rows: dict[str, tuple] = {}
        self._pending_events: list[tuple] = []
        #: Usage records (:data:`_RECORD_USAGE_SQL`) of the open transaction not written yet
        #: (:meth:`record_usage`).
        self._pending_usage: list[tuple] = []
        #: task_id -> the next event sequence number, for the tasks this store inserted or wrote
        #: (cleared when a transaction rolls back, the role changes or it grows past
        #: :attr:`NEXT_SEQ_CACHE`); a task not here is written with ``RETURNING next_seq``.
        self._next_seq: dict[str, int] = {}
        #: Called before every write transaction starts; the core uses it to open a group commit.
        self.before_write: Callable[[], None] | None = None
        #: "leader", "follower" or "setup" (see the module docstring).
        self.role = "leader"
        #: The leader epoch writes carry (PostgreSQL; None: not fenced, SQLite).
        self.epoch: int | None = None
        #: Where the leader is ("host:port", "" unknown), for a follower's NotLeader.
        self.leader_address = ""
        #: Called (no arguments) when the database refused a write for a newer epoch.
        self.on_fenced: Callable[[], None] | None = None
        self._fill_cancelled_errors()

    def close(self) -> None:
        raise NotImplementedError

    def writable(self) -> bool:
        """Readiness probe: can we write a transaction now?"""
        raise NotImplementedError

    def describe(self) -> str:
        """Where the state lives, for logs (no password)."""
        return self.kind

    # --- roles ------------------------------------------------------------------------------------
    @property
    def read_only(self) -> bool:
        """Writes would be refused now (a follower)."""
        return self.role == "follower"

    def lead(self, epoch: int | None) -> None:
        """Write from now on as the leader of ``epoch`` (None: without fencing)."""
        if self.epoch != epoch:
            self._next_seq.clear()  # another leader may have written in between
        self.role, self.epoch = "leader", epoch

    def follow(self, leader_address: str = "") -> None:
        """Refuse writes from now on (NotLeader naming ``leader_address``)."""
        self.role, self.epoch, self.leader_address = "follower", None, leader_address
        self._next_seq.clear()

    def _check_role(self) -> None:
        if self.role == "follower":
            raise NotLeader(self.leader_address)

    # --- the leader lease ---------------------------------------------------------------------------
    def read_lease(self) -> Lease:
        """The lease row now (read in its own transaction when none is open)."""
        r = self.db.execute(
            f"SELECT epoch, holder, address, expire_time, expire_time > {self._NOW}{self._lock_alive_sql()} "
            "FROM leader_lease WHERE name=?",
            (LEASE_NAME,),
        ).fetchone()
        return Lease(int(r[0]), r[1], r[2], float(r[3]), bool(r[4]))

    def _lease_tx(self):
        """The transaction one lease statement runs in: a write transaction of its own."""
        return StateStore._Tx(self, fenced=False)

    def _lock_alive_sql(self) -> str:
        """A condition (``AND ...``) that the leader's lock session, when the lease names one, is
        alive; SQLite has none (one scheduler)."""
        return ""

    def acquire_lease(self, holder: str, address: str, duration_s: float, lock_pid: int = 0) -> Lease | None:
        """Take the lease for ``duration_s`` seconds with a new epoch, when it has expired, when
        ``holder`` holds it already (a leader that stepped down takes it back with a new epoch), or
        when the caller holds the leader's lock (``lock_pid``: its session's backend pid, 0: no
        lock) and the holder's lease names a lock session: that session has ended, so its leader is
        gone or has lost its lock and steps down. Returns the lease taken, or None when another
        holder's lease is still valid. Its own transaction, never fenced (it is what fencing is
        measured against)."""
        with self._lease_tx():
            cur = self.db.execute(
                f"UPDATE leader_lease SET epoch=epoch+1, holder=?, address=?, expire_time={self._NOW}+?, "
                f"renew_time={self._NOW}, lock_pid=? WHERE name=? "
                f"AND (expire_time <= {self._NOW} OR holder=? OR (? <> 0 AND lock_pid <> 0))",
                (holder, address, duration_s, lock_pid, LEASE_NAME, holder, lock_pid),
            )
            taken = cur.rowcount == 1
        return self.read_lease() if taken else None

    def renew_lease(self, holder: str, epoch: int, duration_s: float, lock_pid: int = 0) -> bool:
        """Extend the lease of ``epoch`` held by ``holder`` to ``duration_s`` seconds from now,
        naming its lock session (``lock_pid``, 0: none); False when it is no longer theirs (taken
        over)."""
        with self._lease_tx():
            cur = self.db.execute(
                f"UPDATE leader_lease SET expire_time={self._NOW}+?, renew_time={self._NOW}, lock_pid=? "
                "WHERE name=? AND holder=? AND epoch=?",
                (duration_s, lock_pid, LEASE_NAME, holder, epoch),
            )
            return cur.rowcount == 1

    def release_lease(self, holder: str, epoch: int) -> None:
        """End the lease of ``epoch`` now (a clean shutdown: a follower takes over at once)."""
        with self._lease_tx():
            self.db.execute(
                f"UPDATE leader_lease SET expire_time={self._NOW} WHERE name=? AND holder=? AND epoch=?",
                (LEASE_NAME, holder, epoch),
            )

    def exclusive(self, name: str):
        """A context manager holding a lock named ``name`` across all schedulers on this store
        (start-up steps two schedulers must not run at once). SQLite: nothing to do, the state
        directory's lock already keeps every other scheduler out."""
        return contextlib.nullcontext()

    def schema_version(self) -> int:
        """The newest migration applied to this store."""
        r = self.db.execute("SELECT MAX(version) FROM schema_migrations").fetchone()
        return int(r[0] or 0)

    # --- tasks ---------------------------------------------------------------------------------
    def insert_task(self, task: TaskRow, first_event: common_pb2.TaskEvent) -> None:
        """Insert a new task with its first event (sequence 1) in one transaction."""
        with self._tx():
            self.db.execute(
                f"INSERT INTO tasks ({_COLUMNS}, next_seq) VALUES ({','.join('?' * 22)}, 2)",
                self._task_values(task),
            )
            self._insert_event(task.task_id, 1, first_event)
            self._next_seq[task.task_id] = 2

    def insert_new_task(self, task: TaskRow, first_event: common_pb2.TaskEvent) -> TaskRow | None:
        """Insert a new task with its first event, unless its owner already has a task with its
        ``request_id``: then nothing is written and that task is returned (a retried submit).
        None when inserted. On PostgreSQL one round trip (a data-modifying CTE), not a lookup
        and two inserts.

        Raises:
            StoreUnavailable: not inserted and no task with that request id (its task id is taken).
        """
        with self._tx():
            inserted = self._insert_task_unless_requested(task, first_event)
            if inserted:
                self._next_seq[task.task_id] = 2
        if inserted:
            return None
        existing = self.find_by_request(task.owner, task.request_id) if task.request_id else None
        if existing is None:
            raise StoreUnavailable(f"state store unavailable: task {task.task_id} was not stored (its id is taken)")
        return existing

    def insert_new_tasks(
        self, items: list[tuple[TaskRow, common_pb2.TaskEvent]]
    ) -> list[TaskRow | StoreUnavailable | None]:
        """:meth:`insert_new_task` for several new tasks in one transaction, in order; a request
        id used by an earlier item is found as used by a later one. On PostgreSQL one statement
        for all of them (:meth:`_insert_tasks_unless_requested`), not one round trip each: a
        group commit's submits are written together (:meth:`~.client_api.ClientApi.submit_grouped`).

        Returns, per item: None when inserted; the task its owner's ``request_id`` already named
        (nothing written for this item); or a :class:`StoreUnavailable` to raise for this item
        alone (not inserted and no task with that request id: its task id is taken).

        Raises:
            StoreUnavailable, sqlite3.Error: the statement itself failed (nothing of it is kept
                once the transaction rolls back).
        """
        if not items:
            return []
        with self._tx():
            return self._new_task_results(items, self._insert_tasks_unless_requested(items))

    def send_new_tasks(self, items: list[tuple[TaskRow, common_pb2.TaskEvent]]) -> concurrent.futures.Future | None:
        """:meth:`insert_new_tasks` without waiting on the event loop, where the backend can (on
        PostgreSQL the INSERT goes out from its committer thread): a
        future to hand to :meth:`new_tasks_sent` once it is done, or None (SQLite, or no group
        transaction open): call :meth:`insert_new_tasks`."""
        return None

    def new_tasks_sent(
        self, items: list[tuple[TaskRow, common_pb2.TaskEvent]], sent: concurrent.futures.Future
    ) -> list[TaskRow | StoreUnavailable | None]:
        """What :meth:`insert_new_tasks` returns, for the INSERT :meth:`send_new_tasks` sent
        (done).

        Raises:
            StoreUnavailable: the statement failed (the group transaction fails with it)."""
        raise NotImplementedError

    def _new_task_results(
        self, items: list[tuple[TaskRow, common_pb2.TaskEvent]], inserted: list[bool]
    ) -> list[TaskRow | StoreUnavailable | None]:
        out: list[TaskRow | StoreUnavailable | None] = []
        for (task, _), ok in zip(items, inserted):
            if ok:
                self._next_seq[task.task_id] = 2
                out.append(None)
                continue
            existing = self.find_by_request(task.owner, task.request_id) if task.request_id else None
            out.append(
                existing
                if existing is not None
                else StoreUnavailable(f"state store unavailable: task {task.task_id} was not stored (its id is taken)")
            )
        return out

    def _insert_tasks_unless_requested(self, items: list[tuple[TaskRow, common_pb2.TaskEvent]]) -> list[bool]:
        """Per item, whether its row and first event went in (False: its request id or task id
        was taken). SQLite runs in this process: one statement each costs no round trip."""
        return [self._insert_task_unless_requested(task, ev) for task, ev in items]

    def _insert_task_unless_requested(self, task: TaskRow, first_event: common_pb2.TaskEvent) -> bool:
        cur = self.db.execute(
            f"INSERT INTO tasks ({_COLUMNS}, next_seq) VALUES ({','.join('?' * 22)}, 2) ON CONFLICT DO NOTHING",
            self._task_values(task),
        )
        if cur.rowcount != 1:
            return False
        self._insert_event(task.task_id, 1, first_event)
        return True

    def update_task(self, task: TaskRow, events: Iterable[common_pb2.TaskEvent] = ()) -> list[common_pb2.TaskEvent]:
        """Write ``task`` back and append ``events`` (sequence numbers assigned here), atomically.
        The spec is not written again: it is stored once, by :meth:`insert_task`, and never changes.

        Within a transaction the row and the events are not written at once: the row waits, the
        newest values of each task only, and the events wait, until the outermost transaction
        ends (or a read of ``tasks``/``events`` on this store comes first), and then go in one
        ``executemany`` each (:meth:`_flush_writes`). A task a group commit moves three times is
        then one ``UPDATE``, and a group of a hundred events one statement (on PostgreSQL one
        pipelined round trip) instead of a hundred. The sequence numbers come from
        :attr:`_next_seq`, this store's own count per task (it is the only writer: the state
        directory's lock, or the leader lease with epoch fencing); a task it does not know yet
        is written at once, with ``RETURNING next_seq``.

        Returns the events with their sequence numbers and times set.

        Raises:
            sqlite3.IntegrityError: events for a task that is not stored.
        """
        events = list(events)
        with self._tx():
            vals = self._task_values(task, spec=False)
            first = self._next_seq.get(task.task_id)
            if first is None:
                self._flush_writes()  # the row read back below must include what waits
                # One statement moves next_seq past the new events and reads where they start.
                rows = self.db.execute(_UPDATE_TASK_RETURNING_SQL, (*vals[1:], len(events), task.task_id)).fetchall()
                if not rows:
                    if events:
                        raise sqlite3.IntegrityError(f"events for task {task.task_id}, which is not stored")
                    return []
                first = rows[0][0] - len(events)
            else:
                self._pending_rows[task.task_id] = (*vals[1:], first + len(events), task.task_id)
            self._next_seq[task.task_id] = first + len(events)
            return [self._insert_event(task.task_id, first + i, ev) for i, ev in enumerate(events)]

    def get_task(self, task_id: str) -> TaskRow | None:
        self._flush_writes()
        r = self.db.execute(f"SELECT {_COLUMNS} FROM tasks WHERE task_id=?", (task_id,)).fetchone()
        return _row_to_task(r) if r else None

    def find_by_request(self, owner: str, request_id: str) -> TaskRow | None:
        self._flush_writes()
        r = self.db.execute(
            f"SELECT {_COLUMNS} FROM tasks WHERE owner=? AND request_id=?", (owner, request_id)
        ).fetchone()
        return _row_to_task(r) if r else None

    def list_tasks(
        self,
        states: Iterable[int] = (),
        *,
        limit: int = 100,
        before: tuple[float, str] | None = None,
        owner: str | None = None,
        held: Callable[[str], TaskRow | None] | None = None,
    ) -> list[TaskRow]:
        """Tasks newest first; ``before`` = (create_time, task_id) of the last row of the previous page;
        ``owner`` = only that owner's tasks (None = everyone's). ``held``: the caller's own row of a
        task id, or None; a row it holds is returned as it is instead of decoded again (the
        core's unfinished tasks)."""
        self._flush_writes()
        out = []
        for r in self.db.execute(*list_tasks_query(states, limit, before, owner)):
            row = held(r["task_id"]) if held is not None else None
            out.append(row if row is not None else _row_to_task(r))
        return out

    def tasks_in_states(self, states: Iterable[int]) -> list[TaskRow]:
        self._flush_writes()
        states = list(states)
        rows = self.db.execute(
            f"SELECT {_COLUMNS} FROM tasks WHERE state IN ({','.join('?' * len(states))}) ORDER BY create_time",
            states,
        )
        return [_row_to_task(r) for r in rows]

    def count_tasks(self, *, owner: str, states: Iterable[int]) -> int:
        """How many of ``owner``'s tasks are in ``states`` (the pending-per-owner limit)."""
        self._flush_writes()
        states = list(states)
        sql = f"SELECT COUNT(*) FROM tasks WHERE owner=? AND state IN ({','.join('?' * len(states))})"
        return int(self.db.execute(sql, (owner, *states)).fetchone()[0])

    def count_by_state(self) -> dict[int, int]:
        self._flush_writes()
        return {r[0]: r[1] for r in self.db.execute("SELECT state, COUNT(*) FROM tasks GROUP BY state")}

    # --- usage accounting (state/usage.py) ---------------------------------------------------
    def record_usage(self, row: "UsageRecord") -> None:
        """Write one attempt's accounted usage (replaces a row of the same task and attempt).

        Inside a transaction the row waits, as task rows and events do (:meth:`update_task`),
        until the transaction ends or a read of ``attempt_usage`` comes first, and then goes in
        one ``executemany`` with the transaction's other records (one per task that ended)."""
        values = (
            row.task_id,
            row.attempt,
            row.owner,
            row.queue,
            row.node_id,
            row.node_class,
            row.workload_type,
            row.model,
            row.gpus,
            row.start_time,
            row.end_time,
            row.gpu_seconds,
            row.cpu_task_seconds,
            row.tokens_generated,
            row.tokens_trained,
            row.env_steps,
            row.steps,
            row.cost,
        )
        with self._tx():
            self._pending_usage.append(values)

    # --- quota queues set at run time (state/core.py set_queue) ------------------------------
    def queue_overrides(self) -> list[QueueOverride]:
        """Every queue override, oldest first (the order they apply in)."""
        rows = self.db.execute(
            "SELECT name, gpus, cpu_tasks, borrowing_gpus, borrowing_cpu_tasks, owners, set_time, set_by "
            "FROM queue_overrides ORDER BY set_time, name"
        )
        return [
            QueueOverride(
                r[0],
                int(r[1]),
                int(r[2]),
                _int_or_none(r[3]),
                _int_or_none(r[4]),
                tuple(json.loads(r[5] or "[]")),
                float(r[6]),
                r[7],
            )  # fmt: skip
            for r in rows
        ]

    def set_queue_override(self, row: QueueOverride) -> None:
        """Write (or replace) the override of queue ``row.name``."""
        with self._tx():
            self.db.execute(
                "INSERT INTO queue_overrides (name, gpus, cpu_tasks, borrowing_gpus, borrowing_cpu_tasks, owners, "
                "set_time, set_by) VALUES (?,?,?,?,?,?,?,?) ON CONFLICT(name) DO UPDATE SET gpus=excluded.gpus, "
                "cpu_tasks=excluded.cpu_tasks, borrowing_gpus=excluded.borrowing_gpus, "
                "borrowing_cpu_tasks=excluded.borrowing_cpu_tasks, owners=excluded.owners, "
                "set_time=excluded.set_time, set_by=excluded.set_by",
                (
                    row.name,
                    row.gpus,
                    row.cpu_tasks,
                    row.borrowing_gpus,
                    row.borrowing_cpu_tasks,
                    json.dumps(list(row.owners)),
                    row.set_time,
                    row.set_by,
                ),  # fmt: skip
            )

    def delete_queue_override(self, name: str) -> None:
        """Remove the override of queue ``name`` (none: nothing happens)."""
        with self._tx():
            self.db.execute("DELETE FROM queue_overrides WHERE name=?", (name,))

    _USAGE_SUMS = (
        "SUM(gpu_seconds), SUM(cpu_task_seconds), SUM(tokens_generated), SUM(tokens_trained), "
        "SUM(env_steps), SUM(cost), COUNT(*)"
    )

    def task_usage(self, task_id: str) -> tuple[float, float, float, float, float, float, int]:
        """Sums over a task's recorded attempts: (GPU-seconds, CPU-task seconds, tokens generated,
        tokens trained, env steps, cost, attempts)."""
        self._flush_writes()
        r = self.db.execute(f"SELECT {self._USAGE_SUMS} FROM attempt_usage WHERE task_id=?", (task_id,)).fetchone()
        return _sums(r)

    def usage_by(self, column: str, *, owner: str | None = None, since: float | None = None) -> dict[str, tuple]:
        """Sums of recorded attempts per ``column`` (``owner`` or ``queue``), only ``owner``'s
        attempts when given, only those assigned at or after ``since`` (unix seconds) when given."""
        self._flush_writes()
        assert column in ("owner", "queue")
        where, args = [], []
        if owner is not None:
            where.append("owner=?")
            args.append(owner)
        if since is not None:
            where.append("start_time>=?")
            args.append(since)
        sql = f"SELECT {column}, {self._USAGE_SUMS} FROM attempt_usage"
        if where:
            sql += " WHERE " + " AND ".join(where)
        rows = self.db.execute(sql + f" GROUP BY {column}", tuple(args))
        return {r[0]: _sums(r[1:]) for r in rows}

    def owner_queues(self, *, owner: str | None = None, since: float | None = None) -> dict[str, str]:
        """owner -> the queue of its latest recorded attempt."""
        self._flush_writes()
        sql, args = "SELECT owner, queue, MAX(end_time) FROM attempt_usage", []
        where = []
        if owner is not None:
            where.append("owner=?")
            args.append(owner)
        if since is not None:
            where.append("start_time>=?")
            args.append(since)
        if where:
            sql += " WHERE " + " AND ".join(where)
        return {r[0]: r[1] for r in self.db.execute(sql + " GROUP BY owner, queue ORDER BY 3", tuple(args))}

    def recent_step_seconds(self, workload_type: str, model: str, *, limit: int = 20) -> list[tuple[float, int, int]]:
        """``(seconds, steps, gpus)`` of the newest recorded attempts of finished work of this
        workload type and model that reported steps (for estimates)."""
        self._flush_writes()
        rows = self.db.execute(
            "SELECT end_time - start_time, steps, gpus FROM attempt_usage WHERE workload_type=? AND model=? "
            "AND steps>0 ORDER BY end_time DESC LIMIT ?",
            (workload_type, model, limit),
        )
        return [(float(r[0]), int(r[1]), int(r[2])) for r in rows]

    # --- events --------------------------------------------------------------------------------
    def events_after(self, task_id: str, after_seq: int, *, limit: int = 1000) -> list[common_pb2.TaskEvent]:
        self._flush_writes()
        rows = self.db.execute(
            "SELECT payload FROM events WHERE task_id=? AND seq>? ORDER BY seq LIMIT ?", (task_id, after_seq, limit)
        )
        return [common_pb2.TaskEvent.FromString(r[0]) for r in rows]

    def metric_points(self, task_id: str, after_step: int = 0) -> list[common_pb2.MetricPoint]:
        """The metric history after ``after_step``, by step, each step once: a step that a resumed
        attempt ran again is its newest report (the event log keeps both)."""
        self._flush_writes()
        rows = self.db.execute(
            "SELECT payload FROM events WHERE task_id=? AND kind='metric' AND step>? ORDER BY seq",
            (task_id, after_step),
        )
        newest = {}
        for r in rows:
            point = common_pb2.TaskEvent.FromString(r[0]).metric
            newest[point.step] = point
        return [newest[step] for step in sorted(newest)]

    # --- nodes ---------------------------------------------------------------------------------
    def upsert_node(self, node_id: str, info: bytes) -> None:
        now = time.time()
        with self._tx():
            self.db.execute(
                "INSERT INTO nodes (node_id, info, first_seen, last_seen) VALUES (?,?,?,?) "
                "ON CONFLICT(node_id) DO UPDATE SET info=excluded.info, last_seen=excluded.last_seen",
                (node_id, info, now, now),
            )

    def forget_node(self, node_id: str) -> None:
        """Drop what is known of ``node_id`` (a node that connects again later is new)."""
        with self._tx():
            self.db.execute("DELETE FROM nodes WHERE node_id=?", (node_id,))

    def node_register(self, node_id: str) -> bytes | None:
        """The serialized ``Register`` a node last connected with, or None for a node never seen."""
        r = self.db.execute("SELECT info FROM nodes WHERE node_id=?", (node_id,)).fetchone()
        return bytes(r[0]) if r else None

    # --- datasets --------------------------------------------------------------------------------
    def add_dataset_owner(self, dataset_id: str, owner: str, name: str = "", size_bytes: int = 0) -> None:
        """Record that ``owner`` uploaded ``dataset_id`` (``size_bytes`` bytes) under ``name``
        (idempotent; the same bytes uploaded by two owners belong to both, each with its own name;
        an owner's later upload of the same bytes renames it)."""
        with self._tx():
            self.db.execute(
                "INSERT INTO dataset_owners (dataset_id, owner, name, size_bytes) VALUES (?,?,?,?) "
                "ON CONFLICT (dataset_id, owner) DO UPDATE SET name=excluded.name, size_bytes=excluded.size_bytes",
                (dataset_id, owner, name, size_bytes),
            )

    def dataset_name(self, dataset_id: str, owner: str) -> str | None:
        """The name ``owner`` gave ``dataset_id`` at upload; None when it is not one of its uploaders
        (or uploaded it before names were recorded per owner)."""
        r = self.db.execute(
            "SELECT name FROM dataset_owners WHERE dataset_id=? AND owner=?", (dataset_id, owner)
        ).fetchone()
        return r[0] if r and r[0] else None

    def dataset_bytes(self, owner: str) -> int:
        """Bytes of the datasets ``owner`` has uploaded (each counted once, shared ones included)."""
        r = self.db.execute(
            "SELECT COALESCE(SUM(size_bytes), 0) FROM dataset_owners WHERE owner=?", (owner,)
        ).fetchone()
        return int(r[0])

    def dataset_visible(self, dataset_id: str, owner: str) -> bool:
        """Whether ``owner`` may use ``dataset_id``: one of its uploaders, or a dataset stored
        before uploads recorded owners (no owner at all)."""
        rows = {r[0] for r in self.db.execute("SELECT owner FROM dataset_owners WHERE dataset_id=?", (dataset_id,))}
        return not rows or owner in rows

    # --- endpoints and checkpoints ----------------------------------------------------------------
    def set_endpoint(self, task_id: str, attempt: int, address: str, openai_address: str = "") -> None:
        """Record the ``host:port`` that ``attempt`` of a task serves on and the base URL of its
        OpenAI API (``""``: none); replaces an older attempt's."""
        with self._tx():
            self.db.execute(
                "INSERT INTO task_endpoints (task_id, attempt, address, openai_address) VALUES (?,?,?,?) "
                "ON CONFLICT(task_id) DO UPDATE SET attempt=excluded.attempt, address=excluded.address, "
                "openai_address=excluded.openai_address",
                (task_id, attempt, address, openai_address),
            )

    def endpoint(self, task_id: str) -> tuple[int, str, str] | None:
        """``(attempt, address, openai_address)`` last recorded for a task, or None."""
        r = self.db.execute(
            "SELECT attempt, address, openai_address FROM task_endpoints WHERE task_id=?", (task_id,)
        ).fetchone()
        return (r[0], r[1], r[2]) if r else None

    # --- gang attempts (state/gangs.py) -------------------------------------------------------
    def set_gang(
        self, task_id: str, attempt: int, port: int, members: Sequence[tuple[str, Sequence[int]]], ended=()
    ) -> None:
        """Record gang ``attempt`` of a task: ``members`` ``[(node id, device indices)]`` (member
        0 first), the rendezvous ``port``, the node ids of members whose worker ended (replaces
        the task's older attempt)."""
        row = (task_id, attempt, port, json.dumps([[n, list(d)] for n, d in members]), json.dumps(sorted(ended)))
        with self._tx():
            self.db.execute(
                "INSERT INTO gang_attempts (task_id, attempt, port, members, ended) VALUES (?,?,?,?,?) "
                "ON CONFLICT(task_id) DO UPDATE SET attempt=excluded.attempt, port=excluded.port, "
                "members=excluded.members, ended=excluded.ended",
                row,
            )

    def forget_gang(self, task_id: str) -> None:
        """The task's gang attempt ended: drop its row."""
        with self._tx():
            self.db.execute("DELETE FROM gang_attempts WHERE task_id=?", (task_id,))

    def gangs(self) -> list[tuple[str, int, int, list[tuple[str, tuple[int, ...]]], set[str]]]:
        """Every recorded gang attempt: ``(task id, attempt, port, members, ended)``."""
        out = []
        for r in self.db.execute("SELECT task_id, attempt, port, members, ended FROM gang_attempts ORDER BY task_id"):
            members = [(str(n), tuple(int(i) for i in d)) for n, d in json.loads(r[3])]
            out.append((r[0], int(r[1]), int(r[2]), members, set(json.loads(r[4]))))
        return out

    def checkpoints(self, task_id: str) -> list[common_pb2.Checkpoint]:
        """Every checkpoint a task recorded that is still in the artifact store, oldest first:
        none from before its newest ``artifacts_deleted`` event of ``DeleteTaskArtifacts``, and
        none that retention or ``DeleteCheckpoint`` deleted (an ``artifacts_deleted`` event names
        its key); each with the ``expire_time`` its newest ``checkpoint_expiry`` event gives it."""
        self._flush_writes()
        rows = self.db.execute(
            "SELECT kind, payload FROM events WHERE task_id=? "
            "AND kind IN ('checkpoint', 'artifacts_deleted', 'checkpoint_expiry') ORDER BY seq",
            (task_id,),
        )
        out: list[common_pb2.Checkpoint] = []
        for kind, payload in rows:
            ev = common_pb2.TaskEvent.FromString(payload)
            if kind == "checkpoint":
                out.append(ev.checkpoint)
            elif kind == "checkpoint_expiry":
                for c in out:
                    if c.artifact.key == ev.checkpoint_expiry.key:
                        c.ClearField("expire_time")
                        if ev.checkpoint_expiry.HasField("expire_time"):
                            c.expire_time.CopyFrom(ev.checkpoint_expiry.expire_time)
            elif ev.artifacts_deleted.keys:
                gone = set(ev.artifacts_deleted.keys)
                out = [c for c in out if not (c.artifact.key and c.artifact.key in gone)]
            else:
                out.clear()
        return out

    def expiring_checkpoints(self) -> list[tuple[str, str, float]]:
        """``(task id, artifact key, expire time in epoch seconds)`` of every checkpoint still
        stored that has an expiry (``SetCheckpointTtl``)."""
        self._flush_writes()
        tasks = [r[0] for r in self.db.execute("SELECT DISTINCT task_id FROM events WHERE kind='checkpoint_expiry'")]
        return [
            (task_id, c.artifact.key, c.expire_time.ToNanoseconds() / 1e9)
            for task_id in tasks
            for c in self.checkpoints(task_id)
            if c.HasField("expire_time")
        ]

    def deleted_checkpoint_keys(self, task_id: str) -> list[str]:
        """Artifact keys of the task's checkpoints that retention or ``DeleteCheckpoint`` deleted,
        oldest first."""
        self._flush_writes()
        rows = self.db.execute(
            "SELECT payload FROM events WHERE task_id=? AND kind='artifacts_deleted' ORDER BY seq", (task_id,)
        )
        return [key for (payload,) in rows for key in common_pb2.TaskEvent.FromString(payload).artifacts_deleted.keys]

    def artifacts_deleted(self, task_id: str) -> common_pb2.TaskEvent | None:
        """The task's newest ``artifacts_deleted`` event of ``DeleteTaskArtifacts`` (not one of
        retention or ``DeleteCheckpoint``, which name their keys), or None."""
        self._flush_writes()
        rows = self.db.execute(
            "SELECT payload FROM events WHERE task_id=? AND kind='artifacts_deleted' ORDER BY seq DESC", (task_id,)
        )
        for (payload,) in rows:
            ev = common_pb2.TaskEvent.FromString(payload)
            if not ev.artifacts_deleted.keys:
                return ev
        return None

    # --- internals -----------------------------------------------------------------------------
    def _fill_cancelled_errors(self) -> None:
        """Give CANCELLED rows with an empty ``error`` (written by schedulers that kept the
        reason only in the event) the error :func:`cancel_error` makes of their CANCELLED event."""
        rows = self.db.execute(
            "SELECT task_id FROM tasks WHERE state=? AND error=''", (common_pb2.TASK_STATE_CANCELLED,)
        ).fetchall()
        if not rows:
            return
        with self._tx():
            for (task_id,) in rows:
                found = self.db.execute(
                    "SELECT payload FROM events WHERE task_id=? AND kind='state' ORDER BY seq DESC LIMIT 1",
                    (task_id,),
                ).fetchone()
                if found is None:
                    continue
                change = common_pb2.TaskEvent.FromString(found[0]).state_change
                if change.to_state != common_pb2.TASK_STATE_CANCELLED:
                    continue
                self.db.execute("UPDATE tasks SET error=? WHERE task_id=?", (cancel_error(change.message), task_id))

    def _insert_event(self, task_id: str, seq: int, ev: common_pb2.TaskEvent) -> common_pb2.TaskEvent:
        """Insert ``ev`` as event ``seq`` of ``task_id`` (the caller has moved ``next_seq`` past it):
        inside a transaction when it ends (:meth:`_flush_writes`), else at once."""
        row = (task_id, seq, *self._event_values(task_id, seq, ev))
        if self._tx_depth:
            self._pending_events.append(row)
        else:
            self.db.execute(_INSERT_EVENT_SQL, row)
        return ev

    def _flush_writes(self) -> None:
        """Write the open transaction's waiting task rows and events now (still inside it), so a
        read on this connection sees them, as it sees the transaction's other writes."""
        for sql, rows in self._take_writes():
            self.db.executemany(sql, rows)

    def _take_writes(self) -> list[tuple[str, list[tuple]]]:
        """The open transaction's waiting writes as ``(sql, rows)`` statements, in the order they
        must run, no longer waiting."""
        out = []
        if self._pending_rows:
            out.append((_UPDATE_TASK_SQL, list(self._pending_rows.values())))
        if self._pending_events:
            out.append((_INSERT_EVENT_SQL, self._pending_events))
        if self._pending_usage:
            out.append((_RECORD_USAGE_SQL, self._pending_usage))
        self._pending_rows, self._pending_events, self._pending_usage = {}, [], []
        return out

    def _forget_writes(self) -> None:
        """A transaction rolled back: what waited is dropped, and the counts of :attr:`_next_seq`
        are no longer known to match the database."""
        self._pending_rows, self._pending_events, self._pending_usage = {}, [], []
        self._next_seq.clear()

    @staticmethod
    def _event_values(task_id: str, seq: int, ev: common_pb2.TaskEvent) -> tuple:
        """Stamp ``ev`` (task id, sequence, time when unset); its ``(time, kind, step, payload)`` columns."""
        ev.task_id = task_id
        ev.sequence = seq
        if ev.HasField("time"):
            at = ev.time.ToNanoseconds() / 1e9
        else:  # now: what FromNanoseconds(time_ns()) sets, without its checks of a time that is valid
            now = time.time_ns()
            ev.time.seconds, ev.time.nanos = divmod(now, 1_000_000_000)
            at = now / 1e9
        kind = ev.WhichOneof("event")
        if kind == "state_change":
            kind = "state"
        step = ev.metric.step if kind == "metric" else (ev.checkpoint.step if kind == "checkpoint" else None)
        return at, kind, step, ev.SerializeToString()

    def _task_values(self, t: TaskRow, *, spec: bool = True) -> tuple:
        """The row's values in :data:`_COLUMNS` order; without ``spec``, that column left out."""
        return (
            t.task_id,
            t.owner,
            t.request_id,
            *((t.spec.SerializeToString(),) if spec else ()),
            t.state,
            t.attempt,
            t.priority,
            t.gpu_count,
            t.max_attempts,
            t.max_runtime_s,
            t.create_time,
            t.update_time,
            t.start_time,
            t.end_time,
            t.not_before,
            t.node_id,
            json.dumps(t.device_indices) if t.device_indices else "[]",
            t.error,
            t.latest_step,
            json.dumps(t.latest_metrics) if t.latest_metrics else "{}",
            t.latest_checkpoint.SerializeToString() if t.latest_checkpoint is not None else None,
            t.attempt_step,
        )

    def batch(self) -> "StateStore._Tx":
        """One transaction around several writes (``with store.batch(): ...``): one commit instead
        of one per write. Nests: only the outermost block commits; an error anywhere inside rolls
        all of it back."""
        return self._tx()

    #: Most tasks :attr:`_next_seq` counts before it starts again (a few MB at most).
    NEXT_SEQ_CACHE = 100_000

    #: Audit rows per INSERT statement (8 parameters each: within SQLite's 999 and far within
    #: PostgreSQL's 65,535).
    AUDIT_ROWS_PER_INSERT = 100

    def add_audit(self, row: tuple) -> None:
        """Add one ``audit_log`` row ``(time, owner, role, key_prefix, action, task_id, outcome,
        detail_json)`` to the open transaction (``with store.batch(): ...``). The rows of a
        transaction are written together, in one multi-row INSERT, just before it commits (on
        PostgreSQL one round trip for a whole group commit instead of one per record), so they
        commit or roll back with the writes of the actions they describe.

        Raises:
            RuntimeError: no transaction is open."""
        if not self._tx_depth:
            raise RuntimeError("add_audit: expected an open transaction (with store.batch(): ...)")
        self._audit_rows.append(row)

    def flush_audit(self) -> None:
        """Write the open transaction's audit rows now (still inside it), so a read of
        ``audit_log`` on this connection sees them, as it sees the transaction's other writes."""
        if self._tx_depth and self._audit_rows:
            rows, self._audit_rows = self._audit_rows, []
            self._write_audit_rows(rows)

    def _write_audit_rows(self, rows: list[tuple]) -> None:
        for sql, params in self._audit_statements(rows):
            self.db.execute(sql, params[0])

    def _audit_statements(self, rows: list[tuple]) -> list[tuple[str, list[tuple]]]:
        """``audit_log`` rows as multi-row INSERTs of :attr:`AUDIT_ROWS_PER_INSERT` rows each:
        ``(sql, [params])`` statements."""
        step = self.AUDIT_ROWS_PER_INSERT
        out = []
        for i in range(0, len(rows), step):
            chunk = rows[i : i + step]
            values = ",".join(["(?,?,?,?,?,?,?,?)"] * len(chunk))
            sql = f"INSERT INTO audit_log ({_AUDIT_COLUMNS}) VALUES {values}"
            out.append((sql, [tuple(v for row in chunk for v in row)]))
        return out

    def transaction(self, *, flush_behind: bool = False) -> "StateStore._Tx":
        """Like :meth:`batch` but without calling ``before_write`` (the group commit's own).

        With ``flush_behind`` the backend may commit without the event loop waiting for it
        (PostgreSQL: the COMMIT goes out from a committer thread); the caller must then wait on
        :meth:`flush_pending` before it acknowledges anything the transaction wrote."""
        return StateStore._Tx(self, flush_behind=flush_behind)

    def settle(self) -> None:
        """Wait until a group commit running off the event loop (if any) has ended, and take
        in its failure (:meth:`commit_in_flight`); at once when none runs."""

    def commit_in_flight(self) -> bool:
        """A group commit is still running off the event loop (PostgreSQL's committer thread):
        the next one waits for it (:mod:`.commit`), and anything that uses the connection before
        its end waits too."""
        return False

    def flush_pending(self) -> concurrent.futures.Future | None:
        """After a ``transaction(flush_behind=True)`` committed: None when it is durable already
        (SQLite), else a future that resolves
        (in another thread) once it is, or fails with
        :class:`~opentinker_scheduler.errors.StoreUnavailable` when that cannot be known."""
        return None

    class _Tx:
        """A (nestable) write transaction. The outermost one checks the role (NotLeader on a
        follower) and begins; at its end it commits, fenced by the epoch when ``fenced`` and the
        store leads with one, or rolls back when anything inside failed."""

        def __init__(self, store: "StateStore", *, fenced: bool = True, flush_behind: bool = False) -> None:
            self.store = store
            self.fenced = fenced
            self.flush_behind = flush_behind

        def __enter__(self):
            s = self.store
            if s._tx_depth == 0:
                if self.fenced:
                    s._check_role()
                s._begin(self.flush_behind)
                s._tx_failed = False
                s._tx_fenced = self.fenced
                s._audit_rows = []
                if len(s._next_seq) > s.NEXT_SEQ_CACHE:
                    s._next_seq.clear()
            s._tx_depth += 1

        def __exit__(self, exc_type, exc, tb):
            s = self.store
            s._tx_depth -= 1
            if exc_type is not None:
                s._tx_failed = True
            if s._tx_depth == 0:
                audit, s._audit_rows = s._audit_rows, []
                if s._tx_failed:
                    s._forget_writes()
                    if s._in_transaction():  # the database may have rolled back already (e.g. disk full)
                        s._rollback()
                    if exc_type is None:
                        s._raise_rolled_back()
                else:
                    try:
                        s._commit_writes(audit, s.epoch if s._tx_fenced and s.role == "leader" else None)
                    except BaseException:
                        s._forget_writes()
                        if s._in_transaction():
                            s._rollback()
                        raise
            return False

    def _tx(self) -> "StateStore._Tx":
        if self.before_write is not None:
            self.before_write()
        return StateStore._Tx(self)

    # --- backend hooks ---------------------------------------------------------------------------
    def _commit_writes(self, audit: list[tuple], epoch: int | None) -> None:
        """Write what waits (:meth:`_flush_writes`) and ``audit``'s rows, then :meth:`_commit`.
        A backend may send them together (PostgreSQL: one pipeline)."""
        self._flush_writes()
        if audit:
            self._write_audit_rows(audit)
        self._commit(epoch)

    def _begin(self, flush_behind: bool = False) -> None:
        """Begin a transaction; ``flush_behind``: its commit need not wait for durability
        (:meth:`transaction`)."""
        raise NotImplementedError

    def _commit(self, epoch: int | None) -> None:
        """Commit the open transaction; with an ``epoch``, only if it still holds the lease."""
        raise NotImplementedError

    def _rollback(self) -> None:
        raise NotImplementedError

    def _in_transaction(self) -> bool:
        raise NotImplementedError

    def _raise_rolled_back(self) -> None:
        raise StoreUnavailable("state store unavailable: transaction rolled back: a write inside it failed")


class StateDirInUse(OSError):
    """Another scheduler process holds the state directory's lock."""


class SqliteStore(StateStore):
    """The embedded backend: SQLite (WAL) in ``<state_dir>/scheduler.db``, locked to this process.

    Raises:
        StateDirInUse: another scheduler holds the state directory.
        SchemaTooNew: the database was migrated by a newer scheduler.
        OSError: the state directory cannot be made or is not a folder.
        sqlite3.Error: on I/O failure; callers turn it into UNAVAILABLE.
    """

    kind = "sqlite"
    _NOW = "((julianday('now') - 2440587.5) * 86400.0)"

    def __init__(self, state_dir: Path) -> None:
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
            self._lock_file = open(state_dir / "scheduler.lock", "a+")
        except OSError as exc:
            what = "not a folder" if state_dir.exists() and not state_dir.is_dir() else (exc.strerror or exc)
            raise OSError(f"state_dir {state_dir}: {what}") from None
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock_file.seek(0)
            holder = self._lock_file.read().strip() or "unknown"
            self._lock_file.close()
            raise StateDirInUse(
                f"state_dir {state_dir} is in use by another scheduler (pid {holder}); "
                "one scheduler per state directory"
            ) from None
        self._lock_file.seek(0)
        self._lock_file.truncate()
        self._lock_file.write(str(os.getpid()))
        self._lock_file.flush()
        self.path = state_dir / "scheduler.db"
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("PRAGMA busy_timeout=5000")
        try:
            self._migrate()
        except BaseException:
            self.close()
            raise
        self._setup()

    def _migrate(self) -> None:
        """Apply the migrations this database lacks (:mod:`.schema`), each in its transaction;
        refuse a newer schema."""
        self.db.executescript(schema.MIGRATIONS_TABLE)
        newest = self.db.execute(schema.NEWEST_MIGRATION_SQL).fetchone()
        for m in schema.pending_migrations(newest):
            self.db.execute("BEGIN IMMEDIATE")
            try:
                for statement in _statements(m.sql):
                    if not schema.sqlite_adds_existing_column(self.db, statement):
                        self.db.execute(statement)
                if m.sqlite_fixup is not None:
                    m.sqlite_fixup(self.db)
                self.db.execute(schema.RECORD_MIGRATION_SQL, schema.applied_row(m))
                self.db.execute("COMMIT")
            except BaseException:
                if self.db.in_transaction:
                    self.db.execute("ROLLBACK")
                raise

    def describe(self) -> str:
        return f"sqlite {self.path}"

    def close(self) -> None:
        self.db.close()
        if not self._lock_file.closed:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()

    def writable(self) -> bool:
        """Readiness probe: can we write a transaction now?"""
        if self._tx_depth:
            return True  # a (group) transaction is open on this connection
        try:
            self.db.execute("BEGIN IMMEDIATE")
            self.db.execute("ROLLBACK")
            return True
        except sqlite3.Error:
            return False

    def _begin(self, flush_behind: bool = False) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def _commit(self, epoch: int | None) -> None:
        # One process holds the state directory: nothing to fence against.
        self.db.execute("COMMIT")

    def _rollback(self) -> None:
        self.db.execute("ROLLBACK")

    def _in_transaction(self) -> bool:
        return self.db.in_transaction

    def _raise_rolled_back(self) -> None:
        raise sqlite3.OperationalError("transaction rolled back: a write inside it failed")


def _statements(script: str) -> list[str]:
    """The statements of a migration script (split at ``;`` ending a line; no ``;`` inside them)."""
    return [part.strip() for part in script.split(";\n") if part.strip() and part.strip() != ";"]
