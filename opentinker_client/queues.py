"""Quota queues and the scale signal over ``opentinker.scheduler.v1.AdminService`` (``RLClient.queues``).

::

    with RLClient(api_key=admin_key) as client:
        for q in client.queues.list():
            print(q.name, q.gpus_in_use, "/", q.gpu_quota, q.pending_tasks)
        client.queues.set("team-a", gpu_quota=8, cpu_task_quota=16, gpu_borrowing_limit=4, owners=["alice"])
        client.queues.reset("team-a")             # back to the scheduler config's values
        client.queues.desired_trainers()          # {"default": 3, "spot": 0}

A queue's quota is what its owners' tasks may use at once; a task over it waits (PENDING, with the
reason). Changing a quota needs an admin key and takes effect at once (audited as ``queue.set``);
the change is a runtime override that the scheduler keeps across restarts until it is reset
(``queue.reset``). :meth:`QueueInfo.overrides` says which values differ from the config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from opentinker.scheduler.v1 import admin_pb2

if TYPE_CHECKING:
    from opentinker_client.connection import SchedulerConnection

__all__ = ["QueueAdmin", "QueueInfo", "UsageInfo"]


@dataclass(frozen=True)
class UsageInfo:
    """Accounted use: GPU-seconds (per GPU, assignment to confirmed stop), CPU-task seconds,
    tokens sampled and trained, env steps, cost (in the scheduler's ``usage.currency``)."""

    gpu_seconds: float = 0.0
    cpu_task_seconds: float = 0.0
    tokens_generated: float = 0.0
    tokens_trained: float = 0.0
    env_steps: float = 0.0
    cost: float = 0.0
    attempts: int = 0

    @classmethod
    def from_proto(cls, u) -> "UsageInfo":
        return cls(
            u.gpu_seconds, u.cpu_task_seconds, u.tokens_generated, u.tokens_trained, u.env_steps, u.cost, u.attempts
        )


@dataclass(frozen=True)
class QueueInfo:
    """A quota queue, its use now and its per-owner limits. ``*_borrowing_limit`` None: may borrow
    any idle quota; ``limited`` False: an owner's own queue with no quota."""

    name: str
    gpu_quota: int
    cpu_task_quota: int
    gpu_borrowing_limit: int | None
    cpu_task_borrowing_limit: int | None
    owners: tuple[str, ...]
    gpus_in_use: int
    cpu_tasks_in_use: int
    pending_tasks: int
    dominant_share: float
    limited: bool
    max_pending_per_owner: int
    submit_rate: float
    submit_burst: int
    usage: UsageInfo = field(default_factory=UsageInfo)
    #: Whether a runtime override (``set``, kept across restarts until ``reset``) set its values,
    #: when (unix seconds) and by whom (an API key owner).
    overridden: bool = False
    override_time: float | None = None
    override_by: str = ""
    #: The queue as the scheduler config defines it (None: not in the config).
    configured: "QueueInfo | None" = None

    def overrides(self) -> dict[str, tuple[object, object]]:
        """Values that differ from the config: field -> (config's value, value now); every set
        field of a queue that is not in the config (config's value None). Owners compare as sets."""
        fields = ("gpu_quota", "cpu_task_quota", "gpu_borrowing_limit", "cpu_task_borrowing_limit", "owners")
        c = self.configured
        if c is None:
            return {f: (None, getattr(self, f)) for f in fields} if self.overridden else {}
        out: dict[str, tuple[object, object]] = {}
        for f in fields:
            was, now = getattr(c, f), getattr(self, f)
            if (set(was) != set(now)) if f == "owners" else was != now:
                out[f] = (was, now)
        return out

    @classmethod
    def from_proto(cls, q: admin_pb2.Queue) -> "QueueInfo":
        return cls(
            q.name,
            q.gpu_quota,
            q.cpu_task_quota,
            q.gpu_borrowing_limit if q.HasField("gpu_borrowing_limit") else None,
            q.cpu_task_borrowing_limit if q.HasField("cpu_task_borrowing_limit") else None,
            tuple(q.owners),
            q.gpus_in_use,
            q.cpu_tasks_in_use,
            q.pending_tasks,
            q.dominant_share,
            q.limited,
            q.max_pending_per_owner,
            q.submit_rate,
            q.submit_burst,
            UsageInfo.from_proto(q.usage),
            q.overridden,
            q.override_time.ToNanoseconds() / 1e9 if q.HasField("override_time") else None,
            q.override_by,
            cls.from_proto(q.configured) if q.HasField("configured") else None,
        )


class QueueAdmin:
    """Calls AdminService's queue RPCs through the client's connection (as
    :class:`~opentinker_client.keys.KeyAdmin` does)."""

    def __init__(self, connection: SchedulerConnection) -> None:
        self._connection = connection

    def _call(self, name: str, request):
        return self._connection.unary(name, request, service="admin")

    def list(self) -> list[QueueInfo]:
        """Every queue with a quota, or with tasks now, by name."""
        return [QueueInfo.from_proto(q) for q in self._call("ListQueues", admin_pb2.ListQueuesRequest()).queues]

    def set(
        self,
        name: str,
        *,
        gpu_quota: int,
        cpu_task_quota: int,
        gpu_borrowing_limit: int | None = None,
        cpu_task_borrowing_limit: int | None = None,
        owners: Sequence[str] = (),
    ) -> tuple[QueueInfo, QueueInfo | None]:
        """Add or change a queue now (admin keys); returns (the queue now, as it was or None)."""
        q = admin_pb2.Queue(name=name, gpu_quota=gpu_quota, cpu_task_quota=cpu_task_quota, owners=list(owners))
        if gpu_borrowing_limit is not None:
            q.gpu_borrowing_limit = gpu_borrowing_limit
        if cpu_task_borrowing_limit is not None:
            q.cpu_task_borrowing_limit = cpu_task_borrowing_limit
        resp = self._call("SetQueueQuota", admin_pb2.SetQueueQuotaRequest(queue=q))
        return QueueInfo.from_proto(resp.queue), (
            QueueInfo.from_proto(resp.previous) if resp.HasField("previous") else None
        )

    def reset(self, name: str) -> tuple[QueueInfo | None, QueueInfo | None]:
        """Remove a queue's runtime override now (admin keys): it goes back to the scheduler
        config's values, or is removed when the config has no such queue. Returns (the queue now or
        None when removed, the override removed or None when there was none).

        Raises:
            NotFoundError: the queue is neither overridden nor in the config.
        """
        resp = self._call("ResetQueueQuota", admin_pb2.ResetQueueQuotaRequest(name=name))
        return (
            QueueInfo.from_proto(resp.queue) if resp.HasField("queue") else None,
            QueueInfo.from_proto(resp.removed) if resp.HasField("removed") else None,
        )

    def desired_trainers(self) -> dict[str, int]:
        """Node class -> trainers the pending and running work needs now."""
        resp = self._call("GetDesiredTrainers", admin_pb2.GetDesiredTrainersRequest())
        return {d.node_class: d.desired_trainers for d in resp.node_classes}
