"""ListNodes (and so `opentinker nodes`) lists the resource_pool nodes that have not connected yet,
as not connected with a note saying so, next to the nodes that did; a pool node that connects is
listed once, as itself."""

from __future__ import annotations

from opentinker.node.v1 import node_pb2
from opentinker_client import RLClient
from tests.support.security import LoopbackScheduler

POOL = """
resource_pool:
  - node_id: "gpu-node-01"
    gpu_count: 4
    max_tasks: 8
  - node_id: "gpu-node-02"
    gpu_count: 2
    max_tasks: 3
"""


def test_pool_nodes_that_never_connected_are_listed_as_such(tmp_path) -> None:
    with LoopbackScheduler(tmp_path, POOL) as sched, RLClient(sched.target) as root:
        nodes = root.list_nodes()
        assert [(n.node_id, n.connected, n.gpu_count, n.max_tasks) for n in nodes] == [
            ("gpu-node-01", False, 4, 8),
            ("gpu-node-02", False, 2, 3),
        ]
        assert all(n.notes == ("in resource_pool; has not connected since this scheduler started",) for n in nodes)
        assert nodes[0].last_heartbeat_time is None and nodes[0].running_task_ids == ()
        sched.do(sched.core.node_register, node_pb2.Register(node_id="gpu-node-02", max_tasks=3))  # it connects
        listed = {n.node_id: n for n in root.list_nodes()}
        assert sorted(listed) == ["gpu-node-01", "gpu-node-02"]
        assert listed["gpu-node-02"].connected and listed["gpu-node-02"].notes != nodes[1].notes
