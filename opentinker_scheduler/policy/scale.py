"""The elastic scale signal: how many trainers of each node class the work needs. Pure, no I/O.

Rule (:func:`desired_trainers`):
  * Every connected node that runs a task is needed (its class counts it).
  * Pending work that its queue's quota admits (the caller filters with
    :meth:`~opentinker_scheduler.policy.quota.QuotaBook.admits`, booking as it goes) is packed,
    largest first, into the free room of connected nodes (free GPUs and free task slots; a gang of
    ``k`` members needs ``k`` different nodes); a node that receives work is needed too.
  * What fits nowhere needs new trainers of the ``scale_class``, each the size of ``template``
    (GPUs, task slots), packed the same way, largest first (first-fit decreasing, Johnson 1974, at
    most 11/9 OPT + 1 nodes). Work larger than a template node never fits and adds none (a task
    that no node could ever hold is refused at submit). This is the reservation rule seen from the
    outside: a task that fits in no node's free block counts as needing a node of its own.
  * Idle connected nodes are not needed: the figure drops below the nodes connected when there is
    less work, so an autoscaler can scale in (the trainers' SIGTERM drain hands their work back).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ClassNode:
    """A connected node as the scale signal sees it."""

    node_id: str
    node_class: str
    free_gpus: int
    free_slots: int
    running: int


@dataclass(frozen=True)
class Demand:
    """Pending work of one size: ``count`` tasks of ``members`` nodes x ``gpus`` GPUs each."""

    gpus: int
    members: int
    count: int


def _fits(room: list[int], gpus: int) -> bool:
    return room[1] >= 1 and room[0] >= gpus


def _place(rooms: list[list[int]], used: list[bool], demand: Demand) -> int:
    """Book as many of ``demand`` as fit into ``rooms`` ([free GPUs, free slots], mutated),
    marking the rooms used; returns how many tasks did not fit."""
    left = demand.count
    while left:
        chosen: list[int] = []
        for i, room in enumerate(rooms):  # first fit, one member per node
            if _fits(room, demand.gpus):
                chosen.append(i)
                if len(chosen) == demand.members:
                    break
        if len(chosen) < demand.members:
            break
        if demand.members == 1:  # take as many as this node holds at once
            room = rooms[chosen[0]]
            n = min(left, room[1], room[0] // demand.gpus if demand.gpus else left)
            room[0] -= n * demand.gpus
            room[1] -= n
            used[chosen[0]] = True
            left -= n
            continue
        for i in chosen:
            rooms[i][0] -= demand.gpus
            rooms[i][1] -= 1
            used[i] = True
        left -= 1
    return left


def desired_trainers(
    nodes: list[ClassNode],
    demand: list[Demand],
    *,
    scale_class: str,
    template: tuple[int, int],
) -> dict[str, int]:
    """Trainers each node class needs (see the module doc).

    Args:
        nodes: the connected nodes (accepting or not: a draining node's running work counts).
        demand: pending work that quotas admit, any order.
        scale_class: the class new trainers are of.
        template: (GPUs, task slots) of a new trainer; ``(0, 0)``: none can be added.

    Returns:
        node class -> trainers needed, for every class of ``nodes`` and ``scale_class``.
    """
    rooms = [[n.free_gpus, n.free_slots] for n in nodes]
    used = [n.running > 0 for n in nodes]
    extra_rooms: list[list[int]] = []
    extra_used: list[bool] = []
    for d in sorted(demand, key=lambda d: (-d.gpus * d.members, -d.members)):
        left = _place(rooms, used, d)
        if not left or d.gpus > template[0] or template[1] < 1:
            continue
        rest = Demand(d.gpus, d.members, left)
        left = _place(extra_rooms, extra_used, rest)
        while left:  # new template nodes, enough for one more task (all its members) each time
            for _ in range(rest.members):
                extra_rooms.append([template[0], template[1]])
                extra_used.append(False)
            left = _place(extra_rooms, extra_used, Demand(d.gpus, d.members, left))
    out = dict.fromkeys({n.node_class for n in nodes} | {scale_class}, 0)
    for n, u in zip(nodes, used):
        out[n.node_class] += int(u)
    out[scale_class] += sum(extra_used)
    return out
