"""Faults with real processes: scheduler kill -9 and restart, stale attempts over a real stream."""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from pathlib import Path

import grpc

from opentinker.common.v1 import common_pb2 as C
from opentinker.node.v1 import node_pb2 as N
from opentinker.node.v1 import node_pb2_grpc
from opentinker_client import RLClient

from tests.support.procs import LONG_TINY_LORA_HP
from tests.support.waiting import wait_for

TINY_HP = {"steps": 3, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4, "lora_rank": 4}


def test_scheduler_kill9_and_restart_loses_nothing_and_running_work_continues(
    backend_cluster, tiny_model_dir: Path
) -> None:
    cluster = backend_cluster  # SQLite, and PostgreSQL (the restarted scheduler takes the expired lease)
    cluster.start_scheduler()
    trainer = cluster.start_trainer("node-a")
    cluster.wait_nodes(1)
    with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
        hp = {**TINY_HP, "steps": 60}
        task_id = client.submit_task(workload_type="lora_finetune", model=str(tiny_model_dir), hyperparameters=hp)
        queued = client.submit_task(
            workload_type="lora_finetune", model="/models/later", gpu_count=0, hyperparameters=TINY_HP
        )
        cluster.wait_state(task_id, C.TASK_STATE_RUNNING, what=lambda t: t.latest_step >= 2)
        # Frozen, then killed: the reports of the steps taken meanwhile left the node (into the
        # socket) but were never read, let alone committed, by the scheduler.
        os.kill(cluster.scheduler.pid, signal.SIGSTOP)
        seen = _steps_logged(trainer, task_id)
        wait_for(lambda: _steps_logged(trainer, task_id) >= seen + 2, timeout=120, what="2 steps while frozen")
        cluster.scheduler.kill9()
        time.sleep(1)  # the fault: down for a while, as the worker steps on (not a wait for anything)
        cluster.start_scheduler()  # same port, same state directory
        # Every acknowledged task is still there; the running one continues as attempt 1.
        assert client.get_task(queued).task_id == queued
        task = cluster.wait_state(task_id, C.TASK_STATE_SUCCEEDED)
        assert task.attempt == 1, "the trainer re-announced the task; it must not restart"
        steps = [s for s, _ in client.get_metric_history(task_id)]
        # Nothing acknowledged is lost and nothing counts twice: reports in flight when the
        # scheduler died were kept by the node until acknowledged and resent on reconnect.
        assert steps == list(range(1, 61))
        reasons = [e.reason for e in client.watch(task_id) if e.kind == "state"]
        assert "NODE_LOST" not in reasons
    started = [e for e in trainer.log_events() if e.get("event") == "Task started" and e.get("task_id") == task_id]
    assert len(started) == 1, "the worker was started once"


def _steps_logged(trainer, task_id: str) -> int:
    """How many training steps the trainer's worker has logged for ``task_id``."""
    return sum(1 for e in trainer.log_events() if e.get("task_id") == task_id and isinstance(e.get("step"), int))


class FakeNode:
    """A node at the edge of the test: a raw Connect stream driven by hand (a test double for a
    partitioned trainer), against the real scheduler process."""

    def __init__(self, target: str, node_id: str, running=()) -> None:
        self.channel = grpc.insecure_channel(target)
        self.out: queue.Queue = queue.Queue()
        self.commands: queue.Queue = queue.Queue()
        self.out.put(
            N.ConnectRequest(
                register=N.Register(
                    node_id=node_id, max_tasks=4, running=[N.RunningTask(task_id=t, attempt=a) for t, a in running]
                )
            )
        )
        self.call = node_pb2_grpc.NodeServiceStub(self.channel).Connect(iter(self.out.get, None))
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for cmd in self.call:
                self.commands.put(cmd)
        except grpc.RpcError:
            pass

    def next(self, kind: str, timeout: float = 60) -> N.ConnectResponse:
        deadline = time.monotonic() + timeout
        while True:
            cmd = self.commands.get(timeout=max(0.01, deadline - time.monotonic()))
            if cmd.WhichOneof("command") == kind:
                return cmd

    def report(self, task_id: str, attempt: int, state=C.TASK_STATE_UNSPECIFIED, **kw) -> None:
        self.out.put(N.ConnectRequest(task_report=N.TaskReport(task_id=task_id, attempt=attempt, state=state, **kw)))

    def close(self, goodbye: bool = False) -> None:
        if goodbye:
            self.out.put(N.ConnectRequest(goodbye=N.Goodbye(reason="test")))
        self.out.put(None)
        self.call.cancel()
        self.channel.close()


def test_stale_attempt_report_refused_over_real_stream(tmp_path) -> None:
    from tests.support.procs import Cluster

    cluster = Cluster(tmp_path, "heartbeat_interval: 0.5\nlease: 1.5\n")
    try:
        cluster.start_scheduler()
        target = f"127.0.0.1:{cluster.port}"
        with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
            task_id = client.submit_task(workload_type="lora_finetune", model="/m", hyperparameters=TINY_HP)
            old = FakeNode(target, "node-old")
            assign = old.next("assign_task").assign_task
            assert (assign.task_id, assign.attempt) == (task_id, 1)
            old.report(task_id, 1, C.TASK_STATE_RUNNING)
            cluster.wait_state(task_id, C.TASK_STATE_RUNNING)
            # The old node falls silent (partition): past its lease the attempt is lost.
            task = cluster.wait_state(task_id, C.TASK_STATE_PENDING)
            assert task.attempt == 2
            new = FakeNode(target, "node-new")
            assert new.next("assign_task").assign_task.attempt == 2
            new.report(
                task_id, 2, C.TASK_STATE_RUNNING, metrics=[C.MetricPoint(step=1, values={"loss": 1.0, "reward": 0.5})]
            )
            cluster.wait_state(task_id, C.TASK_STATE_RUNNING, what=lambda t: t.latest_step == 1)
            # The partitioned node comes back and reports attempt 1 finished: refused, and it is
            # told to stop that attempt.
            old.close()
            ghost = FakeNode(target, "node-old", running=[(task_id, 1)])
            ghost.report(task_id, 1, metrics=[C.MetricPoint(step=50, values={"loss": 9.0, "reward": 0.0})])
            ghost.report(task_id, 1, C.TASK_STATE_SUCCEEDED)
            # Both reports reached the scheduler and were refused (not merely not seen yet).
            assert ghost.next("cancel_task").cancel_task.attempt == 1  # told to stop that attempt

            def refused() -> list:
                found = [
                    e
                    for e in cluster.scheduler.log_events()
                    if e.get("event") == "stale report refused (fencing)"
                    and (e.get("task_id"), e.get("attempt"), e.get("node_id")) == (task_id, 1, "node-old")
                ]
                return found if len(found) >= 2 else []

            wait_for(refused, timeout=60, what="the ghost's two reports refused")
            task = cluster.get(task_id)
            assert task.state == C.TASK_STATE_RUNNING and task.attempt == 2 and task.node_id == "node-new"
            assert task.latest_step == 1 and task.latest_metrics["reward"] == 0.5
            new.report(task_id, 2, C.TASK_STATE_SUCCEEDED)
            assert cluster.wait_state(task_id, C.TASK_STATE_SUCCEEDED).attempt == 2
            ghost.close(goodbye=True)
            new.close(goodbye=True)
    finally:
        cluster.close()


def test_a_scheduler_stopped_past_the_lease_keeps_the_running_attempt(cluster, tiny_model_dir: Path) -> None:
    # The cluster's scheduler runs with lease 3 s, heartbeat 0.5 s.
    cluster.start_scheduler()
    trainer = cluster.start_trainer("node-a")
    cluster.wait_nodes(1)
    with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
        task_id = client.submit_task(
            workload_type="lora_finetune", model=str(tiny_model_dir), hyperparameters=LONG_TINY_LORA_HP
        )
        before = cluster.wait_state(task_id, C.TASK_STATE_RUNNING, what=lambda t: t.latest_step >= 2)
        os.kill(cluster.scheduler.pid, signal.SIGSTOP)
        try:
            time.sleep(9)  # the fault itself: stopped for 3x the lease; nothing is heard meanwhile
        finally:
            os.kill(cluster.scheduler.pid, signal.SIGCONT)
        woke = cluster.wait_state(task_id, C.TASK_STATE_RUNNING, what=lambda t: t.latest_step > before.latest_step)
        # The live attempt keeps reporting after the scheduler woke: it was neither lost nor replaced.
        after = cluster.wait_state(task_id, C.TASK_STATE_RUNNING, what=lambda t: t.latest_step > woke.latest_step)
        assert after.attempt == 1, "a stalled scheduler must not requeue work its nodes still run"
        reasons = [e.reason for e in client.watch(task_id, follow=False) if e.kind == "state"]
        assert "NODE_LOST" not in reasons
    lost = [e for e in cluster.scheduler.log_events() if e.get("event") == "task attempt lost"]
    assert lost == []
    assert any(e.get("event", "").startswith("scheduler loop stalled") for e in cluster.scheduler.log_events())
    started = [e for e in trainer.log_events() if e.get("event") == "Task started" and e.get("task_id") == task_id]
    assert len(started) == 1, "the worker was started once"
