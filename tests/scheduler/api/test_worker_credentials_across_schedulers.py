"""Attempt credentials on two schedulers sharing one real PostgreSQL, authentication on: the
signing secret lives in the store, so a credential the leader issued with an assignment is
accepted by the other scheduler (a follower's reads, a new leader after a failover); an altered
one is refused."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from opentinker.node.v1 import node_pb2 as N, node_pb2_grpc
from opentinker_client import RLClient
from opentinker_scheduler.config import SchedulerConfig
from opentinker_scheduler.config.auth import AuthConfig
from opentinker_scheduler.config.store import StoreConfig
from opentinker_scheduler.server import start_scheduler
from opentinker_scheduler.state.worker_credentials import AttemptScope

from tests.support.raw_node import RawNode
from tests.support.security import metadata
from tests.support.waiting import wait_for


@pytest.fixture
def pair(tmp_path, postgres_server):
    """Two schedulers with authentication on, one schema, started at once."""
    schema = postgres_server.new_schema()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    configs = [
        SchedulerConfig(
            state_dir=tmp_path / name,
            auth=AuthConfig(enabled=True, bootstrap_admin_key_file=str(tmp_path / "admin.key")),
            lease_s=600,  # the raw node sends no heartbeats
            store=StoreConfig(
                kind="postgres", dsn=postgres_server.dsn(), schema=schema, leader_lease_s=3, renew_interval_s=0.5
            ),
        )
        for name in ("a", "b")
    ]

    async def both():
        return await asyncio.gather(*(start_scheduler(c, host="127.0.0.1", port=0, http_port=0) for c in configs))

    running = call(both())
    yield running, (tmp_path / "admin.key").read_text().strip()
    for r in running:
        try:
            call(r.stop(0))
        except Exception:  # noqa: BLE001 - stopped already
            pass
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_a_credential_from_one_scheduler_is_accepted_by_the_other(pair) -> None:
    running, admin_key = pair
    wait_for(lambda: sum(r.core.leading for r in running) == 1, timeout=30, what="one leader")
    leader, follower = sorted(running, key=lambda r: not r.core.leading)
    with RLClient(f"127.0.0.1:{leader.port}", api_key=admin_key) as root:
        _, alice_key = root.keys.create("alice", "user")
        _, node_key = root.keys.create("rack-1", "node")
    node = RawNode(f"127.0.0.1:{leader.port}", node_key, "node-a")
    try:
        with RLClient(f"127.0.0.1:{leader.port}", api_key=alice_key) as alice:
            task_id = alice.submit_task(workload_type="lora_finetune", model="Qwen/Qwen2.5-0.5B-Instruct", gpu_count=0)
        credential = node.assignment(task_id).worker_credential
        scope = AttemptScope(task_id, 1, "node-a", "alice")
        assert follower.security.worker_credentials.verify(credential) == scope
        with grpc.insecure_channel(f"127.0.0.1:{follower.port}") as ch:
            stub = node_pb2_grpc.NodeServiceStub(ch)
            # The follower serves the worker's read of its own task, with the leader's credential.
            got = stub.LookupTask(N.LookupTaskRequest(task_id=task_id), metadata=metadata(credential), timeout=10)
            assert got.task.task_id == task_id and got.task.owner == "alice"
            # A credential whose payload was changed no longer matches its signature.
            payload, _, signature = credential.partition(".")
            other = leader.security.worker_credentials.issue(AttemptScope(task_id, 1, "node-b", "alice"))
            forged = other.partition(".")[0] + "." + signature
            for token in (forged, credential + "x", payload):
                with pytest.raises(grpc.RpcError) as err:
                    stub.LookupTask(N.LookupTaskRequest(task_id=task_id), metadata=metadata(token), timeout=10)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "unknown attempt credential" in err.value.details()
    finally:
        node.leave()
