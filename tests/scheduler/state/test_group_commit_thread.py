"""Group commit on PostgreSQL: a group's last round
trip (its writes, the fence, the COMMIT) and a group's INSERT of new tasks go out from the
committer thread, the event loop gathering the next group meanwhile; nothing a group wrote is
acknowledged or sent to a node before its COMMIT has answered, and a commit that fails there
fails its group and the group opened since (built on it), and memory is read back.

A real server (tests/support/postgres.py). A commit is held back by a row lock another session
holds on the task row it updates, so the "not yet" states are certain, not timed.
"""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from opentinker.common.v1 import common_pb2 as C
from opentinker_scheduler.errors import Fenced, StoreUnavailable
from tests.support.scheduler_core import committed_state, drain, pg_group_commit_core, spec, until
from tests.support.stores import committed

pytestmark = pytest.mark.postgres_only


class _RowLock:
    """Another session holding ``task_id``'s row lock: a group that updates the row waits."""

    def __init__(self, store, task_id: str) -> None:
        self.conn = psycopg.connect(store._conninfo, autocommit=True)
        # pg_stat_activity read inside a transaction is a snapshot: it is read on its own session.
        self.watch = psycopg.connect(store._conninfo, autocommit=True)
        self.conn.execute("BEGIN")
        self.conn.execute("SELECT 1 FROM tasks WHERE task_id = %s FOR UPDATE", (task_id,))

    def waiter_pid(self):
        rows = self.watch.execute(
            "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%UPDATE tasks%'"
        ).fetchall()
        return rows[0][0] if rows else None

    def release(self) -> None:
        if not self.conn.closed:
            self.conn.execute("COMMIT")
            self.conn.close()
            self.watch.close()


async def _assignment_held(core):
    """A committed PENDING task, then a group that assigns it, its COMMIT sent from the thread
    and held back by :class:`_RowLock`: ``(task, lock, the group's durable() future)``."""
    first = core.api.submit(spec(gpus=1), owner="u")
    await core.durable()
    lock = _RowLock(core.store, first.task_id)
    assert core.schedule() == 1  # the assignment's UPDATE waits for the row lock
    acked = asyncio.ensure_future(core.durable())
    await until(lambda: lock.waiter_pid() is not None, "the group's COMMIT went out and waits")
    return first, lock, acked


def test_a_groups_commit_goes_out_from_its_thread_and_releases_it_after_the_answer(tmp_path) -> None:
    async def main() -> None:
        core, node = pg_group_commit_core(tmp_path)
        first, lock, acked = await _assignment_held(core)
        try:
            assert core.store.commit_in_flight()
            # The loop goes on: a submit joins the next group, whose commit waits for this one.
            later = asyncio.ensure_future(core.api.submit_grouped(spec(gpus=1), owner="u"))
            for _ in range(20):  # the loop runs meanwhile: these sleeps end
                await asyncio.sleep(0.01)
            assert not acked.done() and not later.done()
            assert node.outbox.empty(), "an assignment left before its commit answered"
            assert committed_state(core.store, first.task_id) == C.TASK_STATE_PENDING
        finally:
            lock.release()
        await acked
        second = await later
        await core.durable()
        assert committed_state(core.store, first.task_id) == C.TASK_STATE_ASSIGNED
        assert committed_state(core.store, second.task_id) == C.TASK_STATE_ASSIGNED
        assert [c.assign_task.task_id for c in drain(node)] == [first.task_id, second.task_id]
        assert not core.store.commit_in_flight()

    asyncio.run(main())


def test_a_commit_failing_on_its_thread_fails_its_group_and_the_one_opened_since(tmp_path) -> None:
    async def main() -> None:
        core, node = pg_group_commit_core(tmp_path)
        first, lock, acked = await _assignment_held(core)
        try:
            later = asyncio.ensure_future(core.api.submit_grouped(spec(gpus=1), owner="u"))  # built on the first
            await asyncio.sleep(0.05)
            lock.conn.execute("SELECT pg_terminate_backend(%s)", (lock.waiter_pid(),))
            with pytest.raises(StoreUnavailable):
                await acked
            with pytest.raises(StoreUnavailable):
                await later
        finally:
            lock.release()
        # Nothing of either group was kept or sent; memory is the store's again.
        assert drain(node) == []
        assert committed_state(core.store, first.task_id) == C.TASK_STATE_PENDING
        assert core.api.get(first.task_id).state == C.TASK_STATE_PENDING
        assert first.task_id not in node.allocations
        assert committed(core.store, "SELECT COUNT(*) FROM tasks") == [(1,)]
        # The next group goes out on a fresh connection.
        assert core.schedule() == 1
        await core.durable()
        assert committed_state(core.store, first.task_id) == C.TASK_STATE_ASSIGNED
        assert [c.assign_task.task_id for c in drain(node)] == [first.task_id]

    asyncio.run(main())


def test_a_commit_refused_by_a_newer_epoch_on_its_thread_makes_the_scheduler_a_follower(tmp_path) -> None:
    async def main() -> None:
        core, node = pg_group_commit_core(tmp_path)
        first, lock, acked = await _assignment_held(core)
        try:
            # A newer leader took the lease meanwhile (as a takeover does: the lease row's epoch).
            lock.conn.execute("UPDATE leader_lease SET epoch = epoch + 1, holder = 'scheduler-b'")
            lock.release()
            with pytest.raises(Fenced):
                await acked
        finally:
            lock.release()
        assert core.store.role == "follower"
        assert drain(node) == [None]  # no assignment; the node's stream is closed (None ends it)
        assert committed_state(core.store, first.task_id) == C.TASK_STATE_PENDING

    asyncio.run(main())
