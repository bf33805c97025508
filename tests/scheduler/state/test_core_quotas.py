"""Quota queues in the core: a task over its queue's quota waits with a reason naming the queue,
usage and quota; borrowing of idle quota and its reclaim by checkpoint-and-requeue preemption;
quota changes at run time, kept in the store across restarts (both backends) until reset; fair
share between two owners at equal priority."""

from __future__ import annotations

import pytest
from opentinker.common.v1 import common_pb2 as C

from opentinker_scheduler.config import QueueConfig
from opentinker_scheduler.errors import NotFound, NotLeader
from opentinker_scheduler.policy.quota import QueueQuota
from opentinker_scheduler.state.core import SchedulerCore
from tests.support.scheduler_core import drain, make_core, register, report, spec
from tests.support.stores import make_store

QUEUES = (
    QueueConfig("team-a", gpus=2, cpu_tasks=1, borrowing_gpus=0, borrowing_cpu_tasks=0, owners=("alice",)),
    QueueConfig("team-b", gpus=2, cpu_tasks=1, owners=("bob",)),
)


def _assigned(node) -> list[str]:
    return [c.assign_task.task_id for c in drain(node) if c.WhichOneof("command") == "assign_task"]


def _run(core, node, task_ids) -> None:
    for t in task_ids:
        assert report(core, node, t, core.api.get(t).attempt, C.TASK_STATE_RUNNING)


def test_over_quota_waits_with_a_reason_naming_queue_usage_and_quota(tmp_path) -> None:
    core = make_core(tmp_path, queues=QUEUES, max_tasks_per_gpu=1)
    node, _ = register(core)
    first = core.api.submit(spec(gpus=2), owner="alice")
    second = core.api.submit(spec(gpus=1), owner="alice")
    cpu = [core.api.submit(spec(gpus=0), owner="alice") for _ in range(2)]
    core.schedule()
    assert set(_assigned(node)) == {first.task_id, cpu[0].task_id}
    assert core.api.get(second.task_id).state == C.TASK_STATE_PENDING  # 2 GPUs free on the node, but not a's
    assert core.reasons.reason(second.task_id).startswith(
        "queue team-a is at its quota: 2 GPUs in use of a nominal quota of 2, the task needs 1 more; "
        "its borrowing_limit is 0 (queue position"
    )
    assert "1 CPU-task slot in use of a nominal quota of 1" in core.reasons.reason(cpu[1].task_id)
    # Its quota frees when the first ends: the next round starts the waiting one.
    _run(core, node, [first.task_id])
    report(core, node, first.task_id, 1, C.TASK_STATE_SUCCEEDED)
    core.schedule()
    assert _assigned(node) == [second.task_id]


def test_quota_change_applies_without_restart(tmp_path) -> None:
    core = make_core(tmp_path, queues=QUEUES, max_tasks_per_gpu=1)
    node, _ = register(core)
    tasks = [core.api.submit(spec(gpus=1), owner="alice") for _ in range(3)]
    core.schedule()
    assert len(_assigned(node)) == 2
    before = core.queues.set_queue(QueueQuota("team-a", 3, 1, 0, None, ("alice",)))
    assert before is not None and before.gpus == 2
    core.schedule()
    assert _assigned(node) == [tasks[2].task_id]
    rows = {
        name: (quota.gpus if quota else None, used, pending)
        for name, quota, used, pending, _ in core.queues.rows(refresh=not core.leading)
    }
    assert rows["team-a"] == (3, (3, 0), 0) and rows["team-b"] == (2, (0, 0), 0)
    # Owners move: carol, in no queue, is a queue of her own until she is listed.
    core.queues.set_queue(QueueQuota("team-c", 0, 0, 0, 0, ("carol",)))
    waiting = core.api.submit(spec(gpus=1), owner="carol")
    core.schedule()
    assert "queue team-c is at its quota" in core.reasons.reason(waiting.task_id)


def _quotas(core) -> dict[str, tuple[int, int, tuple[str, ...]]]:
    return {n: (q.gpus, q.cpu_tasks, q.owners) for n, q in core.queues.book.queues.items()}


def test_runtime_quota_changes_survive_a_restart_until_reset(tmp_path) -> None:
    core = make_core(tmp_path, queues=QUEUES, max_tasks_per_gpu=1)
    core.queues.set_queue(QueueQuota("team-a", 3, 1, 0, None, ("alice",)), by="root")
    core.queues.set_queue(QueueQuota("team-c", 0, 0, 0, 0, ("bob", "carol")), by="root")  # bob leaves team-b
    core.queues.set_queue(QueueQuota("team-b", 2, 1, None, None, ("bob",)), by="ops")  # ... and comes back: newest wins
    waiting = core.api.submit(spec(gpus=1), owner="carol")
    want = {"team-a": (3, 1, ("alice",)), "team-b": (2, 1, ("bob",)), "team-c": (0, 0, ("carol",))}
    assert _quotas(core) == want
    core.store.close()

    # A restart: the config's queues, with the overrides applied over them in the order they were set.
    core = make_core(tmp_path, queues=QUEUES, max_tasks_per_gpu=1)
    assert _quotas(core) == want
    assert core.queues.book.queues["team-a"].borrowing == (0, None)
    override = core.queues.override("team-a")
    assert override is not None and override.set_by == "root" and override.set_time > 0
    assert [o.name for o in core.queues.overrides] == ["team-a", "team-c", "team-b"]
    node, _ = register(core)
    core.schedule()
    assert _assigned(node) == [] and core.reasons.reason(waiting.task_id).startswith("queue team-c is at its quota")

    # Reset: back to the config's values; a queue the config lacks goes, and its owners with it.
    now, removed = core.queues.reset_queue("team-c")
    assert now is None and removed is not None and removed.owners == ("bob", "carol")
    core.schedule()
    assert _assigned(node) == [waiting.task_id]  # carol is a queue of her own again, with no quota
    now, removed = core.queues.reset_queue("team-a")
    assert (now.gpus, now.owners, removed.gpus) == (2, ("alice",), 3)
    assert core.queues.reset_queue("team-a") == (core.queues.book.queues["team-a"], None)  # nothing left to reset
    with pytest.raises(NotFound, match=r"^queue 'team-z' has no runtime override and is not in the scheduler config"):
        core.queues.reset_queue("team-z")
    core.store.close()
    core = make_core(tmp_path, queues=QUEUES, max_tasks_per_gpu=1)
    assert _quotas(core) == {"team-a": (2, 1, ("alice",)), "team-b": (2, 1, ("bob",))}
    assert [o.name for o in core.queues.overrides] == ["team-b"]


@pytest.mark.postgres_only
def test_a_follower_lists_the_queues_the_leader_set(tmp_path) -> None:
    leader = make_core(tmp_path, queues=QUEUES)
    config = leader.config
    follower = SchedulerCore(config, make_store(tmp_path, lead=False), leading=False)
    leader.queues.set_queue(QueueQuota("team-c", 1, 0, 0, 0, ("carol",)), by="root")
    rows = {name: quota for name, quota, *_ in follower.queues.rows(refresh=not follower.leading)}
    assert rows["team-c"] is not None and rows["team-c"].owners == ("carol",)
    assert follower.queues.override("team-c").set_by == "root"
    leader.queues.reset_queue("team-c")
    assert "team-c" not in {name for name, *_ in follower.queues.rows(refresh=not follower.leading)}
    with pytest.raises(NotLeader):
        follower.queues.set_queue(QueueQuota("team-d", 1, 0), by="root")


def test_borrowed_quota_is_reclaimed_by_preemption(tmp_path) -> None:
    core = make_core(tmp_path, queues=QUEUES, max_tasks_per_gpu=1)
    node, _ = register(core)
    # bob borrows alice's idle 2 GPUs: 4 one-GPU tasks on the 4-GPU node.
    bobs = [core.api.submit(spec(gpus=1), owner="bob") for _ in range(4)]
    core.schedule()
    assert sorted(_assigned(node)) == sorted(t.task_id for t in bobs)
    for i, t in enumerate(bobs):
        _run(core, node, [t.task_id])
        core.api.get(t.task_id).start_time = 1000.0 + i  # the last two started last
    # alice, within her nominal quota, needs 2 GPUs back, at the same priority.
    alice = core.api.submit(spec(gpus=2), owner="alice")
    core.tick()
    cancels = [c.cancel_task for c in drain(node) if c.WhichOneof("command") == "cancel_task"]
    assert sorted((c.task_id, c.reason) for c in cancels) == sorted((t.task_id, "PREEMPTED") for t in bobs[2:])
    assert "preempting" in core.reasons.reason(alice.task_id)
    for t in bobs[2:]:
        report(core, node, t.task_id, 1, C.TASK_STATE_CANCELLED, error="PREEMPTED")
    core.schedule()
    assert _assigned(node) == [alice.task_id]
    # The requeued borrowers wait: bob is at his quota and alice's is in use.
    back = core.api.get(bobs[2].task_id)
    assert back.state == C.TASK_STATE_PENDING and back.attempt == 2
    assert "queue team-b is at its quota" in core.reasons.reason(back.task_id)


def test_fair_share_between_two_owners_at_equal_priority(tmp_path) -> None:
    """No queues configured: each owner is a queue of its own. a floods 20 tasks and fills the
    node; b submits 2; each slot that frees goes to b until b's share reaches a's."""
    core = make_core(tmp_path, max_tasks_per_gpu=1)
    node, _ = register(core)
    flood = [core.api.submit(spec(gpus=1), owner="a") for _ in range(20)]
    core.schedule()
    running = _assigned(node)
    assert running == [t.task_id for t in flood[:4]]
    _run(core, node, running)
    late = [core.api.submit(spec(gpus=1), owner="b") for _ in range(2)]
    for i, expect in enumerate(late):
        report(core, node, running[i], 1, C.TASK_STATE_SUCCEEDED)  # a slot frees
        core.schedule()  # one placement round
        assert _assigned(node) == [expect.task_id]
        _run(core, node, [expect.task_id])
    report(core, node, running[2], 1, C.TASK_STATE_SUCCEEDED)
    core.schedule()
    assert _assigned(node) == [flood[4].task_id]  # b has nothing left waiting: a's oldest next
