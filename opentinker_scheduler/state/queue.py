"""The pending queue (PENDING tasks in placement order) and the other unfinished tasks, in memory.

The store stays the source of truth. :class:`~opentinker_scheduler.state.core.SchedulerCore` rebuilds
the queue from it at start and adds or removes a task only after committing a transition into
or out of PENDING, so a placement round never reads the store to find its candidates.

Order (see :mod:`opentinker_scheduler.policy.placement`): larger priority first, then older create
time, then task id. Besides the whole order the queue keeps one ordered list per placement
group (:class:`~opentinker_scheduler.policy.placement.PlacementGroup`: GPU count, share key,
quota queue, memory estimate, tracking loggers), so a round can skip every task that asks for
more GPUs than any node has free without looking at them one by one. Adding and removing cost
O(log n) comparisons plus a memmove of the list.
"""

from __future__ import annotations

import bisect
from typing import Callable, Iterator, Mapping

from opentinker.common.v1 import common_pb2

from opentinker_scheduler.policy.placement import PlacementGroup
from opentinker_scheduler.state.store import ACTIVE_STATES, StateStore, TaskRow

QueueKey = tuple[int, float, str]  # (-priority, create_time, task_id)


def queue_key(task: TaskRow) -> QueueKey:
    return (-task.priority, task.create_time, task.task_id)


def is_gang(task: TaskRow) -> bool:
    """A task that spans several nodes (``spec.resources.nodes`` > 1): kept out of the placement
    groups (:mod:`opentinker_scheduler.state.gangs` places it), in :meth:`PendingQueue.gang_keys`."""
    return task.spec.resources.nodes > 1


def group_of(task: TaskRow, queue_of: Callable[[str], str]) -> PlacementGroup:
    """The placement group of a task, its quota queue from its owner by ``queue_of``."""
    return PlacementGroup(task.gpu_count, task.share_key, queue_of(task.owner), task.memory_need, task.tracking_loggers)


def _no_queues(owner: str) -> str:
    return owner


class PendingQueue:
    """PENDING tasks by id, in placement order overall and per placement group."""

    def __init__(self, queue_of: Callable[[str], str] = _no_queues) -> None:
        #: owner -> quota queue (:meth:`~opentinker_scheduler.policy.quota.QuotaBook.queue_of`).
        self.queue_of = queue_of
        self._rows: dict[str, TaskRow] = {}
        self._keys: dict[str, QueueKey] = {}
        self._order: list[QueueKey] = []
        self._by_gpus: dict[PlacementGroup, list[QueueKey]] = {}
        self._gangs: list[QueueKey] = []  # gang tasks, in placement order (not in _by_gpus)

    def __len__(self) -> int:
        return len(self._rows)

    def __bool__(self) -> bool:
        return bool(self._rows)

    def __contains__(self, task_id: object) -> bool:
        return task_id in self._rows

    def __iter__(self) -> Iterator[TaskRow]:
        """Rows in placement order."""
        return (self._rows[k[2]] for k in list(self._order))

    def get(self, task_id: str) -> TaskRow | None:
        return self._rows.get(task_id)

    def put(self, task: TaskRow) -> None:
        """Add ``task`` or replace its row (priority, create time and gpu_count never change)."""
        if task.task_id in self._rows:
            self._rows[task.task_id] = task
            return
        key = queue_key(task)
        self._rows[task.task_id] = task
        self._keys[task.task_id] = key
        bisect.insort(self._order, key)
        if is_gang(task):
            bisect.insort(self._gangs, key)
            return
        bisect.insort(self._by_gpus.setdefault(group_of(task, self.queue_of), []), key)

    def discard(self, task_id: str) -> TaskRow | None:
        task = self._rows.pop(task_id, None)
        if task is None:
            return None
        key = self._keys.pop(task_id)
        _remove(self._order, key)
        if is_gang(task):
            _remove(self._gangs, key)
            return task
        g = group_of(task, self.queue_of)
        group = self._by_gpus[g]
        _remove(group, key)
        if not group:
            del self._by_gpus[g]
        return task

    def position(self, task_id: str) -> int:
        """1-based place in the queue (0 when not queued)."""
        key = self._keys.get(task_id)
        return bisect.bisect_left(self._order, key) + 1 if key is not None else 0

    def groups(self) -> dict[PlacementGroup, list[QueueKey]]:
        """Placement group -> ordered keys. Read-only: a placement round walks these lists while it
        decides, and the core removes placed tasks only after the round has decided."""
        return self._by_gpus

    def gang_keys(self) -> list[QueueKey]:
        """Keys of the pending gang tasks, in placement order. Read-only."""
        return self._gangs

    def ordered_keys(self) -> list[QueueKey]:
        """All keys in placement order. Read-only; do not change the queue while walking it."""
        return self._order

    def row(self, key: QueueKey) -> TaskRow:
        return self._rows[key[2]]


def _remove(keys: list[QueueKey], key: QueueKey) -> None:
    i = bisect.bisect_left(keys, key)
    if i < len(keys) and keys[i] == key:
        del keys[i]
    else:  # pragma: no cover - a broken invariant; fail loudly rather than drift
        raise KeyError(key)


class LiveTasks:
    """Every unfinished task's row in memory, as last committed, with the counts by state.

    PENDING rows sit in ``queue`` (placement order), ASSIGNED and RUNNING rows in ``active``;
    finished tasks live only in the store. The task table owns the rows: it changes one, writes it,
    then calls :meth:`moved` so membership and counts follow the committed state.
    """

    def __init__(self, queue_of: Callable[[str], str] = _no_queues) -> None:
        self.queue_of = queue_of
        self.queue = PendingQueue(queue_of)
        self.active: dict[str, TaskRow] = {}
        self.counts: dict[int, int] = {}  # TaskState -> number of tasks, finished ones included

    def load(self, store: StateStore) -> None:
        """(Re)read the unfinished tasks and the counts from the store."""
        self.queue = PendingQueue(self.queue_of)
        self.active = {t.task_id: t for t in store.tasks_in_states(ACTIVE_STATES)}
        for task in store.tasks_in_states([common_pb2.TASK_STATE_PENDING]):
            self.queue.put(task)
        self.counts = dict(store.count_by_state())

    def clear(self) -> None:
        """Forget every row and count (this scheduler starts or stops leading)."""
        self.queue = PendingQueue(self.queue_of)
        self.active = {}
        self.counts = {}

    def get(self, task_id: str) -> TaskRow | None:
        return self.active.get(task_id) or self.queue.get(task_id)

    def regroup(self, queue_of: Callable[[str], str]) -> None:
        """Owners moved between quota queues: rebuild the queue's groups with ``queue_of``."""
        self.queue_of = queue_of
        rows = list(self.queue)
        self.queue = PendingQueue(queue_of)
        for row in rows:
            self.queue.put(row)

    def added(self, task: TaskRow) -> None:
        """A new task was committed as PENDING."""
        self.queue.put(task)
        self.counts[task.state] = self.counts.get(task.state, 0) + 1

    def moved(self, task: TaskRow, from_state: int) -> None:
        """``task`` was committed in its current state, coming from ``from_state``."""
        self._place(task)
        self.counts[from_state] -= 1
        self.counts[task.state] = self.counts.get(task.state, 0) + 1

    def reload(self, task_id: str, store: StateStore) -> None:
        """Take the store's row of ``task_id`` again (after a write of it failed)."""
        self.queue.discard(task_id)
        self.active.pop(task_id, None)
        task = store.get_task(task_id)
        if task is not None:
            self._place(task)

    def _place(self, task: TaskRow) -> None:
        if task.state == common_pb2.TASK_STATE_PENDING:
            self.queue.put(task)
        else:
            self.queue.discard(task.task_id)
        if task.state in ACTIVE_STATES:
            self.active[task.task_id] = task
        else:
            self.active.pop(task.task_id, None)


class ReasonsView(Mapping[str, str]):
    """Read-only mapping task id -> why it is pending, worked out on access by ``reason_of``
    (so placement never spends time writing reasons for thousands of tasks nobody reads)."""

    def __init__(self, tasks: LiveTasks, reason_of: Callable[[str], str]) -> None:
        self._tasks = tasks
        self._reason_of = reason_of

    def __getitem__(self, task_id: str) -> str:
        reason = self._reason_of(task_id)
        if not reason:
            raise KeyError(task_id)
        return reason

    def __iter__(self) -> Iterator[str]:
        return (t.task_id for t in self._tasks.queue)

    def __len__(self) -> int:
        return len(self._tasks.queue)
