"""Node liveness under a controlled clock: a scheduler whose own loop stalled gives nodes a grace
before declaring them lost, and disconnected nodes outside resource_pool are forgotten."""

from __future__ import annotations

import time

from opentinker.common.v1 import common_pb2 as C
from opentinker_scheduler.config import PoolNode, SchedulerConfig
from opentinker_scheduler.state.core import SchedulerCore
from tests.support.stores import make_store

from tests.support.scheduler_core import drain, register, report, spec


class Clock:
    """Monotonic time moved forward by hand: nodes heard on the real clock look older by ``shift``."""

    def __init__(self) -> None:
        self.shift = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.shift

    def advance(self, seconds: float) -> None:
        self.shift += seconds


def _core(tmp_path, clock: Clock, **kw) -> SchedulerCore:
    cfg = SchedulerConfig(resource_pool=(PoolNode("gpu-node-01", 4, 8),), state_dir=tmp_path, **kw)
    return SchedulerCore(cfg, make_store(tmp_path), clock=clock)


def _running(core: SchedulerCore):
    task = core.api.submit(spec(), owner="u")
    node, _ = register(core)
    core.schedule()
    drain(node)
    assert report(core, node, task.task_id, 1, C.TASK_STATE_RUNNING)
    return task, node


def _reasons(core: SchedulerCore, task_id: str) -> list[str]:
    return [e.state_change.reason for e in core.store.events_after(task_id, 0) if e.HasField("state_change")]


def test_a_stalled_scheduler_gives_nodes_restart_grace_before_declaring_them_lost(tmp_path) -> None:
    clock = Clock()
    core = _core(tmp_path, clock, lease_s=3, restart_grace_s=30)
    task, node = _running(core)
    # The scheduler process was stopped for 80 s: nothing was heard from anyone meanwhile.
    clock.advance(80)
    core.tick(stalled_s=80)
    t = core.api.get(task.task_id)
    assert t.state == C.TASK_STATE_RUNNING and t.attempt == 1
    assert "NODE_LOST" not in _reasons(core, task.task_id)
    # Its trainer re-registers (a new stream; the old one was silent past the lease) with the task.
    node, registered = register(core, running=[(task.task_id, 1)])
    assert list(registered.stale) == []
    core.tick()
    t = core.api.get(task.task_id)
    assert t.state == C.TASK_STATE_RUNNING and t.attempt == 1 and node.connected


def test_after_a_stall_a_node_that_never_comes_back_is_lost_once_the_grace_ends(tmp_path) -> None:
    clock = Clock()
    core = _core(tmp_path, clock, lease_s=3, restart_grace_s=30)
    task, _ = _running(core)
    clock.advance(80)
    core.tick(stalled_s=80)
    clock.advance(29)
    core.tick()
    assert core.api.get(task.task_id).attempt == 1
    clock.advance(2)  # restart_grace (30 s) since the scheduler woke up, still nothing heard
    core.tick()
    t = core.api.get(task.task_id)
    assert t.state == C.TASK_STATE_PENDING and t.attempt == 2
    assert "NODE_LOST" in _reasons(core, task.task_id)


def test_a_stall_shorter_than_the_lease_gives_no_grace(tmp_path) -> None:
    clock = Clock()
    core = _core(tmp_path, clock, lease_s=3, restart_grace_s=30)
    task, _ = _running(core)
    clock.advance(4)  # the node was silent past its lease while the loop ran late by 2 s only
    core.tick(stalled_s=2)
    t = core.api.get(task.task_id)
    assert t.state == C.TASK_STATE_PENDING and t.attempt == 2


def _gone(core: SchedulerCore, clock: Clock, node_id: str, gpus: int = 1):
    """A trainer that connected, then went away without a goodbye (lost after the lease)."""
    node, _ = register(core, node_id=node_id, gpus=gpus)
    core.node_disconnected(node, node.generation, goodbye=False)
    return node


def test_a_disconnected_node_outside_resource_pool_is_forgotten_after_forget_disconnected_after(tmp_path) -> None:
    clock = Clock()
    core = _core(tmp_path, clock, lease_s=3, forget_disconnected_after_s=600)
    _gone(core, clock, "dyn-1")
    clock.advance(10)
    core.tick()
    # Until then it is listed, and says when it will be forgotten.
    assert "dyn-1" in core.ledger.nodes
    notes = core.node_notes(core.ledger.nodes["dyn-1"])
    assert any("forgotten in 590 s" in n for n in notes), notes
    clock.advance(591)
    core.tick()
    assert "dyn-1" not in core.ledger.nodes
    assert core.store.node_register("dyn-1") is None
    # It may come back later as a new node.
    node, _ = register(core, node_id="dyn-1", gpus=1)
    assert core.ledger.nodes["dyn-1"].connected and not any("forgotten" in n for n in core.node_notes(node))


def test_nodes_in_resource_pool_or_holding_tasks_are_never_forgotten(tmp_path) -> None:
    clock = Clock()
    core = _core(tmp_path, clock, lease_s=3, restart_grace_s=30, forget_disconnected_after_s=600)
    _gone(core, clock, "gpu-node-01", gpus=4)  # in resource_pool
    # A dynamic node running a task, silent for long while the scheduler itself was stopped:
    # within the grace it still holds the task, so it is not forgotten either.
    task = core.api.submit(spec(gpus=1), owner="u")
    node, _ = register(core, node_id="dyn-2", gpus=1)
    core.schedule()
    assert core.api.get(task.task_id).node_id == "dyn-2"
    core.node_disconnected(node, node.generation, goodbye=False)
    clock.advance(10_000)
    core.tick(stalled_s=10_000)
    assert "gpu-node-01" in core.ledger.nodes
    assert not any("forgotten" in n for n in core.node_notes(core.ledger.nodes["gpu-node-01"]))
    assert "dyn-2" in core.ledger.nodes and core.ledger.nodes["dyn-2"].allocations


def test_forget_disconnected_after_counts_from_the_last_time_the_node_was_heard(tmp_path) -> None:
    clock = Clock()
    core = _core(tmp_path, clock, lease_s=3, forget_disconnected_after_s=60)
    node = _gone(core, clock, "dyn-3")
    clock.advance(50)
    node, _ = register(core, node_id="dyn-3", gpus=1)  # back, then gone again
    core.node_disconnected(node, node.generation, goodbye=False)
    clock.advance(50)
    core.tick()
    assert "dyn-3" in core.ledger.nodes
    clock.advance(11)
    core.tick()
    assert "dyn-3" not in core.ledger.nodes
