"""The scheduler's in-memory indexes and group commit: the pending queue, the free-node index,
placement rounds over them (same answers as ``plan``), and commits that hold everything back
until they are durable."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opentinker.common.v1 import common_pb2 as C
from opentinker_scheduler.policy.placement import (
    FreeNodes,
    NodeCapacity,
    PendingTask,
    Placement,
    PlacementGroup,
    RoundHooks,
    place_round,
    plan,
    reservation_node,
)
from opentinker_scheduler.state.queue import PendingQueue

from tests.support.scheduler_core import drain, make_core, register, report, spec
from tests.support.stores import committed


def row(task_id: str, priority: int, create_time: float, gpus: int):
    from opentinker_scheduler.state.store import TaskRow

    return TaskRow(
        task_id=task_id,
        owner="u",
        spec=C.TaskSpec(),
        state=C.TASK_STATE_PENDING,
        attempt=1,
        priority=priority,
        gpu_count=gpus,
        max_attempts=3,
        max_runtime_s=None,
        create_time=create_time,
        update_time=create_time,
    )


def test_pending_queue_order_position_and_groups() -> None:
    q = PendingQueue()
    for tid, prio, t, g in [("a", 1, 3.0, 0), ("b", 2, 5.0, 1), ("c", 1, 1.0, 1), ("d", 2, 4.0, 0)]:
        q.put(row(tid, prio, t, g))
    assert [r.task_id for r in q] == ["d", "b", "c", "a"]  # priority desc, then oldest
    assert [q.position(t) for t in "dbca"] == [1, 2, 3, 4]
    assert {g: [k[2] for k in keys] for g, keys in q.groups().items()} == {
        PlacementGroup(0, None, "u"): ["d", "a"],
        PlacementGroup(1, None, "u"): ["b", "c"],
    }
    q.put(row("b", 2, 5.0, 1))  # replacing a row keeps one entry
    assert len(q) == 4
    assert q.discard("b").task_id == "b" and q.discard("b") is None
    assert [r.task_id for r in q] == ["d", "c", "a"] and q.position("c") == 2 and q.position("b") == 0
    q.discard("c")
    assert PlacementGroup(1, None, "u") not in q.groups()


def test_free_nodes_best_fit_matches_policy() -> None:
    free = FreeNodes()
    free.update(NodeCapacity("roomy", 8, 4, 0, list(range(8))))
    free.update(NodeCapacity("snug", 2, 4, 1, [1]))
    free.update(NodeCapacity("full", 2, 1, 1, [0, 1]))  # no slot left: not indexed
    free.update(NodeCapacity("gone", 4, 4, 0, [0, 1, 2, 3], accepting=False))
    assert len(free) == 2 and "full" not in free and "gone" not in free
    assert free.best_fit(0) == "snug" and free.best_fit(1) == "snug" and free.best_fit(2) == "roomy"
    assert free.best_fit(9) is None and free.most_free_gpus() == 8
    free.update(NodeCapacity("roomy", 8, 4, 4, []))  # now full
    assert free.best_fit(2) is None and free.most_free_gpus() == 1
    free.remove("snug")
    assert not free and free.most_free_gpus() == -1


def _round(tasks: list[PendingTask], nodes: list[NodeCapacity], now: float) -> list[Placement]:
    caps = {n.node_id: n.copy() for n in nodes}
    free = FreeNodes()
    for c in caps.values():
        free.update(c)
    by_id = {t.task_id: t for t in tasks}
    groups: dict[PlacementGroup, list] = {}
    for t in tasks:
        groups.setdefault(PlacementGroup(t.gpu_count, t.share_key), []).append((-t.priority, t.create_time, t.task_id))
    for keys in groups.values():
        keys.sort()
    out: list[Placement] = []

    def take(key, group, node_id: str) -> None:
        c = caps[node_id]
        devices = c.choose_devices(group.gpu_count, group.share_key)
        c.book(devices, group.share_key)
        free.update(c.copy())
        out.append(Placement(key[2], node_id, devices))

    reserve = lambda key, gpu_count: reservation_node(gpu_count, caps.values())  # noqa: E731
    hooks = RoundHooks(take, not_before=lambda key: by_id[key[2]].not_before, reserve=reserve)
    assert place_round(groups, free, now, hooks) == len(out)
    return out


def _shared_node(
    i: int, g: int, u: int, m: int, running: int, accepting: bool, share: int, per_gpu: int
) -> NodeCapacity:
    """A node whose first ``u`` GPUs are busy; of those, the first ``share`` are held by LoRA tasks
    on base model "a" or "b" (alternating), with 1..per_gpu tasks on each."""
    u = min(u, g)
    gpu_share = {d: ("ab"[d % 2], 1 + (d * 7 + i) % per_gpu) for d in range(min(share, u))}
    return NodeCapacity(f"n{i}", g, m, running, list(range(u, g)), accepting, gpu_share, per_gpu)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.integers(-2, 2), st.booleans(), st.sampled_from([None, "a", "b"])), max_size=40
    ),
    st.lists(
        st.tuples(
            st.integers(0, 8),
            st.integers(0, 8),
            st.integers(1, 6),
            st.integers(0, 3),
            st.booleans(),
            st.integers(0, 4),
            st.integers(1, 3),
        ),
        max_size=8,
    ),
)
def test_place_round_agrees_with_plan(task_specs, node_specs) -> None:
    """The incremental round the core runs places exactly what the reference policy places,
    with GPU sharing between LoRA tasks on the same base model in play."""
    tasks = [
        PendingTask(
            f"t{i:02d}", prio, float(i % 7), gpus, not_before=50.0 if waiting else 0.0, share_key=key if gpus else None
        )
        for i, (gpus, prio, waiting, key) in enumerate(task_specs)
    ]
    nodes = [_shared_node(i, *spec_) for i, spec_ in enumerate(node_specs)]
    expected, _ = plan(tasks, nodes, now=10.0)
    assert _round(tasks, nodes, now=10.0) == expected
    # plan itself never overfills a GPU nor mixes base models on one.
    caps = {n.node_id: n.copy() for n in nodes}
    for p in expected:
        task = next(t for t in tasks if t.task_id == p.task_id)
        c = caps[p.node_id]
        for d in p.device_indices:
            if d not in c.free_gpus:
                k, n = c.gpu_share[d]
                assert task.share_key == k and n < c.max_tasks_per_gpu
        c.book(p.device_indices, task.share_key)


def test_schedule_is_cheap_with_a_deep_queue(tmp_path) -> None:
    """Nothing free: a round does not touch the queue; capacity frees: the oldest fitting go."""
    core = make_core(tmp_path, max_tasks_per_gpu=1)
    node, _ = register(core, gpus=4)
    big = [core.api.submit(spec(gpus=4), owner="u") for _ in range(3)]
    small = [core.api.submit(spec(gpus=1), owner="u") for _ in range(50)]
    assert core.schedule() == 1  # the first big task takes all 4 GPUs
    drain(node)
    assert core.schedule() == 0 and len(core.queue) == 52
    assert "no node has 1 free GPU(s)" in core.reasons.reason(small[0].task_id)
    assert "queue position 3 of 52" in core.reasons.reason(
        small[0].task_id
    )  # behind the two big ones (same priority, older)
    report(core, node, big[0].task_id, 1, C.TASK_STATE_SUCCEEDED)
    assert core.schedule() == 1  # head of the queue: the next big task
    assert core.api.get(big[1].task_id).state == C.TASK_STATE_ASSIGNED
    assert core.tasks.counts[C.TASK_STATE_PENDING] == 51 and core.tasks.counts[C.TASK_STATE_SUCCEEDED] == 1


class _FailingCommits:
    """Wraps the store's connection: COMMIT raises while ``fail`` is set (a disk error)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db
        self.fail = False

    def execute(self, sql, *args):
        if self.fail and sql == "COMMIT":
            raise sqlite3.OperationalError("disk I/O error (test)")
        return self._db.execute(sql, *args)

    def __getattr__(self, name):
        return getattr(self._db, name)


def _committed_state(store, task_id: str):
    rows = committed(store, "SELECT state FROM tasks WHERE task_id=?", (task_id,))
    return rows[0][0] if rows else None


def _group_commit_core(tmp_path, gpus: int):
    """A core with group commit on, one registered node and one submitted task:
    ``(core, node, task)``, nothing committed yet."""
    core = make_core(tmp_path)
    core.enable_group_commit()
    node, _ = register(core)
    return core, node, core.api.submit(spec(gpus=gpus), owner="u")


def test_group_commit_holds_commands_until_durable(tmp_path) -> None:
    async def main() -> None:
        core, node, task = _group_commit_core(tmp_path, gpus=1)
        assert core.schedule() == 1
        assert node.outbox.empty(), "an assignment left before its transition was committed"
        assert _committed_state(core.store, task.task_id) is None  # nothing committed yet
        await core.durable()
        assert _committed_state(core.store, task.task_id) == C.TASK_STATE_ASSIGNED
        (cmd,) = drain(node)
        assert cmd.assign_task.task_id == task.task_id
        assert core.commits.commits == 1  # register, submit and assignment shared one commit
        await core.durable()  # nothing open: returns at once

    asyncio.run(main())


@pytest.mark.sqlite_only
def test_failed_group_commit_rebuilds_memory_and_drops_commands(tmp_path) -> None:
    async def main() -> None:
        core, node, task = _group_commit_core(tmp_path, gpus=2)
        await core.durable()
        core.store.db = failing = _FailingCommits(core.store.db)
        failing.fail = True
        assert core.schedule() == 1
        with pytest.raises(sqlite3.OperationalError, match="disk I/O"):
            await core.durable()
        # Memory is the store's again: pending, no GPUs held, no assignment sent.
        assert core.api.get(task.task_id).state == C.TASK_STATE_PENDING and task.task_id in core.queue
        assert dict(node.allocations) == {} and drain(node) == []
        assert core.tasks.counts.get(C.TASK_STATE_ASSIGNED, 0) == 0
        failing.fail = False
        assert core.schedule() == 1
        await core.durable()
        assert _committed_state(core.store, task.task_id) == C.TASK_STATE_ASSIGNED
        assert [c.assign_task.task_id for c in drain(node)] == [task.task_id]

    asyncio.run(main())
