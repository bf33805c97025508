"""Preemptions in flight: which running attempts were told to stop for which blocked task, and
until when their node has to confirm it. :class:`PreemptionTracker` owns that bookkeeping (memory
only); :class:`~opentinker_scheduler.state.core.SchedulerCore` holds one and calls it each tick,
on cancel, on lost allocations and on the victims' final reports. Victim choice itself is the
pure policy :func:`~opentinker_scheduler.policy.preemption.choose_victims`."""

from __future__ import annotations

import time
from typing import Callable, Mapping, NamedTuple, Protocol

import structlog
from opentinker.common.v1 import common_pb2
from opentinker.node.v1 import node_pb2

from opentinker_scheduler.policy.placement import FreeNodes
from opentinker_scheduler.policy.preemption import NodeState, RunningAlloc, choose_victims
from opentinker_scheduler.policy.quota import QuotaBook, task_need
from opentinker_scheduler.state.nodes import NodeSession
from opentinker_scheduler.state.queue import LiveTasks

log = structlog.get_logger("opentinker.scheduler")

S = common_pb2  # TaskState constants: S.TASK_STATE_PENDING ...

#: At most this many blocked tasks are looked at for preemption per tick (bounds tick cost).
PREEMPT_CANDIDATES_PER_TICK = 16


class Victim(NamedTuple):
    """A running attempt told to checkpoint and stop (``CancelTask(reason="PREEMPTED")``)."""

    attempt: int
    node_id: str
    #: The blocked task it makes room for.
    for_task: str


class _Timeouts(Protocol):
    preemption_timeout_s: float


class PreemptionTracker:
    """The preemptions in flight, and starting new ones for blocked higher-priority tasks.

    Args:
        tasks: the core's unfinished tasks (read only: the queue and the active rows).
        nodes: node id -> session (read; victims' stops are pushed down their node's stream).
        free: the index of nodes with room now (read: a task that fits somewhere is not blocked).
        config: anything with ``preemption_timeout_s`` (seconds a node has to confirm a stop),
            read at each preemption, so a changed setting applies to the next one.
        notify: called when a preemption starts (wakes WatchTask streams: pending reasons changed).
        clock: monotonic seconds (tests pass their own).

    State, all in memory (after a scheduler restart a victim's CANCELLED report with error
    "PREEMPTED" is still requeued as preempted, and waiting tasks choose victims afresh):

    * :attr:`victims`: victim task id -> :class:`Victim`. A victim keeps its GPUs in the ledger
      until its node reports it CANCELLED; then the task table requeues it with reason PREEMPTED.
    * :attr:`waiting`: waiting task id -> (node id, victim ids).
    * :attr:`deadlines`: victim task id -> monotonic deadline for its node to confirm it stopped;
      past it the preemption is given up (the waiting task may choose victims again, re-sending
      the stop).
    """

    def __init__(
        self,
        *,
        tasks: LiveTasks,
        nodes: Mapping[str, NodeSession],
        free: FreeNodes,
        config: _Timeouts,
        notify: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
        quotas: Callable[[], QuotaBook | None] = lambda: None,
    ) -> None:
        self._tasks = tasks
        self._nodes = nodes
        self._free = free
        self._config = config
        self._notify = notify
        self._clock = clock
        self._quotas = quotas
        self.victims: dict[str, Victim] = {}
        self.waiting: dict[str, tuple[str, tuple[str, ...]]] = {}
        self.deadlines: dict[str, float] = {}

    def __contains__(self, task_id: object) -> bool:
        """Whether ``task_id`` is a victim whose stop is in flight."""
        return task_id in self.victims

    def victim_ended(self, task_id: str) -> Victim | None:
        """Forget ``task_id`` as a victim (its attempt ended, was lost or timed out); returns the
        record it had, if any."""
        return self.victims.pop(task_id, None)

    def forget(self, task_id: str) -> None:
        """Forget ``task_id`` both as a victim and as a waiting task (it was cancelled)."""
        self.victims.pop(task_id, None)
        self.waiting.pop(task_id, None)

    def waiting_on(self, task_id: str) -> tuple[str, list[str]] | None:
        """``(node id, victim ids still stopping)`` of the preemption waiting task ``task_id``
        started, or None when it has none in flight."""
        waiting = self.waiting.get(task_id)
        if waiting is None:
            return None
        node_id, victims = waiting
        left = [v for v in victims if self._for_task(v) == task_id]
        return (node_id, left) if left else None

    def preempt(self) -> int:
        """Start preemptions for blocked tasks; returns how many tasks got victims this call.

        Looks at pending tasks in queue order while they outrank (strictly higher ``priority``)
        the lowest-priority RUNNING task not already being preempted; for one that fits on no
        node now and has no preemption in flight, :func:`~opentinker_scheduler.policy.preemption.choose_victims`
        picks victims on one node and each is sent ``CancelTask(reason="PREEMPTED")``. The
        victims keep their GPUs in the ledger until their node reports them CANCELLED; then they
        go back to PENDING (attempt + 1, reason PREEMPTED, not counted against max_attempts) and
        the waiting task is placed by the next round. A node that does not confirm within
        ``preemption_timeout`` (config) has the preemption given up: the victim is no longer
        counted as one and the waiting task may choose again (re-sending the stop to the same
        victim if it is still the cheapest). At most :data:`PREEMPT_CANDIDATES_PER_TICK` blocked
        tasks are looked at per call.
        """
        self._prune()
        queue, active = self._tasks.queue, self._tasks.active
        if not queue or not active:
            return 0
        lowest = self._lowest_running()
        if lowest is None:
            return 0
        book = self._quotas()
        quotas = book if book is not None and book.queues else None
        reclaim = self._reclaimable(quotas) if quotas is not None else set()
        now = time.time()
        started = looked = 0
        verdicts: dict[tuple[str, tuple[int, int]], bool] = {}  # (queue, need) -> admitted, for this call
        for key in queue.ordered_keys():
            task = queue.row(key)
            if looked >= PREEMPT_CANDIDATES_PER_TICK or (task.priority <= lowest and not reclaim):
                break
            if (
                task.not_before > now
                or task.spec.resources.nodes > 1  # a gang does not preempt (victims are chosen on one node)
                or task.task_id in self.waiting
                or self._free.best_fit_for(task.gpu_count, task.share_key, need=task.memory_need) is not None
            ):
                continue
            queue_name = quotas.queue_of(task.owner) if quotas is not None else ""
            need = task_need(task.gpu_count)
            if quotas is not None:
                admitted = verdicts.get((queue_name, need))
                if admitted is None:
                    admitted = verdicts[(queue_name, need)] = quotas.admits(queue_name, need)
                if not admitted:
                    continue  # over its queue's quota: it waits, and stops nobody
            reclaiming = quotas is not None and quotas.within_nominal(queue_name, need) and bool(reclaim)
            if task.priority <= lowest and not reclaiming:
                continue
            looked += 1

            def eligible(t, prio=task.priority, q=queue_name, reclaiming=reclaiming) -> bool:
                """Whether running task ``t`` may be stopped for this one: lower priority (in the same
                queue when there are quotas, or borrowed), or borrowed quota this queue reclaims."""
                if reclaiming and t.task_id in reclaim:
                    return True
                if t.priority >= prio:
                    return False
                return quotas is None or t.task_id in reclaim or quotas.queue_of(t.owner) == q

            choice = choose_victims(
                task.priority,
                task.gpu_count,
                self._node_states(task.priority, eligible),
                share_key=task.share_key,
                memory=task.memory_need,
            )
            if choice is None:
                continue
            node = self._nodes[choice.node_id]
            for victim_id in choice.victims:
                victim = active[victim_id]
                # Every node the attempt runs on (a gang's members; member 0 checkpoints, its
                # CANCELLED report requeues the task once).
                members = [
                    n for n in self._nodes.values() if n.allocations.get(victim_id, (None,))[0] == victim.attempt
                ]
                self.victims[victim_id] = Victim(victim.attempt, node.node_id, task.task_id)
                self.deadlines[victim_id] = self._clock() + self._config.preemption_timeout_s
                log.info(
                    "preempting task",
                    task_id=victim_id,
                    attempt=victim.attempt,
                    node_id=node.node_id,
                    priority=victim.priority,
                    for_task=task.task_id,
                    for_priority=task.priority,
                    nodes=[n.node_id for n in members] if len(members) > 1 else None,
                )
                for member in members or [node]:
                    member.push(
                        node_pb2.ConnectResponse(
                            cancel_task=node_pb2.CancelTask(
                                task_id=victim_id, attempt=victim.attempt, reason="PREEMPTED"
                            )
                        )
                    )
            self.waiting[task.task_id] = (node.node_id, choice.victims)
            started += 1
            self._notify()
            lowest = self._lowest_running()
            if lowest is None:
                break
        return started

    def _for_task(self, victim_id: str) -> str:
        victim = self.victims.get(victim_id)
        return victim.for_task if victim is not None else ""

    def _lowest_running(self) -> int | None:
        """The lowest priority of a RUNNING task that is not already a victim (None: no such task)."""
        return min(
            (
                t.priority
                for t in self._tasks.active.values()
                if t.state == S.TASK_STATE_RUNNING and t.task_id not in self.victims
            ),
            default=None,
        )

    def _reclaimable(self, quotas: QuotaBook) -> set[str]:
        """Running tasks (not already victims) that use borrowed quota
        (:meth:`~opentinker_scheduler.policy.quota.QuotaBook.reclaimable`)."""
        return quotas.reclaimable(
            (t.task_id, quotas.queue_of(t.owner), task_need(t.gpu_count), t.start_time or 0.0)
            for t in self._tasks.active.values()
            if t.state == S.TASK_STATE_RUNNING and t.task_id not in self.victims and t.spec.resources.nodes <= 1
        )

    def _node_states(self, priority: int, eligible: Callable | None = None) -> list[NodeState]:
        """Accepting nodes as :func:`choose_victims` sees them. Allocations that may not be
        preempted (not RUNNING, already a victim, a cancelled task not yet confirmed gone, or not
        ``eligible(row)`` when given) are given ``priority`` so they hold their GPUs and slot but
        are never chosen; eligible ones at least one below it."""
        active = self._tasks.active
        spans: dict[tuple[str, int], int] = {}  # (task id, attempt) -> nodes holding it (a gang's members)
        for node in self._nodes.values():
            for task_id, (attempt, _) in node.allocations.items():
                spans[(task_id, attempt)] = spans.get((task_id, attempt), 0) + 1
        out = []
        for node in self._nodes.values():
            if not node.connected or node.draining:
                continue
            running = []
            for task_id, (attempt, devices) in node.allocations.items():
                t = active.get(task_id)
                ok = (
                    t is not None
                    and t.attempt == attempt
                    and t.state == S.TASK_STATE_RUNNING
                    and task_id not in self.victims
                )
                started = (t.start_time or 0.0) if t is not None else 0.0
                prio = priority
                if ok and eligible is None:
                    prio = t.priority
                elif ok and eligible(t):
                    prio = min(t.priority, priority - 1)
                running.append(
                    RunningAlloc(
                        task_id,
                        prio,
                        len(devices),
                        started,
                        tuple(devices),
                        spans[(task_id, attempt)],
                        node.share_key_of(task_id),
                        node.memory_of(task_id),
                    )
                )
            cap = node.capacity()
            out.append(
                NodeState(
                    node.node_id,
                    node.gpu_count,
                    node.max_tasks,
                    len(cap.free_gpus),
                    tuple(running),
                    cap.max_tasks_per_gpu,
                    cap.gpu_memory,
                    tuple(cap.free_gpus),
                )
            )
        return out

    def _prune(self) -> None:
        """Forget preemptions whose victim is no longer that running attempt or whose node did
        not confirm in time, and waiting tasks that are no longer pending or have no victim left."""
        now_m = self._clock()
        for victim_id, (attempt, node_id, waiter) in list(self.victims.items()):
            t = self._tasks.active.get(victim_id)
            if t is None or t.attempt != attempt:
                del self.victims[victim_id]
            elif now_m > self.deadlines.get(victim_id, now_m):
                log.warning(
                    "preemption timed out: node did not confirm the victim stopped",
                    task_id=victim_id,
                    attempt=attempt,
                    node_id=node_id,
                    for_task=waiter,
                    timeout_s=self._config.preemption_timeout_s,
                )
                del self.victims[victim_id]
        for victim_id in [v for v in self.deadlines if v not in self.victims]:
            del self.deadlines[victim_id]
        for waiter, (_, victims) in list(self.waiting.items()):
            if waiter not in self._tasks.queue or not any(self._for_task(v) == waiter for v in victims):
                del self.waiting[waiter]
