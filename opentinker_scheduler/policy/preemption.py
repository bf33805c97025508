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
  * A shareable blocked task (``share_key``: a LoRA task, or an inference task serving the
    base model's adapters) needs no whole GPU: a GPU whose remaining tasks all share its key
    and leave a tenant place (``NodeState.max_tasks_per_gpu``) and the memory of its tenant
    (:meth:`~.placement.NodeCapacity.fits`, as placement books it) counts as made room on too,
    so one tenant of a full model host is stopped for it, not every tenant on the GPU.
  * Among nodes where that works, the one stopping work on the fewest nodes wins (the sum of
    the victims' node counts: one per ordinary task, one per member of a gang), then the fewest
    victims, then the lowest total victim priority, then node id.
Victims are told to checkpoint and stop; they go back to PENDING (attempt + 1) and resume from
that checkpoint. The blocked task is placed once their GPUs are released.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from opentinker_scheduler.policy.placement import MemoryNeed, NodeCapacity, share_and_booked


@dataclass(frozen=True)
class RunningAlloc:
    """One allocation on a node. ``devices`` are its GPU indices; empty means ``gpu_count`` GPUs
    of its own (not shared). ``nodes``: how many nodes the attempt runs on (a gang's members;
    1 for an ordinary task); stopping it stops all of them. ``share_key``: its GPU-sharing key
    (:func:`~.placement.share_key`; None: it holds its GPUs to itself, or is being stopped);
    ``memory``: the GPU memory estimate booked for it (None: counted in tasks only)."""

    task_id: str
    priority: int
    gpu_count: int
    start_time: float
    devices: tuple[int, ...] = ()
    nodes: int = 1
    share_key: str | None = None
    memory: MemoryNeed | None = None


@dataclass(frozen=True)
class NodeState:
    """One node as victim choice sees it. ``free_gpus``: GPUs nobody holds (a count);
    ``free_devices``: their indices when known (for the memory check; empty: unknown);
    ``max_tasks_per_gpu``: shareable tasks one GPU takes; ``gpu_memory``: device -> bytes, as
    the node reported them (a device not there: unknown)."""

    node_id: str
    gpu_count: int
    max_tasks: int
    free_gpus: int
    running: tuple[RunningAlloc, ...]
    max_tasks_per_gpu: int = 1
    gpu_memory: Mapping[int, int] = field(default_factory=dict)
    free_devices: tuple[int, ...] = ()


def _room_after(node: NodeState, chosen: set[str], key: str | None, need: MemoryNeed | None) -> int:
    """GPUs a task with share key ``key`` and memory ``need`` could take on ``node`` once the
    tasks in ``chosen`` are gone: free ones (those it fits on, when their memory is known) plus,
    for a shareable task, the ones open to ``key`` (:class:`~.placement.NodeCapacity`, the
    capacity placement uses, built from what is left)."""
    left = [r for r in node.running if r.task_id not in chosen]
    indexed = {d for r in node.running for d in r.devices}
    held = {d for r in left for d in r.devices}
    share, booked = share_and_booked((r.devices, r.share_key, r.memory) for r in left)
    cap = NodeCapacity(
        node.node_id,
        node.gpu_count,
        node.max_tasks,
        len(left),
        sorted(set(node.free_devices) | (indexed - held)),
        gpu_share=share,
        max_tasks_per_gpu=node.max_tasks_per_gpu,
        gpu_memory=dict(node.gpu_memory),
        gpu_booked=booked,
    )
    # GPUs counted but not indexed: free ones of unknown index, and those held by tasks of their own.
    unindexed = max(0, node.free_gpus - len(node.free_devices)) + sum(
        r.gpu_count for r in node.running if not r.devices and r.task_id in chosen
    )
    return unindexed + cap.open_to(key, need)


@dataclass(frozen=True)
class Preemption:
    node_id: str
    victims: tuple[str, ...]


def choose_victims(
    priority: int,
    gpu_count: int,
    nodes: list[NodeState],
    share_key: str | None = None,
    memory: MemoryNeed | None = None,
) -> Preemption | None:
    """The cheapest set of lower-priority tasks to stop on one node, or None if none suffices.

    Args:
        priority: the blocked task's priority; only strictly lower ones are candidates.
        gpu_count: GPUs the blocked task needs (to itself, or shared when ``share_key`` is set).
        nodes: accepting nodes with their free GPU count and allocations.
        share_key: the blocked task's GPU-sharing key (None: it needs whole GPUs).
        memory: the blocked task's GPU memory estimate (None: counted in tasks only).
    """
    best: tuple[tuple, Preemption] | None = None
    for node in nodes:
        if node.gpu_count < gpu_count:
            continue

        def enough(chosen: set[str], node: NodeState = node) -> bool:
            slots = node.max_tasks - len(node.running) + len(chosen) >= 1
            return slots and _room_after(node, chosen, share_key, memory) >= gpu_count

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
