"""Placement: which pending task goes on which node's GPUs. Pure functions, no I/O.

Policy:
  * Order: larger priority first, then older (create time), then task id.
  * Gang: a task gets all ``gpu_count`` GPUs on one node at once, or nothing.
  * A node runs at most ``max_tasks`` tasks (CPU tasks, ``gpu_count == 0``, need only a slot).
  * Best fit: among nodes that fit, the one with the fewest free GPUs left over (packs small
    tasks, keeps large blocks free), then the fewest running tasks, then node id.
  * Backfill: a task that does not fit does not block smaller ones behind it.
  * A task whose retry backoff has not elapsed waits (``not_before``).
Every task left pending gets a reason a person can act on, in the style of Kubernetes
("no node has 4 free GPUs; largest free block is 2 on gpu-node-01").
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class NodeCapacity:
    """What one node can take now. ``free_gpus`` are device indices."""

    node_id: str
    gpu_count: int
    max_tasks: int
    running: int
    free_gpus: list[int] = field(default_factory=list)
    accepting: bool = True  # False while draining or disconnected

    @property
    def free_slots(self) -> int:
        return max(0, self.max_tasks - self.running)


@dataclass(frozen=True)
class PendingTask:
    task_id: str
    priority: int
    create_time: float
    gpu_count: int
    not_before: float = 0.0


@dataclass(frozen=True)
class Placement:
    task_id: str
    node_id: str
    device_indices: tuple[int, ...]


def queue_order(tasks: list[PendingTask]) -> list[PendingTask]:
    """Pending tasks in placement order: priority desc, then create time, then id."""
    return sorted(tasks, key=lambda t: (-t.priority, t.create_time, t.task_id))


def plan(tasks: list[PendingTask], nodes: list[NodeCapacity], now: float) -> tuple[list[Placement], dict[str, str]]:
    """Place what fits now.

    Args:
        tasks: pending tasks (any order).
        nodes: capacities; mutated copies are used internally, the inputs are not changed.
        now: unix seconds, compared with ``not_before``.

    Returns:
        (placements, reasons): placements in queue order; for every task not placed, why.
    """
    caps = [NodeCapacity(n.node_id, n.gpu_count, n.max_tasks, n.running, sorted(n.free_gpus), n.accepting) for n in nodes]
    placements: list[Placement] = []
    reasons: dict[str, str] = {}
    ordered = queue_order(tasks)
    for position, task in enumerate(ordered, start=1):
        if task.not_before > now:
            reasons[task.task_id] = f"waiting {task.not_before - now:.0f} s more before retrying (backoff after a failed attempt)"
            continue
        fits = [n for n in caps if n.accepting and n.free_slots > 0 and len(n.free_gpus) >= task.gpu_count]
        if fits:
            best = min(fits, key=lambda n: (len(n.free_gpus) - task.gpu_count, n.running, n.node_id))
            devices = tuple(best.free_gpus[: task.gpu_count])
            best.free_gpus = best.free_gpus[task.gpu_count :]
            best.running += 1
            placements.append(Placement(task.task_id, best.node_id, devices))
            continue
        reasons[task.task_id] = why_pending(task, caps, position, len(ordered))
    return placements, reasons


def why_pending(task: PendingTask, caps: list[NodeCapacity], position: int, queue_len: int) -> str:
    """A sentence saying what is short where, and the task's place in the queue."""
    where = f" (queue position {position} of {queue_len})"
    live = [n for n in caps if n.accepting]
    if not live:
        return "no trainer node is connected" + where
    if task.gpu_count == 0:
        return f"all {len(live)} connected node(s) are at max_tasks" + where
    ever = [n for n in live if n.gpu_count >= task.gpu_count]
    if not ever:
        biggest = max(live, key=lambda n: n.gpu_count)
        return (
            f"no connected node has {task.gpu_count} GPU(s); the largest is {biggest.node_id} with "
            f"{biggest.gpu_count}" + where
        )
    with_slots = [n for n in live if n.free_slots > 0]
    if not with_slots:
        return f"every node with {task.gpu_count}+ GPU(s) is at max_tasks" + where
    largest = max(with_slots, key=lambda n: (len(n.free_gpus), n.node_id))
    return (
        f"no node has {task.gpu_count} free GPU(s); largest free block is {len(largest.free_gpus)} on "
        f"{largest.node_id}" + where
    )
