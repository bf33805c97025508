"""Preemption: which lower-priority running tasks to stop so that a higher-priority task fits.

Policy (pure function, no I/O):
  * Only tasks with a strictly lower priority than the blocked task are candidates; equal
    priority never preempts (no thrashing between peers).
  * Per node, candidates are taken lowest priority first, then those on fewer nodes first (a
    gang member stops its whole gang), then the most recently started first (least work lost),
    until the node would have enough free GPUs and a free task slot.
  * A gang (a task across several nodes) is one victim that spans its nodes: choosing it on one
    node stops every member (the tracker tells all of them); it frees, for the blocked task, only
    the GPUs it holds on that node.
  * A GPU counts as freed only when every task on it is a victim (LoRA tasks may share GPUs);
    victims that turn out not to be needed once enough is freed are dropped again (latest
    chosen first), so no task is stopped for nothing.
  * Among nodes where that works, the one stopping work on the fewest nodes wins (the sum of
    the victims' node counts: one per ordinary task, one per member of a gang), then the fewest
    victims, then the lowest total victim priority, then node id.
Victims are told to checkpoint and stop; they go back to PENDING (attempt + 1) and resume from
that checkpoint. The blocked task is placed once their GPUs are released.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunningAlloc:
    """One allocation on a node. ``devices`` are its GPU indices; empty means ``gpu_count`` GPUs
    of its own (not shared). ``nodes``: how many nodes the attempt runs on (a gang's members;
    1 for an ordinary task); stopping it stops all of them."""

    task_id: str
    priority: int
    gpu_count: int
    start_time: float
    devices: tuple[int, ...] = ()
    nodes: int = 1


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
    """The cheapest set of lower-priority tasks to stop on one node, or None if none suffices.

    Args:
        priority: the blocked task's priority; only strictly lower ones are candidates.
        gpu_count: GPUs the blocked task needs to itself.
        nodes: accepting nodes with their free GPU count and allocations.
    """
    best: tuple[tuple, Preemption] | None = None
    for node in nodes:
        if node.gpu_count < gpu_count:
            continue
        occupants: dict[object, set[str]] = {}
        for r in node.running:
            for d in r.devices or [(r.task_id, i) for i in range(r.gpu_count)]:
                occupants.setdefault(d, set()).add(r.task_id)

        def enough(chosen: set[str]) -> bool:
            freed = sum(1 for occ in occupants.values() if occ <= chosen)
            return node.free_gpus + freed >= gpu_count and node.max_tasks - len(node.running) + len(chosen) >= 1

        victims: list[RunningAlloc] = []
        chosen: set[str] = set()
        candidates = sorted(
            (r for r in node.running if r.priority < priority),
            key=lambda r: (r.priority, r.nodes, -r.start_time, r.task_id),
        )
        for cand in candidates:
            if enough(chosen):
                break
            victims.append(cand)
            chosen.add(cand.task_id)
        if not victims or not enough(chosen):
            continue
        for v in reversed(list(victims)):  # drop victims that turned out not to be needed
            if enough(chosen - {v.task_id}):
                victims.remove(v)
                chosen.discard(v.task_id)
        if not victims:
            continue
        key = (sum(v.nodes for v in victims), len(victims), sum(v.priority for v in victims), node.node_id)
        if best is None or key < best[0]:
            best = (key, Preemption(node.node_id, tuple(v.task_id for v in victims)))
    return best[1] if best else None
