"""Gang tasks in the scheduler: tasks that span several nodes (``spec.resources.nodes`` > 1).

A part of :class:`~opentinker_scheduler.state.core.SchedulerCore` that receives the node ledger,
the store, the live tasks and the two transitions it needs, not the core. The task's row keeps
member 0 (its ``node_id`` and ``device_indices``: global rank 0, which reports metrics and
writes checkpoints); :class:`Gangs` keeps every member of each gang attempt that was assigned,
the rendezvous port, and which members' workers have ended, in memory and in the store's
``gang_attempts`` table (written in the same commit as the ASSIGNED transition, and as members
end; dropped when the attempt ends).

* Placement (:meth:`Gangs.place`): all members at once or none
  (:func:`~opentinker_scheduler.policy.gang.place_gang`); a blocked gang reserves its nodes
  (:func:`~opentinker_scheduler.policy.gang.gang_reservation`) against the tasks behind it.
* Assignment (:meth:`Gangs.assignments`): one ``AssignTask`` per member, the same attempt, with
  ``gang`` = its rank range, the world size and the rendezvous (member 0's host name as it
  registered, a port of ``gang_rendezvous_ports`` free on member 0).
* A member's end (:meth:`Gangs.member_report`): its GPUs are released; a member that failed or
  was stopped ends the whole attempt (requeued as attempt + 1 when retryable, from the newest
  checkpoint). Member 0's reports are the task's, as for any task.
* Preemption: a gang is one victim spanning its nodes
  (:func:`~opentinker_scheduler.policy.preemption.choose_victims`); every member is told to
  checkpoint and stop, the members other than member 0 only hand back their GPUs, and member
  0's CANCELLED report requeues the attempt once (PREEMPTED, from that checkpoint).
* The attempt's end, however it came (a member's failure, a lost node, a cancel, a timeout,
  success): every member still running is told to stop (:meth:`Gangs.task_moved`).

Kept across a scheduler restart (:meth:`Gangs.recover`): every member that had not ended holds
its GPUs again in the ledger, and its node, when it reconnects within ``restart_grace`` and
re-announces the attempt, carries on with it (not told it is stale): a restart kills no running
gang. A member whose node does not come back within the grace is lost as any task is, and that
ends the attempt everywhere (requeued as attempt + 1 from its newest checkpoint).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import structlog
from opentinker.common.v1 import common_pb2
from opentinker.node.v1 import node_pb2

from opentinker_scheduler.policy.gang import (
    GangPlacement,
    GangTask,
    gang_reservation,
    place_gang,
    rendezvous_port,
    why_gang_pending,
)
from opentinker_scheduler.state.store import ACTIVE_STATES, TERMINAL_STATES, TaskRow

if TYPE_CHECKING:  # pragma: no cover
    from opentinker_scheduler.policy.quota import QuotaBook
    from opentinker_scheduler.state.ledger import NodeLedger
    from opentinker_scheduler.state.nodes import NodeSession
    from opentinker_scheduler.state.preemption_tracker import PreemptionTracker
    from opentinker_scheduler.state.queue import LiveTasks
    from opentinker_scheduler.state.store import StateStore

log = structlog.get_logger("opentinker.scheduler")
S = common_pb2


def gang_nodes(task: TaskRow) -> int:
    """Nodes ``task`` spans (1 for an ordinary task)."""
    return max(1, int(task.spec.resources.nodes))


def gang_task(task: TaskRow) -> GangTask:
    return GangTask(task.task_id, task.priority, task.create_time, task.gpu_count, gang_nodes(task), task.not_before)


@dataclass
class Gang:
    """One assigned gang attempt: ``members[i] = (node id, devices)``; ``ended``: members whose
    worker reported its end."""

    task_id: str
    attempt: int
    members: tuple[tuple[str, tuple[int, ...]], ...]
    port: int
    ended: set[str] = field(default_factory=set)

    @property
    def primary(self) -> str:
        return self.members[0][0]

    def index_of(self, node_id: str) -> int | None:
        for i, (n, _) in enumerate(self.members):
            if n == node_id:
                return i
        return None


class Requeue(Protocol):
    """:meth:`~opentinker_scheduler.state.task_table.TaskTable.requeue`."""

    def __call__(
        self,
        task: TaskRow,
        reason: str,
        message: str,
        *,
        extra: Sequence[common_pb2.TaskEvent] = (),
        backoff: bool,
        failure: bool = True,
    ) -> None: ...


class FailOrRetry(Protocol):
    """:meth:`~opentinker_scheduler.state.task_table.TaskTable.fail_or_retry`."""

    def __call__(
        self, task: TaskRow, reason: str, message: str, *, retryable: bool, extra: Sequence[common_pb2.TaskEvent] = ()
    ) -> None: ...


class Gangs:
    """The gang attempts the core has assigned (in memory and the store; see the module docstring).

    Args:
        ledger: the nodes; gang members book their GPUs there.
        store: where gangs are kept for a restart.
        rendezvous_ports: the config's ``gang_rendezvous_ports``, ``(low, high)``.
        tasks: the unfinished tasks; gang keys come from its pending queue.
        quotas: returns the quota book in use now.
        need: what a task takes of its queue's quota while active, ``(GPUs, CPU-task slots)``.
        preemptions: the preemptions in flight.
        requeue, fail_or_retry: the task table's transitions of a gang whose member ended.
    """

    def __init__(
        self,
        *,
        ledger: NodeLedger,
        store: StateStore,
        rendezvous_ports: tuple[int, int],
        tasks: LiveTasks,
        quotas: Callable[[], QuotaBook],
        need: Callable[[TaskRow], tuple[int, int]],
        preemptions: PreemptionTracker,
        requeue: Requeue,
        fail_or_retry: FailOrRetry,
    ) -> None:
        self._ledger = ledger
        self._store = store
        self._ports = rendezvous_ports
        self._tasks = tasks
        self._quotas = quotas
        self._need = need
        self._preemptions = preemptions
        self._requeue = requeue
        self._fail_or_retry = fail_or_retry
        self.live: dict[str, Gang] = {}
        #: Nodes the last round's first blocked gang reserved (shown in pending reasons).
        self.reserved: tuple[str, ...] = ()

    # ------------------------------------------------------------------ placement
    def split(self, groups: dict, first_key) -> tuple[dict, dict]:
        """``groups`` cut at ``first_key`` (a gang's queue key): the keys ahead of it, and those behind."""
        ahead, behind = {}, {}
        for g, keys in groups.items():
            i = bisect.bisect_left(keys, first_key)
            if i:
                ahead[g] = keys[:i]
            if i < len(keys):
                behind[g] = keys[i:]
        return ahead, behind

    def place(self, keys: list, now: float) -> tuple[list[tuple[TaskRow, Gang]], tuple[str, ...]]:
        """Place the pending gangs of ``keys`` (queue order) that fit now, booking their members
        in the ledger; the first that does not fit reserves nodes (later gangs do not use them).

        Returns:
            ``([(task, gang)], reserved node ids)``; the gangs are recorded by :meth:`assigned`
            once their transition is committed.
        """
        decided: list[tuple[TaskRow, Gang]] = []
        reserved: tuple[str, ...] = ()
        low, high = self._ports
        quotas = self._quotas()
        for key in keys:
            task = self._tasks.queue.row(key)
            if task.not_before > now:
                continue
            need = self._need(task)
            queue = quotas.queue_of(task.owner)
            if not quotas.admits(queue, need):
                continue  # over its queue's quota: it waits (the core's pending reason says so)
            caps = [n.capacity() for n in self._ledger.nodes.values()]
            gt = gang_task(task)
            placement: GangPlacement | None = place_gang(gt, caps, exclude=reserved)
            port = None
            if placement is not None:
                primary = placement.members[0][0]
                used = [g.port for g in (*self.live.values(), *(g for _, g in decided)) if g.primary == primary]
                port = rendezvous_port(used, low, high)
            if placement is None or port is None:
                if not reserved:
                    reserved = gang_reservation(gt, caps) or ()
                continue
            for node_id, devices in placement.members:
                self._ledger.nodes[node_id].allocate(task.task_id, task.attempt, devices, None)
            decided.append((task, Gang(task.task_id, task.attempt, placement.members, port)))
            quotas.add(queue, need)  # booked for the rest of this call; the core books it for good
        for task, _ in decided:
            quotas.add(quotas.queue_of(task.owner), self._need(task), -1)
        self.reserved = reserved
        return decided, reserved

    def assigned(self, task: TaskRow, gang: Gang) -> None:
        """``gang`` (``task``'s current attempt) is being committed ASSIGNED: recorded in memory
        and in the store (call inside the transition's batch, so both commit together)."""
        self.live[task.task_id] = gang
        self._save(gang)

    def _save(self, gang: Gang) -> None:
        self._store.set_gang(gang.task_id, gang.attempt, gang.port, gang.members, gang.ended)

    def recover(self, active: dict[str, TaskRow]) -> list[tuple[str, TaskRow, tuple[int, ...]]]:
        """Read the recorded gang attempts back (a restart, or a rebuild after a failed commit):
        those that are the current attempt of an ``active`` task become live again.

        Returns:
            ``[(node id, task, devices)]`` of every member other than member 0 whose worker had
            not ended: the core holds their GPUs again (member 0's are the task row's).
            Rows of attempts that are over are ignored (replaced when the task is next placed).
        """
        held = []
        for task_id, attempt, port, members, ended in self._store.gangs():
            task = active.get(task_id)
            if task is None or task.attempt != attempt or not members:
                continue
            gang = Gang(task_id, attempt, tuple(members), port, set(ended))
            self.live[task_id] = gang
            held.extend((n, task, d) for n, d in gang.members[1:] if n not in gang.ended)
        return held

    def assignments(self, gang: Gang, base: node_pb2.AssignTask) -> list[tuple[NodeSession, node_pb2.AssignTask]]:
        """One ``AssignTask`` per member: ``base`` (spec, attempt, checkpoints) with that member's
        devices and ``gang``."""
        per_node = len(gang.members[0][1])
        primary = self._ledger.nodes[gang.primary]
        host = (primary.register.hostname if primary.register is not None else "") or "127.0.0.1"
        out = []
        for i, (node_id, devices) in enumerate(gang.members):
            a = node_pb2.AssignTask()
            a.CopyFrom(base)
            del a.device_indices[:]
            a.device_indices.extend(devices)
            a.gang.CopyFrom(
                node_pb2.GangMember(
                    world_size=per_node * len(gang.members),
                    rank_offset=i * per_node,
                    local_world_size=per_node,
                    member_index=i,
                    members=len(gang.members),
                    rendezvous_host=host,
                    rendezvous_port=gang.port,
                    member_nodes=[n for n, _ in gang.members],
                )
            )
            out.append((self._ledger.nodes[node_id], a))
        return out

    def describe(self, gang: Gang) -> str:
        return "gang " + "; ".join(f"{n} GPUs {list(d)}" for n, d in gang.members) + f" (rendezvous port {gang.port})"

    # ------------------------------------------------------------------ reports and ends
    def member_report(self, node: NodeSession, rep: node_pb2.TaskReport, task: TaskRow) -> bool:
        """Apply ``rep`` when it comes from a member other than member 0 of the task's live gang
        attempt; returns False when it is not such a report (the core applies it as usual).

        Such a member reports only its start and end (global rank 0 reports the task's metrics
        and checkpoints). Its end releases its GPUs; unless it succeeded, it also ends the
        attempt everywhere: FAILED is retried (when retryable) as attempt + 1, CANCELLED (a
        drain) is handed back to the queue."""
        gang = self.live.get(rep.task_id)
        if gang is None or gang.attempt != rep.attempt or node.node_id == gang.primary:
            return False
        if gang.index_of(node.node_id) is None:
            return False
        if rep.state not in TERMINAL_STATES:
            return True
        gang.ended.add(node.node_id)
        self._save(gang)  # a restart from here on does not wait for this member
        held = node.allocations.get(rep.task_id)
        current = task.attempt == rep.attempt and task.state in ACTIVE_STATES
        # Preempted (every member was told to stop): member 0's CANCELLED report, with its last
        # checkpoint, requeues the task once (as PREEMPTED); the others only hand back their GPUs.
        preempted = rep.state == S.TASK_STATE_CANCELLED and rep.task_id in self._preemptions
        if current and rep.state != S.TASK_STATE_SUCCEEDED and not preempted:
            what = f"gang member {node.node_id} (member {gang.index_of(node.node_id)} of {len(gang.members)})"
            if rep.state == S.TASK_STATE_FAILED:
                reason = "ATTEMPT_FAILED" if rep.retryable else "USER_ERROR"
                self._fail_or_retry(
                    task, reason, f"{what} failed: {rep.error or 'worker failed'}", retryable=rep.retryable
                )
            else:
                self._requeue(
                    task,
                    "HANDED_BACK",
                    f"{what} stopped: {rep.error or 'cancelled'}",
                    backoff=False,
                    failure=False,
                )
        if held is not None and held[0] == rep.attempt:
            node.release(rep.task_id)
        return True

    def task_moved(self, task: TaskRow) -> None:
        """``task`` was committed in a new state: when that ends its gang attempt, tell every
        member still running to stop (not after a success: they end on their own) and forget
        the attempt."""
        gang = self.live.get(task.task_id)
        if gang is None or (task.attempt == gang.attempt and task.state in ACTIVE_STATES):
            return
        del self.live[task.task_id]
        self._store.forget_gang(task.task_id)
        if task.state == S.TASK_STATE_SUCCEEDED and task.attempt == gang.attempt:
            return
        for node_id, _ in gang.members:
            node = self._ledger.nodes.get(node_id)
            if node is None or node_id in gang.ended or not node.connected:
                continue
            node.push(
                node_pb2.ConnectResponse(
                    cancel_task=node_pb2.CancelTask(
                        task_id=task.task_id, attempt=gang.attempt, reason="the gang's attempt ended"
                    )
                )
            )
        log.info("gang attempt ended; members told to stop", task_id=task.task_id, attempt=gang.attempt)

    def forget_all(self) -> None:
        """After a rebuild from the store (a failed commit)."""
        self.live.clear()
        self.reserved = ()

    def why(self, task: TaskRow, caps, position: int, length: int) -> str:
        """Why pending gang ``task`` waits."""
        held = [n for n in self.reserved if self._reserver_is_not(task)]
        return why_gang_pending(gang_task(task), caps, position, length, held)

    def _reserver_is_not(self, task: TaskRow) -> bool:
        return bool(self.reserved) and not self._first_blocked_is(task)

    def _first_blocked_is(self, task: TaskRow) -> bool:
        for key in self._tasks.queue.gang_keys():
            return key[2] == task.task_id
        return False
