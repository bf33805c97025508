"""The store interface on both backends: versioned migrations (a newer schema refused), roles
(a follower's writes refused before any SQL), the leader lease and its epoch fencing in the
database, and what a PostgreSQL store does when its connection or its server goes away."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

from opentinker.common.v1 import common_pb2 as C
from opentinker_scheduler.errors import Fenced, NotLeader, StoreUnavailable
from opentinker_scheduler.state import schema
from opentinker_scheduler.state.schema import SchemaTooNew
from opentinker_scheduler.state.store import TaskRow, list_tasks_query

from tests.support.scheduler_core import make_core, spec
from tests.support.stores import committed, current, make_store, take_lead
from tests.support.waiting import wait_for


def _row(task_id: str = "task-a") -> tuple[TaskRow, C.TaskEvent]:
    now = time.time()
    task = TaskRow(
        task_id=task_id,
        owner="u",
        spec=spec(),
        state=C.TASK_STATE_PENDING,
        attempt=1,
        priority=1,
        gpu_count=0,
        max_attempts=3,
        max_runtime_s=None,
        create_time=now,
        update_time=now,
    )
    ev = C.TaskEvent(state_change=C.StateChange(to_state=C.TASK_STATE_PENDING, attempt=1, reason="SUBMITTED"))
    return task, ev


def test_migrations_are_recorded_and_a_reopen_applies_none(tmp_path) -> None:
    store = make_store(tmp_path)
    rows = committed(store, "SELECT version, description FROM schema_migrations ORDER BY version")
    assert [r[0] for r in rows] == [m.version for m in schema.MIGRATIONS]
    assert store.schema_version() == schema.SCHEMA_VERSION
    store.close()
    again = make_store(tmp_path)
    assert committed(again, "SELECT COUNT(*) FROM schema_migrations") == [(len(schema.MIGRATIONS),)]


def test_a_schema_from_a_newer_scheduler_is_refused_clearly(tmp_path) -> None:
    store = make_store(tmp_path)
    newer = schema.SCHEMA_VERSION + 1
    store.db.execute(
        "INSERT INTO schema_migrations (version, description, applied_time, scheduler_version) VALUES (?,?,?,?)",
        (newer, "quotas per queue", time.time(), "9.9.9"),
    )
    store.close()
    with pytest.raises(SchemaTooNew) as info:
        make_store(tmp_path)
    message = str(info.value)
    assert f"schema is version {newer}" in message and "'quotas per queue'" in message
    assert "opentinker 9.9.9" in message and f"understands (version {schema.SCHEMA_VERSION})" in message
    assert isinstance(info.value, OSError)  # the entry point reports it as a failure to start


def test_a_follower_reads_and_refuses_writes_naming_the_leader(tmp_path) -> None:
    core = make_core(tmp_path)
    task = core.api.submit(spec(), owner="u")
    core.store.follow("host-a:8888")
    assert core.store.read_only
    assert core.store.get_task(task.task_id).task_id == task.task_id  # reads still work
    with pytest.raises(NotLeader) as info:
        core.api.submit(spec(), owner="u")
    assert info.value.leader == "host-a:8888" and "the leader is host-a:8888" in str(info.value)
    assert len(core.store.list_tasks()) == 1, "the refused write left nothing behind"
    core.store.lead(core.store.epoch)
    core.api.submit(spec(), owner="u")
    assert len(core.store.list_tasks()) == 2


def test_lease_acquire_renew_release(tmp_path) -> None:
    store = make_store(tmp_path, lead=False)
    first = store.acquire_lease("a", "host-a:1", 30)
    assert first is not None and first.holder == "a" and first.address == "host-a:1" and first.valid
    assert store.acquire_lease("b", "host-b:1", 30) is None, "a valid lease is not taken"
    assert store.renew_lease("a", first.epoch, 30)
    assert not store.renew_lease("a", first.epoch + 1, 30) and not store.renew_lease("b", first.epoch, 30)
    again = store.acquire_lease("a", "host-a:1", 30)  # its own holder takes it back, with a new epoch
    assert again is not None and again.epoch == first.epoch + 1
    store.release_lease("a", again.epoch)
    assert not store.read_lease().valid
    taken = store.acquire_lease("b", "host-b:1", 30)
    assert taken is not None and taken.holder == "b" and taken.epoch == again.epoch + 1
    assert not store.renew_lease("a", again.epoch, 30), "the old epoch cannot renew"


@pytest.mark.postgres_only
def test_a_lease_whose_lock_session_ended_is_taken_over_at_once_and_read_as_dead(tmp_path) -> None:
    """The leader's lock frees when its session ends: the lease, though unexpired, reads as not
    valid (followers name no dead leader), and whoever takes the lock takes the lease, epoch + 1."""
    store = make_store(tmp_path, lead=False)
    old, new = store.lease_channel(), store.lease_channel()
    old_pid = old.take_lock(60)
    first = old.acquire_lease("old", "host-a:1", 3600, old_pid)
    assert old_pid and first is not None and first.valid
    assert new.take_lock(60) == 0, "one session holds the lock"
    assert new.acquire_lease("new", "host-b:1", 3600, 0) is None, "a live leader's lease is not taken"
    seen = new.read_lease()
    assert seen.valid and seen.address == "host-a:1"
    with psycopg.connect(store._conninfo, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (old_pid,))
    wait_for(lambda: not new.read_lease().valid, what="the lease read as dead once its session ended")
    new_pid = new.take_lock(60)
    taken = new.acquire_lease("new", "host-b:1", 3600, new_pid)
    assert new_pid and taken is not None and taken.epoch == first.epoch + 1 and taken.valid
    with pytest.raises(StoreUnavailable):  # its session was ended
        old.renew_lease("old", first.epoch, 3600, old_pid)
    assert not old.lock_held(), "the old session's lock is known gone once its connection broke"
    assert not old.renew_lease("old", first.epoch, 3600, 0), "the old epoch cannot renew"
    new.drop_lock()
    new.db.close()
    old.db.close()


@pytest.mark.postgres_only
def test_the_database_refuses_a_write_of_an_older_epoch(tmp_path) -> None:
    old = make_store(tmp_path, lead=False)
    new = make_store(tmp_path, lead=False)
    lease = old.acquire_lease("old", "host-a:1", 0.2)
    old.lead(lease.epoch)
    fenced = []
    old.on_fenced = lambda: fenced.append(True)
    task, ev = _row("task-before")
    old.insert_task(task, ev)
    while old.read_lease().valid:  # the old leader is stopped; its lease runs out
        time.sleep(0.05)
    taken = new.acquire_lease("new", "host-b:1", 30)
    assert taken is not None and taken.epoch == lease.epoch + 1
    new.lead(taken.epoch)
    task2, ev2 = _row("task-after")
    with pytest.raises(Fenced, match=f"epoch {lease.epoch}, but epoch {taken.epoch} holds the lease"):
        old.insert_task(task2, ev2)
    assert fenced == [True] and old.read_only, "a fenced store steps down"
    assert new.get_task("task-after") is None and new.get_task("task-before") is not None
    new.insert_task(task2, ev2)  # the new leader writes
    assert new.get_task("task-after") is not None


@pytest.mark.postgres_only
def test_a_takeover_waits_for_a_transaction_that_passed_the_fence(tmp_path) -> None:
    """The fence share-locks the lease row until commit: a takeover in between waits for it, so
    a write that passed the fence is never hidden from the new leader's first read."""
    old = make_store(tmp_path, lead=False)
    lease = old.acquire_lease("old", "host-a:1", 0.2)
    old.lead(lease.epoch)
    other = psycopg.connect(old._conninfo, autocommit=True)
    while other.execute("SELECT expire_time > extract(epoch from clock_timestamp()) FROM leader_lease").fetchone()[0]:
        time.sleep(0.05)
    task, ev = _row()
    with old.batch():
        old.insert_task(task, ev)
        # Fence by hand as _commit does, then let a takeover start before the COMMIT.
        old.db.execute(f"SELECT ot_fence({lease.epoch})")
        started = threading.Event()
        result = {}

        def takeover() -> None:
            started.set()
            with psycopg.connect(old._conninfo, autocommit=True) as c:
                c.execute(
                    "UPDATE leader_lease SET epoch=epoch+1, holder='new' WHERE expire_time <= "
                    "extract(epoch from clock_timestamp())"
                )
                result["seen"] = c.execute("SELECT COUNT(*) FROM tasks").fetchone()[0]

        t = threading.Thread(target=takeover)
        t.start()
        started.wait()
        time.sleep(0.3)  # give the takeover the chance to overtake (it must not)
        assert t.is_alive(), "the takeover did not wait for the fenced transaction"
    t.join(10)
    assert result["seen"] == 1, "the new leader's first read misses the old leader's committed write"
    other.close()


@pytest.mark.postgres_only
def test_a_lost_connection_fails_the_whole_transaction_and_the_next_call_reconnects(tmp_path) -> None:
    store = make_store(tmp_path)
    pid = store.db.execute("SELECT pg_backend_pid()").fetchone()[0]
    a, ev_a = _row("task-a")
    b, ev_b = _row("task-b")
    with pytest.raises(StoreUnavailable):
        with store.batch():
            store.insert_task(a, ev_a)
            with psycopg.connect(store._conninfo, autocommit=True) as killer:
                killer.execute("SELECT pg_terminate_backend(%s)", (pid,))
            store.insert_task(b, ev_b)  # the connection is gone: fails, and so does all of the batch
    assert committed(store, "SELECT COUNT(*) FROM tasks") == [(0,)], "part of a failed transaction was committed"
    store.insert_task(b, ev_b)  # a new connection from the pool
    assert store.get_task("task-b") is not None


@pytest.mark.postgres_only
def test_a_database_restart_is_unavailable_then_works_again(tmp_path) -> None:
    store = make_store(tmp_path)
    a, ev_a = _row("task-a")
    store.insert_task(a, ev_a)
    current.server.stop("immediate")
    try:
        with pytest.raises(StoreUnavailable, match="state store unavailable"):
            store.get_task("task-a")
        assert not store.writable()
    finally:
        current.server.start()
    deadline = time.monotonic() + 30
    while not store.writable():  # the pool reconnects
        assert time.monotonic() < deadline, "the store did not reconnect after the restart"
        time.sleep(0.1)
    assert store.get_task("task-a") is not None, "a committed row was lost in the restart"


@pytest.mark.postgres_only
def test_a_silent_network_is_an_error_within_the_call_timeout(tmp_path) -> None:
    from opentinker_scheduler.state.pg_store import PostgresStore

    from tests.support.tcp_proxy import TcpProxy

    make_store(tmp_path)  # the schema, migrated
    proxy = TcpProxy("127.0.0.1", current.server.port)
    store = PostgresStore(
        f"host=127.0.0.1 port={proxy.port} user=postgres dbname=postgres",
        schema_name=current.schemas[str(tmp_path)],
        call_timeout_s=1.0,
        connect_timeout_s=1.0,
    )
    current.opened.append(store)
    try:
        take_lead(store)
        store.get_task("task-a")
        proxy.pause()
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match="did not answer within 1 s"):
            store.get_task("task-a")
        assert time.monotonic() - started < 5, "the call waited far past its timeout"
        proxy.resume()
        deadline = time.monotonic() + 30
        while not store.writable():
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        proxy.close()


@pytest.mark.postgres_only
def test_the_password_comes_from_the_config_and_never_shows(tmp_path, monkeypatch) -> None:
    from opentinker_scheduler.config import SchedulerConfig
    from opentinker_scheduler.config.store import StoreConfig
    from opentinker_scheduler.state.backends import open_store

    admin = psycopg.connect(current.server.dsn(), autocommit=True)
    admin.execute("DROP ROLE IF EXISTS ot_pw")
    admin.execute("CREATE ROLE ot_pw LOGIN PASSWORD 's3cret-Pa55' SUPERUSER")
    # trust auth accepts any password; what matters here is where it travels (never a message).
    monkeypatch.setenv("OT_TEST_DB_PASSWORD", "s3cret-Pa55")
    cfg = SchedulerConfig(
        state_dir=tmp_path,
        store=StoreConfig(
            kind="postgres",
            dsn=f"host=127.0.0.1 port={current.server.port} user=ot_pw dbname=postgres",
            password_env="OT_TEST_DB_PASSWORD",
            schema=current.server.new_schema(),
        ),
    )
    store = open_store(cfg)
    current.opened.append(store)
    assert "s3cret" not in store.describe() and "user=ot_pw" in store.describe()
    assert "s3cret" not in repr(cfg)
    bad = SchedulerConfig(
        state_dir=tmp_path,
        store=StoreConfig(
            kind="postgres", dsn="host=127.0.0.1 port=1 user=x dbname=y", password_env="OT_TEST_DB_PASSWORD"
        ),
    )
    with pytest.raises(OSError) as info:
        open_store(bad)
    assert "cannot connect to PostgreSQL" in str(info.value) and "s3cret" not in str(info.value)
    monkeypatch.delenv("OT_TEST_DB_PASSWORD")
    with pytest.raises(OSError, match="store.password_env: environment variable OT_TEST_DB_PASSWORD is not set"):
        open_store(cfg)
    admin.close()


def test_a_new_task_goes_in_once_per_owner_and_request_id(tmp_path) -> None:
    store = make_store(tmp_path)
    first, ev = _row("task-1")
    first.request_id = "r1"
    assert store.insert_new_task(first, ev) is None
    again, ev2 = _row("task-2")
    again.request_id = "r1"
    existing = store.insert_new_task(again, ev2)  # a retried submit: nothing written
    assert existing is not None and existing.task_id == "task-1"
    assert store.get_task("task-2") is None
    assert committed(store, "SELECT COUNT(*) FROM events WHERE task_id=?", ("task-2",)) == [(0,)]
    events = committed(store, "SELECT seq, kind FROM events WHERE task_id=?", ("task-1",))
    assert events == [(1, "state")]
    other, ev3 = _row("task-3")  # another owner may use the same request id
    other.owner, other.request_id = "v", "r1"
    assert store.insert_new_task(other, ev3) is None
    assert [e.sequence for e in store.events_after("task-3", 0)] == [1]


@pytest.mark.postgres_only
def test_an_error_inside_a_transaction_fails_its_commit_instead_of_a_silent_rollback(tmp_path) -> None:
    # PostgreSQL aborts a transaction at its first error, and answers its COMMIT with a ROLLBACK,
    # not an error: a caller that caught the error must not make the rest look committed.
    store = make_store(tmp_path)
    with pytest.raises(StoreUnavailable, match="rolled back"):
        with store.transaction():
            store.db.execute(
                "INSERT INTO nodes (node_id, info, first_seen, last_seen) VALUES (?,?,?,?)", ("n1", "{}", 0.0, 0.0)
            )
            with pytest.raises(StoreUnavailable):
                store.db.execute("SELECT no_such_column FROM tasks")
    assert committed(store, "SELECT COUNT(*) FROM nodes WHERE node_id=?", ("n1",)) == [(0,)]
    with store.transaction():  # the connection is usable again
        store.db.execute(
            "INSERT INTO nodes (node_id, info, first_seen, last_seen) VALUES (?,?,?,?)", ("n2", "{}", 0.0, 0.0)
        )
    assert committed(store, "SELECT COUNT(*) FROM nodes WHERE node_id=?", ("n2",)) == [(1,)]


def _plan(store, sql: str, args: list) -> str:
    """The query plan of ``sql`` as one text. PostgreSQL is told to avoid a sequential scan it
    would choose for a small table, so the plan shows whether an index can serve the query."""
    if current.name == "sqlite":
        return "\n".join(str(r[-1]) for r in store.db.execute(f"EXPLAIN QUERY PLAN {sql}", args))
    store.db.execute("SET enable_seqscan = off")
    try:
        return "\n".join(str(r[0]) for r in store.db.execute(f"EXPLAIN {sql}", args))
    finally:
        store.db.execute("SET enable_seqscan = on")


def test_a_task_list_page_is_read_from_an_index_without_sorting_the_table(tmp_path) -> None:
    """A ListTasks page, first or later, one owner's or everyone's, walks an index newest first:
    no whole-table scan and no sort, so a page costs its rows however many tasks are stored."""
    core = make_core(tmp_path)
    for owner in ("a", "b"):
        for _ in range(3):
            core.api.submit(spec(), owner=owner)
    last = core.store.list_tasks(limit=2, owner="a")[-1]
    assert [t.owner for t in core.store.list_tasks(limit=9, before=(last.create_time, last.task_id), owner="a")] == [
        "a"
    ], "the next page starts after the previous page's last row"
    for owner, before in (("a", None), ("a", (last.create_time, last.task_id)), (None, None)):
        plan = _plan(core.store, *list_tasks_query((), 101, before, owner))
        if current.name == "sqlite":
            assert "USING INDEX tasks_" in plan and "TEMP B-TREE" not in plan, plan
        else:
            assert "Index Scan Backward using tasks_" in plan and "Sort" not in plan, plan


def test_an_endpoint_keeps_its_openai_url_and_the_next_attempt_replaces_both(tmp_path) -> None:
    store = make_store(tmp_path)
    store.set_endpoint("task-1", 1, "node-1:4000", "http://node-1:4001/v1")
    assert store.endpoint("task-1") == (1, "node-1:4000", "http://node-1:4001/v1")
    store.set_endpoint("task-1", 2, "node-2:4000")  # the next attempt serves no OpenAI API
    assert store.endpoint("task-1") == (2, "node-2:4000", "")
    store.close()
    assert make_store(tmp_path).endpoint("task-1") == (2, "node-2:4000", "")
