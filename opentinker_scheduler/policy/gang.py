"""Gang placement: a task that spans several nodes (``resources.nodes``). Pure functions, no I/O.

Policy (the single-node rules of :mod:`.placement`, per member):

  * All or nothing: a gang of ``nodes`` members gets ``gpu_count`` free GPUs (never shared ones)
    and a task slot on each of ``nodes`` distinct accepting nodes in one round, or nothing.
  * Members by best fit: among nodes with room, fewest free GPUs left over after taking
    ``gpu_count``, then fewest running tasks, then node id; member 0 (global rank 0, the
    rendezvous) is the first of them. Devices: the lowest free indices.
  * Order: gangs take their turn in queue order with every other task (priority, then age);
    the core places the tasks ahead of a gang first, then the gang.
  * Reservation (the rule of :func:`.placement.reservation_node`, for ``nodes`` nodes): the first
    gang in queue order that does not fit now, but would on ``nodes`` accepting nodes if they were
    empty, reserves that many (:func:`gang_reservation`: most free GPUs now, then fewest running
    tasks, then node id). Tasks behind it in that round are not placed on the reserved nodes, so
    their work drains and the gang gets them; smaller tasks still backfill elsewhere.
  * Rendezvous: member 0 hosts torch.distributed's ``TCPStore`` on a port of the configured range
    that no other gang on that node holds (:func:`rendezvous_port`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from opentinker_scheduler.policy.placement import NodeCapacity

__all__ = [
    "GangPlacement",
    "GangTask",
    "gang_never_fits",
    "gang_reservation",
    "place_gang",
    "rendezvous_port",
    "why_gang_pending",
]


@dataclass(frozen=True)
class GangTask:
    """A pending gang task: ``nodes`` members of ``gpu_count`` GPUs each."""

    task_id: str
    priority: int
    create_time: float
    gpu_count: int
    nodes: int
    not_before: float = 0.0


@dataclass(frozen=True)
class GangPlacement:
    """Where a gang goes: ``members[i] = (node id, device indices)`` of member ``i``."""

    task_id: str
    members: tuple[tuple[str, tuple[int, ...]], ...]


def _room(cap: NodeCapacity, gpu_count: int) -> bool:
    return cap.accepting and cap.free_slots > 0 and len(cap.free_gpus) >= gpu_count


def place_gang(task: GangTask, caps: Iterable[NodeCapacity], exclude: Iterable[str] = ()) -> GangPlacement | None:
    """The members of ``task`` on nodes of ``caps`` with room now (none of ``exclude``), or None
    when fewer than ``task.nodes`` nodes have room: a gang never half-places. Does not book.

    Args:
        task: the gang.
        caps: node capacities (not changed).
        exclude: node ids not to use (another gang's reservation).
    """
    skip = set(exclude)
    fits = [c for c in caps if c.node_id not in skip and _room(c, task.gpu_count)]
    if len(fits) < task.nodes:
        return None
    fits.sort(key=lambda c: (len(c.free_gpus) - task.gpu_count, c.running, c.node_id))
    members = tuple((c.node_id, tuple(sorted(c.free_gpus)[: task.gpu_count])) for c in fits[: task.nodes])
    return GangPlacement(task.task_id, members)


def gang_reservation(task: GangTask, caps: Iterable[NodeCapacity]) -> tuple[str, ...] | None:
    """The nodes a blocked gang reserves: ``task.nodes`` accepting nodes that could each hold a
    member if empty, those with the most free GPUs now, then the fewest running tasks, then node
    id. None when fewer than ``task.nodes`` accepting nodes could ever hold a member."""
    able = [c for c in caps if c.accepting and c.gpu_count >= task.gpu_count and c.max_tasks >= 1]
    if len(able) < task.nodes:
        return None
    able.sort(key=lambda c: (-len(c.free_gpus), c.running, c.node_id))
    return tuple(c.node_id for c in able[: task.nodes])


def gang_never_fits(nodes: int, gpu_count: int, sizes: Mapping[str, int]) -> str | None:
    """Why a gang of ``nodes`` x ``gpu_count`` GPUs can never be placed on a cluster whose nodes
    have ``sizes`` (node id -> GPUs), with the numbers; None when it could be."""
    able = sorted(n for n, g in sizes.items() if g >= gpu_count)
    if len(able) >= nodes:
        return None
    have = ", ".join(f"{n}: {g}" for n, g in sorted(sizes.items())) or "none"
    return (
        f"spec.resources.nodes: {nodes} nodes with {gpu_count} GPU(s) each asked ({nodes * gpu_count} GPUs), "
        f"but only {len(able)} node(s) of the cluster have {gpu_count}+ GPUs (GPUs per node: {have})"
    )


def why_gang_pending(
    task: GangTask,
    caps: Sequence[NodeCapacity],
    position: int,
    queue_len: int,
    reserved_for_other: Iterable[str] = (),
) -> str:
    """A sentence saying what a gang lacks: how many nodes have room for a member, which, and
    how many it needs; its place in the queue."""
    where = f" (queue position {position} of {queue_len})"
    held = set(reserved_for_other)
    room = sorted(c.node_id for c in caps if _room(c, task.gpu_count) and c.node_id not in held)
    shown = ", ".join(room[:5]) + (" ..." if len(room) > 5 else "")
    why = (
        f"gang of {task.nodes} nodes x {task.gpu_count} GPU(s): {len(room)} node(s) have {task.gpu_count} free "
        f"GPU(s) and a free task slot{' (' + shown + ')' if room else ''}; it needs {task.nodes} at once"
    )
    if held:
        why += f"; {', '.join(sorted(held))} reserved for a task ahead"
    return why + where


def rendezvous_port(in_use: Iterable[int], low: int, high: int) -> int | None:
    """The lowest port of ``low .. high`` (inclusive) not ``in_use``, or None when all are."""
    taken = set(in_use)
    for port in range(low, high + 1):
        if port not in taken:
            return port
    return None
