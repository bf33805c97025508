"""Why a pending task has not started, for a person to read.

Worked out when asked, from the ledger as it is now, so placement rounds do not spend time
writing reasons for thousands of queued tasks nobody reads.
"""

from __future__ import annotations

import time

from opentinker_common.spec.tracking import EXTRAS as TRACKING_LOGGERS

from opentinker_scheduler.policy.placement import PendingTask, reserved_reason, why_pending, with_left_out
from opentinker_scheduler.state.gangs import gang_nodes
from opentinker_scheduler.state.queue import LiveTasks, QueueKey, queue_key
from opentinker_scheduler.state.quota_queues import QuotaQueues, quota_need
from opentinker_scheduler.state.store import TaskRow
from opentinker_scheduler.state.task_table import TaskTable


class PendingReasons:
    """Why each pending task waits.

    Args:
        tasks: the unfinished tasks (their pending queue).
        queues: the quota queues (a queue over its quota holds its tasks back).
        table: the nodes, preemptions and gangs of the current term (read).

    Attributes:
        reservation: ``(queue key, node id)`` the last placement round reserved for the first
            blocked task, or None; the core sets it after each round.
    """

    def __init__(self, tasks: LiveTasks, queues: QuotaQueues, table: TaskTable) -> None:
        self._tasks = tasks
        self._queues = queues
        self._table = table
        self.reservation: tuple[QueueKey, str] | None = None

    def reason(self, task_id: str) -> str:
        """Why a PENDING task has not started, for a person to read ("" when it is not pending).

        Worked out when asked, from the ledger as it is now, so placement rounds do not spend
        time writing reasons for thousands of queued tasks nobody reads."""
        queue, ledger, quotas = self._tasks.queue, self._table.ledger, self._queues.book
        task = queue.get(task_id)
        if task is None:
            return ""
        now = time.time()
        if task.not_before > now:
            return (
                f"waiting {task.not_before - now:.0f} s more before retrying as attempt {task.attempt} "
                f"(backoff after attempt {task.attempt - 1} failed)"
            )
        position, length = queue.position(task_id), len(queue)
        waiting = self._table.preemptions.waiting_on(task_id)
        if waiting is not None:
            node_id, left = waiting
            return (
                f"preempting {', '.join(left)} on {node_id} to make room (waiting for the node to confirm they "
                f"checkpointed and stopped; queue position {position} of {length})"
            )
        over = quotas.why_not(quotas.queue_of(task.owner), quota_need(task))
        if over is not None:
            return f"{over} (queue position {position} of {length})"
        if gang_nodes(task) > 1:
            return self._table.gangs.why(task, [n.capacity() for n in ledger.nodes.values()], position, length)
        reserver, reserved = self._reservation_ahead_of(task)
        closed = ledger.free.closed_to(task.gpu_count, reserved)
        memory = task.memory_need
        unable = ledger.nodes_without(task.tracking_loggers)
        if ledger.free.best_fit_for(task.gpu_count, task.share_key, with_left_out(closed, unable), memory) is not None:
            return f"waiting for the next placement round (queue position {position} of {length})"
        if unable and ledger.free.best_fit_for(task.gpu_count, task.share_key, closed, memory) is not None:
            named = sorted(task.tracking_loggers)
            extras = ", ".join(f"opentinker[{TRACKING_LOGGERS[k][1]}]" for k in named)
            return (
                f"waiting for a node that can write its spec.tracking loggers ({', '.join(named)}): "
                f"the nodes with room cannot ({', '.join(sorted(unable))}; install {extras} there) "
                f"(queue position {position} of {length})"
            )
        if (
            reserver is not None
            and reserved is not None
            and ledger.free.best_fit_for(task.gpu_count, task.share_key, need=memory)
        ):
            return reserved_reason(reserved, reserver, position, length)  # room only on the reserved node
        pending = PendingTask(
            task.task_id, task.priority, task.create_time, task.gpu_count, task.not_before, task.share_key, memory
        )
        why = why_pending(pending, ledger.capacities(), position, length)
        if self.reservation is not None and self.reservation[0][2] == task_id:
            why += (
                f"; {self.reservation[1]} is reserved for it (no task behind it starts there, "
                "except CPU tasks in max_tasks slots it does not need)"
            )
        return why

    def _reservation_ahead_of(self, task: TaskRow) -> tuple[PendingTask | None, str | None]:
        """The last round's reserving task and node when that task is still pending and ahead of
        ``task`` in queue order (so the reservation holds ``task`` back), else (None, None)."""
        if self.reservation is None:
            return None, None
        key, node_id = self.reservation
        row = self._tasks.queue.get(key[2])
        if row is None or queue_key(row) != key or not key < queue_key(task):
            return None, None
        return PendingTask(row.task_id, row.priority, row.create_time, row.gpu_count, row.not_before), node_id
