"""No starvation under backfill: the first blocked task in queue order reserves a node, and no
task behind it is placed there in that round (plan and the core's incremental round alike)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from opentinker.common.v1 import common_pb2 as C
from opentinker_scheduler.policy.placement import (
    RESERVATION_SLOTS,
    NodeCapacity,
    PendingTask,
    plan,
    queue_order,
    reservation_node,
)

from tests.support.scheduler_core import drain, make_core, register, report, spec


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 6), st.integers(-2, 2), st.booleans()), max_size=30),
    st.lists(
        st.tuples(st.integers(0, 8), st.integers(0, 8), st.integers(1, 6), st.integers(0, 3), st.booleans()), max_size=6
    ),
)
def test_reserved_node_gets_nothing_from_behind(task_specs, node_specs) -> None:
    tasks = [
        PendingTask(f"t{i:02d}", prio, float(i % 5), gpus, not_before=50.0 if waiting else 0.0)
        for i, (gpus, prio, waiting) in enumerate(task_specs)
    ]
    nodes = [
        NodeCapacity(f"n{i}", g, m, running, list(range(min(u, g), g)), accepting)
        for i, (g, u, m, running, accepting) in enumerate(node_specs)
    ]
    placements, reasons = plan(tasks, nodes, now=10.0)
    placed = {p.task_id: p for p in placements}
    ordered = [t for t in queue_order(tasks) if t.not_before <= 10.0]
    # Replay the round to find the first blocked task that could ever fit somewhere.
    caps = {
        n.node_id: NodeCapacity(n.node_id, n.gpu_count, n.max_tasks, n.running, sorted(n.free_gpus), n.accepting)
        for n in nodes
    }
    reserver, reserved = None, None
    for t in ordered:
        if t.task_id in placed:
            c = caps[placed[t.task_id].node_id]
            c.free_gpus = c.free_gpus[t.gpu_count :]
            c.running += 1
            continue
        reserved = reservation_node(t.gpu_count, caps.values())
        if reserved is not None:
            reserver = t
            break
    if reserver is None:
        return
    # The reserver is blocked, it could fit on the reserved node if that node were empty, and
    # nothing behind it in queue order that uses a GPU went there; CPU tasks behind it went there
    # only into slots the reservation does not need.
    node = next(n for n in nodes if n.node_id == reserved)
    assert node.accepting and node.gpu_count >= reserver.gpu_count
    assert f"{reserved} is reserved for it" in reasons[reserver.task_id]
    behind = ordered[ordered.index(reserver) + 1 :]
    there = [t for t in behind if t.task_id in placed and placed[t.task_id].node_id == reserved]
    assert not [t.task_id for t in there if t.gpu_count > 0]
    on_node = [p for p in placements if p.node_id == reserved]
    assert not there or node.max_tasks - node.running - len(on_node) >= RESERVATION_SLOTS
    # A task behind it that fits only on the reserved node is told about the reservation.
    for t in behind:
        if t.task_id in reasons and t.not_before <= 10.0 and reasons[t.task_id].startswith(f"node {reserved} "):
            assert f"is reserved for {reserver.task_id} ({reserver.gpu_count} GPU" in reasons[t.task_id]


def test_core_round_keeps_reserved_node_for_big_task(tmp_path) -> None:
    """Small tasks keep arriving on a one-node cluster: the big task still gets the node."""
    core = make_core(tmp_path, max_tasks_per_gpu=1)
    node, _ = register(core)
    first = core.api.submit(spec(gpus=2), owner="u")
    core.schedule()
    drain(node)
    report(core, node, first.task_id, 1, C.TASK_STATE_RUNNING)
    big = core.api.submit(spec(gpus=4), owner="u")
    small = core.api.submit(spec(gpus=1), owner="u")
    assert core.schedule() == 0  # 2 GPUs free, but the node is reserved for the big task
    assert "gpu-node-01 is reserved for it" in core.reasons.reason(big.task_id)
    assert core.api.get(small.task_id).state == C.TASK_STATE_PENDING
    report(core, node, first.task_id, 1, C.TASK_STATE_SUCCEEDED)
    assert core.schedule() == 1
    assert core.api.get(big.task_id).state == C.TASK_STATE_ASSIGNED


def test_core_round_backfills_on_other_nodes(tmp_path) -> None:
    core = make_core(tmp_path, max_tasks_per_gpu=1)
    a, _ = register(core, node_id="a", gpus=4)
    b, _ = register(core, node_id="b", gpus=2)
    first = core.api.submit(spec(gpus=3), owner="u")
    core.schedule()
    assert core.api.get(first.task_id).node_id == "a"
    big = core.api.submit(spec(gpus=4), owner="u")
    small = core.api.submit(spec(gpus=1), owner="u")
    assert core.schedule() == 1
    assert core.api.get(small.task_id).node_id == "b"  # best fit would pick a; a is reserved
    assert core.api.get(big.task_id).state == C.TASK_STATE_PENDING


def test_pending_reason_names_the_reservation(tmp_path) -> None:
    """A task held back only by the reservation says so, naming the reserving task and node
    (not "waiting for the next placement round")."""
    core = make_core(tmp_path, max_tasks_per_gpu=1)
    node, _ = register(core)
    first = core.api.submit(spec(gpus=2), owner="u")
    core.schedule()
    big = core.api.submit(spec(gpus=4), owner="u")
    small = core.api.submit(spec(gpus=1), owner="u")
    assert core.schedule() == 0
    why = core.reasons.reason(small.task_id)
    assert why == (
        f"node gpu-node-01 is reserved for {big.task_id} (4 GPUs, priority {big.priority}) until it starts; "
        "queue position 2 of 2"
    )
    assert "gpu-node-01 is reserved for it" in core.reasons.reason(big.task_id)
    assert core.api.get(first.task_id).node_id == node.node_id


def test_cpu_tasks_use_spare_slots_and_the_reservation_still_wins(tmp_path) -> None:
    """CPU tasks start on the reserved node in the max_tasks slots the reservation does not need;
    the last slot stays free, so the big task starts as soon as its GPUs free up."""
    core = make_core(tmp_path, max_tasks_per_gpu=1)
    node, _ = register(core)  # 4 GPUs, max_tasks 8
    first = core.api.submit(spec(gpus=2), owner="u")
    core.schedule()
    drain(node)
    report(core, node, first.task_id, 1, C.TASK_STATE_RUNNING)
    big = core.api.submit(spec(gpus=4), owner="u")
    small = core.api.submit(spec(gpus=1), owner="u")
    cpu = [core.api.submit(spec(gpus=0), owner="u") for _ in range(7)]
    assert core.schedule() == 6  # 1 running + 6 CPU tasks: one slot left for the big task
    assert [core.api.get(t.task_id).state for t in cpu] == [C.TASK_STATE_ASSIGNED] * 6 + [C.TASK_STATE_PENDING]
    assert core.api.get(small.task_id).state == C.TASK_STATE_PENDING
    assert f"node gpu-node-01 is reserved for {big.task_id}" in core.reasons.reason(cpu[-1].task_id)
    assert f"node gpu-node-01 is reserved for {big.task_id}" in core.reasons.reason(small.task_id)
    more = core.api.submit(spec(gpus=0), owner="u")  # still arriving: the last slot stays the big task's
    assert core.schedule() == 0
    report(core, node, first.task_id, 1, C.TASK_STATE_SUCCEEDED)
    assert core.schedule() >= 1
    assert core.api.get(big.task_id).state == C.TASK_STATE_ASSIGNED
    assert core.api.get(big.task_id).node_id == "gpu-node-01"
    assert core.api.get(small.task_id).state == C.TASK_STATE_PENDING
    assert core.api.get(more.task_id).state in (C.TASK_STATE_PENDING, C.TASK_STATE_ASSIGNED)
