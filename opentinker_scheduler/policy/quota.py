"""Queues and quotas: who may use how much of a shared cluster, and who goes next. Pure, no I/O.

Model (after Kubernetes Kueue's ClusterQueues in one cohort):
  * A **queue** (a team, say) has a nominal quota of GPUs and of CPU-task slots. Owners (API key
    owners) are mapped to queues; an owner not mapped goes to the configured default queue, or,
    without one, to a queue of its own with no quota (it neither lends nor is limited).
  * A task uses ``gpu_count x nodes`` GPUs of its queue's quota (a CPU task, ``gpu_count == 0``,
    one CPU-task slot) from assignment until it leaves ASSIGNED/RUNNING.
  * **Admission** (:meth:`QuotaBook.admits`): a task may start when its queue's usage plus the
    task stays within the nominal quota; beyond it, the queue **borrows**: allowed while the
    borrowed amount stays within the queue's ``borrowing_limit`` (None: no limit) and all the
    borrowing in the cohort stays within the quota other queues leave idle. A task that is not
    admitted stays PENDING with a reason naming its queue, usage and quota
    (:meth:`QuotaBook.why_not`); it never fails.
  * **Reclaim** (:meth:`QuotaBook.reclaimable`): a task whose queue is within its nominal quota
    but that fits on no node may stop tasks of queues that borrow (above their nominal quota), of
    any priority, newest first, only as many as the queue borrows: the existing
    checkpoint-and-requeue preemption does it, so a queue back within its nominal quota regains it
    within one preemption round.
  * **Fair share** (:meth:`QuotaBook.dominant_share`): at equal priority the next task placed is
    the one whose queue has the lowest dominant share, the larger of its used fractions of GPUs
    and of CPU-task slots (of its nominal quota; of the whole cluster for a queue with no quota).
    This is dominant-resource fairness, Ghodsi et al., "Dominant Resource Fairness: Fair
    Allocation of Multiple Resource Types", NSDI 2011, with queues as users and the quota as each
    user's weight (as Kueue's fair sharing weighs by nominal quota), so an owner who submits 1,000
    tasks does not starve one who submits one.

Resources are a pair ``(gpus, cpu_tasks)`` of non-negative integers throughout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

#: A resource vector: (GPUs, CPU-task slots).
Need = tuple[int, int]
_NAMES = ("GPU", "CPU-task slot")


@dataclass(frozen=True)
class QueueQuota:
    """One queue's quota. ``borrowing_*``: how far beyond nominal it may go on idle quota of
    other queues (None: as far as there is idle quota; 0: never)."""

    name: str
    gpus: int
    cpu_tasks: int
    borrowing_gpus: int | None = None
    borrowing_cpu_tasks: int | None = None
    owners: tuple[str, ...] = ()

    @property
    def nominal(self) -> Need:
        return (self.gpus, self.cpu_tasks)

    @property
    def borrowing(self) -> tuple[int | None, int | None]:
        return (self.borrowing_gpus, self.borrowing_cpu_tasks)


def task_need(gpu_count: int, nodes: int = 1) -> Need:
    """What a task takes of its queue's quota: ``gpu_count x nodes`` GPUs, or one CPU-task slot."""
    return (gpu_count * max(1, nodes), 0) if gpu_count > 0 else (0, 1)


@dataclass
class QuotaBook:
    """The queues, their quotas and current usage.

    Args:
        queues: the configured queues (names unique).
        default_queue: where owners not mapped go; "" (or a name with no quota configured): each
            unmapped owner is a queue of its own, named by the owner, with no quota.
        cluster: total (GPUs, CPU-task slots) of the cluster, the denominator of the dominant
            share of a queue with no quota (at least 1 each).
        used: queue -> [GPUs, CPU-task slots] in use; change it only through :meth:`add` and
            :meth:`clear_usage`, which keep the cohort's sums current.

    The cohort's idle and borrowed amounts per resource (what :meth:`why_not` weighs a borrowing
    task against) are kept as running sums over the limited queues, updated by :meth:`add`, so a
    quota verdict costs O(1) instead of O(queues): a placement round over a deep queue asks it
    once per group (:func:`~.placement.place_round`), and every submit may start a round.
    """

    queues: Mapping[str, QueueQuota] = field(default_factory=dict)
    default_queue: str = ""
    cluster: Need = (1, 1)
    used: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.queues = dict(self.queues)
        self._owner_queue = {o: q.name for q in self.queues.values() for o in q.owners}
        #: Per resource: sum over limited queues of nominal quota left unused, and of use beyond it.
        self._idle_sum = [0, 0]
        self._borrowed_sum = [0, 0]
        for name in self.queues:
            self._count(name, 1)
        self._shares: dict[str, tuple[Need, float]] = {}  # queue -> (cluster then, dominant share)

    @classmethod
    def of(cls, queues: Iterable[QueueQuota], default_queue: str = "", cluster: Need = (1, 1)) -> QuotaBook:
        return cls({q.name: q for q in queues}, default_queue, cluster)

    # ------------------------------------------------------------------ membership
    def queue_of(self, owner: str) -> str:
        """The queue an owner's tasks go to."""
        q = self._owner_queue.get(owner)
        if q is not None:
            return q
        if self.default_queue:
            return self.default_queue
        return owner

    def limited(self, queue: str) -> bool:
        """Whether ``queue`` has a quota (configured), so it is limited and lends what it leaves idle."""
        return queue in self.queues

    # ------------------------------------------------------------------ usage
    def usage(self, queue: str) -> Need:
        u = self.used.get(queue)
        return (u[0], u[1]) if u else (0, 0)

    def add(self, queue: str, need: Need, sign: int = 1) -> None:
        """Book (``sign`` 1) or release (-1) ``need`` on ``queue``."""
        limited = queue in self.queues
        if limited:
            self._count(queue, -1)
        u = self.used.setdefault(queue, [0, 0])
        u[0] += sign * need[0]
        u[1] += sign * need[1]
        if u == [0, 0]:
            del self.used[queue]
        self._shares.pop(queue, None)
        if limited:
            self._count(queue, 1)

    def clear_usage(self) -> None:
        """Forget all usage (before recounting it from the active tasks)."""
        self.used.clear()
        self._shares.clear()
        self._idle_sum = [0, 0]
        self._borrowed_sum = [0, 0]
        for name in self.queues:
            self._count(name, 1)

    def _count(self, queue: str, sign: int) -> None:
        """Add (1) or take out (-1) limited ``queue``'s part of the cohort's idle and borrowed sums."""
        nominal, used = self.queues[queue].nominal, self.usage(queue)
        for r in (0, 1):
            self._idle_sum[r] += sign * max(0, nominal[r] - used[r])
            self._borrowed_sum[r] += sign * max(0, used[r] - nominal[r])

    def _idle(self, r: int, but: str = "") -> int:
        """Nominal quota of resource ``r`` that limited queues other than ``but`` leave unused
        (what may be lent)."""
        q = self.queues.get(but)
        return self._idle_sum[r] - (max(0, q.nominal[r] - self.usage(but)[r]) if q is not None else 0)

    def _borrowed(self, r: int, but: str = "") -> int:
        """Resource ``r`` used beyond nominal quota by limited queues other than ``but``."""
        q = self.queues.get(but)
        return self._borrowed_sum[r] - (max(0, self.usage(but)[r] - q.nominal[r]) if q is not None else 0)

    # ------------------------------------------------------------------ decisions
    def admits(self, queue: str, need: Need) -> bool:
        """Whether a task of ``queue`` needing ``need`` may start now (see the module doc)."""
        return self.why_not(queue, need) is None

    def why_not(self, queue: str, need: Need) -> str | None:
        """None when admitted, else the reason, e.g. ``"queue team-a is at its quota: 8 of 8 GPUs
        in use, the task needs 2 more; it may borrow 0 (borrowing_limit 0)"``."""
        q = self.queues.get(queue)
        if q is None:
            return None
        used = self.usage(queue)
        for r in (0, 1):
            if need[r] == 0:
                continue
            after = used[r] + need[r]
            if after <= q.nominal[r]:
                continue
            borrowed = after - q.nominal[r]
            limit = q.borrowing[r]
            head = (
                f"queue {queue} is at its quota: {used[r]} {_unit(r, used[r])} in use of a nominal quota of "
                f"{q.nominal[r]}, the task needs {need[r]} more"
            )
            if limit is not None and borrowed > limit:
                return f"{head}; its borrowing_limit is {limit}"
            lendable = self._idle(r, but=queue) - self._borrowed(r, but=queue)
            if borrowed > lendable:
                return f"{head}; other queues leave {max(0, lendable)} idle to borrow"
        return None

    def within_nominal(self, queue: str, need: Need) -> bool:
        """Whether ``queue`` would stay within its nominal quota with ``need`` more (a queue with
        no quota: always). Such a task may reclaim borrowed resources."""
        q = self.queues.get(queue)
        if q is None:
            return True
        used = self.usage(queue)
        return all(used[r] + need[r] <= q.nominal[r] for r in (0, 1))

    def dominant_share(self, queue: str) -> float:
        """The larger of the queue's used fractions of GPUs and CPU-task slots: of its nominal
        quota, or of the cluster for a queue with no quota (DRF, Ghodsi et al. 2011). A queue
        with a zero quota that uses something has share ``inf``.

        Remembered per queue until its usage (:meth:`add`) or the cluster's size changes: a
        placement round ranks every group by it at every choice."""
        hit = self._shares.get(queue)
        if hit is not None and hit[0] == self.cluster:
            return hit[1]
        used = self.usage(queue)
        q = self.queues.get(queue)
        denom = q.nominal if q is not None else self.cluster
        share = 0.0
        for r in (0, 1):
            if used[r]:
                share = max(share, used[r] / denom[r] if denom[r] else float("inf"))
        self._shares[queue] = (self.cluster, share)
        return share

    def reclaimable(self, running: Iterable[tuple[str, str, Need, float]]) -> set[str]:
        """Tasks that a queue within its nominal quota may stop to get it back.

        Args:
            running: ``(task id, queue, need, start time)`` of running tasks.

        Returns:
            Per queue that borrows (uses more than its nominal quota of some resource), its
            newest tasks that use that resource while what is left of them still exceeds the
            nominal quota (so the queue is not pushed below its nominal quota by more than one
            task). Queues with no quota never lend, so their tasks are never reclaimed.
        """
        by_queue: dict[str, list[tuple[float, str, Need]]] = {}
        for task_id, queue, need, start in running:
            if queue in self.queues:
                by_queue.setdefault(queue, []).append((start, task_id, need))
        out: set[str] = set()
        for queue, tasks in by_queue.items():
            nominal = self.queues[queue].nominal
            over = [max(0, u - n) for u, n in zip(self.usage(queue), nominal)]
            for _, task_id, need in sorted(tasks, reverse=True):  # newest first: least work lost
                if any(need[r] and over[r] > 0 for r in (0, 1)):
                    out.add(task_id)
                    over = [o - n for o, n in zip(over, need)]
        return out

    # ------------------------------------------------------------------ changes
    def with_queue(self, quota: QueueQuota) -> QuotaBook:
        """A copy with ``quota`` added or replacing the queue of that name (usage kept; owners of
        the new entry move to it)."""
        queues = {n: q for n, q in self.queues.items() if n != quota.name}
        queues = {
            n: QueueQuota(q.name, q.gpus, q.cpu_tasks, q.borrowing_gpus, q.borrowing_cpu_tasks,
                          tuple(o for o in q.owners if o not in quota.owners))
            for n, q in queues.items()
        }  # fmt: skip
        queues[quota.name] = quota
        return QuotaBook(queues, self.default_queue, self.cluster, {k: list(v) for k, v in self.used.items()})


def _unit(r: int, n: int) -> str:
    return _NAMES[r] + ("" if n == 1 else "s")
