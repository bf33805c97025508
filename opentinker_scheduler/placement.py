"""Placement: which pending task goes on which node's GPUs. Pure functions, no I/O.

Policy:
  * Order: larger priority first, then older (create time), then task id.
  * Gang: a task gets all ``gpu_count`` GPUs on one node at once, or nothing.
  * A node runs at most ``max_tasks`` tasks (CPU tasks, ``gpu_count == 0``, need only a slot).
  * Best fit: among nodes that fit, the one with the fewest free GPUs left over (packs small
    tasks, keeps large blocks free), then the fewest running tasks, then node id.
  * Backfill: a task that does not fit does not block smaller ones behind it, except on its
    reserved node (next point), so backfill cannot starve it.
  * Reservation: in each round, the first task in queue order (highest priority, then oldest)
    that does not fit now but could on some accepting node if that node were empty reserves one
    node (:func:`reservation_node`: the candidate with the most free GPUs now, then the fewest
    running tasks, then node id). Tasks behind it in that round are not placed on the reserved
    node, so its running work drains and the blocked task gets it; smaller tasks still backfill
    on every other node. On a one-node cluster this means no backfill past a blocked task.
  * A task whose retry backoff has not elapsed waits (``not_before``).
Every task left pending gets a reason a person can act on, in the style of Kubernetes
("no node has 4 free GPUs; largest free block is 2 on gpu-node-01").

:func:`plan` states the policy over plain lists. The scheduler runs the same policy
incrementally with :func:`place_round` over two indexes it keeps up to date — the pending queue
by ``gpu_count`` (:mod:`opentinker_scheduler.queue`) and :class:`FreeNodes` — so one round
costs O(placements + distinct gpu counts), not O(pending tasks x nodes). A property test keeps
the two in agreement.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
import heapq
from typing import Callable, Hashable, Iterable, Mapping, Sequence


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
    reserved: str | None = None
    for position, task in enumerate(ordered, start=1):
        if task.not_before > now:
            reasons[task.task_id] = f"waiting {task.not_before - now:.0f} s more before retrying (backoff after a failed attempt)"
            continue
        fits = [n for n in caps if n.node_id != reserved and n.accepting and n.free_slots > 0 and len(n.free_gpus) >= task.gpu_count]
        if fits:
            best = min(fits, key=lambda n: (len(n.free_gpus) - task.gpu_count, n.running, n.node_id))
            devices = tuple(best.free_gpus[: task.gpu_count])
            best.free_gpus = best.free_gpus[task.gpu_count :]
            best.running += 1
            placements.append(Placement(task.task_id, best.node_id, devices))
            continue
        reasons[task.task_id] = why_pending(task, caps, position, len(ordered))
        if reserved is None:
            reserved = reservation_node(task.gpu_count, caps)
            if reserved is not None:
                reasons[task.task_id] += f"; {reserved} is reserved for it"
    return placements, reasons


def reservation_node(gpu_count: int, caps: Iterable[NodeCapacity]) -> str | None:
    """The node a blocked task of ``gpu_count`` GPUs reserves: among accepting nodes that could
    hold it if empty, the one with the most free GPUs now, then the fewest running tasks, then
    node id. None when no accepting node could ever hold it."""
    best: tuple[int, int, str] | None = None
    for n in caps:
        if n.accepting and n.gpu_count >= gpu_count and n.max_tasks >= 1:
            key = (-len(n.free_gpus), n.running, n.node_id)
            if best is None or key < best:
                best = key
    return best[2] if best is not None else None


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


class FreeNodes:
    """Nodes that can take a task now (accepting, with a free slot), in best-fit order: fewest
    free GPUs, then fewest running tasks, then node id. The owner calls :meth:`update` whenever a
    node's ledger or state changes."""

    def __init__(self) -> None:
        self._keys: list[tuple[int, int, str]] = []  # (free GPUs, running, node id), sorted
        self._key_of: dict[str, tuple[int, int, str]] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def __bool__(self) -> bool:
        return bool(self._keys)

    def update(self, cap: NodeCapacity) -> None:
        old = self._key_of.pop(cap.node_id, None)
        if old is not None:
            del self._keys[bisect.bisect_left(self._keys, old)]
        if cap.accepting and cap.free_slots > 0:
            key = (len(cap.free_gpus), cap.running, cap.node_id)
            self._key_of[cap.node_id] = key
            bisect.insort(self._keys, key)

    def remove(self, node_id: str) -> None:
        old = self._key_of.pop(node_id, None)
        if old is not None:
            del self._keys[bisect.bisect_left(self._keys, old)]

    def most_free_gpus(self, exclude: str | None = None) -> int:
        """Largest free GPU block on a node that can take a task (-1 when none can), leaving
        out node ``exclude`` (a reserved node)."""
        for key in reversed(self._keys):  # at most two steps: one node is left out
            if key[2] != exclude:
                return key[0]
        return -1

    def best_fit(self, gpu_count: int, exclude: str | None = None) -> str | None:
        """The node :func:`plan` would pick for a task of ``gpu_count`` GPUs, or None, leaving
        out node ``exclude``."""
        i = bisect.bisect_left(self._keys, (gpu_count, -1, ""))
        if i < len(self._keys) and self._keys[i][2] == exclude:
            i += 1
        return self._keys[i][2] if i < len(self._keys) else None

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._key_of


def place_round(
    groups: Mapping[int, Sequence[Hashable]],
    free: FreeNodes,
    now: float,
    not_before: Callable[[Hashable], float],
    take: Callable[[Hashable, int, str], None],
    reserve: Callable[[Hashable, int], str | None] | None = None,
) -> int:
    """One placement round of :func:`plan`'s policy, over indexes instead of lists.

    Args:
        groups: ``gpu_count`` -> that group's pending tasks as sortable keys, in queue order
            (the keys of all groups share one order). Not changed here.
        free: nodes that can take a task now; ``take`` must keep it current.
        now: unix seconds, compared with ``not_before(key)``.
        take: ``take(key, gpu_count, node_id)`` puts the task on the node (best fit from
            ``free``) and updates ``free``.
        reserve: ``reserve(key, gpu_count)`` is called for the first blocked task in queue order
            (at the point of the queue where :func:`plan` meets it) and returns the node it
            reserves (:func:`reservation_node` over the current capacities), or None when no
            node could ever hold it (then the next blocked task is asked). Tasks after it are
            not placed on that node. None: no reservation.

    Returns:
        How many tasks were placed. Tasks are considered in queue order; a group whose GPU
        count no node can offer any more is dropped whole (capacity only shrinks in a round),
        which gives the same placements as :func:`plan`. A dropped group's first task not in
        backoff is the group's candidate for the reservation.
    """
    live = {g: keys for g, keys in groups.items() if keys}
    cursor = dict.fromkeys(live, 0)
    placed = 0
    reserved: str | None = None
    blocked: list[tuple[Hashable, int]] = []  # heap of dropped groups' first eligible keys
    while True:
        most = free.most_free_gpus(reserved)
        for g in [g for g in live if g > most]:
            keys = live.pop(g)
            if reserve is not None and reserved is None:
                i = cursor[g]
                while i < len(keys) and not_before(keys[i]) > now:
                    i += 1
                if i < len(keys):
                    heapq.heappush(blocked, (keys[i], g))
        g = min(live, key=lambda g: live[g][cursor[g]]) if live else None
        if reserve is not None and reserved is None and blocked and (g is None or blocked[0][0] < live[g][cursor[g]]):
            bkey, bg = heapq.heappop(blocked)
            reserved = reserve(bkey, bg)
            if reserved is not None:
                blocked.clear()
            continue  # capacity outside the reserved node is less: drop groups again
        if g is None:
            break
        key = live[g][cursor[g]]
        cursor[g] += 1
        if cursor[g] == len(live[g]):
            del live[g]
        if not_before(key) > now:
            continue
        node_id = free.best_fit(g, reserved)
        assert node_id is not None  # g <= most free GPUs on a node with a free slot
        take(key, g, node_id)
        placed += 1
    return placed
