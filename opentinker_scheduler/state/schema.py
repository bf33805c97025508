"""The state store's schema, as numbered migrations shared by both backends (SQLite, PostgreSQL).

Every migration is written once, in the SQLite dialect; :func:`postgres_ddl` turns it into
PostgreSQL's (``BLOB`` -> ``BYTEA``, ``REAL`` -> ``DOUBLE PRECISION``, ``INTEGER`` -> ``BIGINT``,
``TEXT`` -> ``TEXT COLLATE "C"`` so both sort ids byte by byte, ``AUTOINCREMENT`` -> an identity
column), and a migration may add statements for one backend only (``postgres``).

``schema_migrations`` records each applied migration (version, description, time, scheduler
version). A store opens only when its newest version is one this scheduler knows: an older
scheduler refuses a newer schema with :class:`SchemaTooNew`, naming both versions, rather than
writing rows it does not understand. A database written before versioning existed (no
``schema_migrations``) is adopted as it is: migration 1 creates only what is missing, and its
``sqlite_fixup`` adds the columns such a database may lack.

A new table or column is a new migration appended to :data:`MIGRATIONS` (never an edit of an
applied one): ``CREATE TABLE IF NOT EXISTS ...`` or ``ALTER TABLE ... ADD COLUMN ...``. Both are
idempotent on both backends (an added column that exists already is left as it is: PostgreSQL's
``ADD COLUMN IF NOT EXISTS``, and :func:`sqlite_adds_existing_column` on SQLite, which has no such
clause), so a store that carries part of a migration (adopted without ``schema_migrations``, say)
still opens.
"""

from __future__ import annotations

import functools
import re
import time
from dataclasses import dataclass
from typing import Callable

#: Name of the one row of ``leader_lease`` (several schedulers on one database share it).
LEASE_NAME = "scheduler"

#: SQLSTATE the PostgreSQL fence function raises when a newer leader epoch holds the lease.
FENCED_SQLSTATE = "OTF01"


class SchemaTooNew(OSError):
    """The store's schema was migrated by a newer scheduler than this one (an ``OSError``, so
    the entry point reports it as a failure to start, like a state directory in use)."""


@dataclass(frozen=True)
class Migration:
    version: int
    description: str
    #: DDL in the SQLite dialect (both backends; PostgreSQL's via :func:`postgres_ddl`).
    sql: str
    #: Extra statements for PostgreSQL only, in its own dialect.
    postgres: str = ""
    #: Called with the SQLite connection after ``sql``: repairs of databases from before versioning.
    sqlite_fixup: Callable | None = None


def _sqlite_add_missing_columns(db) -> None:
    """A database written by a scheduler from before versioning may lack columns added since;
    add them (with their defaults) so it opens as it is."""
    have = {r[1] for r in db.execute("PRAGMA table_info(tasks)")}
    if "attempt_step" not in have:
        db.execute("ALTER TABLE tasks ADD COLUMN attempt_step INTEGER NOT NULL DEFAULT 0")


_V1 = """
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
CREATE TABLE IF NOT EXISTS api_keys (
    prefix       TEXT PRIMARY KEY,        -- otk_<8 hex>, the public part
    key_hash     TEXT NOT NULL,           -- sha256 hex of the whole key; the key itself is never stored
    owner        TEXT NOT NULL,
    role         TEXT NOT NULL,           -- admin | user | node
    description  TEXT NOT NULL DEFAULT '',
    create_time  REAL NOT NULL,
    revoke_time  REAL,
    expire_time  REAL,                    -- set by a rotation with a grace period
    replaced_by  TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS api_keys_owner ON api_keys (owner);
CREATE TABLE IF NOT EXISTS audit_log (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    time        REAL NOT NULL,            -- unix seconds
    owner       TEXT NOT NULL,
    role        TEXT NOT NULL,
    key_prefix  TEXT NOT NULL,
    action      TEXT NOT NULL,
    task_id     TEXT NOT NULL DEFAULT '',
    outcome     TEXT NOT NULL,            -- OK or a status code name
    detail      TEXT NOT NULL DEFAULT '{}' -- JSON
);
CREATE INDEX IF NOT EXISTS audit_action ON audit_log(action, id);
"""

_V2 = f"""
CREATE TABLE IF NOT EXISTS leader_lease (
    name         TEXT PRIMARY KEY,       -- '{LEASE_NAME}': one row
    epoch        INTEGER NOT NULL,       -- bumps at every change of leader; the leader's writes carry it
    holder       TEXT NOT NULL,          -- instance id of the leader ('' = never held)
    address      TEXT NOT NULL,          -- host:port clients and trainers reach the leader at
    expire_time  REAL NOT NULL,          -- unix seconds by the database's clock
    renew_time   REAL NOT NULL
);
INSERT INTO leader_lease (name, epoch, holder, address, expire_time, renew_time)
    VALUES ('{LEASE_NAME}', 0, '', '', 0, 0) ON CONFLICT DO NOTHING;
"""

#: The fence: every write transaction of a leader ends with ``SELECT ot_fence(<its epoch>)``. It
#: share-locks the lease row, so a takeover (which updates the row) waits for a transaction that
#: passed the fence to commit, and every transaction after a takeover sees the new epoch and is
#: refused (SQLSTATE OTF01): a leader that lost its lease cannot write, whatever it believes.
_V2_POSTGRES = f"""
CREATE OR REPLACE FUNCTION ot_fence(expected BIGINT) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    held BIGINT;
BEGIN
    SELECT epoch INTO held FROM leader_lease WHERE name = '{LEASE_NAME}' FOR SHARE;
    IF held IS DISTINCT FROM expected THEN
        RAISE EXCEPTION 'fenced: this scheduler writes as leader epoch %, but epoch % holds the lease', expected, held
            USING ERRCODE = '{FENCED_SQLSTATE}';
    END IF;
END $$;
"""

#: Each owner's own name for a dataset and its size: a shared (content-addressed) dataset answers
#: every uploader with the name they gave, and an owner's stored bytes are summed for
#: ``limits.max_dataset_bytes_per_owner``. Rows from before carry '' and 0.
_V3 = """
ALTER TABLE dataset_owners ADD COLUMN name TEXT NOT NULL DEFAULT '';
ALTER TABLE dataset_owners ADD COLUMN size_bytes INTEGER NOT NULL DEFAULT 0;
"""

#: Usage accounting (state/usage.py): one row per attempt that left ASSIGNED/RUNNING.
_V4 = """
CREATE TABLE IF NOT EXISTS attempt_usage (
    task_id           TEXT NOT NULL,
    attempt           INTEGER NOT NULL,
    owner             TEXT NOT NULL,
    queue             TEXT NOT NULL,
    node_id           TEXT NOT NULL,
    node_class        TEXT NOT NULL,
    workload_type     TEXT NOT NULL,
    model             TEXT NOT NULL,
    gpus              INTEGER NOT NULL,   -- GPUs held (gpu_count x nodes); 0 = a CPU task
    start_time        REAL NOT NULL,      -- unix seconds: assigned
    end_time          REAL NOT NULL,      -- unix seconds: stopped
    gpu_seconds       REAL NOT NULL,
    cpu_task_seconds  REAL NOT NULL,
    tokens_generated  REAL NOT NULL,
    tokens_trained    REAL NOT NULL,
    env_steps         REAL NOT NULL,
    steps             INTEGER NOT NULL,   -- metric steps the attempt reported
    cost              REAL NOT NULL,
    PRIMARY KEY (task_id, attempt)
);
CREATE INDEX IF NOT EXISTS attempt_usage_by_start ON attempt_usage (start_time);
CREATE INDEX IF NOT EXISTS attempt_usage_by_kind ON attempt_usage (workload_type, model, end_time);
"""

#: Quota queues changed at run time (``AdminService.SetQueueQuota``), applied over the config's
#: ``queues:`` at every start, oldest first, until ``ResetQueueQuota`` removes them.
_V5 = """
CREATE TABLE IF NOT EXISTS queue_overrides (
    name                 TEXT PRIMARY KEY,
    gpus                 INTEGER NOT NULL,   -- nominal GPU quota
    cpu_tasks            INTEGER NOT NULL,   -- nominal quota of CPU tasks at once
    borrowing_gpus       INTEGER,            -- NULL: may borrow any idle quota
    borrowing_cpu_tasks  INTEGER,
    owners               TEXT NOT NULL DEFAULT '[]', -- JSON list of API key owners
    set_time             REAL NOT NULL,      -- unix seconds; overrides apply in this order
    set_by               TEXT NOT NULL DEFAULT '' -- owner of the admin key that set it
);
"""

#: Gang attempts (state/gangs.py): one row per gang task's assigned attempt, written with its
#: ASSIGNED transition, so that a restarted scheduler knows every member (a restart kills no gang).
_V6 = """
CREATE TABLE IF NOT EXISTS gang_attempts (
    task_id   TEXT PRIMARY KEY,
    attempt   INTEGER NOT NULL,
    port      INTEGER NOT NULL,       -- rendezvous port on member 0
    members   TEXT NOT NULL,          -- JSON [[node id, [device index, ...]], ...], member 0 first
    ended     TEXT NOT NULL DEFAULT '[]' -- JSON [node id, ...]: members whose worker ended
);
"""

#: A table no code uses now. Applied migrations never change, so it stays in the schema.
_V7 = """
CREATE TABLE IF NOT EXISTS wal_flush (
    id  INTEGER PRIMARY KEY,
    n   INTEGER NOT NULL DEFAULT 0      -- how many flushes (only its WAL record matters)
);
INSERT INTO wal_flush (id, n) VALUES (1, 0) ON CONFLICT (id) DO NOTHING;
"""

#: Secrets the schedulers on one store sign with (state/worker_credentials.py: attempt
#: credentials), so a new leader accepts what the old one issued.
_V8 = """
CREATE TABLE IF NOT EXISTS signing_secrets (
    name    TEXT PRIMARY KEY,
    secret  TEXT NOT NULL               -- hex
);
"""

#: The leader's lock session (state/leadership.py): the PostgreSQL backend pid of the session that
#: holds the leader's advisory lock, 0 when the leader holds none. Followers read the leader as
#: alive only while that session holds the lock, and may take over at once when it does not.
_V9 = """
ALTER TABLE leader_lease ADD COLUMN lock_pid INTEGER NOT NULL DEFAULT 0;
"""

#: ListTasks reads a page newest first (``ORDER BY create_time DESC, task_id DESC``), one owner's
#: or everyone's. These indexes let it walk to the page's rows instead of reading and sorting the
#: whole table for each page.
_V10 = """
CREATE INDEX IF NOT EXISTS tasks_owner_created ON tasks(owner, create_time, task_id);
CREATE INDEX IF NOT EXISTS tasks_created ON tasks(create_time, task_id);
"""

#: The base URL of the OpenAI-compatible API an inference task's attempt serves beside its
#: InferenceService (``Task.openai_endpoint``); empty when it serves none.
_V11 = """
ALTER TABLE task_endpoints ADD COLUMN openai_address TEXT NOT NULL DEFAULT '';
"""

MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "tasks, events, nodes, endpoints, dataset owners, API keys, audit log",
        _V1,
        sqlite_fixup=_sqlite_add_missing_columns,
    ),
    Migration(2, "leader lease with an epoch (several schedulers on one database; fencing)", _V2, _V2_POSTGRES),
    Migration(3, "dataset names and sizes per owner", _V3),
    Migration(4, "usage accounting per attempt (GPU-seconds, tokens, env steps, cost)", _V4),
    Migration(5, "quota queues set at run time (overrides of the config, kept across restarts)", _V5),
    Migration(6, "gang attempts: members, devices and rendezvous port (kept across a restart)", _V6),
    Migration(7, "a row whose update flushes the WAL of asynchronously committed groups (PostgreSQL)", _V7),
    Migration(8, "signing secrets (attempt credentials of task workers)", _V8),
    Migration(9, "the leader's lock session in the leader lease (failover when it ends)", _V9),
    Migration(10, "task list indexes: newest first, per owner and in all", _V10),
    Migration(11, "the OpenAI API base URL of a task's endpoint", _V11),
)

#: The newest schema version this scheduler knows.
SCHEMA_VERSION = MIGRATIONS[-1].version

MIGRATIONS_TABLE = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    version            INTEGER PRIMARY KEY,
    description        TEXT NOT NULL,
    applied_time       REAL NOT NULL,     -- unix seconds
    scheduler_version  TEXT NOT NULL DEFAULT ''
);
"""


def scheduler_version() -> str:
    """This scheduler's package version, recorded with each migration it applies."""
    from importlib import metadata

    try:
        return metadata.version("opentinker")
    except metadata.PackageNotFoundError:  # pragma: no cover - a source tree
        return "dev"


def too_new(found: int, description: str, by: str) -> SchemaTooNew:
    """The refusal of a store at schema ``found`` (> :data:`SCHEMA_VERSION`)."""
    who = f" by opentinker {by}" if by else ""
    return SchemaTooNew(
        f"the state store's schema is version {found} ({description!r}, applied{who}), newer than this "
        f"scheduler understands (version {SCHEMA_VERSION}); run a scheduler at least as new as the one "
        "that migrated it, or restore the store from a backup taken before that upgrade"
    )


#: The newest applied migration's row: ``(version, description, scheduler_version)`` or none.
NEWEST_MIGRATION_SQL = (
    "SELECT version, description, scheduler_version FROM schema_migrations ORDER BY version DESC LIMIT 1"
)

#: Records one applied migration; its parameters are :func:`applied_row`'s (``?`` placeholders:
#: PostgreSQL callers swap them for ``%s``).
RECORD_MIGRATION_SQL = (
    "INSERT INTO schema_migrations (version, description, applied_time, scheduler_version) VALUES (?,?,?,?)"
)


def pending_migrations(newest: tuple | None) -> tuple[Migration, ...]:
    """The migrations a store lacks, oldest first, given its :data:`NEWEST_MIGRATION_SQL` row
    (None: a new store, every migration).

    Raises:
        SchemaTooNew: the store is at a version newer than :data:`SCHEMA_VERSION`.
    """
    if newest is not None and newest[0] > SCHEMA_VERSION:
        raise too_new(newest[0], newest[1], newest[2])
    done = newest[0] if newest is not None else 0
    return tuple(m for m in MIGRATIONS if m.version > done)


def applied_row(m: Migration) -> tuple:
    """:data:`RECORD_MIGRATION_SQL`'s parameters for ``m``, applied now by this scheduler."""
    return (m.version, m.description, time.time(), scheduler_version())


_COMMENT = re.compile(r"--[^\n]*")


@functools.lru_cache(maxsize=64)
def postgres_ddl(sql: str) -> str:
    """SQLite DDL as PostgreSQL DDL (see the module docstring for the rules)."""
    out = _COMMENT.sub("", sql)
    out = re.sub(r"\bINTEGER PRIMARY KEY AUTOINCREMENT\b", "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY", out)
    out = re.sub(r"\)\s*WITHOUT ROWID", ")", out)
    out = re.sub(r"\bBLOB\b", "BYTEA", out)
    out = re.sub(r"\bREAL\b", "DOUBLE PRECISION", out)
    out = re.sub(r"\bINTEGER\b", "BIGINT", out)
    out = re.sub(r"\bTEXT\b", 'TEXT COLLATE "C"', out)
    out = re.sub(r"\bADD COLUMN (?!IF NOT EXISTS)", "ADD COLUMN IF NOT EXISTS ", out)
    return out


_ADD_COLUMN = re.compile(r"^\s*ALTER\s+TABLE\s+(\w+)\s+ADD\s+COLUMN\s+(\w+)", re.I)


def sqlite_adds_existing_column(db, statement: str) -> bool:
    """Whether ``statement`` is an ``ALTER TABLE t ADD COLUMN c`` whose column ``t.c`` exists
    already in SQLite database ``db`` (the migration then skips it)."""
    m = _ADD_COLUMN.match(statement)
    return bool(m) and any(r[1] == m.group(2) for r in db.execute(f'PRAGMA table_info("{m.group(1)}")'))


@functools.lru_cache(maxsize=4096)
def postgres_query(sql: str) -> str:
    """A statement with SQLite's ``?`` placeholders as one with psycopg's ``%s`` (a literal ``%``
    doubled). The store's SQL has no ``?`` inside string literals."""
    return sql.replace("%", "%%").replace("?", "%s")
