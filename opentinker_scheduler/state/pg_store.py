"""The PostgreSQL backend of the state store, for several schedulers on one database.

:class:`PostgresStore` runs the SQL of :class:`~opentinker_scheduler.state.store.StateStore` (the
same statements as SQLite, placeholders translated: :func:`~.schema.postgres_query`) on one
connection taken from a psycopg 3 pool, from the event loop; the lease keeper
(:mod:`.leadership`) has its own connection from the same pool (:meth:`PostgresStore.lease_channel`).

Durability is the same promise as SQLite's: a transition commits before it is acknowledged or
pushed. A group commit's round trips go out from a committer thread, :meth:`_PgDb.behind`, the
event loop going on meanwhile, and the group's waiters are released once its COMMIT has answered.
On top, every
transaction of the leader ends with ``SELECT ot_fence(<epoch>); COMMIT`` in one round trip: the
database refuses it when a newer epoch holds the lease (:class:`~opentinker_scheduler.errors.Fenced`),
so a leader that lost its lease (stopped, cut off) can never write over its successor.

No call blocks the event loop for long: each statement has a deadline (``call_timeout_s``) after
which a watchdog thread shuts the connection's socket down, so a database that stops answering
(a network split, a stopped server) is an error, not a frozen scheduler; the server side has
``statement_timeout``, ``lock_timeout`` and ``idle_in_transaction_session_timeout`` (a stopped
scheduler's open transaction does not hold its locks for ever). A lost connection is replaced from
the pool on the next call; a transaction that lost its connection fails as a whole (nothing of it
runs outside it).

Every psycopg error surfaces as :class:`~opentinker_scheduler.errors.StoreUnavailable`
("state store unavailable: ..."), or :class:`~opentinker_scheduler.errors.Fenced`. The password
never appears in a log line or an error: it comes from the environment or a file
(:class:`~opentinker_scheduler.config.store.StoreConfig`), and :meth:`PostgresStore.describe`
shows the DSN without it.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import functools
import json
import math
import os
import re
import socket
import threading
import time
import zlib

import psycopg
import structlog
from psycopg import conninfo as pg_conninfo
from psycopg import pq
from psycopg_pool import ConnectionPool, PoolTimeout

from opentinker_scheduler.errors import Fenced, StoreUnavailable
from opentinker_scheduler.state import schema
from opentinker_scheduler.state.store import (
    _AUDIT_COLUMNS,
    _COLUMNS,
    _INSERT_EVENT_SQL,
    _RECORD_USAGE_SQL,
    _UPDATE_TASK_SQL,
    StateStore,
)

log = structlog.get_logger("opentinker.scheduler")

_SCHEMA_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


def leader_lock_key(schema_name: str) -> tuple[int, int]:
    """The two int4 keys of the leader's advisory lock for the schedulers of ``schema_name``
    (``pg_locks`` shows them as ``classid``, ``objid`` with ``objsubid`` 2)."""
    return zlib.crc32(b"opentinker-leader") & 0x7FFFFFFF, zlib.crc32(schema_name.encode()) & 0x7FFFFFFF


@functools.lru_cache(maxsize=256)
def _row_class(names: tuple[str, ...]) -> type:
    index = {n: i for i, n in enumerate(names)}

    class Row(tuple):
        """A row that indexes by position and by column name (as ``sqlite3.Row``)."""

        __slots__ = ()

        def __getitem__(self, key):
            if isinstance(key, str):
                return tuple.__getitem__(self, index[key])
            return tuple.__getitem__(self, key)

        def keys(self) -> list[str]:
            return list(names)

    return Row


def _row_factory(cursor):
    desc = cursor.description
    if desc is None:
        return tuple
    return _row_class(tuple(d.name for d in desc))


class _Watchdog:
    """One daemon thread that ends calls past their deadline by shutting their socket down (the
    blocked libpq call then fails at once with a broken connection)."""

    _lock = threading.Lock()
    _instance: "_Watchdog | None" = None

    def __init__(self) -> None:
        self.watched: set["_PgDb"] = set()
        threading.Thread(target=self._run, name="pg-watchdog", daemon=True).start()

    @classmethod
    def get(cls) -> "_Watchdog":
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def _run(self) -> None:
        while True:
            time.sleep(0.1)
            now = time.monotonic()
            for db in list(self.watched):
                deadline, fd = db.deadline, db.fd
                if deadline and now > deadline and fd >= 0 and not db.expired:
                    db.expired = True
                    try:
                        s = socket.socket(fileno=os.dup(fd))
                        try:
                            s.shutdown(socket.SHUT_RDWR)
                        finally:
                            s.close()
                    except OSError:
                        pass


class _PgDb:
    """The store's connection as :class:`StateStore` uses it: ``execute(sql, params)`` with ``?``
    placeholders, rows by position or name. Takes a connection from the pool when it has none
    (or its last one broke)."""

    def __init__(self, store: "_PgBase") -> None:
        self.store = store
        self.conn: psycopg.Connection | None = None
        #: Until then (monotonic) a call fails at once: the last wait for a connection failed
        #: (the database is down), so calls do not each block the event loop for the wait.
        self.down_until = 0.0
        self.deadline = 0.0  # monotonic deadline of the call in progress (0: none)
        self.fd = -1
        self.expired = False  # the watchdog ended the call in progress
        #: The connection of the open transaction was lost: every statement until it ends fails.
        self.tx_lost = False
        #: Statements that open the transaction (``BEGIN`` ...), not sent yet: they go out in one
        #: pipeline with the transaction's first statement (a deferred BEGIN: no round trip of its own).
        self.pending_begin: list[str] = []
        #: Calls that waited for the server's answer (each one round trip), for tests and profiling.
        self.round_trips = 0
        #: A group commit running on the committer thread (:meth:`behind`): until
        #: :meth:`settle` has seen it end, the connection is that thread's.
        self.inflight: concurrent.futures.Future | None = None
        self._committer: concurrent.futures.ThreadPoolExecutor | None = None
        _Watchdog.get().watched.add(self)

    def settle(self) -> None:
        """Wait until the commit on the committer thread (if any) has ended, and hand its failure
        to the store (:meth:`_PgBase._behind_failed`), so the connection is the caller's again.
        Called (from the event loop's thread) before anything else uses the connection."""
        f = self.inflight
        if f is None:
            return
        exc = f.exception()  # blocks only while it still runs
        self.inflight = None
        if exc is not None:
            self.store._behind_failed(exc)

    def connection(self) -> psycopg.Connection:
        self.settle()
        if self.conn is not None and (self.conn.broken or self.conn.closed):
            self.discard()
        if self.conn is None:
            if time.monotonic() < self.down_until:
                raise StoreUnavailable(
                    f"state store unavailable: no connection to PostgreSQL ({self.store.describe()})"
                )
            wait = min(self.store.connect_timeout_s, 1.0)
            try:
                self.conn = self.store.pool.getconn(timeout=wait)
            except PoolTimeout:
                self.down_until = time.monotonic() + 0.5
                raise StoreUnavailable(
                    f"state store unavailable: no connection to PostgreSQL within {wait:g} s ({self.store.describe()})"
                ) from None
            self.fd = self.conn.pgconn.socket
        return self.conn

    def discard(self) -> None:
        """Give a (broken) connection back to the pool, which replaces it."""
        conn, self.conn, self.fd = self.conn, None, -1
        if conn is not None:
            try:
                self.store.pool.putconn(conn)
            except Exception:  # noqa: BLE001 - a pool that is closing; the connection is gone anyway
                pass

    def execute(self, sql: str, params=(), *, prepare: bool | None = None, binary: bool = False):
        """Run one statement (``?`` placeholders) within the call deadline; ``binary``: parameters
        and results in PostgreSQL's binary format (arrays: no quoting of each value). An error
        inside a transaction fails the transaction as a whole (PostgreSQL aborts it): it rolls
        back at its end."""
        query = schema.postgres_query(sql) if params else sql
        return self._call(lambda conn: conn.execute(query, params or None, prepare=prepare, binary=binary))

    def executemany(self, sql: str, rows: list[tuple]) -> None:
        """Run one statement (``?`` placeholders) for each of ``rows`` within the call deadline,
        pipelined (psycopg sends them all, then reads the answers: one round trip); errors as
        :meth:`execute`."""
        query = schema.postgres_query(sql)

        def run(conn: psycopg.Connection) -> None:
            with conn.cursor() as cur:
                cur.executemany(query, rows)

        self._call(run)

    def pipelined(self, statements: list[tuple[str, list[tuple] | None]]) -> None:
        """Run ``statements`` in one pipeline (one round trip): each ``(sql, rows)`` is a
        statement with ``?`` placeholders run once per row of ``rows``, or ``(sql, None)`` a
        statement without parameters (one SQL command, never a script). PostgreSQL runs them in
        order; after the first error it skips the rest (an open transaction is then aborted and
        rolls back at its end). Errors as :meth:`execute`."""

        def run(conn: psycopg.Connection) -> None:
            with conn.pipeline():
                for sql, rows in statements:
                    if rows is None:
                        conn.execute(sql, prepare=False)
                    elif rows:
                        with conn.cursor() as cur:
                            cur.executemany(schema.postgres_query(sql), rows)

        self._call(run)

    def behind(
        self, statements: list[tuple[str, list[tuple] | None]], *, rows: bool = False
    ) -> concurrent.futures.Future:
        """Run ``statements`` (as :meth:`pipelined`; a deferred BEGIN first) from a thread of its
        own, the committer, and return at once: a future that resolves once PostgreSQL has
        answered (with every row they returned, ``rows``), or fails with the store's error
        (StoreUnavailable, Fenced). The event loop goes on meanwhile; its next use of the
        connection waits for the end first (:meth:`settle`).

        The statements go as one text, their parameters bound here, on the loop (psycopg's
        ``ClientCursor.mogrify``), in PostgreSQL's simple query protocol: the thread sends it,
        waits and reads the answers, next to no Python of its own, so it seldom waits for the
        interpreter lock the event loop holds (a pipeline of bound statements sent from the
        thread took twice its round trip under load). PostgreSQL runs them in order and stops
        at the first error (the transaction is then aborted and rolls back at its end)."""
        conn = self.connection()
        begin, self.pending_begin = self.pending_begin, []
        mogrify = psycopg.ClientCursor(conn).mogrify
        parts = list(begin)
        for sql, params in statements:
            if params is None:
                parts.append(sql)
            else:
                query = schema.postgres_query(sql)
                parts.extend(mogrify(query, p) for p in params)
        text = ";\n".join(parts)
        if self._committer is None:
            self._committer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pg-commit")

        def run() -> list | None:  # on the committer thread: the connection and this call's own state only
            self.round_trips += 1
            self.expired = False
            self.deadline = time.monotonic() + self.store.call_timeout_s
            try:
                cur = conn.execute(text, prepare=False)
                if not rows:
                    return None
                out = []
                while True:
                    if cur.description is not None:
                        out.extend(cur.fetchall())
                    if not cur.nextset():
                        return out
            except psycopg.Error as exc:
                raise self.error(exc) from exc
            finally:
                self.deadline = 0.0

        self.inflight = self._committer.submit(run)
        return self.inflight

    def _call(self, fn):
        """``fn(connection)`` under the call deadline (the watchdog closes a connection past it);
        a psycopg error fails the open transaction and becomes the store's error (:meth:`failed`).
        A deferred BEGIN (:attr:`pending_begin`) goes out first, in the same pipeline."""
        if self.tx_lost and self.store._tx_depth:
            raise StoreUnavailable("state store unavailable: the connection of this transaction was lost")
        conn = self.connection()
        if self.pending_begin:
            begin, self.pending_begin, inner = self.pending_begin, [], fn

            def fn(conn: psycopg.Connection):
                with conn.pipeline():  # the results reach their cursors when the block ends
                    for sql in begin:
                        conn.execute(sql, prepare=False)
                    return inner(conn)

        self.round_trips += 1
        self.expired = False
        self.deadline = time.monotonic() + self.store.call_timeout_s
        try:
            return fn(conn)
        except psycopg.Error as exc:
            if self.store._tx_depth:
                self.store._tx_failed = True
            raise self.failed(exc) from exc
        finally:
            self.deadline = 0.0

    def executescript(self, script: str) -> None:
        """DDL in the SQLite dialect (translated), as one simple query (a script never joins a
        pipeline: a deferred BEGIN goes out on its own first)."""
        if self.pending_begin:
            begin, self.pending_begin = self.pending_begin, []
            self.pipelined([(sql, None) for sql in begin])
        self.execute(schema.postgres_ddl(script))

    @property
    def begun(self) -> bool:
        """A transaction is open here: begun on the server, or its BEGIN deferred."""
        return bool(self.pending_begin) or self.in_transaction

    @property
    def in_transaction(self) -> bool:
        self.settle()
        return self.conn is not None and self.conn.info.transaction_status != pq.TransactionStatus.IDLE

    @property
    def in_failed_transaction(self) -> bool:
        """The open transaction was aborted by an error (its COMMIT would only roll back)."""
        self.settle()
        return self.conn is not None and self.conn.info.transaction_status == pq.TransactionStatus.INERROR

    def failed(self, exc: psycopg.Error) -> Exception:
        """The store's error for a psycopg error; a broken connection is given back."""
        if getattr(exc, "sqlstate", None) != schema.FENCED_SQLSTATE:
            broken = self.conn is not None and (self.conn.broken or self.conn.closed)
            if broken:
                if self.store._tx_depth:
                    self.tx_lost = True
                self.discard()
        return self.error(exc)

    def error(self, exc: psycopg.Error) -> Exception:
        """The store's error for a psycopg error (Fenced, or StoreUnavailable saying why)."""
        if getattr(exc, "sqlstate", None) == schema.FENCED_SQLSTATE:
            return Fenced(exc.diag.message_primary or str(exc))
        if self.expired:
            return StoreUnavailable(
                f"state store unavailable: PostgreSQL did not answer within {self.store.call_timeout_s:g} s "
                "(connection closed)"
            )
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return StoreUnavailable(f"state store unavailable: {first}")

    def close(self) -> None:
        with contextlib.suppress(Exception):  # its failure was the group's to report
            self.settle()
        if self._committer is not None:
            self._committer.shutdown(wait=True)
        _Watchdog.get().watched.discard(self)
        self.discard()


#: PostgreSQL types of :data:`~opentinker_scheduler.state.store._COLUMNS` (the tasks table), of
#: an event's ``(task_id, time, kind, step, payload)`` and of an audit row, for a group's rows sent
#: as one JSON parameter (:func:`_json_rows`).
_TASK_TYPES = (
    "text text text bytea int8 int8 int8 int8 int8 float8 float8 float8 float8 float8 float8 "
    "text text text int8 text bytea int8"
).split()
_EVENT_TYPES = "text float8 text int8 bytea".split()
_AUDIT_TYPES = "float8 text text text text text text text".split()


def _json_select(types: list[str], alias: str) -> str:
    """The columns of a row ``alias`` of ``jsonb_array_elements``: element ``i`` read as text
    (``->>``) and cast to its column's type; a bytea column travels as base64. jsonb, not json:
    the server parses the parameter once (``->>`` on json parses the row's text again for every
    column: in the same benchmark run PostgreSQL's CPU per submit nearly doubled)."""
    return ", ".join(
        f"decode({alias}->>{i}, 'base64')" if kind == "bytea" else f"({alias}->>{i})::{kind}"
        for i, kind in enumerate(types)
    )


_INSERT_TASKS_SQL = (
    f"WITH t AS (INSERT INTO tasks ({_COLUMNS}, next_seq) "
    f"SELECT {_json_select(_TASK_TYPES, 'r')}, 2 FROM jsonb_array_elements(?::jsonb) AS a (r) "
    "ON CONFLICT DO NOTHING RETURNING task_id), "
    f"e (task_id, time, kind, step, payload) AS (SELECT {_json_select(_EVENT_TYPES, 'r')} "
    "FROM jsonb_array_elements(?::jsonb) AS b (r)) "
    "INSERT INTO events (task_id, seq, time, kind, step, payload) "
    "SELECT e.task_id, 1, e.time, e.kind, e.step, e.payload "
    "FROM e JOIN t ON t.task_id = e.task_id RETURNING task_id"
)
_INSERT_AUDIT_SQL = (
    f"INSERT INTO audit_log ({_AUDIT_COLUMNS}) "
    f"SELECT {_json_select(_AUDIT_TYPES, 'r')} FROM jsonb_array_elements(?::jsonb) AS a (r)"
)


#: A task row written back (:data:`~opentinker_scheduler.state.store._UPDATE_TASK_SQL`'s
#: parameters: every column but ``task_id`` and ``spec``, then ``next_seq`` and ``task_id``).
_UPDATE_TYPES = [*_TASK_TYPES[1:3], *_TASK_TYPES[4:], "int8", "text"]
_UPDATE_COLUMNS = [
    c.split("=")[0].strip() for c in _UPDATE_TASK_SQL.split(" SET ", 1)[1].split(" WHERE ")[0].split(",")
]
_USAGE_COLUMNS = _RECORD_USAGE_SQL.split("(", 1)[1].split(")", 1)[0]
#: An event row with its sequence number (:data:`~opentinker_scheduler.state.store._INSERT_EVENT_SQL`).
_EVENT_ROW_TYPES = ["text", "int8", *_EVENT_TYPES[1:]]
_USAGE_TYPES = (
    "text int8 text text text text text text int8 float8 float8 float8 float8 float8 float8 float8 int8 float8".split()
)
#: The write-behind statements of a transaction (:meth:`StateStore._take_writes`) as one statement
#: each over a jsonb array of their rows, in place of one statement per row (``executemany``
#: sends and reads each one: per row a socket write and psycopg's pipeline bookkeeping).
_JSON_WRITES = {
    _UPDATE_TASK_SQL: (
        f"UPDATE tasks AS t SET {', '.join(f'{c} = x.{c}' for c in _UPDATE_COLUMNS)} "
        f"FROM (SELECT {_json_select(_UPDATE_TYPES, 'r')} FROM jsonb_array_elements(?::jsonb) AS a (r)) "
        f"AS x ({', '.join(_UPDATE_COLUMNS)}, task_id) WHERE t.task_id = x.task_id",
        _UPDATE_TYPES,
    ),
    _INSERT_EVENT_SQL: (
        "INSERT INTO events (task_id, seq, time, kind, step, payload) "
        f"SELECT {_json_select(_EVENT_ROW_TYPES, 'r')} FROM jsonb_array_elements(?::jsonb) AS a (r)",
        _EVENT_ROW_TYPES,
    ),
    _RECORD_USAGE_SQL: (
        f"INSERT INTO attempt_usage ({_USAGE_COLUMNS}) "
        f"SELECT {_json_select(_USAGE_TYPES, 'r')} FROM jsonb_array_elements(?::jsonb) AS a (r) "
        + _RECORD_USAGE_SQL[_RECORD_USAGE_SQL.index("ON CONFLICT") :],
        _USAGE_TYPES,
    ),
}


def _json_float(v) -> float | str | None:
    # JSON has no infinities or NaN; PostgreSQL's float8 input reads them as these words.
    if v is None:
        return None
    v = float(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "Infinity" if v > 0 else "-Infinity"
    return v


def _json_bytes(v) -> str | None:
    return None if v is None else base64.b64encode(v).decode("ascii")


def _json_int(v) -> int | None:
    return None if v is None else int(v)


_JSON_CONVERT = {"float8": _json_float, "bytea": _json_bytes, "int8": _json_int}


def _json_rows(rows: list[tuple], types: list[str]) -> str:
    """``rows`` as one JSON array of arrays, each value as :func:`_json_select` reads it back:
    bytes as base64, non-finite floats as PostgreSQL's words for them, text as JSON strings.

    One text parameter per table whatever the number of rows: the statement stays the same, so
    psycopg prepares it once, and ``json.dumps`` (C) replaces psycopg's per-value Python array
    dumper, which was the largest part of a group's CPU on the scheduler's loop."""
    assert all(len(r) == len(types) for r in rows), "a row of the wrong width"
    convert = [(i, _JSON_CONVERT[kind]) for i, kind in enumerate(types) if kind in _JSON_CONVERT]
    out = []
    for r in rows:
        r = list(r)
        for i, fn in convert:
            r[i] = fn(r[i])
        out.append(r)
    return json.dumps(out, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


class _PgBase(StateStore):
    """The PostgreSQL side of :class:`StateStore`: connection and transaction hooks."""

    kind = "postgres"
    _NOW = "extract(epoch from clock_timestamp())::float8"

    pool: ConnectionPool
    connect_timeout_s: float
    call_timeout_s: float
    _safe_dsn: str
    schema_name: str

    def _lock_alive_sql(self) -> str:
        """The lease names a lock session (``lock_pid``) only while that session holds the
        leader's lock: a leader killed, or whose session the database ended, is not valid."""
        k1, k2 = leader_lock_key(self.schema_name)
        return (
            " AND (lock_pid = 0 OR EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted "
            f"AND pid = lock_pid AND classid = {k1} AND objid = {k2} AND objsubid = 2 "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())))"
        )

    def describe(self) -> str:
        return f"postgres {self._safe_dsn}"

    def writable(self) -> bool:
        """Readiness probe: can we reach the database now (a round trip)?"""
        if self._tx_depth:
            return True
        try:
            self.db.execute("SELECT 1").fetchone()
            return True
        except StoreUnavailable:
            return False

    _behind: concurrent.futures.Future | None = None  # the last group commit's, on the committer thread
    _tx_flush_behind = False  # the open transaction is a group commit: it commits on the committer thread
    _unflushed = False  # the last commit went to the committer thread and nobody has asked for it yet

    def _begin(self, flush_behind: bool = False) -> None:
        # Deferred: BEGIN goes out with the transaction's first statement (_PgDb._call), or with
        # its commit when nothing needed an answer before it; no round trip of its own. (A group
        # commit still running on the committer thread is not waited for here: see _commit_writes.)
        self.db.tx_lost = False
        self._tx_flush_behind = flush_behind
        self.db.pending_begin = ["BEGIN"]

    def settle(self) -> None:
        """See :meth:`StateStore.settle`."""
        self.db.settle()

    def commit_in_flight(self) -> bool:
        """See :meth:`StateStore.commit_in_flight`."""
        f = self.db.inflight
        return f is not None and not f.done()

    def _behind_failed(self, exc: BaseException) -> None:
        """A group's commit on the committer thread failed (on the loop's thread, once seen):
        what waits to be written is dropped (it came after that group), the transaction opened
        since then fails at its end, and a refusal by epoch makes this scheduler a follower,
        as an inline commit's does."""
        self._forget_writes()
        if self._tx_depth:
            self._tx_failed = True
        if isinstance(exc, Fenced):
            self._fenced()

    def _fenced(self) -> None:
        """A commit was refused by epoch: this scheduler no longer leads."""
        self.role, self.epoch = "follower", None
        if self.on_fenced is not None:
            self.on_fenced()

    def _commit(self, epoch: int | None) -> None:
        self._commit_writes([], epoch)

    def _commit_writes(self, audit: list[tuple], epoch: int | None) -> None:
        """The transaction's waiting writes (task rows, events, usage; :meth:`_flush_writes`),
        its ``audit`` rows, the fence (``SELECT ot_fence(epoch)``, refused with
        :class:`~opentinker_scheduler.errors.Fenced` when a newer epoch holds the lease) and the
        COMMIT, in one pipeline: one round trip (a deferred BEGIN too, when nothing went before).
        After any error nothing of it commits."""
        self.db.settle()  # the previous group's commit, when it still runs on the committer thread
        if self._tx_failed:  # it failed: this transaction's writes came after it
            raise StoreUnavailable("state store unavailable: the commit of the group before this one failed")
        if self.db.tx_lost or not self.db.begun:
            raise StoreUnavailable("state store unavailable: the connection of this transaction was lost")
        if self.db.in_failed_transaction:  # PostgreSQL would answer the COMMIT with a ROLLBACK
            raise StoreUnavailable("state store unavailable: the transaction was aborted by an error inside it")
        statements = self._take_writes() + self._audit_statements(audit)
        if epoch is not None:
            statements.append((f"SELECT ot_fence({int(epoch)})", None))
        statements.append(("COMMIT", None))
        if self._tx_flush_behind:
            self._behind = self.db.behind(statements)  # failed: _behind_failed, and this future
            self._unflushed = True
            return
        try:
            self.db.pipelined(statements)
        except Fenced:
            self._fenced()
            raise

    def flush_pending(self):
        """See :meth:`StateStore.flush_pending`: after a group commit, the future of its commit on
        the committer thread; else None."""
        if not self._unflushed:
            return None
        self._unflushed = False
        return self._behind

    def _rollback(self) -> None:
        if self.db.pending_begin:  # nothing was sent: nothing to roll back
            self.db.pending_begin = []
            return
        if self.db.conn is None or self.db.tx_lost:
            return
        try:
            self.db.execute("ROLLBACK")
        except StoreUnavailable:
            pass  # the connection went with it: so did the transaction

    def _in_transaction(self) -> bool:
        return self.db.begun

    def _insert_task_unless_requested(self, task, first_event) -> bool:
        # The task row and its first event in one statement (one round trip); the event only when
        # the row went in (no conflict on the owner's request id).
        t, e = self._task_values(task), self._event_values(task.task_id, 1, first_event)
        rows = self.db.execute(
            f"WITH t AS (INSERT INTO tasks ({_COLUMNS}, next_seq) VALUES ({','.join('?' * len(t))}, 2) "
            "ON CONFLICT DO NOTHING RETURNING task_id) "
            "INSERT INTO events (task_id, seq, time, kind, step, payload) "
            "SELECT task_id, 1, ?::float8, ?::text, ?::bigint, ?::bytea FROM t RETURNING seq",
            (*t, *e),
        ).fetchall()
        return bool(rows)

    #: New tasks per INSERT (a bound on one statement's JSON parameters, two in all).
    TASKS_PER_INSERT = 500

    def _insert_tasks_unless_requested(self, items) -> list[bool]:
        # Every item's row and first event in one statement (one round trip however many):
        # the rows whose request id or task id is free go in, then the events of those rows.
        # A later row naming an earlier row's request id conflicts with it and is left out.
        # The rows travel as one JSON parameter (_json_rows) and the first events as another: the
        # statement's text is the same for any number of rows, so it is prepared once (a
        # multi-row VALUES list was parsed anew each time, a fifth of the CPU per submit; one
        # array per column, 27 in all, spent as much in psycopg's Python array dumper).
        if len(items) == 1:
            return [self._insert_task_unless_requested(*items[0])]
        if len(items) > self.TASKS_PER_INSERT:
            step = self.TASKS_PER_INSERT
            return [
                ok
                for at in range(0, len(items), step)
                for ok in self._insert_tasks_unless_requested(items[at : at + step])
            ]
        went_in = {r[0] for r in self.db.execute(_INSERT_TASKS_SQL, self._new_task_params(items)).fetchall()}
        return [task.task_id in went_in for task, _ in items]

    def _new_task_params(self, items) -> tuple[str, str]:
        """The parameters of :data:`_INSERT_TASKS_SQL` for ``items``: their rows and their first
        events, each as one JSON array (:func:`_json_rows`)."""
        rows, events = [], []
        for task, ev in items:
            rows.append(self._task_values(task))
            events.append((task.task_id, *self._event_values(task.task_id, 1, ev)))
        return _json_rows(rows, _TASK_TYPES), _json_rows(events, _EVENT_TYPES)

    def send_new_tasks(self, items):
        """See :meth:`StateStore.send_new_tasks`: the group's new tasks (:data:`_INSERT_TASKS_SQL`,
        :attr:`TASKS_PER_INSERT` a statement) go out from the committer thread; the future holds
        the ids of the rows that went in."""
        if not (self._tx_flush_behind and self._tx_depth and items):
            return None
        self.db.settle()
        if self._tx_failed:
            return None  # the sync path reports it
        step = self.TASKS_PER_INSERT
        params = [self._new_task_params(items[at : at + step]) for at in range(0, len(items), step)]
        return self.db.behind([(_INSERT_TASKS_SQL, params)], rows=True)

    def new_tasks_sent(self, items, sent):
        """See :meth:`StateStore.new_tasks_sent`."""
        self.db.settle()
        went_in = {r[0] for r in sent.result()}  # its error: the statement failed (the group fails with it)
        with self._tx():
            return self._new_task_results(items, [task.task_id in went_in for task, _ in items])

    def _take_writes(self) -> list[tuple[str, list[tuple]]]:
        """:meth:`StateStore._take_writes`, each statement of several rows as one statement over
        a jsonb array of them (:data:`_JSON_WRITES`). Task rows are one per task already; usage
        records of one attempt twice stay one statement each, in order (one ``ON CONFLICT DO
        UPDATE`` may not touch a row twice)."""
        out = []
        for sql, rows in super()._take_writes():
            as_json = _JSON_WRITES.get(sql) if len(rows) > 1 else None
            if as_json is not None and sql is _RECORD_USAGE_SQL and len({r[:2] for r in rows}) < len(rows):
                as_json = None
            out.append((as_json[0], [(_json_rows(rows, as_json[1]),)]) if as_json else (sql, rows))
        return out

    def _audit_statements(self, rows: list[tuple]) -> list[tuple[str, list[tuple]]]:
        """Every audit row in one INSERT of one JSON parameter (see
        :meth:`_insert_tasks_unless_requested`)."""
        return [(_INSERT_AUDIT_SQL, [(_json_rows(rows, _AUDIT_TYPES),)])] if rows else []

    def close(self) -> None:
        self.db.close()


class PostgresStore(_PgBase):
    """The state in PostgreSQL (``store: {kind: postgres, ...}``).

    Args:
        dsn: libpq connection string or URI without a password (``host=db port=5432 dbname=opentinker
            user=opentinker``).
        password: the password (from ``password_env``/``password_file``), or None (libpq's own
            ``PGPASSWORD``/``.pgpass``, or none).
        schema: the PostgreSQL schema holding the tables (made when missing).
        call_timeout_s: most seconds one statement may take before its connection is closed.
        connect_timeout_s: most seconds to wait for a connection (start-up, and after one broke).
        idle_in_transaction_s: the server ends a session idle this long inside a transaction.
        pool_size: most connections this scheduler holds (the loop's, the lease keeper's, spares).
        synchronous_commit: False = PostgreSQL's ``synchronous_commit=off`` for this scheduler's
            sessions (``store.synchronous_commit``): a commit returns before its WAL is flushed.

    A group commit (:mod:`.commit`) sends its last round trip (its writes, the fence, the COMMIT)
    from a thread of its own on the same connection (:meth:`_PgDb.behind`), so the event loop goes
    on gathering the next group meanwhile. Nothing is acknowledged before it is durable.

    Raises:
        OSError: the database cannot be reached at start (the message names the DSN, never the
            password), or ``schema`` is not a plain identifier.
        SchemaTooNew: the database was migrated by a newer scheduler.
    """

    def __init__(
        self,
        dsn: str,
        *,
        password: str | None = None,
        schema_name: str = "public",
        call_timeout_s: float = 10.0,
        connect_timeout_s: float = 5.0,
        idle_in_transaction_s: float = 5.0,
        pool_size: int = 4,
        application_name: str = "opentinker-scheduler",
        synchronous_commit: bool = True,
    ) -> None:
        if not _SCHEMA_NAME.match(schema_name):
            raise OSError(f"store.schema: expected a plain identifier (letters, digits, _), got {schema_name!r}")
        self.schema_name = schema_name
        self.call_timeout_s = call_timeout_s
        self.connect_timeout_s = connect_timeout_s
        params = pg_conninfo.conninfo_to_dict(dsn)
        params.pop("password", None)
        self._safe_dsn = " ".join(f"{k}={v}" for k, v in sorted(params.items())) + f" schema={schema_name}"
        server_options = " ".join(
            (
                params.get("options", ""),
                f"-c search_path={schema_name}",
                f"-c idle_in_transaction_session_timeout={int(idle_in_transaction_s * 1000)}",
                f"-c statement_timeout={int(call_timeout_s * 1000)}",
                f"-c lock_timeout={int(min(call_timeout_s, 5.0) * 1000)}",
                "" if synchronous_commit else "-c synchronous_commit=off",
            )
        ).strip()
        extra = {
            "options": server_options,
            "connect_timeout": max(1, int(connect_timeout_s)),
            "application_name": application_name,
            "keepalives": 1,
            "keepalives_idle": 5,
            "keepalives_interval": 2,
            "keepalives_count": 3,
        }
        if password is not None:
            extra["password"] = password
        self._conninfo = pg_conninfo.make_conninfo(dsn, **extra)
        try:  # one direct connection first: its error says why (refused, auth, no such database)
            psycopg.connect(self._conninfo).close()
        except psycopg.Error as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise OSError(f"state store: cannot connect to PostgreSQL ({self._safe_dsn}): {first}") from None
        self.pool = ConnectionPool(
            self._conninfo,
            min_size=1,
            max_size=max(2, pool_size),
            open=False,
            kwargs={"autocommit": True, "row_factory": _row_factory, "prepare_threshold": 5},
            # No check on getconn: a check is a round trip outside the watchdog (a silent network
            # would hang it); a dead connection fails its first statement instead, within the deadline.
            # A failed reconnection backs off 1, 2, 4 ... s; giving up after a few seconds lets the
            # next call start a fresh attempt at once, so a database back after a long outage is
            # used within a second or two rather than after the backoff has grown to minutes.
            reconnect_timeout=4.0,
            name="opentinker-store",
        )
        try:
            self.pool.open(wait=True, timeout=connect_timeout_s)
        except PoolTimeout:
            self.pool.close()
            raise OSError(
                f"state store: cannot connect to PostgreSQL ({self._safe_dsn}) within {connect_timeout_s:g} s"
            )
        self.db = _PgDb(self)
        try:
            self._migrate()
            self._setup()
        except BaseException:
            self.close()
            raise
        self.role = "setup"

    def _migrate(self) -> None:
        """Apply the missing migrations in one transaction, under an advisory lock (schedulers
        started at once migrate one after the other); refuse a newer schema."""
        conn = self.db.connection()
        try:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"opentinker-migrate/{self.schema_name}",))
                conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{self.schema_name}"')
                conn.execute(schema.postgres_ddl(schema.MIGRATIONS_TABLE))
                newest = conn.execute(schema.NEWEST_MIGRATION_SQL).fetchone()
                for m in schema.pending_migrations(newest):
                    conn.execute(schema.postgres_ddl(m.sql))
                    if m.postgres:
                        conn.execute(m.postgres)
                    conn.execute(schema.RECORD_MIGRATION_SQL.replace("?", "%s"), schema.applied_row(m))
                    log.info("state store migrated", version=m.version, description=m.description)
        except psycopg.Error as exc:
            raise self.db.failed(exc) from exc

    @contextlib.contextmanager
    def exclusive(self, name: str):
        """A session advisory lock named ``name`` (in this schema) while the block runs."""
        key = f"opentinker/{self.schema_name}/{name}"
        self.db.execute("SELECT pg_advisory_lock(hashtext(?))", (key,))
        try:
            yield
        finally:
            self.db.execute("SELECT pg_advisory_unlock(hashtext(?))", (key,))

    def lease_channel(self) -> "LeaseChannel":
        """A second store view on its own connection, for the lease keeper's thread (the lease
        methods of :class:`StateStore`; never the loop's connection)."""
        return LeaseChannel(self)

    def close(self) -> None:
        self.db.close()
        self.pool.close()


class LeaseChannel(_PgBase):
    """The lease methods of :class:`StateStore` on a connection of their own (one thread's), and
    the leader's lock: a session-level advisory lock on that connection, which PostgreSQL frees
    the moment the session ends (the scheduler killed, its connection closed or terminated).

    The lock needs a real database session: behind a pooler in transaction mode (PgBouncer's
    default) a session lock is taken on whichever server connection runs the statement, so
    schedulers must reach PostgreSQL directly or through a pooler in session mode."""

    def __init__(self, main: PostgresStore, call_timeout_s: float | None = None) -> None:
        self.pool = main.pool
        self.connect_timeout_s = main.connect_timeout_s
        self.call_timeout_s = call_timeout_s or main.call_timeout_s
        self._safe_dsn = main._safe_dsn
        self.schema_name = main.schema_name
        self.db = _PgDb(self)
        self._tx_depth = 0
        self._tx_failed = False
        self._tx_fenced = False
        self._audit_rows = []
        self._pending_rows, self._pending_events, self._pending_usage, self._next_seq = {}, [], [], {}
        self.before_write = None
        self.role = "setup"
        self.epoch = None
        self.leader_address = ""
        self.on_fenced = None
        #: The connection whose session holds the leader's lock (None: not held).
        self._lock_conn: psycopg.Connection | None = None
        self.lock_pid = 0  # that session's backend pid (0: not held)

    def _lease_tx(self):
        """No transaction: each lease statement commits by itself (autocommit), sent outside
        pipeline mode. After a pipelined transaction PostgreSQL 15 did not end the session
        once idle past ``idle_session_timeout``, and the lock of a partitioned leader stayed held."""
        return contextlib.nullcontext()

    def take_lock(self, idle_timeout_s: float) -> int:
        """Try to take the leader's lock on this channel's session; its backend pid, or 0 when
        another session holds it. ``idle_timeout_s``: the database ends this session once it has
        been idle that long (``idle_session_timeout``), so the lock of a scheduler that stopped
        or was cut off is freed even though its connection looks open."""
        if self.lock_held():
            return self.lock_pid
        k1, k2 = leader_lock_key(self.schema_name)
        got, pid = self.db.execute(f"SELECT pg_try_advisory_lock({k1}, {k2}), pg_backend_pid()").fetchone()
        if not got:
            return 0
        self._lock_conn, self.lock_pid = self.db.conn, int(pid)
        with contextlib.suppress(StoreUnavailable):  # PostgreSQL before 14 has no such setting
            self.db.execute(f"SET idle_session_timeout = {int(idle_timeout_s * 1000)}")
        return self.lock_pid

    def lock_held(self) -> bool:
        """Whether this channel's session still holds the lock it took (its connection is the
        same and not broken); no round trip."""
        conn = self._lock_conn
        if conn is not None and (conn is not self.db.conn or conn.broken or conn.closed):
            self._lock_conn, self.lock_pid = None, 0
        return self._lock_conn is not None

    def lock_socket(self) -> int:
        """The socket of the lock's session (-1: no lock): readable when the database writes on
        the idle session, as it does when it ends it."""
        return self.db.fd if self.lock_held() else -1

    def drop_lock(self) -> None:
        """Give the lock back (if held); a connection that fails meanwhile frees it anyway."""
        if not self.lock_held():
            return
        self._lock_conn, self.lock_pid = None, 0
        k1, k2 = leader_lock_key(self.schema_name)
        with contextlib.suppress(StoreUnavailable):
            self.db.execute(f"SELECT pg_advisory_unlock({k1}, {k2})")
            self.db.execute("RESET idle_session_timeout")
