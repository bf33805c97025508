"""PreemptionTracker on its own (no core, no store): real task rows, node sessions and the free
index; victims told once, deadlines given up, records forgotten when their attempt ends."""

from __future__ import annotations

from dataclasses import dataclass

from opentinker.common.v1 import common_pb2 as C

from opentinker_scheduler.policy.placement import FreeNodes
from opentinker_scheduler.state.nodes import NodeSession
from opentinker_scheduler.state.preemption_tracker import PreemptionTracker, Victim
from opentinker_scheduler.state.queue import LiveTasks
from opentinker_scheduler.state.store import TaskRow


@dataclass
class Timeouts:
    preemption_timeout_s: float = 60.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def row(task_id: str, state: int, priority: int, gpus: int = 4, attempt: int = 1) -> TaskRow:
    spec = C.TaskSpec(workload_type="full_rl")
    spec.resources.gpu_count = gpus
    return TaskRow(
        task_id=task_id,
        owner="u",
        spec=spec,
        state=state,
        attempt=attempt,
        priority=priority,
        gpu_count=gpus,
        max_attempts=3,
        max_runtime_s=None,
        create_time=1.0,
        update_time=1.0,
        start_time=1.0 if state == C.TASK_STATE_RUNNING else None,
    )


def setup(*, low_priority: int = 0, high_priority: int = 10):
    """One 4-GPU node running ``low`` on all its GPUs; ``high`` (4 GPUs) pending."""
    tasks, free, nodes = LiveTasks(), FreeNodes(), {}
    node = NodeSession(
        node_id="n1", gpu_count=4, max_tasks=4, connected=True, on_change=lambda n: free.update(n.capacity())
    )
    nodes["n1"] = node
    low = row("low", C.TASK_STATE_RUNNING, low_priority)
    tasks.active["low"] = low
    node.allocate("low", 1, (0, 1, 2, 3))
    high = row("high", C.TASK_STATE_PENDING, high_priority)
    tasks.added(high)
    clock, notified = Clock(), []
    tracker = PreemptionTracker(
        tasks=tasks, nodes=nodes, free=free, config=Timeouts(), notify=lambda: notified.append(1), clock=clock
    )
    return tracker, tasks, node, clock, notified


def stops(node: NodeSession) -> list[tuple[str, int, str]]:
    out = []
    while not node.outbox.empty():
        cmd = node.outbox.get_nowait()
        if cmd is not None and cmd.WhichOneof("command") == "cancel_task":
            out.append((cmd.cancel_task.task_id, cmd.cancel_task.attempt, cmd.cancel_task.reason))
    return out


def test_blocked_higher_priority_task_gets_a_victim_told_once() -> None:
    tracker, _, node, clock, notified = setup()
    assert tracker.preempt() == 1
    assert stops(node) == [("low", 1, "PREEMPTED")]
    assert tracker.victims == {"low": Victim(1, "n1", "high")} and "low" in tracker
    assert tracker.waiting == {"high": ("n1", ("low",))}
    assert tracker.deadlines == {"low": clock.now + 60.0}
    assert tracker.waiting_on("high") == ("n1", ["low"]) and tracker.waiting_on("low") is None
    assert notified == [1]
    # In flight: no second stop, no second record.
    assert tracker.preempt() == 0
    assert stops(node) == []


def test_equal_or_lower_priority_never_preempts() -> None:
    for high in (0, -1):
        tracker, _, node, _, notified = setup(low_priority=0, high_priority=high)
        assert tracker.preempt() == 0
        assert stops(node) == [] and tracker.victims == {} and notified == []


def test_a_stop_the_node_never_confirms_is_given_up_and_sent_again() -> None:
    tracker, _, node, clock, _ = setup()
    tracker.preempt()
    stops(node)
    clock.now += 59
    assert tracker.preempt() == 0 and "low" in tracker
    clock.now += 2  # past the deadline
    assert tracker.preempt() == 1
    assert stops(node) == [("low", 1, "PREEMPTED")]
    assert tracker.deadlines == {"low": clock.now + 60.0}


def test_an_ended_victim_is_forgotten_and_its_waiter_with_it() -> None:
    tracker, tasks, _, _, _ = setup()
    tracker.preempt()
    assert tracker.victim_ended("low") == Victim(1, "n1", "high")
    assert tracker.victim_ended("low") is None
    assert tracker.waiting_on("high") is None  # no victim left for it
    del tasks.active["low"]
    tracker.preempt()  # prunes: no waiter without victims, no deadline without a victim
    assert tracker.waiting == {} and tracker.deadlines == {}


def test_a_victim_whose_attempt_changed_is_pruned() -> None:
    tracker, tasks, _, _, _ = setup()
    tracker.preempt()
    tasks.active["low"].attempt = 2  # lost and placed again meanwhile
    tasks.active["low"].state = C.TASK_STATE_ASSIGNED  # not RUNNING: no new victim either
    assert tracker.preempt() == 0
    assert tracker.victims == {} and tracker.waiting == {} and tracker.deadlines == {}


def test_forget_drops_a_cancelled_task_as_victim_and_as_waiter() -> None:
    tracker, _, _, _, _ = setup()
    tracker.preempt()
    tracker.forget("high")
    assert tracker.waiting == {} and "low" in tracker
    tracker.forget("low")
    assert tracker.victims == {}
