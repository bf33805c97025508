"""AdminService's quota-queue requests: a bad SetQueueQuota is refused field by field (nothing
changes); a good one becomes the policy's QueueQuota, borrowing limits unset meaning "any";
ResetQueueQuota refuses a non-admin key, a bad name and an unknown queue."""

from __future__ import annotations

import grpc
import pytest

from opentinker.common.v1 import common_pb2
from opentinker.scheduler.v1 import admin_pb2, admin_pb2_grpc
from opentinker_scheduler.api.admin import quota_from_proto
from opentinker_scheduler.errors import InvalidArgument
from tests.support.security import LoopbackScheduler, metadata


def test_a_queue_request_becomes_a_quota() -> None:
    q = admin_pb2.Queue(name="team-a", gpu_quota=8, cpu_task_quota=2, owners=["alice", "bob", "alice"])
    q.gpu_borrowing_limit = 0
    quota = quota_from_proto(q)
    assert (quota.gpus, quota.cpu_tasks, quota.borrowing_gpus, quota.borrowing_cpu_tasks) == (8, 2, 0, None)
    assert quota.owners == ("alice", "bob")


@pytest.mark.parametrize(
    ("queue", "field"),
    [
        (admin_pb2.Queue(name="team a", gpu_quota=1), "queue.name"),
        (admin_pb2.Queue(name="", gpu_quota=1), "queue.name"),
        (admin_pb2.Queue(name="a", gpu_quota=-1), "queue.gpu_quota"),
        (admin_pb2.Queue(name="a", cpu_task_quota=2_000_000), "queue.cpu_task_quota"),
        (admin_pb2.Queue(name="a", gpu_borrowing_limit=-2), "queue.gpu_borrowing_limit"),
        (admin_pb2.Queue(name="a", owners=["ok", ""]), "queue.owners[1]"),
    ],
)
def test_a_bad_queue_request_names_the_field(queue, field) -> None:
    with pytest.raises(InvalidArgument) as info:
        quota_from_proto(queue)
    assert str(info.value).startswith(f"{field}: expected"), str(info.value)


def test_reset_queue_quota_refuses_by_name_and_role(tmp_path) -> None:
    config = "auth: {enabled: true}\nqueues:\n  - {name: team-a, gpus: 2, owners: [alice]}\n"
    with LoopbackScheduler(tmp_path / "state", config) as sched, sched.channel() as ch:
        stub = admin_pb2_grpc.AdminServiceStub(ch)
        root = metadata(sched.admin_key)
        user = stub.CreateApiKey(
            admin_pb2.CreateApiKeyRequest(owner="alice", role=admin_pb2.API_KEY_ROLE_USER), metadata=root
        )
        refused = {}
        for name, md in (("team-a", metadata(user.api_key)), ("team a", root), ("team-z", root)):
            with pytest.raises(grpc.RpcError) as err:
                stub.ResetQueueQuota(admin_pb2.ResetQueueQuotaRequest(name=name), metadata=md)
            refused[name] = (err.value.code(), err.value.details())
        assert refused["team-a"][0] == grpc.StatusCode.PERMISSION_DENIED and "admin keys only" in refused["team-a"][1]
        assert refused["team a"][0] == grpc.StatusCode.INVALID_ARGUMENT and refused["team a"][1].startswith(
            "name: expected"
        )
        assert (
            refused["team-z"][0] == grpc.StatusCode.NOT_FOUND
            and "not in the scheduler config (queues: team-a)" in refused["team-z"][1]
        )
        # A configured queue with no override is answered as it is; nothing changed.
        resp = stub.ResetQueueQuota(admin_pb2.ResetQueueQuotaRequest(name="team-a"), metadata=root)
        assert resp.queue.gpu_quota == 2 and not resp.queue.overridden and not resp.HasField("removed")
        assert resp.queue.configured.gpu_quota == 2


def test_get_desired_trainers_counts_the_pending_work_no_node_can_take(tmp_path) -> None:
    config = "auth: {enabled: true}\nresource_pool:\n  - {node_id: gpu-node-01, gpu_count: 2, max_tasks: 2}\n"
    with LoopbackScheduler(tmp_path / "state", config) as sched, sched.channel() as ch:
        stub = admin_pb2_grpc.AdminServiceStub(ch)
        root = metadata(sched.admin_key)
        idle = stub.GetDesiredTrainers(admin_pb2.GetDesiredTrainersRequest(), metadata=root)
        assert [(d.node_class, d.desired_trainers, d.pending_gpus) for d in idle.node_classes] == [("default", 0, 0)]
        spec = common_pb2.TaskSpec(workload_type="full_rl", resources=common_pb2.Resources(gpu_count=2))
        spec.env_config.update({"env_id": "CartPole-v1"})
        sched.do(lambda: sched.core.api.submit(spec, owner="alice"))  # pending: no node is connected
        busy = stub.GetDesiredTrainers(admin_pb2.GetDesiredTrainersRequest(), metadata=root)
        assert [
            (d.node_class, d.desired_trainers, d.connected_trainers, d.pending_gpus) for d in busy.node_classes
        ] == [("default", 1, 0, 2)]
