"""The node ledger: the trainer nodes the scheduler knows and what they hold.

Each :class:`~opentinker_scheduler.state.nodes.NodeSession` books its GPUs and LoRA tenants.
:class:`NodeLedger` keeps the sessions by id, the index of nodes with room
(:class:`~opentinker_scheduler.policy.placement.FreeNodes`) and the views placement and pending
reasons read, and re-indexes a node whenever its bookings, state or size change.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Sequence

from opentinker_scheduler.config import PoolNode
from opentinker_scheduler.policy.placement import FreeNodes, NodeCapacity
from opentinker_scheduler.policy.tracking import NodeLoggers
from opentinker_scheduler.state.nodes import NodeSession


class NodeLedger:
    """Node sessions by id and the index of those with room.

    Args:
        clock: monotonic seconds; a new session is last seen now.
        defer: holds a command for a node until the open group commit is durable.
        max_tasks_per_gpu: the config's limit of LoRA tasks sharing one GPU.
        pool: the config's ``resource_pool``: nodes the cluster may have before they connect.
        on_membership: called after a node connected, left or changed size.
        default_node_class: the class of a node that announced none (``usage.default_node_class``).
    """

    def __init__(
        self,
        clock: Callable[[], float],
        defer: Callable[[asyncio.Queue, object], bool],
        max_tasks_per_gpu: int,
        pool: Sequence[PoolNode],
        on_membership: Callable[[], None],
        default_node_class: str = "",
    ) -> None:
        self._clock = clock
        self._defer = defer
        self._max_tasks_per_gpu = max_tasks_per_gpu
        self._pool = pool
        self._on_membership = on_membership
        self._default_node_class = default_node_class
        self.nodes: dict[str, NodeSession] = {}
        #: Nodes that can take a task now, in best-fit order.
        self.free = FreeNodes()
        self._version = 0  # bumps whenever a node's capacity may have changed
        self._caps: tuple[int, list[NodeCapacity]] | None = None
        self._max_gpus: int | None = None  # cache of max_possible_gpus(); None: recompute

    def node(self, node_id: str) -> NodeSession:
        """The session of ``node_id``, made disconnected and empty on first use."""
        node = self.nodes.get(node_id)
        if node is None:
            node = self.nodes[node_id] = NodeSession(
                node_id=node_id,
                last_seen=self._clock(),
                on_change=self.changed,
                defer=self._defer,
                max_tasks_per_gpu=self._max_tasks_per_gpu,
            )
        return node

    def node_class(self, node_id: str) -> str:
        """The class ``node_id`` announced (``--node-class``), else the default node class."""
        node = self.nodes.get(node_id)
        reg = node.register if node is not None else None
        return (reg.node_class if reg is not None else "") or self._default_node_class

    def changed(self, node: NodeSession, *, membership: bool = False) -> None:
        """Re-index a node after its bookings, state or size changed. ``membership``: it
        connected, left or changed size."""
        self._version += 1
        if membership:
            self._max_gpus = None
            self._on_membership()
        self.free.update(node.capacity())

    def forget(self, node_id: str) -> None:
        """Drop a node from memory."""
        del self.nodes[node_id]
        self.free.remove(node_id)
        self._version += 1
        self._max_gpus = None
        self._on_membership()

    def capacities(self) -> list[NodeCapacity]:
        """What every node can take now. Kept until a node changes: do not modify."""
        if self._caps is None or self._caps[0] != self._version:
            self._caps = (self._version, [n.capacity() for n in self.nodes.values()])
        return self._caps[1]

    def nodes_without(self, loggers: frozenset[str]) -> frozenset[str]:
        """Connected nodes that said they cannot write one of ``loggers`` (``spec.tracking``):
        a task naming them is not placed there. A node that did not say is not counted."""
        if not loggers:
            return frozenset()
        return frozenset(
            n.node_id
            for n in self.nodes.values()
            if n.connected and n.register.tracking_reported and not loggers <= set(n.register.tracking_loggers)
        )

    def node_loggers(self) -> list[NodeLoggers]:
        """What each connected node said it can write of ``spec.tracking`` (None: it did not say)."""
        return [
            NodeLoggers(n.node_id, frozenset(n.register.tracking_loggers) if n.register.tracking_reported else None)
            for n in self.nodes.values()
            if n.connected
        ]

    def sizes(self) -> dict[str, int]:
        """GPUs of every node the cluster may have: resource_pool entries and connected nodes."""
        sizes = {n.node_id: n.gpu_count for n in self._pool}
        sizes.update({n.node_id: n.gpu_count for n in self.nodes.values() if n.connected})
        return sizes

    def max_possible_gpus(self) -> int:
        """Most GPUs any one node could ever offer: pool entries and connected nodes."""
        if self._max_gpus is None:
            sizes = [n.gpu_count for n in self._pool]
            sizes += [n.gpu_count for n in self.nodes.values() if n.connected]
            self._max_gpus = max(sizes, default=0)
        return self._max_gpus
