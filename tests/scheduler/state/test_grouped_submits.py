"""Submits written by their group commit (``SchedulerCore.submit_grouped``, ``StateStore.insert_new_tasks``),
on both backends: the submits of one group are one INSERT (on PostgreSQL one statement), join
memory in submit order with one placement round, and commit together with what their callers
write next (the audit record); a request id used earlier, or twice in one group, gives the first
task; a group that fails or is abandoned before it writes them fails every one of its submits and
keeps none of them."""

from __future__ import annotations

import asyncio
import math
import sqlite3
import time

import pytest

from opentinker.common.v1 import common_pb2 as C
from opentinker_scheduler.errors import AlreadyExists, NotLeader, StoreUnavailable
from opentinker_scheduler.security.audit import AuditLog
from opentinker_scheduler.state.pg_store import PostgresStore
from opentinker_scheduler.state.store import TaskRow

from tests.support.scheduler_core import drain, make_core, register, spec
from tests.support.stores import committed, make_store


def _row(task_id: str, request_id: str | None = None, owner: str = "u") -> TaskRow:
    now = time.time()
    return TaskRow(
        task_id=task_id, owner=owner, request_id=request_id, spec=spec(), state=C.TASK_STATE_PENDING, attempt=1,
        priority=1, gpu_count=0, max_attempts=3, max_runtime_s=None, create_time=now, update_time=now,
    )  # fmt: skip


def _pending() -> C.TaskEvent:
    return C.TaskEvent(state_change=C.StateChange(to_state=C.TASK_STATE_PENDING, attempt=1, reason="SUBMITTED"))


async def _grouped_core(tmp_path, **kw):
    """A core with group commit on (its start-up writes committed)."""
    core = make_core(tmp_path, **kw)
    core.enable_group_commit()
    await core.durable()
    return core


class _CountingDb:
    """Wraps the store's connection and counts the statements that write tasks."""

    _OWN = ("_db", "task_inserts", "fail_commit")

    def __init__(self, db) -> None:
        self._db = db
        self.task_inserts = 0
        self.fail_commit = False

    def execute(self, sql, *args, **kw):
        if "INSERT INTO tasks" in sql:
            self.task_inserts += 1
        if self.fail_commit and sql.strip().upper().startswith("COMMIT"):
            raise sqlite3.OperationalError("disk I/O error (test)")
        return self._db.execute(sql, *args, **kw)

    def pipelined(self, statements):  # PostgreSQL: the writes, fence and COMMIT of a transaction
        self.task_inserts += sum("INSERT INTO tasks" in sql for sql, _ in statements)
        return self._db.pipelined(statements)

    def behind(self, statements, **kw):  # PostgreSQL: the INSERT from the committer thread
        self.task_inserts += sum("INSERT INTO tasks" in sql for sql, _ in statements)
        return self._db.behind(statements, **kw)

    def __getattr__(self, name):
        return getattr(self._db, name)

    def __setattr__(self, name, value):  # the store's own state of its connection (a deferred BEGIN)
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self._db, name, value)


def test_insert_new_tasks_writes_each_row_and_first_event_and_names_used_request_ids(tmp_path) -> None:
    store = make_store(tmp_path)
    assert store.insert_new_task(_row("task-old", "req-old"), _pending()) is None
    out = store.insert_new_tasks(
        [
            (_row("task-a", "req-a"), _pending()),
            (_row("task-b", "req-old"), _pending()),  # used by a stored task
            (_row("task-c"), _pending()),  # no request id
            (_row("task-d", "req-a"), _pending()),  # used by an earlier item of the same call
            (_row("task-e", "req-a", owner="other"), _pending()),  # another owner's request ids are its own
        ]
    )
    assert out[0] is None and out[2] is None and out[4] is None
    assert out[1].task_id == "task-old" and out[3].task_id == "task-a"
    stored = committed(store, "SELECT task_id, next_seq FROM tasks ORDER BY task_id")
    assert stored == [("task-a", 2), ("task-c", 2), ("task-e", 2), ("task-old", 2)]
    events = committed(store, "SELECT task_id, seq, kind FROM events ORDER BY task_id")
    assert events == [("task-a", 1, "state"), ("task-c", 1, "state"), ("task-e", 1, "state"), ("task-old", 1, "state")]
    # The store's own sequence count knows the new rows: their next event is 2, written behind.
    task = store.get_task("task-a")
    task.state = C.TASK_STATE_CANCELLED
    assert [e.sequence for e in store.update_task(task, [_pending()])] == [2]


def test_a_taken_task_id_fails_that_item_alone(tmp_path) -> None:
    store = make_store(tmp_path)
    store.insert_new_task(_row("task-a"), _pending())
    out = store.insert_new_tasks([(_row("task-a"), _pending()), (_row("task-b"), _pending())])
    assert isinstance(out[0], StoreUnavailable) and "its id is taken" in str(out[0])
    assert out[1] is None
    assert committed(store, "SELECT task_id FROM tasks ORDER BY task_id") == [("task-a",), ("task-b",)]


def test_a_groups_submits_are_one_insert_placed_in_one_round_and_committed_with_their_audit_records(tmp_path) -> None:
    async def main() -> None:
        core = make_core(tmp_path, max_tasks_per_gpu=1)
        core.enable_group_commit()
        node, _ = register(core)  # 4 GPUs: 4 of the 6 tasks fit
        await core.durable()
        commits = core.commits.commits
        core.store.db = db = _CountingDb(core.store.db)
        trips = getattr(db, "round_trips", 0)
        audit = AuditLog(core.store)

        async def submit(i: int) -> TaskRow:
            task = await core.api.submit_grouped(spec(gpus=1), owner="u", request_id=f"r{i}")
            # Written and in memory (placed too: a node has room), not committed yet.
            assert core.api.get(task.task_id) is task
            assert committed(core.store, "SELECT 1 FROM tasks WHERE task_id=?", (task.task_id,)) == []
            audit.record("task.submit", owner="u", role="user", task_id=task.task_id, gpu_count=1, priority=1)
            await core.durable()
            return task

        tasks = await asyncio.gather(*(submit(i) for i in range(6)))
        assert db.task_inserts == (1 if isinstance(core.store, PostgresStore) else 6)  # SQLite: in-process, one each
        assert core.commits.commits == commits + 1  # rows, assignments and audit records: one commit
        if isinstance(core.store, PostgresStore):
            # The deferred BEGIN goes with the INSERT; the assignments, audit rows, fence and
            # COMMIT go in one pipeline: two round trips for the whole group.
            assert db.round_trips - trips == 2
        states = dict(committed(core.store, "SELECT task_id, state FROM tasks"))
        assert sorted(states.values()) == sorted([C.TASK_STATE_ASSIGNED] * 4 + [C.TASK_STATE_PENDING] * 2)
        assert [t.task_id for t in tasks if t.state == C.TASK_STATE_ASSIGNED] == [t.task_id for t in tasks[:4]]
        audited = committed(core.store, "SELECT task_id FROM audit_log WHERE action='task.submit'")
        assert sorted(r[0] for r in audited) == sorted(t.task_id for t in tasks)
        assert sorted(c.assign_task.task_id for c in drain(node)) == sorted(t.task_id for t in tasks[:4])

    asyncio.run(main())


def test_a_request_id_submitted_twice_in_one_group_or_again_later_gives_the_first_task(tmp_path) -> None:
    async def main() -> None:
        core = await _grouped_core(tmp_path)
        a, b = await asyncio.gather(
            core.api.submit_grouped(spec(), owner="u", request_id="same"),
            core.api.submit_grouped(spec(), owner="u", request_id="same"),
        )
        await core.durable()
        assert a is b and len(core.queue) == 1
        again = await core.api.submit_grouped(spec(), owner="u", request_id="same")
        assert again.task_id == a.task_id
        with pytest.raises(AlreadyExists, match="different spec"):
            await core.api.submit_grouped(spec(gpus=2), owner="u", request_id="same")
        await core.durable()
        assert committed(core.store, "SELECT count(*) FROM tasks") == [(1,)]

    asyncio.run(main())


@pytest.mark.sqlite_only  # fails sqlite3's COMMIT through a wrapped connection
def test_a_failed_group_fails_every_submit_and_keeps_none(tmp_path) -> None:
    async def main() -> None:
        core = await _grouped_core(tmp_path)
        core.store.db = db = _CountingDb(core.store.db)
        db.fail_commit = True

        async def submit(i: int) -> None:
            await core.api.submit_grouped(spec(), owner="u", request_id=f"r{i}")
            await core.durable()

        results = await asyncio.gather(*(submit(i) for i in range(3)), return_exceptions=True)
        assert all(isinstance(r, sqlite3.OperationalError) for r in results), results
        assert len(core.queue) == 0 and committed(core.store, "SELECT count(*) FROM tasks") == [(0,)]
        db.fail_commit = False
        task = await core.api.submit_grouped(spec(), owner="u", request_id="r0")  # the retry goes in
        await core.durable()
        assert committed(core.store, "SELECT task_id FROM tasks") == [(task.task_id,)]

    asyncio.run(main())


def test_a_group_abandoned_before_it_wrote_its_submits_fails_them_with_not_leader(tmp_path) -> None:
    async def main() -> None:
        core = await _grouped_core(tmp_path)
        submits = [
            asyncio.ensure_future(core.api.submit_grouped(spec(), owner="u", request_id=f"r{i}")) for i in range(3)
        ]
        await asyncio.sleep(0)  # each has validated its spec and waits for the group to write it
        assert not any(s.done() for s in submits)
        core.demote("test: another scheduler leads")
        results = await asyncio.gather(*submits, return_exceptions=True)
        assert all(isinstance(r, NotLeader) for r in results), results
        assert committed(core.store, "SELECT count(*) FROM tasks") == [(0,)]

    asyncio.run(main())


def test_submits_waiting_for_their_group_count_towards_the_owners_pending_tasks(tmp_path) -> None:
    async def main() -> None:
        core = await _grouped_core(tmp_path)
        waiting = [asyncio.ensure_future(core.api.submit_grouped(spec(), owner="u")) for _ in range(2)]
        other = asyncio.ensure_future(core.api.submit_grouped(spec(), owner="v"))
        await asyncio.sleep(0)
        assert core.api.waiting_new_tasks("u") == 2 and core.api.waiting_new_tasks("v") == 1
        await asyncio.gather(*waiting, other)
        assert core.api.waiting_new_tasks("u") == 0
        await core.durable()

    asyncio.run(main())


def test_a_groups_rows_and_audit_records_read_back_exactly_as_written(tmp_path) -> None:
    # Text that needs escaping or is not ASCII, floats that need every digit or are not finite,
    # large integers, NULLs and bytes: on PostgreSQL a group's rows travel as JSON, and a value
    # comes back as the one written.
    store = make_store(tmp_path)
    odd = _row("task-odd", 'req "1"\\\n\t☃ δ', owner="ünïcode 用户")
    odd.max_runtime_s = math.inf
    odd.create_time, odd.update_time = 1796322483.123456789, 0.1 + 0.2
    odd.not_before = -math.inf
    odd.error = "line one\nline two \x01 'quoted' \"double\""
    odd.latest_step, odd.attempt_step = 2**62, 2**40
    odd.latest_checkpoint = C.Checkpoint(step=7, path="/ck/\u00e9\u0000x", format="peft_lora")
    event = C.TaskEvent(
        state_change=C.StateChange(to_state=C.TASK_STATE_PENDING, attempt=1, reason="SUBMITTED", message="\x00\xff")
    )
    event.time.FromNanoseconds(1796322483_987654321)
    plain = _row("task-plain")
    assert store.insert_new_tasks([(odd, event), (plain, _pending())]) == [None, None]
    got = store.get_task("task-odd")
    for (
        field
    ) in "owner request_id max_runtime_s create_time update_time not_before error latest_step attempt_step".split():
        assert getattr(got, field) == getattr(odd, field), field
    assert got.latest_checkpoint == odd.latest_checkpoint and got.spec == odd.spec
    assert got.start_time is None and store.get_task("task-plain").latest_checkpoint is None
    (first,) = store.events_after("task-odd", 0)
    assert first.state_change.message == "\x00\xff" and first.time.ToNanoseconds() // 1000 == 1796322483_987654

    records = [
        (1796322483.5, "ünïcode 用户", "user", "ot_ab", "task.submit", "task-odd", "OK", '{"why": "a\\nb ☃"}'),
        (1796322484.000001, "u", "admin", "", "task.cancel", "", "PERMISSION_DENIED", "{}"),
    ]
    with store.batch():
        for record in records:
            store.add_audit(record)
    back = committed(store, "SELECT time, owner, role, key_prefix, action, task_id, outcome, detail FROM audit_log")
    assert back == records
