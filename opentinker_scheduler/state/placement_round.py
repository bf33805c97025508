"""The scheduler's side of one placement round: the hooks :func:`~opentinker_scheduler.policy.placement.place_round`
calls, over the pending queue, the nodes' GPU ledgers and the quota book.

A round decides in memory. :class:`RoundBook` books each placement on its node and on its queue's
quota as the round goes, so later choices see it, and keeps the decisions for the core to commit.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Mapping

from opentinker_scheduler.policy.placement import PlacementGroup, RoundHooks, reservation_node
from opentinker_scheduler.policy.quota import QuotaBook, task_need
from opentinker_scheduler.state.nodes import NodeSession
from opentinker_scheduler.state.queue import PendingQueue, QueueKey
from opentinker_scheduler.state.store import TaskRow


class RoundBook:
    """The hooks of one placement round and what it decided.

    Args:
        queue: the pending queue the round's keys come from.
        nodes: node id -> its session; ``take`` books devices in its ledger.
        quotas: the quota book; ``take`` books usage on it until :meth:`unbook`.
        nodes_without: loggers -> the nodes that cannot write them (``spec.tracking``).
    """

    def __init__(
        self,
        queue: PendingQueue,
        nodes: Mapping[str, NodeSession],
        quotas: QuotaBook,
        nodes_without: Callable[[frozenset[str]], frozenset[str]],
    ) -> None:
        self._queue = queue
        self._nodes = nodes
        self._quotas = quotas
        self._nodes_without = nodes_without
        self._without: dict[frozenset[str], frozenset[str]] = {}
        self._booked: list[tuple[str, tuple[int, int]]] = []
        #: ``(task, node, devices)`` of each task placed, in the order placed.
        self.decided: list[tuple[TaskRow, NodeSession, tuple[int, ...]]] = []
        #: ``(queue key, node id)`` of the node reserved for the first blocked task, or None.
        self.reservation: tuple[QueueKey, str] | None = None

    def hooks(self) -> RoundHooks:
        """The hooks for :func:`~opentinker_scheduler.policy.placement.place_round`. Quotas are
        asked only when some queue has one."""
        hooks = RoundHooks(
            take=self.take, not_before=self.not_before, left_out=self.left_out, rank=self.rank, reserve=self.reserve
        )
        return replace(hooks, admit=self.admit) if self._quotas.queues else hooks

    def not_before(self, key: QueueKey) -> float:
        return self._queue.row(key).not_before

    def take(self, key: QueueKey, group: PlacementGroup, node_id: str) -> None:
        """Book the task on the node's GPUs and on its queue's quota."""
        task, node = self._queue.row(key), self._nodes[node_id]
        devices = node.capacity().choose_devices(group.gpu_count, group.share_key, group.memory)
        node.allocate(task.task_id, task.attempt, devices, group.share_key, group.memory)
        self.decided.append((task, node, devices))
        need = task_need(group.gpu_count)
        self._quotas.add(group.queue, need)
        self._booked.append((group.queue, need))

    def admit(self, key: QueueKey, group: PlacementGroup) -> bool:
        return self._quotas.admits(group.queue, task_need(group.gpu_count))

    def rank(self, group: PlacementGroup, key: QueueKey) -> tuple:
        """Fair share: priority first, then the dominant share of the group's queue, then age."""
        return (key[0], self._quotas.dominant_share(group.queue), key[1], key[2])

    def reserve(self, key: QueueKey, gpu_count: int) -> str | None:
        """Reserve a node for the blocked task, never one it cannot run on."""
        unable = self._unable_for(self._queue.row(key).tracking_loggers)
        node_id = reservation_node(gpu_count, (n.capacity() for n in self._nodes.values() if n.node_id not in unable))
        if node_id is not None:
            self.reservation = (key, node_id)
        return node_id

    def left_out(self, group: PlacementGroup) -> frozenset[str]:
        """Nodes that cannot write the loggers the group's tasks name."""
        return self._unable_for(group.loggers)

    def unbook(self) -> None:
        """Take back the round's quota bookings: the committed transitions book them for good."""
        for queue, need in self._booked:
            self._quotas.add(queue, need, -1)
        self._booked.clear()

    def _unable_for(self, loggers: frozenset[str]) -> frozenset[str]:
        if not loggers:
            return frozenset()
        if loggers not in self._without:
            self._without[loggers] = self._nodes_without(loggers)
        return self._without[loggers]
