"""state/store.py on both backends: inside a transaction a task's row and its events wait until it
ends (one UPDATE per task however often it moved, the events in one executemany), reads on the
store see them at once, nothing is committed before the end, and a rollback leaves no row, no
event and no wrong sequence number behind."""

from __future__ import annotations

import math
import time

import pytest

from opentinker.common.v1 import common_pb2 as C
from opentinker_scheduler.state.store import TaskRow

from tests.support.scheduler_core import spec
from tests.support.stores import committed, make_store, take_lead


def _task(task_id: str) -> TaskRow:
    now = time.time()
    return TaskRow(
        task_id=task_id, owner="u", spec=spec(), state=C.TASK_STATE_PENDING, attempt=1, priority=1,
        gpu_count=0, max_attempts=3, max_runtime_s=None, create_time=now, update_time=now,
    )  # fmt: skip


def _state(to: int) -> C.TaskEvent:
    return C.TaskEvent(state_change=C.StateChange(to_state=to, attempt=1, reason="R"))


def _move(store, task: TaskRow, to: int) -> list[C.TaskEvent]:
    task.state = to
    return store.update_task(task, [_state(to)])


def _seqs(store, task_id: str) -> list[int]:
    return [r[0] for r in committed(store, "SELECT seq FROM events WHERE task_id=? ORDER BY seq", (task_id,))]


def test_reads_inside_a_transaction_see_waiting_writes_and_nothing_commits_before_its_end(tmp_path) -> None:
    store = make_store(tmp_path)
    task = _task("task-a")
    store.insert_task(task, _state(C.TASK_STATE_PENDING))
    with store.batch():
        out = [_move(store, task, s) for s in (C.TASK_STATE_ASSIGNED, C.TASK_STATE_RUNNING)]
        assert [e[0].sequence for e in out] == [2, 3]
        assert _seqs(store, "task-a") == [1]  # not committed yet
        assert store.get_task("task-a").state == C.TASK_STATE_RUNNING  # but read on this store
        assert [e.sequence for e in store.events_after("task-a", 0)] == [1, 2, 3]
        _move(store, task, C.TASK_STATE_SUCCEEDED)  # after the read: waits again
        assert store.count_by_state() == {C.TASK_STATE_SUCCEEDED: 1}
    assert _seqs(store, "task-a") == [1, 2, 3, 4]
    row = committed(store, "SELECT state, next_seq FROM tasks WHERE task_id=?", ("task-a",))
    assert row == [(C.TASK_STATE_SUCCEEDED, 5)]


def test_a_rolled_back_transaction_leaves_no_writes_and_the_next_sequence_is_the_databases(tmp_path) -> None:
    store = make_store(tmp_path)
    task = _task("task-a")
    store.insert_task(task, _state(C.TASK_STATE_PENDING))
    with pytest.raises(RuntimeError, match="boom"):
        with store.batch():
            _move(store, task, C.TASK_STATE_ASSIGNED)
            _move(store, task, C.TASK_STATE_RUNNING)
            raise RuntimeError("boom")
    assert _seqs(store, "task-a") == [1]
    assert committed(store, "SELECT state FROM tasks WHERE task_id=?", ("task-a",)) == [(C.TASK_STATE_PENDING,)]
    assert [e.sequence for e in _move(store, task, C.TASK_STATE_ASSIGNED)] == [2]
    assert _seqs(store, "task-a") == [1, 2]


@pytest.mark.sqlite_only  # counts statements with sqlite3's trace callback
def test_a_task_moved_three_times_in_one_transaction_is_one_update(tmp_path) -> None:
    store = make_store(tmp_path)
    tasks = [_task(f"task-{i}") for i in range(3)]
    for t in tasks:
        store.insert_task(t, _state(C.TASK_STATE_PENDING))
    statements: list[str] = []
    store.db.set_trace_callback(statements.append)
    with store.batch():
        for to in (C.TASK_STATE_ASSIGNED, C.TASK_STATE_RUNNING, C.TASK_STATE_SUCCEEDED):
            for t in tasks:
                _move(store, t, to)
    store.db.set_trace_callback(None)
    updates = [s for s in statements if s.startswith("UPDATE tasks")]
    inserts = [s for s in statements if s.startswith("INSERT INTO events")]
    assert len(updates) == 3 and len(inserts) == 9  # executemany: one row each, prepared once
    assert all(_seqs(store, t.task_id) == [1, 2, 3, 4] for t in tasks)


@pytest.mark.postgres_only
def test_a_leader_again_after_another_wrote_takes_the_sequence_from_the_database(tmp_path) -> None:
    first = make_store(tmp_path)
    task = _task("task-a")
    first.insert_task(task, _state(C.TASK_STATE_PENDING))
    _move(first, task, C.TASK_STATE_ASSIGNED)
    first.release_lease("tests", first.epoch)
    first.follow()
    second = make_store(tmp_path, lead=False)
    take_lead(second, holder="other")
    other = second.get_task("task-a")
    _move(second, other, C.TASK_STATE_RUNNING)  # seq 3, written by the other leader
    second.release_lease("other", second.epoch)
    second.follow()
    take_lead(first)
    assert [e.sequence for e in _move(first, task, C.TASK_STATE_SUCCEEDED)] == [4]
    assert _seqs(first, "task-a") == [1, 2, 3, 4]


def _usage(task_id: str, gpu_seconds: float):
    from opentinker_scheduler.state.store import UsageRecord

    return UsageRecord(
        task_id=task_id, attempt=1, owner="u", queue="q", node_id="n", node_class="c", workload_type="w",
        model="m", gpus=1, start_time=1.0, end_time=1.0 + gpu_seconds, gpu_seconds=gpu_seconds,
        cpu_task_seconds=0.0, tokens_generated=0.0, tokens_trained=0.0, env_steps=0.0, steps=1, cost=0.0,
    )  # fmt: skip


def test_usage_records_wait_for_the_transactions_end_and_reads_see_them(tmp_path) -> None:
    store = make_store(tmp_path)
    store.insert_task(_task("task-a"), _state(C.TASK_STATE_PENDING))
    usage_rows = "SELECT gpu_seconds FROM attempt_usage WHERE task_id=?"
    with store.batch():
        store.record_usage(_usage("task-a", 5.0))
        assert committed(store, usage_rows, ("task-a",)) == []  # not committed yet
        assert store.task_usage("task-a")[0] == 5.0  # but read on this store
        store.record_usage(_usage("task-a", 7.0))  # the same attempt again: replaces it
        assert store.usage_by("owner") == {"u": (7.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1)}
    assert committed(store, usage_rows, ("task-a",)) == [(7.0,)]
    with pytest.raises(RuntimeError, match="boom"):
        with store.batch():
            store.record_usage(_usage("task-a", 9.0))
            raise RuntimeError("boom")
    assert committed(store, usage_rows, ("task-a",)) == [(7.0,)]
    store.record_usage(_usage("task-a", 11.0))  # outside a transaction: at once
    assert committed(store, usage_rows, ("task-a",)) == [(11.0,)]


def test_a_transactions_rows_events_and_usage_of_several_tasks_read_back_exactly(tmp_path) -> None:
    # On PostgreSQL the waiting writes of several tasks go as one statement per table (a jsonb
    # array of their rows): values that need escaping, every digit or are not finite come back
    # as written, whether a read flushes them mid-transaction or the commit does.
    store = make_store(tmp_path)
    tasks = [_task(f"task-{n}") for n in range(3)]
    for task in tasks:
        store.insert_task(task, _state(C.TASK_STATE_PENDING))
    odd = tasks[0]
    with store.batch():
        odd.error, odd.node_id, odd.max_runtime_s = "a 'quoted' \"line\"\n☃ \\ done", "nöde-1", math.inf
        odd.latest_step, odd.latest_metrics, odd.update_time = 2**53 + 1, {"loss": 0.1 + 0.2}, 1796322483.123456
        odd.latest_checkpoint = C.Checkpoint(step=2, path="/ck/\u00e9\u0000", format="peft_lora")
        for task in tasks:
            _move(store, task, C.TASK_STATE_RUNNING)
        assert store.get_task("task-0").error == odd.error  # a read flushes them: one statement per table
        for task in tasks[1:]:
            _move(store, task, C.TASK_STATE_SUCCEEDED)
        store.record_usage(_usage("task-1", 1e-300))
        store.record_usage(_usage("task-2", 2.5))
        assert store.task_usage("task-1")[0] == 1e-300  # flushed: the two records in one statement
        store.record_usage(_usage("task-2", 3.5))  # the same attempt twice, no read between:
        store.record_usage(_usage("task-2", 4.5))  # one statement each, in order (the last replaces)
    got = store.get_task("task-0")
    for field in ("error", "node_id", "max_runtime_s", "latest_step", "latest_metrics", "update_time"):
        assert getattr(got, field) == getattr(odd, field), field
    assert got.latest_checkpoint == odd.latest_checkpoint and got.state == C.TASK_STATE_RUNNING
    assert [store.get_task(f"task-{n}").state for n in (1, 2)] == [C.TASK_STATE_SUCCEEDED] * 2
    assert [_seqs(store, f"task-{n}") for n in range(3)] == [[1, 2], [1, 2, 3], [1, 2, 3]]
    usage = committed(store, "SELECT task_id, gpu_seconds FROM attempt_usage ORDER BY task_id")
    assert usage == [("task-1", 1e-300), ("task-2", 4.5)]
