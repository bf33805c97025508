"""Group commit on PostgreSQL with synchronous commit: the group commits asynchronously, its WAL is
flushed behind the event loop on a connection of its own (``pg_store._WalFlusher``), and nothing
the group wrote is acknowledged or sent to a node before that flush is done.

A real server (tests/support/postgres.py). The flush is held back by locking the one row it
updates from another session, so the "not yet" states are certain, not timed.
"""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from opentinker.common.v1 import common_pb2 as C
from opentinker_scheduler.errors import StoreUnavailable
from tests.support.scheduler_core import committed_state, drain, pg_group_commit_core, spec, until
from tests.support import stores
from tests.support.stores import committed

pytestmark = pytest.mark.postgres_only


def _blocker(store) -> psycopg.Connection:
    """A session holding the row lock the flush needs (released by its COMMIT)."""
    conn = psycopg.connect(store._conninfo, autocommit=True)
    conn.execute("BEGIN")
    conn.execute("SELECT n FROM wal_flush WHERE id = 1 FOR UPDATE")
    return conn


def test_groups_are_released_after_their_flush_in_commit_order(tmp_path) -> None:
    async def main() -> None:
        core, node = pg_group_commit_core(tmp_path, flush="background")
        first = core.submit(spec(gpus=1), owner="u")
        await core.durable()
        flusher = core.store._flusher
        assert flusher is not None and flusher.flushes >= 1
        blocker = _blocker(core.store)
        try:
            assert core.schedule() == 1
            acked = asyncio.ensure_future(core.durable())
            await until(
                lambda: committed_state(core.store, first.task_id) == C.TASK_STATE_ASSIGNED, "group 1 committed"
            )
            second = core.submit(spec(gpus=1), owner="u")  # a second group on top of the unflushed one
            assert core.schedule() == 1
            await until(
                lambda: committed_state(core.store, second.task_id) == C.TASK_STATE_ASSIGNED, "group 2 committed"
            )
            for _ in range(10):
                await asyncio.sleep(0.01)
            # Both groups are committed, neither is durable: nobody answered, nothing left.
            assert not acked.done()
            assert node.outbox.empty(), "an assignment left before its flush"
            late = asyncio.ensure_future(core.durable())  # nothing open: waits for the newest flush
            await asyncio.sleep(0.05)
            assert not late.done()
        finally:
            blocker.execute("COMMIT")
            blocker.close()
        await acked
        await late
        assert [c.assign_task.task_id for c in drain(node)] == [first.task_id, second.task_id]
        await core.durable()  # all flushed: at once

    asyncio.run(main())


def test_a_failed_flush_fails_its_group_and_reloads_memory(tmp_path) -> None:
    async def main() -> None:
        core, node = pg_group_commit_core(tmp_path, flush="background")
        task = core.submit(spec(gpus=1), owner="u")
        await core.durable()
        blocker = _blocker(core.store)
        try:
            assert core.schedule() == 1
            acked = asyncio.ensure_future(core.durable())
            await until(
                lambda: committed_state(core.store, task.task_id) == C.TASK_STATE_ASSIGNED, "the group committed"
            )

            def flusher_pid():
                rows = blocker.execute(
                    "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%wal_flush%'"
                ).fetchall()
                return rows[0][0] if rows else None

            await until(lambda: flusher_pid() is not None, "the flush waits for the lock")
            blocker.execute("SELECT pg_terminate_backend(%s)", (flusher_pid(),))
            with pytest.raises(StoreUnavailable):
                await acked
        finally:
            blocker.execute("COMMIT")
            blocker.close()
        # Whether the group survived was unknown, so its assignment never left; memory is the
        # store's again (here the commit did survive: the task is assigned and holds its GPU until
        # the node re-announces it or restart_grace passes, as after a restart).
        assert drain(node) == []
        assert core.get(task.task_id).state == C.TASK_STATE_ASSIGNED
        assert task.task_id in node.allocations
        # The next group flushes on a fresh connection.
        other = core.submit(spec(gpus=1), owner="u")
        await core.durable()
        assert committed_state(core.store, other.task_id) == C.TASK_STATE_PENDING

    asyncio.run(main())


def test_inline_flush_commits_synchronously(tmp_path) -> None:
    core, node = pg_group_commit_core(tmp_path, flush="inline")
    assert core.store._flusher is None

    async def main() -> None:
        task = core.submit(spec(gpus=1), owner="u")
        assert core.schedule() == 1
        await core.durable()
        assert committed_state(core.store, task.task_id) == C.TASK_STATE_ASSIGNED
        assert [c.assign_task.task_id for c in drain(node)] == [task.task_id]

    asyncio.run(main())


def test_an_error_inside_a_transaction_fails_its_commit_instead_of_a_silent_rollback(tmp_path) -> None:
    # PostgreSQL aborts a transaction at its first error, and answers its COMMIT with a ROLLBACK,
    # not an error: a caller that caught the error must not make the rest look committed.
    store = stores.make_store(tmp_path)
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
