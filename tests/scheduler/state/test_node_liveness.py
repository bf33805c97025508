"""Node liveness under a controlled clock: a scheduler whose own loop stalled gives nodes a grace
before declaring them lost, and disconnected nodes outside resource_pool are forgotten."""

from __future__ import annotations

import time

from opentinker.common.v1 import common_pb2 as C
from opentinker_scheduler.config import PoolNode, SchedulerConfig
from opentinker_scheduler.state.core import SchedulerCore
from opentinker_scheduler.state.store import Store

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
    return SchedulerCore(cfg, Store(tmp_path), clock=clock)


def _running(core: SchedulerCore):
    task = core.submit(spec(), owner="u")
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
    t = core.get(task.task_id)
    assert t.state == C.TASK_STATE_RUNNING and t.attempt == 1
    assert "NODE_LOST" not in _reasons(core, task.task_id)
    # Its trainer re-registers (a new stream; the old one was silent past the lease) with the task.
    node, registered = register(core, running=[(task.task_id, 1)])
    assert list(registered.stale) == []
    core.tick()
    t = core.get(task.task_id)
    assert t.state == C.TASK_STATE_RUNNING and t.attempt == 1 and node.connected


def test_after_a_stall_a_node_that_never_comes_back_is_lost_once_the_grace_ends(tmp_path) -> None:
    clock = Clock()
    core = _core(tmp_path, clock, lease_s=3, restart_grace_s=30)
    task, _ = _running(core)
    clock.advance(80)
    core.tick(stalled_s=80)
    clock.advance(29)
    core.tick()
    assert core.get(task.task_id).attempt == 1
    clock.advance(2)  # restart_grace (30 s) since the scheduler woke up, still nothing heard
    core.tick()
    t = core.get(task.task_id)
    assert t.state == C.TASK_STATE_PENDING and t.attempt == 2
    assert "NODE_LOST" in _reasons(core, task.task_id)


def test_a_stall_shorter_than_the_lease_gives_no_grace(tmp_path) -> None:
    clock = Clock()
    core = _core(tmp_path, clock, lease_s=3, restart_grace_s=30)
    task, _ = _running(core)
    clock.advance(4)  # the node was silent past its lease while the loop ran late by 2 s only
    core.tick(stalled_s=2)
    t = core.get(task.task_id)
    assert t.state == C.TASK_STATE_PENDING and t.attempt == 2
