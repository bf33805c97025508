"""The quota queues in force: the config's ``queues:`` with runtime overrides applied over them.

:class:`QuotaQueues` keeps the :class:`~opentinker_scheduler.policy.quota.QuotaBook` that
placement, preemption and the task table book usage on. An override (``SetQueue``) is written to
the store first and applied over the config at every start until it is reset. Changing the queues
regroups the pending tasks and recounts usage from the active ones.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

import structlog

from opentinker_scheduler.config import SchedulerConfig
from opentinker_scheduler.errors import NotFound
from opentinker_scheduler.state.changes import Changes
from opentinker_scheduler.policy.quota import QueueQuota, QuotaBook, task_need
from opentinker_scheduler.state.gangs import gang_nodes
from opentinker_scheduler.state.nodes import NodeSession
from opentinker_scheduler.state.queue import LiveTasks
from opentinker_scheduler.state.store import QueueOverride, StateStore, TaskRow

log = structlog.get_logger("opentinker.scheduler")


def quota_need(task: TaskRow) -> tuple[int, int]:
    """What ``task`` takes of its queue's quota while active: (GPUs, CPU-task slots)."""
    return task_need(task.gpu_count, gang_nodes(task))


class QuotaQueues:
    """The quota book in force and the runtime overrides it was made with.

    Args:
        config: the scheduler config (its ``queues``, ``default_queue``).
        store: where overrides are kept.
        tasks: the unfinished tasks: pending ones are regrouped, active ones counted.
        changes: woken when a queue is set or reset.
        require_leader: raises NotLeader on a follower, which may not change queues.

    Attributes:
        book: the quota book in force; replaced whenever the queues change.
        overrides: the runtime overrides in force, oldest first, as the store keeps them.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        store: StateStore,
        tasks: LiveTasks,
        changes: Changes,
        require_leader: Callable[[], None],
    ) -> None:
        self._config = config
        self._require_leader = require_leader
        self._changes = changes
        self._store = store
        self._tasks = tasks
        self.overrides: list[QueueOverride] = []
        self.book = self._book_of([])
        tasks.regroup(self.book.queue_of)

    def current(self) -> QuotaBook:
        """The quota book in force now."""
        return self.book

    def set_queue(self, quota: QueueQuota, *, by: str = "") -> QueueQuota | None:
        """Add or change a quota queue now (no restart): its quota, borrowing limits and owners
        (owners listed move to it from any other queue). The change is a runtime override, written
        to the store first (nothing changes when that fails) and applied over the config at every
        start until :meth:`reset_queue`. Pending tasks are regrouped and usage recounted; the next
        placement round decides with it. ``by``: who set it (an API key owner). Returns the queue
        as it was (None: new). The caller audits the change.

        Raises:
            NotLeader: this scheduler does not lead.
        """
        self._require_leader()
        before = self.book.queues.get(quota.name)
        row = QueueOverride(quota.name, quota.gpus, quota.cpu_tasks, quota.borrowing_gpus,
                            quota.borrowing_cpu_tasks, tuple(quota.owners), time.time(), by)  # fmt: skip
        self._store.set_queue_override(row)
        self.use([*(o for o in self.overrides if o.name != quota.name), row])
        log.info(
            "queue quota set (runtime override)",
            queue=quota.name,
            gpus=quota.gpus,
            cpu_tasks=quota.cpu_tasks,
            owners=quota.owners,
            by=by,
        )
        self._changes.notify()
        return before

    def reset_queue(self, name: str) -> tuple[QueueQuota | None, QueueOverride | None]:
        """Remove queue ``name``'s runtime override now: it goes back to the config's values, or
        is removed when the config has no such queue (its owners go back to where the config and
        the other overrides put them). Returns ``(the queue now or None, the override removed or
        None)``; a configured queue with no override is returned as it is. The caller audits it.

        Raises:
            NotLeader: this scheduler does not lead.
            NotFound: ``name`` is neither overridden nor in the config.
        """
        self._require_leader()
        removed = self.override(name)
        if removed is None and all(q.name != name for q in self._config.queues):
            known = sorted({q.name for q in self._config.queues} | {o.name for o in self.overrides})
            raise NotFound(
                f"queue {name!r} has no runtime override and is not in the scheduler config "
                f"(queues: {', '.join(known) or 'none'})"
            )
        if removed is not None:
            self._store.delete_queue_override(name)
            self.use([o for o in self.overrides if o.name != name])
            log.info("queue override removed", queue=name, configured=self.book.queues.get(name) is not None)
            self._changes.notify()
        return self.book.queues.get(name), removed

    def override(self, name: str) -> QueueOverride | None:
        """The runtime override of queue ``name``, or None."""
        return next((o for o in self.overrides if o.name == name), None)

    def use(self, overrides: list[QueueOverride], *, start: bool = False) -> None:
        """Decide with the config's queues and ``overrides`` from now on: pending tasks regrouped,
        usage recounted. ``start``: read from the store (start, promotion, reload); each override
        that changes what the config says is logged."""
        if start and overrides and overrides != self.overrides:
            configured = {q.name: q for q in self._config.queues}
            for o in overrides:
                was = configured.get(o.name)
                log.info(
                    "quota queue override applied over the config",
                    queue=o.name,
                    gpus=o.gpus,
                    cpu_tasks=o.cpu_tasks,
                    borrowing_gpus=o.borrowing_gpus,
                    borrowing_cpu_tasks=o.borrowing_cpu_tasks,
                    owners=o.owners,
                    config=None
                    if was is None
                    else {"gpus": was.gpus, "cpu_tasks": was.cpu_tasks, "owners": was.owners},
                    set_by=o.set_by,
                    set_time=o.set_time,
                )
        book = self._book_of(overrides)
        book.cluster = self.book.cluster
        self.book, self.overrides = book, list(overrides)
        self._tasks.regroup(book.queue_of)
        self.recount()

    def recount(self) -> None:
        """Quota usage from the active tasks (after a reload, or owners moved between queues)."""
        self.book.clear_usage()
        for task in self._tasks.active.values():
            self.book.add(self.book.queue_of(task.owner), quota_need(task))

    def cluster_changed(self, nodes: Iterable[NodeSession]) -> None:
        """The cluster's size, the dominant-share denominator of queues with no quota."""
        live = [n for n in nodes if n.connected]
        self.book.cluster = (max(1, sum(n.gpu_count for n in live)), max(1, sum(n.max_tasks for n in live)))

    def queue_config(self, owner: str):
        """``(index, QueueConfig)`` of the configured queue ``owner``'s tasks go to, when it sets
        per-owner limits (``queues[i].limits``), else None."""
        name = self.book.queue_of(owner)
        for i, q in enumerate(self._config.queues):
            if q.name == name and (
                q.max_pending_per_owner is not None or q.submit_rate is not None or q.submit_burst is not None
            ):
                return i, q
        return None

    def rows(self, *, refresh: bool) -> list[tuple[str, QueueQuota | None, tuple[int, int], int, float]]:
        """Every queue with a quota or with tasks now: ``(name, quota or None, usage (GPUs,
        CPU tasks), pending tasks, dominant share)``, by name. ``refresh``: read the overrides
        from the store first (a follower: the leader may have changed them since)."""
        if refresh:
            overrides = self._store.queue_overrides()
            if overrides != self.overrides:
                self.use(overrides)
        pending: dict[str, int] = {}
        for task in self._tasks.queue:
            q = self.book.queue_of(task.owner)
            pending[q] = pending.get(q, 0) + 1
        names = sorted(set(self.book.queues) | set(self.book.used) | set(pending))
        return [
            (n, self.book.queues.get(n), self.book.usage(n), pending.get(n, 0), self.book.dominant_share(n))
            for n in names
        ]

    def _book_of(self, overrides: list[QueueOverride]) -> QuotaBook:
        """The config's queues with ``overrides`` applied over them in order (no usage)."""
        book = QuotaBook.of(
            (
                QueueQuota(q.name, q.gpus, q.cpu_tasks, q.borrowing_gpus, q.borrowing_cpu_tasks, q.owners)
                for q in self._config.queues
            ),
            self._config.default_queue,
        )
        for o in overrides:
            book = book.with_queue(
                QueueQuota(o.name, o.gpus, o.cpu_tasks, o.borrowing_gpus, o.borrowing_cpu_tasks, o.owners)
            )
        return book
