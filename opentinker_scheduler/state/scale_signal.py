"""The scale signal: how many trainers each node class needs now.

Read by the server for ``/metrics`` and the autoscaler hooks. Pending tasks that their queue's
quota admits (booked in queue order on a copy of the quota book) are packed into connected nodes'
free room (:func:`~opentinker_scheduler.policy.scale.desired_trainers`); the rest need new
trainers of ``usage.default_node_class``.
"""

from __future__ import annotations

import dataclasses

from opentinker_scheduler.config import SchedulerConfig
from opentinker_scheduler.policy.quota import QuotaBook
from opentinker_scheduler.policy.scale import ClassNode, Demand, desired_trainers as pack_trainers
from opentinker_scheduler.state.gangs import gang_nodes
from opentinker_scheduler.state.ledger import NodeLedger
from opentinker_scheduler.state.queue import PendingQueue
from opentinker_scheduler.state.quota_queues import quota_need


@dataclasses.dataclass(frozen=True)
class ClassDemand:
    """One node class in the scale signal: trainers needed, connected now, pending GPUs admitted."""

    node_class: str
    desired: int
    connected: int
    pending_gpus: int


def desired_trainers(
    config: SchedulerConfig, ledger: NodeLedger, pending: PendingQueue, quotas: QuotaBook
) -> list[ClassDemand]:
    """Trainers each node class needs now (:func:`~..policy.scale.desired_trainers`): pending
    tasks of ``pending`` that their queue's quota admits (booked in queue order on a copy of
    ``quotas``), packed into connected nodes' free room, the rest into new trainers of
    ``usage.default_node_class`` sized like the largest node of that class (else of any)."""
    live = [n for n in ledger.nodes.values() if n.connected]
    nodes = []
    for n in live:
        cap = n.capacity()
        free = len(cap.free_gpus) if cap.accepting else 0
        slots = cap.free_slots if cap.accepting else 0
        nodes.append(ClassNode(n.node_id, ledger.node_class(n.node_id), free, slots, len(n.allocations)))
    book = QuotaBook(quotas.queues, quotas.default_queue, quotas.cluster,
                     {k: list(v) for k, v in quotas.used.items()})  # fmt: skip
    counts: dict[tuple[int, int], int] = {}
    pending_gpus: dict[str, int] = {}
    # Usage only grows below, so a (queue, need) refused once stays refused: one quota verdict
    # each, not one per pending task (a deep queue over its quota cost O(tasks x queues)).
    refused: set[tuple[str, tuple[int, int]]] = set()
    for key in pending.ordered_keys():
        task = pending.row(key)
        queue, need = book.queue_of(task.owner), quota_need(task)
        if book.queues and ((queue, need) in refused or not book.admits(queue, need)):
            refused.add((queue, need))
            continue
        book.add(queue, need)
        size = (task.gpu_count, gang_nodes(task))
        counts[size] = counts.get(size, 0) + 1
    scale_class = config.usage.default_node_class
    same = [n for n in live if ledger.node_class(n.node_id) == scale_class] or live
    sizes = [(n.gpu_count, n.max_tasks) for n in same] or [(p.gpu_count, p.max_tasks) for p in config.resource_pool]
    template = max(sizes, default=(0, 0))
    pending_gpus[scale_class] = sum(g * m * c for (g, m), c in counts.items())
    want = pack_trainers(
        nodes, [Demand(g, m, c) for (g, m), c in counts.items()], scale_class=scale_class, template=template
    )
    connected: dict[str, int] = {}
    for n in nodes:
        connected[n.node_class] = connected.get(n.node_class, 0) + 1
    return [ClassDemand(c, want[c], connected.get(c, 0), pending_gpus.get(c, 0)) for c in sorted(want)]
