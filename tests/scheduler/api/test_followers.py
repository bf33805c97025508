"""Two schedulers in this process on one real PostgreSQL: exactly one leads; the follower serves
reads from the database and refuses writes with UNAVAILABLE naming the leader (ErrorInfo);
/health says who leads on both, /ready passes on the leader only; a client given both URLs
reaches the leader; a leader that stops hands its lease over at once."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from opentinker.common.v1 import common_pb2 as C
from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from opentinker_client import RLClient
from opentinker_common.net.leader import not_leader
from opentinker_scheduler.config import SchedulerConfig
from opentinker_scheduler.config.store import StoreConfig
from opentinker_scheduler.server import start_scheduler

from tests.support.http import http_get
from tests.support.loop_thread import LoopThread
from tests.support.waiting import wait_for


@pytest.fixture
def pair(tmp_path, postgres_server):
    """Two schedulers on one schema, started at once: ``(loop, [running, running])``."""
    schema = postgres_server.new_schema()
    loop = LoopThread()
    configs = [
        SchedulerConfig(
            state_dir=tmp_path / name,
            heartbeat_interval_s=0.5,
            lease_s=3,
            store=StoreConfig(
                kind="postgres", dsn=postgres_server.dsn(), schema=schema, leader_lease_s=3, renew_interval_s=0.5
            ),
        )
        for name in ("a", "b")
    ]

    async def both():
        return await asyncio.gather(
            *(start_scheduler(c, host="127.0.0.1", port=0, http_port=0, tick_interval_s=0.1) for c in configs)
        )

    running = loop.call(both())
    yield loop, list(running)
    for r in running:
        try:
            loop.call(r.stop(0))
        except Exception:  # noqa: BLE001 - stopped by the test
            pass
    loop.close()


def _roles(running) -> list[str]:
    return ["leader" if r.core.leading else "follower" for r in running]


def _health(r, path: str = "/health") -> tuple[int, dict]:
    status, body = http_get(f"http://127.0.0.1:{r.http.port}{path}")
    return status, json.loads(body)


def test_one_leader_and_a_follower_that_reads_and_points_writers_to_it(pair) -> None:
    loop, running = pair
    wait_for(lambda: sorted(_roles(running)) == ["follower", "leader"], timeout=30, what="one leader, one follower")
    leader, follower = sorted(running, key=lambda r: not r.core.leading)
    leader_address = f"127.0.0.1:{leader.port}"
    assert leader.leadership.address == leader_address
    # A follower names a leader only once it has read the lease with the leader's lock held.
    wait_for(lambda: follower.core.store.leader_address == leader_address, timeout=30, what="the follower names it")

    spec = C.TaskSpec(workload_type="lora_finetune", model="/models/m")
    with grpc.insecure_channel(f"127.0.0.1:{follower.port}") as ch:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            stub.SubmitTask(scheduler_pb2.SubmitTaskRequest(spec=spec, request_id="r1"), timeout=10)
        err = info.value
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert f"the leader is {leader_address}" in err.details()
        status = rpc_status.from_call(err)
        infos = [d for d in status.details if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR)]
        assert len(infos) == 1
        detail = error_details_pb2.ErrorInfo()
        infos[0].Unpack(detail)
        assert (detail.reason, detail.domain, detail.metadata["leader"]) == (
            "NOT_LEADER",
            "opentinker.scheduler",
            leader_address,
        )
        assert not_leader(err) == leader_address

        with grpc.insecure_channel(f"127.0.0.1:{leader.port}") as lch:
            task = (
                scheduler_pb2_grpc.SchedulerServiceStub(lch)
                .SubmitTask(scheduler_pb2.SubmitTaskRequest(spec=spec, request_id="r1"), timeout=10)
                .task
            )
        # Reads on the follower come from the database.
        got = stub.GetTask(scheduler_pb2.GetTaskRequest(task_id=task.task_id), timeout=10).task
        assert got.task_id == task.task_id and got.state == C.TASK_STATE_PENDING
        listed = stub.ListTasks(scheduler_pb2.ListTasksRequest(), timeout=10).tasks
        assert [t.task_id for t in listed] == [task.task_id]
        events = list(
            stub.WatchTask(scheduler_pb2.WatchTaskRequest(task_id=task.task_id, history_only=True), timeout=10)
        )
        assert events[0].event.state_change.reason == "SUBMITTED"
        with pytest.raises(grpc.RpcError) as info:
            stub.ListNodes(scheduler_pb2.ListNodesRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and not_leader(info.value) == leader_address

    assert _health(leader) == (200, {"status": "ok", "role": "leader", "leader": leader_address, "epoch": 1})
    wait_for(lambda: _health(follower)[1].get("leader") == leader_address, what="the follower knows the leader")
    assert _health(follower) == (200, {"status": "ok", "role": "follower", "leader": leader_address, "epoch": 1})
    assert _health(leader, "/ready")[0] == 200
    status, body = _health(follower, "/ready")
    assert status == 503 and body["status"] == "follower" and body["leader"] == leader_address

    # A client given both URLs, the follower first, submits through the leader.
    urls = f"127.0.0.1:{follower.port},127.0.0.1:{leader.port}"
    with RLClient(scheduler_url=urls) as client:
        task_id = client.submit_task(workload_type="lora_finetune", model="/models/m")
        assert client.get_task(task_id).state == "pending"
    assert len(leader.core.store.list_tasks()) == 2

    # The leader stops: it hands its lease back and the follower leads at once (epoch 2).
    loop.call(leader.stop(0))
    wait_for(lambda: follower.core.leading, timeout=15, what="the follower took over")
    assert follower.core.store.epoch == 2
    assert {t.task_id for t in follower.core.queue} == {task.task_id, task_id}, "the new leader read the queue"
    with RLClient(scheduler_url=urls) as client:
        third = client.submit_task(workload_type="lora_finetune", model="/models/m")
        assert client.get_task(third).state == "pending"
