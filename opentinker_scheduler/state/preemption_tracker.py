"""The preemption half of :class:`~opentinker_scheduler.state.core.SchedulerCore`: choosing victims for
blocked higher-priority tasks (:mod:`.preemption` is the pure policy), telling them to stop,
and giving up on preemptions a node never confirms. Mixed into the core; it shares its state."""

from __future__ import annotations

import time

import structlog
from opentinker.common.v1 import common_pb2
from opentinker.node.v1 import node_pb2

from opentinker_scheduler.policy.preemption import NodeState, RunningAlloc, choose_victims

log = structlog.get_logger("opentinker.scheduler")

S = common_pb2  # TaskState constants: S.TASK_STATE_PENDING ...

#: At most this many blocked tasks are looked at for preemption per tick (bounds tick cost).
PREEMPT_CANDIDATES_PER_TICK = 16


class Preempting:
    """Preemptions in flight live in ``self._victims``, ``self._preempting`` and
    ``self._victim_deadline`` (see :class:`~opentinker_scheduler.state.core.SchedulerCore`)."""

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
        victim if it is still the cheapest). Preemptions in flight live in memory only: after a
        scheduler restart a victim's CANCELLED report with error "PREEMPTED" is still requeued as
        preempted, and waiting tasks choose victims afresh.
        """
        self._prune_preemptions()
        if not self.queue or not self.active:
            return 0
        lowest = min((t.priority for t in self.active.values() if t.state == S.TASK_STATE_RUNNING and t.task_id not in self._victims), default=None)
        if lowest is None:
            return 0
        now = time.time()
        started = looked = 0
        for key in self.queue.ordered_keys():
            task = self.queue.row(key)
            if task.priority <= lowest or looked >= PREEMPT_CANDIDATES_PER_TICK:
                break
            if task.not_before > now or task.task_id in self._preempting or self.free.best_fit_for(task.gpu_count, task.share_key) is not None:
                continue
            looked += 1
            choice = choose_victims(task.priority, task.gpu_count, self._node_states(task.priority))
            if choice is None:
                continue
            node = self.nodes[choice.node_id]
            for victim_id in choice.victims:
                victim = self.active[victim_id]
                self._victims[victim_id] = (victim.attempt, node.node_id, task.task_id)
                self._victim_deadline[victim_id] = time.monotonic() + self.config.preemption_timeout_s
                log.info("preempting task", task_id=victim_id, attempt=victim.attempt, node_id=node.node_id, priority=victim.priority, for_task=task.task_id, for_priority=task.priority)
                node.push(node_pb2.ConnectResponse(cancel_task=node_pb2.CancelTask(task_id=victim_id, attempt=victim.attempt, reason="PREEMPTED")))
            self._preempting[task.task_id] = (node.node_id, choice.victims)
            started += 1
            self._notify()
            lowest = min((t.priority for t in self.active.values() if t.state == S.TASK_STATE_RUNNING and t.task_id not in self._victims), default=None)
            if lowest is None:
                break
        return started

    def _node_states(self, priority: int) -> list[NodeState]:
        """Accepting nodes as :func:`choose_victims` sees them. Allocations that may not be
        preempted (not RUNNING, already a victim, a cancelled task not yet confirmed gone) are
        given ``priority`` so they hold their GPUs and slot but are never chosen."""
        out = []
        for node in self.nodes.values():
            if not node.connected or node.draining:
                continue
            running = []
            for task_id, (attempt, devices) in node.allocations.items():
                t = self.active.get(task_id)
                ok = t is not None and t.attempt == attempt and t.state == S.TASK_STATE_RUNNING and task_id not in self._victims
                running.append(RunningAlloc(task_id, t.priority if ok else priority, len(devices), (t.start_time or 0.0) if t is not None else 0.0, tuple(devices)))
            cap = node.capacity()
            out.append(NodeState(node.node_id, node.gpu_count, node.max_tasks, len(cap.free_gpus), tuple(running)))
        return out

    def _prune_preemptions(self) -> None:
        """Forget preemptions whose victim is no longer that running attempt, and waiting tasks
        that are no longer pending or have no victim left."""
        now_m = time.monotonic()
        for victim_id, (attempt, node_id, waiter) in list(self._victims.items()):
            t = self.active.get(victim_id)
            if t is None or t.attempt != attempt:
                del self._victims[victim_id]
            elif now_m > self._victim_deadline.get(victim_id, now_m):
                log.warning(
                    "preemption timed out: node did not confirm the victim stopped",
                    task_id=victim_id, attempt=attempt, node_id=node_id, for_task=waiter, timeout_s=self.config.preemption_timeout_s,
                )
                del self._victims[victim_id]
        for victim_id in [v for v in self._victim_deadline if v not in self._victims]:
            del self._victim_deadline[victim_id]
        for waiter, (_, victims) in list(self._preempting.items()):
            if waiter not in self.queue or not any(self._victims.get(v, (0, "", ""))[2] == waiter for v in victims):
                del self._preempting[waiter]

