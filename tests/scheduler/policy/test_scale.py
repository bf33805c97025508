"""The scale signal (policy/scale.py): busy nodes count, pending work fills free room first, the
rest needs new template-sized trainers (gangs on distinct nodes), idle nodes are not needed."""

from __future__ import annotations

from opentinker_scheduler.policy.scale import ClassNode, Demand, desired_trainers


def test_idle_nodes_are_not_needed_and_busy_ones_are() -> None:
    nodes = [ClassNode("a", "spot", 4, 8, 0), ClassNode("b", "spot", 0, 7, 1)]
    assert desired_trainers(nodes, [], scale_class="spot", template=(4, 8)) == {"spot": 1}


def test_pending_work_fills_free_room_then_new_trainers() -> None:
    nodes = [ClassNode("a", "on-demand", 2, 8, 1)]
    demand = [Demand(1, 1, 2), Demand(4, 1, 3), Demand(0, 1, 5)]
    # a takes the two 1-GPU tasks and the CPU tasks; three 4-GPU tasks need three new nodes.
    assert desired_trainers(nodes, demand, scale_class="spot", template=(4, 8)) == {"on-demand": 1, "spot": 3}


def test_a_gang_needs_distinct_nodes_and_oversized_work_adds_none() -> None:
    demand = [Demand(2, 3, 1), Demand(8, 1, 1)]
    assert desired_trainers([], demand, scale_class="x", template=(4, 4)) == {"x": 3}
    assert desired_trainers([], demand, scale_class="x", template=(0, 0)) == {"x": 0}
