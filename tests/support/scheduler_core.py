"""Helpers for tests of the scheduler core without gRPC: a core on a one-node pool, task specs,
a registered node, the messages queued for it, and task reports from it."""

from __future__ import annotations

from pathlib import Path

from google.protobuf import struct_pb2

from opentinker.common.v1 import common_pb2 as C
from opentinker.node.v1 import node_pb2 as N
from opentinker_scheduler.config import PoolNode, SchedulerConfig
from opentinker_scheduler.state.core import SchedulerCore
from tests.support.stores import make_store


def make_core(tmp: Path, **kw) -> SchedulerCore:
    """A core on a one-node pool, its store on the current backend (tests/support/stores.py)."""
    cfg = SchedulerConfig(resource_pool=(PoolNode("gpu-node-01", 4, 8),), state_dir=tmp, **kw)
    return SchedulerCore(cfg, make_store(tmp))


def spec(gpus: int = 0, model: str = "/models/m", **hp) -> C.TaskSpec:
    s = C.TaskSpec(workload_type="lora_finetune", model=model, resources=C.Resources(gpu_count=gpus))
    h = struct_pb2.Struct()
    h.update(hp)
    s.hyperparameters.CopyFrom(h)
    return s


def register(core: SchedulerCore, node_id: str = "gpu-node-01", gpus: int = 4, running=()):
    devices = [C.Device(index=i, uuid=f"u{i}", name="g", simulated=True) for i in range(gpus)]
    running_tasks = [N.RunningTask(task_id=t, attempt=a) for t, a in running]
    return core.node_register(N.Register(node_id=node_id, devices=devices, max_tasks=8, running=running_tasks))


def drain(node) -> list:
    out = []
    while not node.outbox.empty():
        out.append(node.outbox.get_nowait())
    return out


def report(core, node, task_id, attempt, state=C.TASK_STATE_UNSPECIFIED, **kw):
    return core.node_report(node, N.TaskReport(task_id=task_id, attempt=attempt, state=state, **kw))


def pg_group_commit_core(tmp: Path):
    """A leading core with group commit on, on a fresh PostgreSQL schema of the current test
    server (``postgres_only`` tests); one node registered.
    Returns ``(core, node)``."""
    from tests.support import stores
    from opentinker_scheduler.state.pg_store import PostgresStore

    store = PostgresStore(stores.current.server.dsn(), schema_name=stores.current.server.new_schema())
    stores.current.opened.append(store)
    stores.take_lead(store)
    core = SchedulerCore(SchedulerConfig(resource_pool=(PoolNode("gpu-node-01", 4, 8),), state_dir=tmp), store)
    core.enable_group_commit()
    node, _ = register(core)
    return core, node


def committed_state(store, task_id: str):
    """The task's committed state (read on a second connection), or None when not committed."""
    from tests.support.stores import committed

    rows = committed(store, "SELECT state FROM tasks WHERE task_id=?", (task_id,))
    return rows[0][0] if rows else None


async def until(predicate, what: str) -> None:
    """Yield to the loop until ``predicate()`` (progress, not a time budget: the suite's hang
    guard ends a test that never gets there)."""
    import asyncio

    while not predicate():
        await asyncio.sleep(0.01)
    assert predicate(), what
