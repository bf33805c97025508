"""Victim choice for preemption: strictly lower priority, fewest victims, youngest first."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from opentinker_scheduler.policy.preemption import NodeState, RunningAlloc, choose_victims


def test_lower_priority_youngest_first() -> None:
    node = NodeState("n", 4, 8, 0, (RunningAlloc("old", 1, 2, 10.0), RunningAlloc("young", 1, 2, 20.0)))
    assert choose_victims(2, 2, [node]).victims == ("young",)
    assert choose_victims(2, 4, [node]).victims == ("young", "old")


def test_equal_or_higher_priority_never_preempted() -> None:
    node = NodeState("n", 2, 8, 0, (RunningAlloc("peer", 2, 2, 1.0),))
    assert choose_victims(2, 1, [node]) is None
    assert choose_victims(1, 1, [node]) is None


def test_fewest_victims_across_nodes_and_slots() -> None:
    a = NodeState("a", 4, 8, 0, (RunningAlloc("a1", 0, 2, 1.0), RunningAlloc("a2", 0, 2, 2.0)))
    b = NodeState("b", 4, 8, 2, (RunningAlloc("b1", 0, 2, 1.0),))
    assert choose_victims(5, 4, [a, b]) == choose_victims(5, 4, [b, a])
    assert choose_victims(5, 4, [a, b]).node_id == "b"
    full = NodeState("c", 0, 1, 0, (RunningAlloc("cpu", 0, 0, 1.0),))  # CPU task slots
    assert choose_victims(1, 0, [full]).victims == ("cpu",)
    assert choose_victims(1, 8, [a, b]) is None


def test_a_gang_is_one_victim_that_stops_every_node_it_spans() -> None:
    gang = RunningAlloc("gang", 0, 2, 20.0, nodes=2)  # a member of a 2-node gang: 2 GPUs here
    solo = RunningAlloc("solo", 0, 2, 10.0)  # older, otherwise the youngest would go first
    node = NodeState("a", 4, 8, 0, (gang, solo))
    assert choose_victims(5, 2, [node]).victims == ("solo",)  # one node stopped, not two
    assert choose_victims(5, 4, [node]).victims == ("solo", "gang")  # the gang last
    # Across nodes: a node where one ordinary task makes room wins over one where the gang must go.
    b = NodeState("b", 2, 8, 0, (RunningAlloc("b1", 0, 2, 1.0),))
    only_gang = NodeState("c", 2, 8, 0, (RunningAlloc("gang", 0, 2, 20.0, nodes=2),))
    assert choose_victims(5, 2, [only_gang, b]).node_id == "b"
    assert choose_victims(5, 2, [only_gang]).victims == ("gang",)  # still a victim when it is the only one


@given(
    st.integers(-2, 3),
    st.integers(0, 4),
    st.lists(st.tuples(st.integers(-2, 3), st.integers(0, 2)), max_size=6),
    st.integers(0, 4),
)
def test_victims_always_make_room_and_are_lower(priority, gpus, running, free) -> None:
    allocs = tuple(RunningAlloc(f"t{i}", p, g, float(i)) for i, (p, g) in enumerate(running))
    node = NodeState("n", free + sum(g for _, g in running), len(allocs) + 1, free, allocs)
    choice = choose_victims(priority, gpus, [node])
    if choice is None:
        return
    by_id = {a.task_id: a for a in allocs}
    assert all(by_id[v].priority < priority for v in choice.victims)
    assert free + sum(by_id[v].gpu_count for v in choice.victims) >= gpus
