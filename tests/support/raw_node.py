"""A trainer node on a NodeService stream of its own, without an agent: it registers, keeps the
assignments it is sent (with their attempt credentials) and reports what a test tells it to."""

from __future__ import annotations

import queue
import threading

import grpc

from opentinker.node.v1 import node_pb2 as N, node_pb2_grpc

from tests.support.security import metadata
from tests.support.waiting import wait_for


class RawNode:
    """A node on a NodeService stream of its own (no agent): it registers and keeps the
    assignments it is sent. It sends no heartbeats: give the scheduler a long ``lease``."""

    def __init__(self, target: str, key: str, node_id: str) -> None:
        self.node_id = node_id
        self.assigned: dict[str, N.AssignTask] = {}
        self._out: queue.Queue = queue.Queue()
        self._out.put(N.ConnectRequest(register=N.Register(node_id=node_id, max_tasks=4)))
        self._channel = grpc.insecure_channel(target)
        self._stream = node_pb2_grpc.NodeServiceStub(self._channel).Connect(self._requests(), metadata=metadata(key))
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _requests(self):
        while (msg := self._out.get()) is not None:
            yield msg

    def _read(self) -> None:
        try:
            for msg in self._stream:
                if msg.WhichOneof("command") == "assign_task":
                    self.assigned[msg.assign_task.task_id] = msg.assign_task
        except grpc.RpcError:
            pass

    def assignment(self, task_id: str) -> N.AssignTask:
        return wait_for(lambda: self.assigned.get(task_id), 60, f"{task_id} assigned to {self.node_id}")

    def report(self, assign: N.AssignTask, state: int) -> None:
        """Report ``assign``'s worker in ``state`` (TASK_STATE_CANCELLED: it has stopped)."""
        self._out.put(
            N.ConnectRequest(task_report=N.TaskReport(task_id=assign.task_id, attempt=assign.attempt, state=state))
        )

    def leave(self) -> None:
        """Say goodbye and close: the scheduler requeues what the node held (a new attempt)."""
        if not self._reader.is_alive():
            return
        self._out.put(N.ConnectRequest(goodbye=N.Goodbye(reason="test")))
        self._out.put(None)
        self._reader.join(30)
        self._channel.close()
