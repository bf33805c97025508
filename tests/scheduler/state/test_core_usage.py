"""Usage accounting in the core: per attempt GPU-seconds from assignment to confirmed stop (a
cancelled or timed-out attempt until its node confirms the worker is gone, or is lost), tokens and
env steps from the metrics, cost by node class; rolled up per task, owner and queue, persisted
(both store backends); the dry-run estimate from recent step times; the desired-trainers signal."""

from __future__ import annotations

import time

from opentinker.common.v1 import common_pb2 as C
from opentinker.node.v1 import node_pb2 as N

from opentinker_scheduler.config import QueueConfig
from opentinker_scheduler.config.usage import UsageConfig
from opentinker_scheduler.state.scale_signal import desired_trainers
from tests.support.scheduler_core import drain, make_core, register, report, spec
from tests.support.stores import committed


def _assigned(node) -> list[str]:
    return [c.assign_task.task_id for c in drain(node) if c.WhichOneof("command") == "assign_task"]


def _state_times(core, task_id) -> list[tuple[str, int, float]]:
    """(reason, attempt, unix seconds) of each state change of a task, from its stored events."""
    return [
        (e.state_change.reason, e.state_change.attempt, e.time.ToNanoseconds() / 1e9)
        for e in core.store.events_after(task_id, 0)
        if e.WhichOneof("event") == "state_change"
    ]


def test_finished_task_usage_is_its_attempts_gpu_seconds(tmp_path) -> None:
    usage = UsageConfig(currency="EUR", default_node_class="on-demand", prices={"on-demand": 3.6, "spot": 1.8})
    core = make_core(tmp_path, usage=usage, max_tasks_per_gpu=1,
                     queues=(QueueConfig("team-a", gpus=4, cpu_tasks=2, owners=("alice",)),))  # fmt: skip
    node, _ = register(core)
    task = core.api.submit(spec(gpus=2), owner="alice")
    core.schedule()
    assert _assigned(node) == [task.task_id]
    report(core, node, task.task_id, 1, C.TASK_STATE_RUNNING)
    point = C.MetricPoint(step=1, values={"grpo/tokens": 120.0, "train/tokens": 40.0, "env_steps": 8.0})
    report(core, node, task.task_id, 1, metrics=[point])
    time.sleep(0.05)
    # The node is lost: attempt 1 ends (NODE_LOST), attempt 2 runs to the end.
    node.connected = False  # as the liveness check does past the lease
    core.ledger.changed(node, membership=True)
    core.table.lose_node(node, "test")
    node, _ = register(core)
    core.schedule()
    assert _assigned(node) == [task.task_id]
    report(core, node, task.task_id, 2, C.TASK_STATE_RUNNING)
    report(core, node, task.task_id, 2, metrics=[C.MetricPoint(step=2, values={"grpo/tokens": 30.0})])
    time.sleep(0.05)
    report(core, node, task.task_id, 2, C.TASK_STATE_SUCCEEDED)
    got = core.usage.task_usage(core.api.get(task.task_id))
    times = _state_times(core, task.task_id)
    spans = []
    for attempt in (1, 2):
        start = next(t for r, a, t in times if r == "ASSIGNED" and a == attempt)
        end = next(t for r, a, t in times if a >= attempt and t > start and r in ("NODE_LOST", "COMPLETED"))
        spans.append(end - start)
    expected = 2 * sum(spans)
    assert got.attempts == 2 and abs(got.gpu_seconds - expected) <= core.config.heartbeat_interval_s
    assert got.gpu_seconds > 0.1  # two GPUs for at least 0.1 s: the waits above
    assert (got.tokens_generated, got.tokens_trained, got.env_steps) == (150.0, 40.0, 8.0)
    assert abs(got.cost - got.gpu_seconds / 3600 * 3.6) < 1e-9
    by_owner, by_queue, queues = core.usage.rollup(core.active.values())
    assert by_owner["alice"].gpu_seconds == by_queue["team-a"].gpu_seconds == got.gpu_seconds
    assert queues == {"alice": "team-a"}
    assert core.usage.rollup(core.active.values(), since=time.time() + 60)[0] == {}
    # Persisted: a new core on the same store reads the same figures.
    core.store.close()
    again = make_core(tmp_path, usage=usage)
    assert again.usage.task_usage(again.api.get(task.task_id)).gpu_seconds == got.gpu_seconds


def _usage_rows(core, task_id) -> list[tuple[int, float, float, float]]:
    """(attempt, start, end, GPU-seconds) of each committed usage record of a task."""
    sql = "SELECT attempt, start_time, end_time, gpu_seconds FROM attempt_usage WHERE task_id=? ORDER BY attempt"
    return committed(core.store, sql, (task_id,))


#: How long the worker takes to checkpoint and stop after the scheduler ended its attempt.
STOPPING_S = 0.3


def test_a_cancelled_attempt_is_accounted_until_its_node_confirms_the_stop(tmp_path) -> None:
    core = make_core(tmp_path, max_tasks_per_gpu=1)
    node, _ = register(core)
    task = core.api.submit(spec(gpus=2), owner="alice")
    core.schedule()
    assert _assigned(node) == [task.task_id]
    report(core, node, task.task_id, 1, C.TASK_STATE_RUNNING)
    core.api.cancel(task.task_id)
    assert core.api.get(task.task_id).state == C.TASK_STATE_CANCELLED
    ((_, start, at_cancel, gpu_s_at_cancel),) = _usage_rows(core, task.task_id)  # written with the transition
    time.sleep(STOPPING_S)  # the worker checkpoints on SIGTERM and takes a while to go
    assert task.task_id in node.allocations  # its GPUs are still held
    confirm_from = time.time()
    report(core, node, task.task_id, 1, C.TASK_STATE_CANCELLED)
    confirm_to = time.time()
    assert node.allocations == {} and core.table.stopping == {}
    ((attempt, start_again, end, gpu_s),) = _usage_rows(core, task.task_id)
    assigned = next(t for r, a, t in _state_times(core, task.task_id) if r == "ASSIGNED")
    assert attempt == 1 and start_again == start and abs(start - assigned) < 0.01
    assert confirm_from <= end <= confirm_to, "the attempt's usage ends at the node's confirmation"
    assert abs(gpu_s - 2 * (end - start)) < 1e-6 and gpu_s >= gpu_s_at_cancel + 2 * STOPPING_S
    assert at_cancel < confirm_from
    got = core.usage.task_usage(core.api.get(task.task_id))
    assert got.attempts == 1 and got.gpu_seconds == gpu_s
    # A report of the ended attempt after the confirmation changes nothing.
    report(core, node, task.task_id, 1, C.TASK_STATE_CANCELLED)
    assert _usage_rows(core, task.task_id) == [(attempt, start, end, gpu_s)]


def test_a_timed_out_attempt_is_accounted_until_its_node_is_declared_lost(tmp_path) -> None:
    core = make_core(tmp_path, max_tasks_per_gpu=1)
    node, _ = register(core)
    s = spec(gpus=1)
    s.limits.max_runtime.FromSeconds(5)
    task = core.api.submit(s, owner="bob")
    core.schedule()
    report(core, node, task.task_id, 1, C.TASK_STATE_RUNNING)
    core.active[task.task_id].start_time = time.time() - 10  # past max_runtime
    core.tick()
    assert core.api.get(task.task_id).state == C.TASK_STATE_FAILED and task.task_id in core.table.stopping
    time.sleep(STOPPING_S)  # the node goes silent before confirming
    lost_from = time.time()
    node.connected = False  # as the liveness check does past the lease
    core.ledger.changed(node, membership=True)
    core.table.lose_node(node, "test")
    lost_to = time.time()
    ((_, start, end, gpu_s),) = _usage_rows(core, task.task_id)
    assert lost_from <= end <= lost_to and abs(gpu_s - (end - start)) < 1e-6
    assert core.table.stopping == {} and core.usage.stopping == {}


def test_running_attempt_counts_up_to_now_and_cpu_tasks_count_slot_seconds(tmp_path) -> None:
    core = make_core(tmp_path)
    node, _ = register(core)
    cpu = core.api.submit(spec(gpus=0), owner="bob")
    core.schedule()
    report(core, node, cpu.task_id, 1, C.TASK_STATE_RUNNING)
    first = core.usage.task_usage(core.api.get(cpu.task_id))
    time.sleep(0.02)
    second = core.usage.task_usage(core.api.get(cpu.task_id))
    assert first.gpu_seconds == 0 and 0 < first.cpu_task_seconds < second.cpu_task_seconds
    assert first.attempts == 1 and first.cost == 0


def test_dry_run_estimate_from_recent_step_times(tmp_path) -> None:
    usage = UsageConfig(prices={"default": 2.0})
    core = make_core(tmp_path, usage=usage, max_tasks_per_gpu=1)
    node, _ = register(core)
    row, est, basis = core.api.estimate(spec(gpus=1, steps=10), owner="u")
    assert row.task_id == "" and est.gpu_seconds == 0 and basis.startswith("no estimate: no recorded attempt")
    done = core.api.submit(spec(gpus=1, steps=4), owner="u")
    core.schedule()
    report(core, node, done.task_id, 1, C.TASK_STATE_RUNNING)
    report(core, node, done.task_id, 1, metrics=[C.MetricPoint(step=s, values={"loss": 1.0}) for s in (1, 2, 3, 4)])
    report(core, node, done.task_id, 1, C.TASK_STATE_SUCCEEDED)
    (recorded,) = core.store.recent_step_seconds("lora_finetune", "/models/m")
    per_step = recorded[0] / 4
    row, est, basis = core.api.estimate(spec(gpus=2, steps=10), owner="u")
    assert abs(est.gpu_seconds - 2 * 10 * per_step) < 1e-6 and abs(est.cost - est.gpu_seconds / 3600 * 2.0) < 1e-9
    assert basis.startswith("one attempt of 10 steps x") and "at 2 USD per GPU-hour (default)" in basis
    assert est.attempts == 1  # an estimate of one attempt, not of none
    assert core.store.count_tasks(owner="u", states=(C.TASK_STATE_PENDING,)) == 0  # nothing was submitted


def test_desired_trainers_counts_busy_nodes_and_pending_admitted_work(tmp_path) -> None:
    core = make_core(tmp_path, max_tasks_per_gpu=1,
                     queues=(QueueConfig("capped", gpus=2, cpu_tasks=0, borrowing_gpus=0, owners=("c",)),))  # fmt: skip
    devices = [C.Device(index=i, uuid=f"s{i}", name="g", simulated=True) for i in range(4)]
    core.node_register(N.Register(node_id="spot-1", devices=devices, max_tasks=8, node_class="spot"))
    node, _ = register(core)  # gpu-node-01, the default class
    assert {
        d.node_class: d.desired for d in desired_trainers(core.config, core.ledger, core.queue, core.queues.book)
    } == {"default": 0, "spot": 0}  # idle
    for _ in range(3):
        core.api.submit(spec(gpus=4), owner="u")  # 3 whole nodes of work: 2 fit now, 1 more node needed
    for _ in range(5):
        core.api.submit(spec(gpus=1), owner="c")  # over its 2-GPU quota: only 2 count
    want = {
        d.node_class: (d.desired, d.connected, d.pending_gpus)
        for d in desired_trainers(core.config, core.ledger, core.queue, core.queues.book)
    }
    assert want == {"default": (3, 1, 14), "spot": (1, 1, 0)}


def test_a_bad_node_class_is_refused_at_register(tmp_path) -> None:
    import pytest

    from opentinker_scheduler.errors import InvalidArgument

    core = make_core(tmp_path)
    with pytest.raises(InvalidArgument, match=r"^register.node_class: expected a node class"):
        core.node_register(N.Register(node_id="n1", max_tasks=1, node_class="spot instance"))
    assert "n1" not in core.ledger.nodes or not core.ledger.nodes["n1"].connected
