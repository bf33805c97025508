"""The pure gang rules: all members or none, best fit, reservation, rendezvous ports, refusal."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from opentinker_scheduler.config import parse_config
from opentinker_scheduler.policy.gang import GangTask, gang_never_fits, gang_reservation, place_gang, rendezvous_port
from opentinker_scheduler.policy.placement import NodeCapacity


def cap(node_id: str, gpus: int, free: list[int], running: int = 0, accepting: bool = True) -> NodeCapacity:
    return NodeCapacity(node_id, gpus, 8, running, list(free), accepting)


def gang(nodes: int, gpus: int) -> GangTask:
    return GangTask("t", 1, 0.0, gpus, nodes)


def test_members_by_best_fit_with_the_lowest_free_devices() -> None:
    caps = [cap("a", 4, [0, 1, 2, 3]), cap("b", 2, [0, 1]), cap("c", 4, [1, 3], running=1)]
    placed = place_gang(gang(2, 2), caps)
    assert placed.members == (("b", (0, 1)), ("c", (1, 3)))  # no GPU left over on either
    assert place_gang(gang(2, 2), caps, exclude=["b"]).members == (("c", (1, 3)), ("a", (0, 1)))


def test_never_half_places() -> None:
    caps = [cap("a", 2, [0, 1]), cap("b", 2, [0]), cap("c", 2, [0, 1], accepting=False)]
    assert place_gang(gang(2, 2), caps) is None


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4), st.booleans()), min_size=1, max_size=6),
    st.integers(1, 4),
    st.integers(1, 3),
)
def test_a_placement_is_whole_distinct_and_within_free_gpus(node_specs, nodes, gpus) -> None:
    caps = [cap(f"n{i}", g, list(range(min(f, g))), accepting=acc) for i, (g, f, acc) in enumerate(node_specs)]
    placed = place_gang(gang(nodes, gpus), caps)
    room = [c for c in caps if c.accepting and len(c.free_gpus) >= gpus]
    if placed is None:
        assert len(room) < nodes
        return
    ids = [n for n, _ in placed.members]
    assert len(ids) == nodes == len(set(ids))
    by_id = {c.node_id: c for c in caps}
    for n, devices in placed.members:
        assert len(devices) == gpus and set(devices) <= set(by_id[n].free_gpus) and by_id[n].accepting


def test_reservation_takes_the_nodes_with_most_free_gpus() -> None:
    caps = [cap("a", 4, [0]), cap("b", 4, [0, 1, 2]), cap("c", 4, [0, 1]), cap("d", 1, [0])]
    assert gang_reservation(gang(2, 4), caps) == ("b", "c")
    assert gang_reservation(gang(4, 4), caps) is None  # d can never hold a 4-GPU member


def test_rendezvous_port_is_the_lowest_free_of_the_range() -> None:
    assert rendezvous_port([], 29500, 29502) == 29500
    assert rendezvous_port([29500, 29501], 29500, 29502) == 29502
    assert rendezvous_port([29500, 29501, 29502], 29500, 29502) is None


def test_a_gang_larger_than_the_cluster_names_the_numbers() -> None:
    why = gang_never_fits(3, 2, {"a": 2, "b": 4, "c": 1})
    assert why == (
        "spec.resources.nodes: 3 nodes with 2 GPU(s) each asked (6 GPUs), but only 2 node(s) of the cluster "
        "have 2+ GPUs (GPUs per node: a: 2, b: 4, c: 1)"
    )
    assert gang_never_fits(2, 2, {"a": 2, "b": 4}) is None


def test_the_port_range_is_configured() -> None:
    assert parse_config("gang_rendezvous_ports: [30000, 30010]\n").gang_rendezvous_ports == (30000, 30010)
    for bad, want in (("[30010, 30000]", "low <= high"), ("[1, 2, 3]", "two ports"), ("[80, 90]", "1024")):
        try:
            parse_config(f"gang_rendezvous_ports: {bad}\n", "c.yaml")
        except Exception as exc:  # noqa: BLE001 - ConfigError
            assert "c.yaml:1:" in str(exc) and want in str(exc), str(exc)
        else:
            raise AssertionError(bad)
