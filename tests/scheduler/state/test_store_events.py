"""state/store.py: event sequence numbers per task (1, 2, 3, ... with no gap, several events in one
update), kept across a reopen; the spec written once."""

from __future__ import annotations

import sqlite3
import time

import pytest

from opentinker.common.v1 import common_pb2 as C
from opentinker_scheduler.state.store import SqliteStore, TaskRow


def _task(task_id: str) -> TaskRow:
    now = time.time()
    spec = C.TaskSpec(workload_type="lora_finetune", model="m", name="n")
    return TaskRow(
        task_id=task_id, owner="o", spec=spec, state=C.TASK_STATE_PENDING, attempt=1, priority=0,
        gpu_count=0, max_attempts=3, max_runtime_s=None, create_time=now, update_time=now,
    )  # fmt: skip


def _state(to: int) -> C.TaskEvent:
    return C.TaskEvent(state_change=C.StateChange(to_state=to, reason="R"))


def test_sequences_are_dense_per_task_and_survive_a_reopen(tmp_path) -> None:
    store = SqliteStore(tmp_path)
    a, b = _task("task-a"), _task("task-b")
    store.insert_task(a, _state(C.TASK_STATE_PENDING))
    store.insert_task(b, _state(C.TASK_STATE_PENDING))
    a.state = C.TASK_STATE_RUNNING
    out = store.update_task(a, [_state(C.TASK_STATE_RUNNING), C.TaskEvent(metric=C.MetricPoint(step=1))])
    assert [e.sequence for e in out] == [2, 3] and all(e.task_id == "task-a" for e in out)
    assert store.update_task(a) == []  # the row only
    assert [e.sequence for e in store.update_task(b, [_state(C.TASK_STATE_CANCELLED)])] == [2]
    store.close()
    store = SqliteStore(tmp_path)
    assert [e.sequence for e in store.update_task(a, [_state(C.TASK_STATE_SUCCEEDED)])] == [4]
    assert [e.sequence for e in store.events_after("task-a", 0)] == [1, 2, 3, 4]
    assert [e.sequence for e in store.events_after("task-b", 0)] == [1, 2]
    row = store.get_task("task-a")
    assert row.state == C.TASK_STATE_RUNNING and row.spec == a.spec
    with pytest.raises(sqlite3.IntegrityError, match="task-x"):
        store.update_task(_task("task-x"), [_state(C.TASK_STATE_RUNNING)])
    store.close()
