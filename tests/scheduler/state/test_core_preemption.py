"""Preemption and max_runtime in the core: victims told, requeued on confirmation, the waiting
task placed; equal priority never preempts; no repeated preemption while one is in flight; a
timed-out task's final checkpoint is still recorded."""

from __future__ import annotations

import time

from opentinker.common.v1 import common_pb2 as C

from tests.support.scheduler_core import drain, make_core as _make_core, register, report, spec


def make_core(tmp, **kw):
    """These tests are about preemption of tasks that hold their GPUs alone."""
    return _make_core(tmp, **{"max_tasks_per_gpu": 1, **kw})


def prio_spec(gpus: int, priority: int, **kw) -> C.TaskSpec:
    s = spec(gpus=gpus, **kw)
    s.priority = priority
    return s


def _run(core, node, task_id: str) -> None:
    core.schedule()
    drain(node)
    assert report(core, node, task_id, core.api.get(task_id).attempt, C.TASK_STATE_RUNNING)


def _running_and_waiting(core, running_priority: int, waiting_priority: int):
    """Register one node, run a 4-GPU task at ``running_priority`` on it, then submit a second
    4-GPU task at ``waiting_priority``: ``(node, running, waiting)``, not yet ticked."""
    node, _ = register(core)
    running = core.api.submit(prio_spec(4, running_priority), owner="u")
    _run(core, node, running.task_id)
    return node, running, core.api.submit(prio_spec(4, waiting_priority), owner="u")


def _cancels(node) -> list:
    return [c.cancel_task for c in drain(node) if c.WhichOneof("command") == "cancel_task"]


def test_higher_priority_preempts_lower_then_runs(tmp_path) -> None:
    core = make_core(tmp_path)
    node, _ = register(core)
    low = core.api.submit(prio_spec(3, 0), owner="u")
    _run(core, node, low.task_id)
    ck = C.Checkpoint(step=5, path="/ck/step_5")
    assert report(core, node, low.task_id, 1, checkpoint=ck)
    high = core.api.submit(prio_spec(2, 10), owner="u")
    core.tick()
    (cancel,) = _cancels(node)
    assert (cancel.task_id, cancel.attempt, cancel.reason) == (low.task_id, 1, "PREEMPTED")
    assert core.api.get(low.task_id).state == C.TASK_STATE_RUNNING  # until the node confirms
    assert f"preempting {low.task_id} on gpu-node-01" in core.reasons.reason(high.task_id)
    # The victim's GPUs still count as used: nothing is placed before the confirmation.
    assert core.schedule() == 0
    # No second preemption while this one is in flight.
    core.tick()
    assert _cancels(node) == []
    # The worker checkpointed and stopped; the agent reports CANCELLED with the reason.
    assert report(core, node, low.task_id, 1, C.TASK_STATE_CANCELLED, error="PREEMPTED")
    t = core.api.get(low.task_id)
    assert t.state == C.TASK_STATE_PENDING and t.attempt == 2 and t.max_attempts == 4  # hand-back: attempt not used up
    assert t.handed_back == 1 and t.spec.limits.max_attempts == 3  # what `get` shows: 1 of 3 used
    last = list(core.store.events_after(low.task_id, 0))[-1].state_change
    assert last.reason == "PREEMPTED" and high.task_id in last.message
    assert low.task_id not in node.allocations
    assert core.schedule() == 1
    (assign,) = [c.assign_task for c in drain(node)]
    assert assign.task_id == high.task_id
    assert core.api.get(high.task_id).state == C.TASK_STATE_ASSIGNED
    # The victim waits (it fits nowhere) and later resumes from its checkpoint.
    assert core.api.get(low.task_id).state == C.TASK_STATE_PENDING
    report(core, node, high.task_id, 1, C.TASK_STATE_RUNNING)
    report(core, node, high.task_id, 1, C.TASK_STATE_SUCCEEDED)
    core.schedule()
    (assign,) = [c.assign_task for c in drain(node)]
    assert assign.task_id == low.task_id and assign.attempt == 2 and assign.resume_from.path == "/ck/step_5"


def test_equal_priority_never_preempts(tmp_path) -> None:
    core = make_core(tmp_path)
    node, a, b = _running_and_waiting(core, 5, 5)
    for _ in range(3):
        core.tick()
    assert _cancels(node) == []
    assert core.api.get(b.task_id).state == C.TASK_STATE_PENDING
    assert "preempting" not in core.reasons.reason(b.task_id)
    # A lower-priority task never preempts a higher one either.
    c = core.api.submit(prio_spec(4, 1), owner="u")
    core.tick()
    assert _cancels(node) == [] and core.api.get(c.task_id).state == C.TASK_STATE_PENDING


def test_lowest_priority_victim_and_only_enough(tmp_path) -> None:
    core = make_core(tmp_path)
    node, _ = register(core)
    tasks = {}
    for prio in (3, 1, 2, 4):
        t = core.api.submit(prio_spec(1, prio), owner="u")
        tasks[prio] = t.task_id
        _run(core, node, t.task_id)
    high = core.api.submit(prio_spec(1, 9), owner="u")
    core.tick()
    assert [(c.task_id, c.reason) for c in _cancels(node)] == [(tasks[1], "PREEMPTED")]
    assert "preempting" in core.reasons.reason(high.task_id)


def test_node_loss_clears_preemption_in_flight(tmp_path) -> None:
    core = make_core(tmp_path)  # a 10 s lease: the first tick finds the node alive however slow the store
    node, low, high = _running_and_waiting(core, 0, 10)
    core.tick()
    assert len(_cancels(node)) == 1
    assert core.preemptions.victims and core.preemptions.waiting
    node.last_seen -= core.config.lease_s + 1  # silent past its lease
    core.tick()  # the node is lost: the victim is requeued as NODE_LOST, the record goes
    assert core.preemptions.victims == {} and core.preemptions.waiting == {}
    t = core.api.get(low.task_id)
    assert t.state == C.TASK_STATE_PENDING and t.attempt == 2
    assert "preempting" not in core.reasons.reason(high.task_id)
    # A late report from the lost attempt is refused and changes nothing.
    assert not report(core, node, low.task_id, 1, C.TASK_STATE_CANCELLED, error="PREEMPTED")
    # The node comes back: the high-priority task is placed first.
    node, _ = register(core)
    core.tick()
    assigned = [c.assign_task.task_id for c in drain(node) if c.WhichOneof("command") == "assign_task"]
    assert assigned == [high.task_id]


def test_victim_finishing_on_its_own_clears_record(tmp_path) -> None:
    core = make_core(tmp_path)
    node, low, high = _running_and_waiting(core, 0, 10)
    core.tick()
    assert len(_cancels(node)) == 1
    assert report(core, node, low.task_id, 1, C.TASK_STATE_SUCCEEDED)
    assert core.api.get(low.task_id).state == C.TASK_STATE_SUCCEEDED and core.preemptions.victims == {}
    core.tick()
    assert core.api.get(high.task_id).state == C.TASK_STATE_ASSIGNED


def test_preempted_report_after_scheduler_restart_is_still_a_preemption(tmp_path) -> None:
    core = make_core(tmp_path)
    node, low, _high = _running_and_waiting(core, 0, 10)
    core.tick()
    core.store.close()
    core2 = make_core(tmp_path)  # the in-flight record is gone; the agent's report still says why
    node2, _ = register(core2, running=[(low.task_id, 1)])
    assert report(core2, node2, low.task_id, 1, C.TASK_STATE_CANCELLED, error="PREEMPTED")
    t = core2.api.get(low.task_id)
    assert t.state == C.TASK_STATE_PENDING and t.attempt == 2
    assert list(core2.store.events_after(low.task_id, 0))[-1].state_change.reason == "PREEMPTED"


def test_max_runtime_timeout_keeps_final_checkpoint(tmp_path) -> None:
    core = make_core(tmp_path)
    node, _ = register(core)
    s = spec(gpus=2)
    s.limits.max_runtime.FromSeconds(5)
    task = core.api.submit(s, owner="u")
    _run(core, node, task.task_id)
    core.active[task.task_id].start_time = time.time() - 10
    core.tick()
    t = core.api.get(task.task_id)
    assert t.state == C.TASK_STATE_FAILED and "max_runtime" in t.error
    assert list(core.store.events_after(task.task_id, 0))[-1].state_change.reason == "TIMEOUT"
    (cancel,) = _cancels(node)
    assert (cancel.task_id, cancel.reason) == (task.task_id, "TIMEOUT")
    # The worker checkpoints on SIGTERM; that report still lands, then the node confirms.
    report(core, node, task.task_id, 1, checkpoint=C.Checkpoint(step=7, path="/ck/step_7"))
    t = core.api.get(task.task_id)
    assert t.state == C.TASK_STATE_FAILED and t.latest_checkpoint.path == "/ck/step_7" and t.latest_checkpoint.step == 7
    kinds = [e.WhichOneof("event") for e in core.store.events_after(task.task_id, 0)]
    assert kinds[-1] == "checkpoint"
    assert task.task_id in node.allocations  # GPUs held until the worker is gone
    report(core, node, task.task_id, 1, C.TASK_STATE_CANCELLED, error="TIMEOUT")
    assert node.allocations == {} and core.table.stopping == {}
    # After that, no more checkpoints are taken for it, nor from another attempt.
    report(core, node, task.task_id, 1, checkpoint=C.Checkpoint(step=9, path="/ck/step_9"))
    assert core.api.get(task.task_id).latest_checkpoint.path == "/ck/step_7"
    assert core.api.get(task.task_id).state == C.TASK_STATE_FAILED


def test_a_gang_is_preempted_whole_and_requeued_once(tmp_path) -> None:
    """A high-priority task that needs a 2-node gang's GPUs on one node: every member is told to
    checkpoint and stop; the members other than member 0 only hand back their GPUs; member 0's
    CANCELLED report requeues the gang once (PREEMPTED, from its checkpoint); no member keeps GPUs."""
    from opentinker_scheduler.config import PoolNode, SchedulerConfig
    from opentinker_scheduler.state.core import SchedulerCore

    from tests.support.stores import make_store

    pool = (PoolNode("node-a", 2, 8), PoolNode("node-b", 2, 8))
    core = SchedulerCore(SchedulerConfig(resource_pool=pool, state_dir=tmp_path), make_store(tmp_path))
    nodes = {n: register(core, n, gpus=2)[0] for n in ("node-a", "node-b")}
    g = prio_spec(2, 0)
    g.resources.nodes = 2
    gang = core.api.submit(g, owner="u")
    core.schedule()
    t = core.api.get(gang.task_id)
    primary, other = nodes[t.node_id], nodes["node-b" if t.node_id == "node-a" else "node-a"]
    for n in (primary, other):
        drain(n)
        report(core, n, gang.task_id, 1, C.TASK_STATE_RUNNING)
    report(core, primary, gang.task_id, 1, checkpoint=C.Checkpoint(step=4, path="/ck/step_4"))
    high = core.api.submit(prio_spec(2, 10), owner="u")
    core.tick()
    for n in (primary, other):  # every member, once
        assert [(c.task_id, c.attempt, c.reason) for c in _cancels(n)] == [(gang.task_id, 1, "PREEMPTED")]
    report(core, other, gang.task_id, 1, C.TASK_STATE_CANCELLED, error="PREEMPTED")  # a member first
    assert gang.task_id not in other.allocations and core.api.get(gang.task_id).state == C.TASK_STATE_RUNNING
    report(
        core, primary, gang.task_id, 1, C.TASK_STATE_CANCELLED, error="PREEMPTED",
        checkpoint=C.Checkpoint(step=5, path="/ck/step_5"),
    )  # fmt: skip
    t = core.api.get(gang.task_id)
    assert t.state == C.TASK_STATE_PENDING and t.attempt == 2 and t.latest_checkpoint.step == 5
    reasons = [e.state_change.reason for e in core.store.events_after(gang.task_id, 0) if e.HasField("state_change")]
    assert reasons.count("PREEMPTED") == 1 and "HANDED_BACK" not in reasons
    assert not any(gang.task_id in n.allocations for n in (primary, other))
    assert core.schedule() == 1 and core.api.get(high.task_id).state == C.TASK_STATE_ASSIGNED


def test_exhausted_attempts_are_counted_as_the_spec_counts_them_with_hand_backs_apart(tmp_path) -> None:
    core = make_core(tmp_path, default_max_attempts=2)
    node, _ = register(core)
    low = core.api.submit(prio_spec(3, 0), owner="u")
    _run(core, node, low.task_id)
    high = core.api.submit(prio_spec(2, 10), owner="u")
    core.tick()
    assert report(core, node, low.task_id, 1, C.TASK_STATE_CANCELLED, error="PREEMPTED")  # handed back
    assert core.schedule() == 1
    drain(node)
    assert report(core, node, high.task_id, 1, C.TASK_STATE_SUCCEEDED)
    for attempt in (2, 3):  # the two attempts max_attempts allows, each failed
        core.api.get(low.task_id).not_before = 0.0  # no backoff wait in this test
        _run(core, node, low.task_id)
        assert core.api.get(low.task_id).attempt == attempt
        assert report(core, node, low.task_id, attempt, C.TASK_STATE_FAILED, error="boom", retryable=True)
    t = core.api.get(low.task_id)
    assert t.state == C.TASK_STATE_FAILED
    assert t.error == (
        "boom (max_attempts (2) exhausted; 1 more attempt was handed back "
        "(preempted, drained or node lost; not counted))"
    ), t.error
