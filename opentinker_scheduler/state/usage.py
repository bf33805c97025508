"""Usage accounting: what each attempt used, rolled up per task, owner and queue.

Per attempt, from its assignment (ASSIGNED) until its stop is confirmed: the node reported it
ended, or the node was declared lost. An attempt the scheduler ends itself (cancel, max_runtime)
leaves ASSIGNED/RUNNING at once but keeps its GPUs until its worker is gone (it checkpoints on
SIGTERM within the node's grace period), so its meter runs on until the node confirms the stop
(or is lost): :meth:`UsageMeters.end` with ``until_confirmed``, then :meth:`UsageMeters.confirmed`.

* GPU-seconds: GPUs held (``gpu_count x nodes``) times those seconds; CPU-task seconds for a CPU
  task (``gpu_count 0``) instead;
* tokens generated and trained, env steps: summed from the worker's per-step metrics
  (:data:`GENERATED_KEYS`, :data:`TRAINED_KEYS`; ``env_steps`` is cumulative, its newest value
  counts);
* cost: GPU-hours times ``usage.prices[node class]`` (config/usage.py), the node class being what
  the trainer announced (``--node-class``) or ``usage.default_node_class``.

The running attempt's meter lives in memory (:class:`UsageMeters`); when it ends one row goes to
the store (``attempt_usage``), written with the transition that ended it. For an attempt that is
still stopping that row ends at the transition, and is rewritten to end at the confirmation when
it comes (until then, and for ever when the scheduler restarts in between, the attempt's usage is
counted up to the transition). A scheduler restart starts a running attempt's meter again from
the attempt's start time (RUNNING), so its accounting stays within one heartbeat interval of the
truth for the time before the restart.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

from opentinker.common.v1 import common_pb2

from opentinker_scheduler.config.usage import UsageConfig
from opentinker_scheduler.state.store import StateStore, TaskRow, UsageRecord

#: Per-step metric keys that count tokens sampled (rollouts), first present wins.
GENERATED_KEYS = ("grpo/tokens", "rollout/tokens", "tokens_generated")
#: Per-step metric keys that count tokens trained on, first present wins.
TRAINED_KEYS = ("train/tokens", "tokens_trained")


@dataclass
class Meter:
    """One live attempt's counters."""

    task_id: str
    attempt: int
    owner: str
    queue: str
    node_id: str
    node_class: str
    gpus: int
    start_time: float
    tokens_generated: float = 0.0
    tokens_trained: float = 0.0
    env_steps: float = 0.0
    steps: int = 0

    def record(self, task: TaskRow, end_time: float, price_per_gpu_hour: float) -> UsageRecord:
        seconds = max(0.0, end_time - self.start_time)
        gpu_seconds = self.gpus * seconds
        return UsageRecord(
            task_id=self.task_id,
            attempt=self.attempt,
            owner=self.owner,
            queue=self.queue,
            node_id=self.node_id,
            node_class=self.node_class,
            workload_type=task.spec.workload_type,
            model=task.spec.model,
            gpus=self.gpus,
            start_time=self.start_time,
            end_time=end_time,
            gpu_seconds=gpu_seconds,
            cpu_task_seconds=seconds if self.gpus == 0 else 0.0,
            tokens_generated=self.tokens_generated,
            tokens_trained=self.tokens_trained,
            env_steps=self.env_steps,
            steps=self.steps,
            cost=gpu_seconds / 3600.0 * price_per_gpu_hour,
        )


def usage_proto(sums: tuple, extra: UsageRecord | None = None) -> common_pb2.Usage:
    """``opentinker.common.v1.Usage`` of store sums (:meth:`StateStore.task_usage`), plus a live
    attempt's ``extra`` record when given."""
    gpu_s, cpu_s, gen, trained, env, cost, attempts = sums
    if extra is not None:
        gpu_s += extra.gpu_seconds
        cpu_s += extra.cpu_task_seconds
        gen += extra.tokens_generated
        trained += extra.tokens_trained
        env += extra.env_steps
        cost += extra.cost
        attempts += 1
    return common_pb2.Usage(
        gpu_seconds=gpu_s,
        cpu_task_seconds=cpu_s,
        tokens_generated=gen,
        tokens_trained=trained,
        env_steps=env,
        cost=cost,
        attempts=attempts,
    )


class UsageMeters:
    """Meters of the live attempts (memory) and their records in ``store``.

    Args:
        store: where ended attempts are written (``attempt_usage``).
        config: prices and the default node class.
        node_class_of: node id -> its class, asked when an attempt ends (a node that re-registers
            after a scheduler restart is known by then).
    """

    def __init__(self, store: StateStore, config: UsageConfig, node_class_of: Callable[[str], str]) -> None:
        self.store = store
        self.config = config
        self.node_class_of = node_class_of
        self.live: dict[str, Meter] = {}
        #: Attempts ended by the scheduler whose worker is still stopping: task id -> (meter, row).
        self.stopping: dict[str, tuple[Meter, TaskRow]] = {}

    def price(self, node_class: str) -> float:
        return self.config.price(node_class)

    def start(self, task: TaskRow, *, queue: str, gpus: int, start_time: float | None = None) -> None:
        """``task``'s current attempt was assigned (or is found active after a restart)."""
        self.live[task.task_id] = Meter(
            task.task_id,
            task.attempt,
            task.owner,
            queue,
            task.node_id,
            "",
            gpus,
            time.time() if start_time is None else start_time,
        )

    def metric(self, task_id: str, attempt: int, values) -> None:
        """Count one applied metric point of ``attempt`` (live, or still stopping: a step its
        worker finished after a cancel counts in the record :meth:`confirmed` rewrites)."""
        m = self.live.get(task_id)
        if m is None and task_id in self.stopping:
            m = self.stopping[task_id][0]
        if m is None or m.attempt != attempt:
            return
        m.steps += 1
        for key in GENERATED_KEYS:
            if key in values:
                m.tokens_generated += float(values[key])
                break
        for key in TRAINED_KEYS:
            if key in values:
                m.tokens_trained += float(values[key])
                break
        if "env_steps" in values:
            m.env_steps = max(m.env_steps, float(values["env_steps"]))

    def end(self, task: TaskRow, end_time: float | None = None, *, until_confirmed: bool = False) -> UsageRecord | None:
        """``task``'s live attempt left ASSIGNED/RUNNING: write its record (returned); None when it
        had no meter. ``until_confirmed``: the scheduler ended it and its worker is still
        stopping; the record is rewritten by :meth:`confirmed` to end when the stop is confirmed."""
        m = self.live.pop(task.task_id, None)
        if m is None:
            return None
        rec = self._record(m, task, time.time() if end_time is None else end_time)
        self.store.record_usage(rec)
        if until_confirmed:
            self.stopping[task.task_id] = (m, task)
        return rec

    def confirmed(self, task_id: str, attempt: int, end_time: float | None = None) -> UsageRecord | None:
        """The worker of ``task_id``'s ``attempt``, ended by the scheduler, is gone (its node said
        so, or the node was declared lost): rewrite the attempt's record to end at ``end_time``
        (default now) and return it; None when that attempt was not waiting for a confirmation."""
        held = self.stopping.get(task_id)
        if held is None or held[0].attempt != attempt:
            return None
        del self.stopping[task_id]
        m, task = held
        rec = self._record(m, task, time.time() if end_time is None else end_time)
        self.store.record_usage(rec)
        return rec

    def so_far(self, task: TaskRow) -> UsageRecord | None:
        """The running attempt's usage up to now (not written), or None."""
        m = self.live.get(task.task_id)
        return self._record(m, task, time.time()) if m is not None else None

    def task_usage(self, task: TaskRow) -> common_pb2.Usage:
        """What ``task`` used, all attempts, the running one up to now."""
        return usage_proto(self.store.task_usage(task.task_id), self.so_far(task))

    def rollup(
        self, active: Iterable[TaskRow], *, owner: str | None = None, since: float | None = None
    ) -> tuple[dict[str, common_pb2.Usage], dict[str, common_pb2.Usage], dict[str, str]]:
        """``(per owner, per queue, owner -> queue)`` of recorded attempts plus the running ones
        of ``active`` (assigned at or after ``since`` when given; only ``owner``'s when given)."""
        by_owner = {k: usage_proto(v) for k, v in self.store.usage_by("owner", owner=owner, since=since).items()}
        by_queue = {k: usage_proto(v) for k, v in self.store.usage_by("queue", owner=owner, since=since).items()}
        queues = self.store.owner_queues(owner=owner, since=since)
        for task in active:
            if owner is not None and task.owner != owner:
                continue
            live = self.so_far(task)
            if live is None or (since is not None and live.start_time < since):
                continue
            for table, key in ((by_owner, live.owner), (by_queue, live.queue)):
                table[key] = usage_proto(_usage_sums(table.get(key)), live)
            queues[live.owner] = live.queue
        return by_owner, by_queue, queues

    def _record(self, m: Meter, task: TaskRow, end_time: float) -> UsageRecord:
        m.node_class = self.node_class_of(m.node_id) or self.config.default_node_class
        return m.record(task, end_time, self.price(m.node_class))


def _usage_sums(u: common_pb2.Usage | None) -> tuple:
    """A ``Usage`` as the sums tuple of :meth:`~.store.StateStore.task_usage` (zeros for None)."""
    if u is None:
        return (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0)
    return (u.gpu_seconds, u.cpu_task_seconds, u.tokens_generated, u.tokens_trained, u.env_steps, u.cost, u.attempts)
