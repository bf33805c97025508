"""Preemption and max_runtime with real processes: a higher-priority task preempts a running
lower-priority one, which checkpoints, goes back to PENDING (attempt 2, reason PREEMPTED) and
resumes from that checkpoint; a task over its max_runtime ends FAILED/TIMEOUT with its final
checkpoint recorded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from opentinker.common.v1 import common_pb2 as C
from opentinker_client import RLClient

HP = {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4, "lora_rank": 4}


def test_high_priority_preempts_and_victim_resumes_from_checkpoint(cluster, tiny_model_dir: Path) -> None:
    cluster.start_scheduler()
    cluster.start_trainer("node-a", "--max-tasks", "1", "--kill-grace", "60")  # time to checkpoint under load
    cluster.wait_nodes(1)
    with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
        low = client.submit_task(
            workload_type="lora_finetune", model=str(tiny_model_dir), hyperparameters={**HP, "steps": 40}, priority=0
        )
        cluster.wait_state(low, C.TASK_STATE_RUNNING, what=lambda t: t.latest_step >= 3)
        high = client.submit_task(
            workload_type="lora_finetune", model=str(tiny_model_dir), hyperparameters={**HP, "steps": 3}, priority=50
        )
        task = cluster.wait_state(low, C.TASK_STATE_PENDING)
        assert task.attempt == 2
        # `get` says what is true: the preemption handed its attempt back, one of three is used.
        got = subprocess.run(
            [sys.executable, "-m", "opentinker_client", "--scheduler-url", cluster.url, "get", low],
            capture_output=True,
            text=True,
            timeout=60,
            env={**{k: v for k, v in os.environ.items() if k != "SCHEDULER_URL"}, "COLUMNS": "200"},
        )
        assert got.returncode == 0, got.stderr
        rows = [line.strip() for line in got.stdout.splitlines()]
        (attempt_row,) = [row for row in rows if row.partition("  ")[0] == "attempt"]
        assert attempt_row.split(None, 1)[1].strip() == (
            "2: 1 of 3 used, 1 handed back (preempted, drained or node lost; not counted)"
        )
        preempted_at = task.latest_checkpoint.step
        assert preempted_at >= 3, "the preempted worker wrote a checkpoint before stopping"
        cluster.wait_state(high, C.TASK_STATE_SUCCEEDED)
        task = cluster.wait_state(low, C.TASK_STATE_SUCCEEDED)
        assert task.attempt == 2
        events = list(client.watch(low))
        assert "PREEMPTED" in [e.reason for e in events if e.kind == "state"]
        steps = [e.step for e in events if e.kind == "metric"]
        assert steps.count(1) == 1, "the second attempt resumed from the checkpoint, not from scratch"
        assert steps[-1] == 40


def test_max_runtime_fails_with_timeout_after_final_checkpoint(cluster, tiny_model_dir: Path) -> None:
    cluster.start_scheduler()
    cluster.start_trainer("node-a", "--kill-grace", "60")  # time to write the final checkpoint under load
    cluster.wait_nodes(1)
    with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
        # A stop before the first step writes no checkpoint, so the limit must leave room to load
        # the model and step once: 12 s does on a quiet machine (about 5 s to the first step); on a
        # loaded one, where the task ran out of time still loading, it is doubled and tried again.
        for max_runtime in (12, 24, 48, 96):
            task_id = client.submit_task(
                workload_type="lora_finetune",
                model=str(tiny_model_dir),
                hyperparameters={**HP, "steps": 10000},
                max_runtime=max_runtime,
            )
            cluster.wait_state(task_id, C.TASK_STATE_FAILED)
            events = list(client.watch(task_id))
            assert [e.reason for e in events if e.kind == "state"][-1] == "TIMEOUT"
            if any(e.kind == "metric" for e in events):
                break
        else:
            pytest.fail(f"no task stepped once within its max_runtime, the last {max_runtime} s")
        # The worker writes its final checkpoint on SIGTERM (the agent allows 60 s), after the end.
        task = cluster.wait_state(task_id, C.TASK_STATE_FAILED, what=lambda t: t.HasField("latest_checkpoint"))
        assert task.latest_checkpoint.path and task.latest_checkpoint.attempt == 1, "the final checkpoint was recorded"
        # Written on SIGTERM, after the scheduler ended the task: not an earlier periodic one.
        assert task.latest_checkpoint.create_time.ToNanoseconds() >= task.end_time.ToNanoseconds()


def test_an_inference_task_preempts_one_tenant_of_a_full_model_host(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A real scheduler and one ``--simulate-gpus 1`` node whose model host takes 2 tenants, both
    taken by low-priority LoRA tasks: a higher-priority inference task on the same base needs one
    tenant place, so one LoRA task is preempted and the other keeps training beside it."""
    from tests.integration.test_model_host import _wait
    from tests.support.procs import Cluster

    cluster = Cluster(tmp_path, "heartbeat_interval: 0.5\nlease: 3\n")
    try:
        cluster.start_scheduler()
        cluster.start_trainer(
            "node-a", "--simulate-gpus", "1", "--max-tasks", "4", "--tenants-per-host", "2", "--kill-grace", "60"
        )
        cluster.wait_nodes(1)
        with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
            hp = {**HP, "steps": 10000, "checkpoint_every": 1}
            lora = [
                client.submit_task(
                    workload_type="lora_finetune",
                    model=str(tiny_model_dir),
                    gpu_count=1,
                    hyperparameters=hp,
                    priority=0,
                )
                for _ in range(2)
            ]
            for task_id in lora:
                _wait(cluster, client, task_id, C.TASK_STATE_RUNNING, lambda t: t.latest_step >= 1)
            served = client.submit_task(
                workload_type="inference",
                model=str(tiny_model_dir),
                gpu_count=1,
                hyperparameters={"ttl_s": 600},
                priority=50,
            )
            _wait(cluster, client, served, C.TASK_STATE_RUNNING, lambda t: bool(t.endpoint))
            tasks = {t: client.get_task(t).proto for t in lora}
            preempted = [t for t, p in tasks.items() if p.attempt == 2]
            kept = [t for t, p in tasks.items() if p.attempt == 1]
            assert len(preempted) == 1 and len(kept) == 1, {t: (p.state, p.attempt) for t, p in tasks.items()}
            assert tasks[kept[0]].state == C.TASK_STATE_RUNNING
            assert tasks[preempted[0]].state == C.TASK_STATE_PENDING
            events = [e for e in client.watch(preempted[0], follow=False) if e.kind == "state"]
            assert [e.reason for e in events].count("PREEMPTED") == 1
            for task_id in (*lora, served):
                client.cancel(task_id)
    finally:
        cluster.close()
