"""A trainer node as the scheduler tracks it: its stream, state, telemetry and GPU ledger."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping

from opentinker.common.v1 import common_pb2
from opentinker.node.v1 import node_pb2

from opentinker_scheduler.policy.placement import MemoryNeed, NodeCapacity, share_and_booked


@dataclass
class NodeSession:
    """A trainer node as the scheduler tracks it, connected or not."""

    node_id: str
    register: node_pb2.Register = field(default_factory=node_pb2.Register)
    gpu_count: int = 0
    max_tasks: int = 1
    connected: bool = False
    draining: bool = False
    last_seen: float = field(default_factory=time.monotonic)  # monotonic seconds
    last_heartbeat_time: float = 0.0  # unix seconds
    telemetry: list[common_pb2.DeviceTelemetry] = field(default_factory=list)
    host: common_pb2.HostTelemetry | None = None  # CPU and memory of its host, latest heartbeat
    #: Its model hosts and their LoRA tenants (``common_pb2.ModelHost``), latest heartbeat.
    model_hosts: list = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    max_tasks_per_gpu: int = 1  # LoRA tasks on one base model may share a GPU up to this
    # The GPU ledger: task_id -> (attempt, device indices) of everything occupying this node,
    # including cancelled tasks whose process the node has not yet confirmed gone, and the
    # GPU-sharing key of each (None: needs its GPUs to itself). Changed only through allocate()
    # and release(), which tell the core (on_change) to re-index the node.
    _ledger: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict, repr=False)
    _share: dict[str, str | None] = field(default_factory=dict, repr=False)
    #: task_id -> the GPU memory estimate of a shared LoRA task (None or absent: not counted).
    _memory: dict[str, MemoryNeed | None] = field(default_factory=dict, repr=False)
    #: (register, gpu_count, :meth:`gpu_memory`) as last worked out.
    _gpu_memory: tuple | None = field(default=None, repr=False, compare=False)
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    generation: int = 0  # bumps on every (re)connect; stale streams' events are ignored
    on_change: Callable[["NodeSession"], None] | None = field(default=None, repr=False, compare=False)
    # Returns True when it took the command, to deliver once the open group commit is durable.
    defer: Callable[[asyncio.Queue, object], bool] | None = field(default=None, repr=False, compare=False)

    @property
    def allocations(self) -> Mapping[str, tuple[int, tuple[int, ...]]]:
        """The ledger, read-only."""
        return MappingProxyType(self._ledger)

    def allocate(
        self,
        task_id: str,
        attempt: int,
        devices: tuple[int, ...],
        share_key: str | None = None,
        memory: MemoryNeed | None = None,
    ) -> None:
        """Book ``devices`` for ``task_id``'s ``attempt`` (replacing what it held), with the GPU
        memory estimate ``memory`` of a shared LoRA task."""
        self._ledger[task_id] = (attempt, tuple(devices))
        self._share[task_id] = share_key
        self._memory[task_id] = memory
        if self.on_change is not None:
            self.on_change(self)

    def seal(self, task_id: str) -> None:
        """Stop sharing ``task_id``'s GPUs: it is being stopped (cancel, timeout) and its process
        is in no known state until the node confirms it gone, so nobody new joins its GPUs."""
        if self._share.get(task_id) is not None:
            self._share[task_id] = None
            if self.on_change is not None:
                self.on_change(self)

    def release(self, task_id: str) -> tuple[int, tuple[int, ...]] | None:
        held = self._ledger.pop(task_id, None)
        self._share.pop(task_id, None)
        self._memory.pop(task_id, None)
        if held is not None and self.on_change is not None:
            self.on_change(self)
        return held

    def used_gpus(self) -> set[int]:
        return {d for _, devs in self._ledger.values() for d in devs}

    def _holdings(self) -> list[tuple[tuple[int, ...], str | None, MemoryNeed | None]]:
        return [(devs, self._share.get(t), self._memory.get(t)) for t, (_, devs) in self._ledger.items()]

    def gpu_share(self) -> dict[int, tuple[str, int]]:
        """device -> (share key, tasks) for busy GPUs whose tasks all have the same share key."""
        return share_and_booked(self._holdings())[0]

    def share_key_of(self, task_id: str) -> str | None:
        """The GPU-sharing key booked for ``task_id`` (None: it holds its GPUs alone, or is sealed)."""
        return self._share.get(task_id)

    def memory_of(self, task_id: str) -> MemoryNeed | None:
        """The GPU memory estimate booked for ``task_id`` (None: not counted)."""
        return self._memory.get(task_id)

    def gpu_memory(self) -> dict[int, int]:
        """device -> its memory in bytes as the node registered it, for the GPUs placed on.

        Worked out once per registration and GPU count (both change only when the node
        registers), not on every re-index of the node (two per task placed); a copy is returned."""
        cached = self._gpu_memory
        if cached is None or cached[0] is not self.register or cached[1] != self.gpu_count:
            memory = {
                d.index: d.memory_total_bytes
                for d in self.register.devices
                if d.memory_total_bytes > 0 and 0 <= d.index < self.gpu_count
            }
            cached = self._gpu_memory = (self.register, self.gpu_count, memory)
        return dict(cached[2])

    def gpu_booked(self) -> dict[int, int]:
        """device -> bytes the estimates of the tasks on it take: each task's tenant bytes, plus
        its base model's bytes once per share key (the largest, should two differ)."""
        return share_and_booked(self._holdings())[1]

    def capacity(self) -> NodeCapacity:
        used = self.used_gpus()
        share, booked = share_and_booked(self._holdings())  # gpu_share() and gpu_booked() in one pass
        return NodeCapacity(
            node_id=self.node_id,
            gpu_count=self.gpu_count,
            max_tasks=self.max_tasks,
            running=len(self._ledger),
            free_gpus=[i for i in range(self.gpu_count) if i not in used],
            accepting=self.connected and not self.draining,
            gpu_share=share,
            # A node with model hosts shares a GPU among as many LoRA tasks as a host takes.
            max_tasks_per_gpu=max(self.max_tasks_per_gpu, self.register.tenants_per_host),
            gpu_memory=self.gpu_memory(),
            gpu_booked=booked,
        )

    def push(self, command: node_pb2.ConnectResponse | None) -> None:
        """Send a command down the stream (None ends it), after any uncommitted write commits.
        A ``report_ack`` is cumulative: the acks of one group commit go as one, the newest."""
        cumulative = command is not None and command.WhichOneof("command") == "report_ack"
        if self.defer is None or not self.defer(self.outbox, command, cumulative=cumulative):
            self.outbox.put_nowait(command)
