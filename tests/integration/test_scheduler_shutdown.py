"""SIGTERM to a scheduler with trainer nodes connected: it ends their streams itself (rather
than having grpc.aio cancel the NodeService.Connect handlers after the stop grace), exits 0 with
no traceback in its log, and the node reconnects to the next scheduler on the same state."""

from __future__ import annotations


def test_sigterm_with_a_node_connected_exits_cleanly_and_the_node_comes_back(cluster) -> None:
    scheduler = cluster.start_scheduler()
    cluster.start_trainer("shutdown-node")
    cluster.wait_nodes(1)
    assert scheduler.terminate() == 0
    log = scheduler.log_text()
    assert "Traceback" not in log and "Exception not handled" not in log, log[-4000:]
    cluster.start_scheduler()  # same state dir and port: the trainer's backoff finds it
    assert [n.node_id for n in cluster.wait_nodes(1, timeout=120)] == ["shutdown-node"]
