"""Placement policy: priority then age, gang, max_tasks, best fit, backfill, pending reasons."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from opentinker_scheduler.policy.placement import NodeCapacity, PendingTask, plan, queue_order


def node(node_id: str, gpus: int, max_tasks: int = 8, used: int = 0, running: int = 0) -> NodeCapacity:
    return NodeCapacity(node_id, gpus, max_tasks, running, list(range(used, gpus)))


def test_priority_then_age() -> None:
    tasks = [PendingTask("old-low", 1, 1.0, 1), PendingTask("new-high", 2, 5.0, 1), PendingTask("old-high", 2, 2.0, 1)]
    assert [t.task_id for t in queue_order(tasks)] == ["old-high", "new-high", "old-low"]
    placements, reasons = plan(tasks, [node("n", 2)], now=10)
    assert [p.task_id for p in placements] == ["old-high", "new-high"]
    assert "old-low" in reasons and "no node has 1 free GPU" in reasons["old-low"]
    assert "queue position 3 of 3" in reasons["old-low"]


def test_gang_all_gpus_on_one_node() -> None:
    placements, reasons = plan([PendingTask("big", 1, 0, 4)], [node("a", 2), node("b", 2)], now=0)
    assert placements == []
    assert reasons["big"].startswith("no connected node has 4 GPU(s); the largest is a with 2")
    placements, _ = plan([PendingTask("big", 1, 0, 4)], [node("a", 2), node("b", 4)], now=0)
    assert placements[0].node_id == "b" and placements[0].device_indices == (0, 1, 2, 3)


def test_free_block_reason_kubernetes_style() -> None:
    _, reasons = plan([PendingTask("t", 1, 0, 4)], [node("gpu-node-01", 4, used=2)], now=0)
    assert reasons["t"].startswith("no node has 4 free GPU(s); largest free block is 2 on gpu-node-01")


def test_max_tasks_limits_cpu_tasks() -> None:
    tasks = [PendingTask(f"t{i}", 0, i, 0) for i in range(3)]
    placements, reasons = plan(tasks, [node("n", 0, max_tasks=2)], now=0)
    assert len(placements) == 2
    assert "at max_tasks" in reasons["t2"]


def test_backfill_small_task_behind_big_one() -> None:
    tasks = [PendingTask("big", 5, 0, 4), PendingTask("small", 1, 1, 1)]
    placements, reasons = plan(tasks, [node("n", 4, used=2), node("m", 2)], now=0)
    assert [(p.task_id, p.node_id) for p in placements] == [("small", "m")]  # backfills elsewhere
    assert "big" in reasons and "n is reserved for it" in reasons["big"]
    # The blocked task's reserved node takes nothing from behind it (no starvation).
    placements, reasons = plan(tasks, [node("n", 4, used=2)], now=0)
    assert placements == [] and "small" in reasons


def test_best_fit_packs() -> None:
    placements, _ = plan([PendingTask("t", 1, 0, 1)], [node("roomy", 8), node("snug", 1)], now=0)
    assert placements[0].node_id == "snug"


def test_backoff_and_no_nodes() -> None:
    _, reasons = plan([PendingTask("t", 1, 0, 0, not_before=100)], [node("n", 0)], now=50)
    assert "before retrying" in reasons["t"]
    _, reasons = plan([PendingTask("t", 1, 0, 0)], [], now=0)
    assert reasons["t"].startswith("no trainer node is connected")
    draining = node("n", 4)
    draining.accepting = False
    _, reasons = plan([PendingTask("t", 1, 0, 1)], [draining], now=0)
    assert reasons["t"].startswith("no trainer node is connected")


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 8), st.integers(-3, 3)), max_size=30),
    st.lists(st.tuples(st.integers(0, 8), st.integers(0, 8), st.integers(1, 6)), min_size=0, max_size=6),
)
def test_plan_never_oversubscribes(task_specs, node_specs) -> None:
    tasks = [PendingTask(f"t{i}", prio, float(i), gpus) for i, (gpus, prio) in enumerate(task_specs)]
    nodes = [NodeCapacity(f"n{i}", g, m, 0, list(range(min(u, g), g))) for i, (g, u, m) in enumerate(node_specs)]
    placements, reasons = plan(tasks, nodes, now=0)
    assert {p.task_id for p in placements}.isdisjoint(reasons)
    assert {p.task_id for p in placements} | set(reasons) == {t.task_id for t in tasks}
    by_id = {t.task_id: t for t in tasks}
    for n in nodes:
        mine = [p for p in placements if p.node_id == n.node_id]
        used = [d for p in mine for d in p.device_indices]
        assert len(used) == len(set(used)), "a GPU given twice"
        assert set(used) <= set(n.free_gpus), "a busy or missing GPU given"
        assert len(mine) <= n.max_tasks
        for p in mine:
            assert len(p.device_indices) == by_id[p.task_id].gpu_count


def test_reason_behind_a_reservation_names_it() -> None:
    tasks = [PendingTask("big", 3, 0, 4), PendingTask("small", 1, 1, 1), PendingTask("small2", 1, 2, 2)]
    placements, reasons = plan(tasks, [node("gpu-node-01", 4, used=2, running=1)], now=0)
    assert placements == []
    assert "gpu-node-01 is reserved for it" in reasons["big"]
    assert reasons["small"] == (
        "node gpu-node-01 is reserved for big (4 GPUs, priority 3) until it starts; queue position 2 of 3"
    )
    assert reasons["small2"].startswith("node gpu-node-01 is reserved for big")


def test_cpu_tasks_take_spare_slots_on_a_reserved_node() -> None:
    """A CPU task needs none of the reserved GPUs: it goes on the reserved node while that leaves
    the one slot the reservation needs; GPU tasks behind the reservation still do not."""
    tasks = [PendingTask("big", 3, 0, 4), PendingTask("small", 1, 1, 1)]
    tasks += [PendingTask(f"cpu{i}", 1, 2 + i, 0) for i in range(3)]
    placements, reasons = plan(tasks, [node("n", 4, max_tasks=3, used=2, running=1)], now=0)
    assert [(p.task_id, p.node_id, p.device_indices) for p in placements] == [("cpu0", "n", ())]
    assert "n is reserved for it" in reasons["big"]
    assert reasons["cpu1"] == "node n is reserved for big (4 GPUs, priority 3) until it starts; queue position 4 of 5"
    assert reasons["small"].startswith("node n is reserved for big")


def test_a_round_keeps_a_group_off_the_nodes_left_out_for_it() -> None:
    from opentinker_scheduler.policy.placement import FreeNodes, PlacementGroup, RoundHooks, place_round

    ledger = {c.node_id: c for c in (node("a", 1), node("b", 2), node("c", 4))}
    free = FreeNodes()
    for c in ledger.values():
        free.update(c)
    assert free.best_fit(1, frozenset({"a", "b"})) == "c" and free.most_free_gpus(frozenset({"c"})) == 2
    groups = {
        PlacementGroup(1, None, "q", loggers=frozenset({"mlflow"})): [(0.0, "logs")],
        PlacementGroup(1, None, "q"): [(1.0, "plain")],
    }
    got = []

    def take(key, group, node_id) -> None:
        cap = ledger[node_id]
        cap.book(cap.choose_devices(group.gpu_count, group.share_key), group.share_key)
        free.update(cap)
        got.append((key[1], node_id))

    left_out = {frozenset({"mlflow"}): frozenset({"a", "b"})}
    place_round(groups, free, 0.0, RoundHooks(take, left_out=lambda g: left_out.get(g.loggers, frozenset())))
    assert got == [("logs", "c"), ("plain", "a")]  # best fit "a" for the one it may use
