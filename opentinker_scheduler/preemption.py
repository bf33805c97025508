"""Preemption: which lower-priority running tasks to stop so that a higher-priority task fits.

Policy (pure function, no I/O):
  * Only tasks with a strictly lower priority than the blocked task are candidates; equal
    priority never preempts (no thrashing between peers).
  * Per node, candidates are taken lowest priority first, then the most recently started first
    (least work lost), until the node would have enough free GPUs and a free task slot.
  * Among nodes where that works, the one needing the fewest victims wins, then the lowest
    total victim priority, then node id.
Victims are told to checkpoint and stop; they go back to PENDING (attempt + 1) and resume from
that checkpoint. The blocked task is placed once their GPUs are released.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunningAlloc:
    task_id: str
    priority: int
    gpu_count: int
    start_time: float


@dataclass(frozen=True)
class NodeState:
    node_id: str
    gpu_count: int
    max_tasks: int
    free_gpus: int
    running: tuple[RunningAlloc, ...]


@dataclass(frozen=True)
class Preemption:
    node_id: str
    victims: tuple[str, ...]


def choose_victims(priority: int, gpu_count: int, nodes: list[NodeState]) -> Preemption | None:
    """The cheapest set of lower-priority tasks to stop on one node, or None if none suffices."""
    best: tuple[tuple, Preemption] | None = None
    for node in nodes:
        if node.gpu_count < gpu_count:
            continue
        free, slots = node.free_gpus, node.max_tasks - len(node.running)
        victims: list[RunningAlloc] = []
        candidates = sorted((r for r in node.running if r.priority < priority), key=lambda r: (r.priority, -r.start_time, r.task_id))
        for cand in candidates:
            if free >= gpu_count and slots >= 1:
                break
            victims.append(cand)
            free += cand.gpu_count
            slots += 1
        if free < gpu_count or slots < 1 or not victims:
            continue
        key = (len(victims), sum(v.priority for v in victims), node.node_id)
        if best is None or key < best[0]:
            best = (key, Preemption(node.node_id, tuple(v.task_id for v in victims)))
    return best[1] if best else None
