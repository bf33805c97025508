"""Durable scheduler state in SQLite (WAL mode) under the configured state directory.

Every task transition is one transaction that updates the ``tasks`` row and appends its event;
it commits before the scheduler acknowledges the RPC or pushes a command, so ``kill -9`` of the
scheduler loses nothing that was acknowledged. WAL with ``synchronous=NORMAL`` survives process
crashes (a power loss may drop the last transactions; set ``synchronous=FULL`` to cover that).

Events are stored as serialized ``opentinker.common.v1.TaskEvent`` messages with a per-task
sequence number starting at 1; metric points are events of kind ``metric``.
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from opentinker.common.v1 import common_pb2

from opentinker_scheduler.policy.placement import share_key

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tasks (
    task_id        TEXT PRIMARY KEY,
    owner          TEXT NOT NULL,
    request_id     TEXT,
    spec           BLOB NOT NULL,         -- serialized opentinker.common.v1.TaskSpec
    state          INTEGER NOT NULL,      -- opentinker.common.v1.TaskState
    attempt        INTEGER NOT NULL,
    priority       INTEGER NOT NULL,
    gpu_count      INTEGER NOT NULL,
    max_attempts   INTEGER NOT NULL,
    max_runtime_s  REAL,
    create_time    REAL NOT NULL,         -- unix seconds
    update_time    REAL NOT NULL,
    start_time     REAL,
    end_time       REAL,
    not_before     REAL NOT NULL DEFAULT 0, -- retry backoff: not placed before this time
    node_id        TEXT NOT NULL DEFAULT '',
    device_indices TEXT NOT NULL DEFAULT '[]',
    error          TEXT NOT NULL DEFAULT '',
    latest_step    INTEGER NOT NULL DEFAULT 0,
    latest_metrics TEXT NOT NULL DEFAULT '{}',
    latest_checkpoint BLOB,               -- serialized Checkpoint
    next_seq       INTEGER NOT NULL DEFAULT 1,
    attempt_step   INTEGER NOT NULL DEFAULT 0 -- highest metric step the current attempt reported
);
CREATE UNIQUE INDEX IF NOT EXISTS tasks_request ON tasks(owner, request_id) WHERE request_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS tasks_state ON tasks(state);
CREATE TABLE IF NOT EXISTS events (
    task_id  TEXT NOT NULL,
    seq      INTEGER NOT NULL,
    time     REAL NOT NULL,
    kind     TEXT NOT NULL,              -- state | metric | checkpoint
    step     INTEGER,
    payload  BLOB NOT NULL,              -- serialized TaskEvent
    PRIMARY KEY (task_id, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS nodes (
    node_id     TEXT PRIMARY KEY,
    info        BLOB NOT NULL,           -- serialized opentinker.node.v1.Register
    first_seen  REAL NOT NULL,
    last_seen   REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS task_endpoints (
    task_id  TEXT PRIMARY KEY,
    attempt  INTEGER NOT NULL,           -- the attempt whose server listens there
    address  TEXT NOT NULL               -- host:port (an inference task's InferenceService)
);
CREATE TABLE IF NOT EXISTS dataset_owners (
    dataset_id  TEXT NOT NULL,           -- sha256:<hex>
    owner       TEXT NOT NULL,           -- an owner who uploaded these bytes
    PRIMARY KEY (dataset_id, owner)
) WITHOUT ROWID;
"""

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
    def share_key(self) -> str | None:
        """GPU-sharing key (:func:`~opentinker_scheduler.policy.placement.share_key`): the base model of
        a LoRA task on GPUs, None for a task that needs its GPUs to itself."""
        return share_key(self.spec.workload_type, self.spec.model, self.gpu_count)


_COLUMNS = (
    "task_id, owner, request_id, spec, state, attempt, priority, gpu_count, max_attempts, max_runtime_s, "
    "create_time, update_time, start_time, end_time, not_before, node_id, device_indices, error, "
    "latest_step, latest_metrics, latest_checkpoint, attempt_step"
)


def _row_to_task(r: sqlite3.Row) -> TaskRow:
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


class StateDirInUse(OSError):
    """Another scheduler process holds the state directory's lock."""


class Store:
    """The scheduler's SQLite database. Single-threaded use from the event loop.

    Raises:
        sqlite3.Error: on I/O failure; callers turn it into UNAVAILABLE.
    """

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
        self.db.executescript(_SCHEMA)
        self._add_missing_columns()
        self._tx_depth = 0
        self._tx_failed = False
        #: Called before every write transaction starts; the core uses it to open a group commit.
        self.before_write: Callable[[], None] | None = None
        self._fill_cancelled_errors()

    def _add_missing_columns(self) -> None:
        """A store written by an older scheduler lacks columns added since; add them (with their
        defaults) so it opens as it is."""
        have = {r["name"] for r in self.db.execute("PRAGMA table_info(tasks)")}
        if "attempt_step" not in have:
            self.db.execute("ALTER TABLE tasks ADD COLUMN attempt_step INTEGER NOT NULL DEFAULT 0")

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

    # --- tasks ---------------------------------------------------------------------------------
    def insert_task(self, task: TaskRow, first_event: common_pb2.TaskEvent) -> None:
        """Insert a new task with its first event (sequence 1) in one transaction."""
        with self._tx():
            self.db.execute(
                f"INSERT INTO tasks ({_COLUMNS}, next_seq) VALUES ({','.join('?' * 22)}, 2)",
                self._task_values(task),
            )
            self._insert_event(task.task_id, 1, first_event)

    def update_task(self, task: TaskRow, events: Iterable[common_pb2.TaskEvent] = ()) -> list[common_pb2.TaskEvent]:
        """Write ``task`` back and append ``events`` (sequence numbers assigned here), atomically.
        The spec is not written again: it is stored once, by :meth:`insert_task`, and never changes.

        Returns the events with their sequence numbers and times set.

        Raises:
            sqlite3.IntegrityError: events for a task that is not stored.
        """
        events = list(events)
        with self._tx():
            vals = self._task_values(task, spec=False)
            # One statement moves next_seq past the new events and reads where they start.
            rows = self.db.execute(
                "UPDATE tasks SET owner=?, request_id=?, state=?, attempt=?, priority=?, gpu_count=?, "
                "max_attempts=?, max_runtime_s=?, create_time=?, update_time=?, start_time=?, end_time=?, "
                "not_before=?, node_id=?, device_indices=?, error=?, latest_step=?, latest_metrics=?, "
                "latest_checkpoint=?, attempt_step=?, next_seq=next_seq+? WHERE task_id=? RETURNING next_seq",
                (*vals[1:], len(events), task.task_id),
            ).fetchall()
            if not events:
                return []
            if not rows:
                raise sqlite3.IntegrityError(f"events for task {task.task_id}, which is not stored")
            first = rows[0][0] - len(events)
            return [self._insert_event(task.task_id, first + i, ev) for i, ev in enumerate(events)]

    def get_task(self, task_id: str) -> TaskRow | None:
        r = self.db.execute(f"SELECT {_COLUMNS} FROM tasks WHERE task_id=?", (task_id,)).fetchone()
        return _row_to_task(r) if r else None

    def find_by_request(self, owner: str, request_id: str) -> TaskRow | None:
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
    ) -> list[TaskRow]:
        """Tasks newest first; ``before`` = (create_time, task_id) of the last row of the previous page;
        ``owner`` = only that owner's tasks (None = everyone's)."""
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
            where.append("(create_time < ? OR (create_time = ? AND task_id < ?))")
            args.extend([before[0], before[0], before[1]])
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY create_time DESC, task_id DESC LIMIT ?"
        args.append(limit)
        return [_row_to_task(r) for r in self.db.execute(sql, args)]

    def tasks_in_states(self, states: Iterable[int]) -> list[TaskRow]:
        states = list(states)
        rows = self.db.execute(
            f"SELECT {_COLUMNS} FROM tasks WHERE state IN ({','.join('?' * len(states))}) ORDER BY create_time",
            states,
        )
        return [_row_to_task(r) for r in rows]

    def count_tasks(self, *, owner: str, states: Iterable[int]) -> int:
        """How many of ``owner``'s tasks are in ``states`` (the pending-per-owner limit)."""
        states = list(states)
        sql = f"SELECT COUNT(*) FROM tasks WHERE owner=? AND state IN ({','.join('?' * len(states))})"
        return int(self.db.execute(sql, (owner, *states)).fetchone()[0])

    def count_by_state(self) -> dict[int, int]:
        return {r[0]: r[1] for r in self.db.execute("SELECT state, COUNT(*) FROM tasks GROUP BY state")}

    # --- events --------------------------------------------------------------------------------
    def events_after(self, task_id: str, after_seq: int, *, limit: int = 1000) -> list[common_pb2.TaskEvent]:
        rows = self.db.execute(
            "SELECT payload FROM events WHERE task_id=? AND seq>? ORDER BY seq LIMIT ?", (task_id, after_seq, limit)
        )
        return [common_pb2.TaskEvent.FromString(r[0]) for r in rows]

    def metric_points(self, task_id: str, after_step: int = 0) -> list[common_pb2.MetricPoint]:
        rows = self.db.execute(
            "SELECT payload FROM events WHERE task_id=? AND kind='metric' AND step>? ORDER BY seq",
            (task_id, after_step),
        )
        return [common_pb2.TaskEvent.FromString(r[0]).metric for r in rows]

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
    def add_dataset_owner(self, dataset_id: str, owner: str) -> None:
        """Record that ``owner`` uploaded ``dataset_id`` (idempotent; the same bytes uploaded by
        two owners belong to both)."""
        with self._tx():
            self.db.execute(
                "INSERT OR IGNORE INTO dataset_owners (dataset_id, owner) VALUES (?,?)", (dataset_id, owner)
            )

    def dataset_visible(self, dataset_id: str, owner: str) -> bool:
        """Whether ``owner`` may use ``dataset_id``: one of its uploaders, or a dataset stored
        before uploads recorded owners (no owner at all)."""
        rows = {r[0] for r in self.db.execute("SELECT owner FROM dataset_owners WHERE dataset_id=?", (dataset_id,))}
        return not rows or owner in rows

    # --- endpoints and checkpoints ----------------------------------------------------------------
    def set_endpoint(self, task_id: str, attempt: int, address: str) -> None:
        """Record the ``host:port`` that ``attempt`` of a task serves on (replaces an older one)."""
        with self._tx():
            self.db.execute(
                "INSERT INTO task_endpoints (task_id, attempt, address) VALUES (?,?,?) "
                "ON CONFLICT(task_id) DO UPDATE SET attempt=excluded.attempt, address=excluded.address",
                (task_id, attempt, address),
            )

    def endpoint(self, task_id: str) -> tuple[int, str] | None:
        """``(attempt, address)`` last recorded for a task, or None."""
        r = self.db.execute("SELECT attempt, address FROM task_endpoints WHERE task_id=?", (task_id,)).fetchone()
        return (r[0], r[1]) if r else None

    def checkpoints(self, task_id: str) -> list[common_pb2.Checkpoint]:
        """Every checkpoint a task recorded, oldest first."""
        rows = self.db.execute(
            "SELECT payload FROM events WHERE task_id=? AND kind='checkpoint' ORDER BY seq", (task_id,)
        )
        return [common_pb2.TaskEvent.FromString(r[0]).checkpoint for r in rows]

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
        """Insert ``ev`` as event ``seq`` of ``task_id`` (the caller has moved ``next_seq`` past it)."""
        ev.task_id = task_id
        ev.sequence = seq
        if not ev.HasField("time"):
            ev.time.FromNanoseconds(time.time_ns())
        kind = ev.WhichOneof("event")
        kind = {"state_change": "state"}.get(kind, kind)
        step = ev.metric.step if kind == "metric" else (ev.checkpoint.step if kind == "checkpoint" else None)
        self.db.execute(
            "INSERT INTO events (task_id, seq, time, kind, step, payload) VALUES (?,?,?,?,?,?)",
            (task_id, seq, ev.time.ToNanoseconds() / 1e9, kind, step, ev.SerializeToString()),
        )
        return ev

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

    def batch(self) -> "Store._Tx":
        """One transaction around several writes (``with store.batch(): ...``): one commit instead
        of one per write. Nests: only the outermost block commits; an error anywhere inside rolls
        all of it back."""
        return self._tx()

    def transaction(self) -> "Store._Tx":
        """Like :meth:`batch` but without calling ``before_write`` (the group commit's own)."""
        return Store._Tx(self)

    class _Tx:
        def __init__(self, store: "Store") -> None:
            self.store = store

        def __enter__(self):
            s = self.store
            if s._tx_depth == 0:
                s.db.execute("BEGIN IMMEDIATE")
                s._tx_failed = False
            s._tx_depth += 1

        def __exit__(self, exc_type, exc, tb):
            s = self.store
            s._tx_depth -= 1
            if exc_type is not None:
                s._tx_failed = True
            if s._tx_depth == 0:
                if s._tx_failed:
                    if s.db.in_transaction:  # SQLite may have rolled back already (e.g. disk full)
                        s.db.execute("ROLLBACK")
                    if exc_type is None:
                        raise sqlite3.OperationalError("transaction rolled back: a write inside it failed")
                else:
                    try:
                        s.db.execute("COMMIT")
                    except BaseException:
                        if s.db.in_transaction:
                            s.db.execute("ROLLBACK")
                        raise
            return False

    def _tx(self) -> "Store._Tx":
        if self.before_write is not None:
            self.before_write()
        return Store._Tx(self)
