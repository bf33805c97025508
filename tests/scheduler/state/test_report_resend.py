"""Reports a node resends after a reconnect (``Register.pending``) count once: each (task,
attempt, metric step) and each checkpoint is applied a single time, across scheduler restarts."""

from __future__ import annotations

import pytest

import sqlite3

from opentinker.common.v1 import common_pb2 as C
from opentinker.node.v1 import node_pb2 as N
from opentinker_scheduler.state.store import SqliteStore

from tests.support.scheduler_core import make_core, register, report, spec

DEVICES = [C.Device(index=i, simulated=True) for i in range(4)]


def _metric_report(task_id: str, attempt: int, step: int, seq: int) -> N.TaskReport:
    return N.TaskReport(
        task_id=task_id, attempt=attempt, seq=seq, metrics=[C.MetricPoint(step=step, values={"loss": 1.0 / step})]
    )


def _running(tmp_path):
    core = make_core(tmp_path)
    task = core.api.submit(spec(), owner="u")
    node, _ = register(core)
    core.schedule()
    report(core, node, task.task_id, 1, C.TASK_STATE_RUNNING)
    return core, node, task


def _steps(core, task_id: str) -> list[int]:
    """The steps of the metric points recorded in the task's event log, in order."""
    return [e.metric.step for e in core.store.events_after(task_id, 0) if e.WhichOneof("event") == "metric"]


def test_resent_metric_points_after_a_restart_are_applied_once(tmp_path) -> None:
    core, node, task = _running(tmp_path)
    for seq, step in ((1, 1), (2, 2), (3, 3)):
        core.node_report(node, _metric_report(task.task_id, 1, step, seq))
    core.store.close()  # kill -9: steps 1-3 were committed, the acks for 2 and 3 never reached the node
    core2 = make_core(tmp_path)
    pending = [_metric_report(task.task_id, 1, step, seq) for seq, step in ((2, 2), (3, 3), (4, 4), (5, 5))]
    _, registered = core2.node_register(
        N.Register(
            node_id="gpu-node-01",
            devices=DEVICES,
            max_tasks=8,
            running=[N.RunningTask(task_id=task.task_id, attempt=1)],
            pending=pending,
        )
    )
    assert _steps(core2, task.task_id) == [1, 2, 3, 4, 5]
    assert registered.report_ack == 5, "the node may forget every report it resent"
    assert core2.node_protocol.duplicates == 2
    t = core2.api.get(task.task_id)
    assert (t.state, t.attempt, t.latest_step, t.attempt_step) == (C.TASK_STATE_RUNNING, 1, 5, 5)


def test_a_resent_checkpoint_is_recorded_once(tmp_path) -> None:
    core, node, task = _running(tmp_path)
    ck = N.TaskReport(task_id=task.task_id, attempt=1, seq=7, checkpoint=C.Checkpoint(step=10, path="/ck/step_10"))
    core.node_report(node, ck)
    core.node_report(node, ck)
    kinds = [e.WhichOneof("event") for e in core.store.events_after(task.task_id, 0)]
    assert kinds.count("checkpoint") == 1
    assert core.node_protocol.duplicates == 1


def test_a_final_in_both_pending_and_finished_is_applied_once(tmp_path) -> None:
    core, node, task = _running(tmp_path)
    core.store.close()
    core2 = make_core(tmp_path)
    last = _metric_report(task.task_id, 1, 3, seq=11)
    done = N.TaskReport(task_id=task.task_id, attempt=1, seq=12, state=C.TASK_STATE_SUCCEEDED)
    _, registered = core2.node_register(
        N.Register(node_id="gpu-node-01", devices=DEVICES, max_tasks=8, pending=[last, done], finished=[done])
    )
    t = core2.api.get(task.task_id)
    # The metric point written before the end counts: pending is applied in order, before finished.
    assert t.state == C.TASK_STATE_SUCCEEDED and _steps(core2, task.task_id) == [3]
    assert registered.report_ack == 12
    ends = [
        e
        for e in core2.store.events_after(task.task_id, 0)
        if e.WhichOneof("event") == "state_change" and e.state_change.to_state == C.TASK_STATE_SUCCEEDED
    ]
    assert len(ends) == 1


def test_the_next_attempt_reports_its_own_steps(tmp_path) -> None:
    core, node, task = _running(tmp_path)
    for step in (1, 2, 3):
        core.node_report(node, _metric_report(task.task_id, 1, step, seq=step))
    report(core, node, task.task_id, 1, C.TASK_STATE_FAILED, error="oom", retryable=True)
    t = core.api.get(task.task_id)
    assert t.attempt == 2 and t.attempt_step == 0
    t.not_before = 0
    core.schedule()
    report(core, node, task.task_id, 2, C.TASK_STATE_RUNNING)
    # Attempt 2 resumed from step 1's checkpoint: its steps 2 and 3 are new points, not duplicates.
    for step in (2, 3, 4):
        core.node_report(node, _metric_report(task.task_id, 2, step, seq=10 + step))
    assert _steps(core, task.task_id) == [1, 2, 3, 2, 3, 4]
    assert core.node_protocol.duplicates == 0
    # The history shows each step once, the newest attempt's.
    assert [(p.step, p.attempt) for p in core.store.metric_points(task.task_id)] == [(1, 1), (2, 2), (3, 2), (4, 2)]


@pytest.mark.sqlite_only
def test_a_store_written_before_attempt_step_existed_opens(tmp_path) -> None:
    core, node, task = _running(tmp_path)
    core.node_report(node, _metric_report(task.task_id, 1, 1, seq=1))
    core.store.close()
    db = sqlite3.connect(tmp_path / "scheduler.db")
    db.execute("ALTER TABLE tasks DROP COLUMN attempt_step")
    db.execute("DROP TABLE schema_migrations")  # as written before the schema was versioned
    db.commit()
    db.close()
    store = SqliteStore(tmp_path)
    assert store.get_task(task.task_id).attempt_step == 0
    store.close()
