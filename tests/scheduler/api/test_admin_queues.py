"""AdminService's quota-queue requests: a bad SetQueueQuota is refused field by field (nothing
changes); a good one becomes the policy's QueueQuota, borrowing limits unset meaning "any"."""

from __future__ import annotations

import pytest

from opentinker.scheduler.v1 import admin_pb2
from opentinker_scheduler.api.admin import quota_from_proto
from opentinker_scheduler.errors import InvalidArgument


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
