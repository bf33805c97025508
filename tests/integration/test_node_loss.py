"""A trainer killed with kill -9 under a running task, with real processes: the lost node hands
the attempt back (it does not use up max_attempts, 1 here) and the task resumes on another node;
the task's ``max_node_losses``-th node loss ends it FAILED, saying why."""

from __future__ import annotations

from pathlib import Path

from opentinker.common.v1 import common_pb2 as C
from opentinker_client import RLClient

from tests.support.procs import Cluster

HP = {"steps": 10000, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4, "lora_rank": 4}


def test_a_killed_trainer_hands_the_attempt_back_and_max_node_losses_ends_the_task(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    cluster = Cluster(tmp_path, "heartbeat_interval: 0.5\nlease: 3\ndefault_max_attempts: 1\nmax_node_losses: 2\n")
    try:
        cluster.start_scheduler()
        first = cluster.start_trainer("node-a")
        cluster.wait_nodes(1)
        with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
            task_id = client.submit_task(workload_type="lora_finetune", model=str(tiny_model_dir), hyperparameters=HP)
            cluster.wait_state(task_id, C.TASK_STATE_RUNNING, what=lambda t: t.latest_step >= 1)
            first.kill9()
            task = cluster.wait_state(task_id, C.TASK_STATE_PENDING)
            assert task.attempt == 2
            second = cluster.start_trainer("node-b")
            cluster.wait_state(
                task_id, C.TASK_STATE_RUNNING, what=lambda t: t.node_id == "node-b" and t.latest_step >= 1
            )
            second.kill9()
            task = cluster.wait_state(task_id, C.TASK_STATE_FAILED)
            assert "its attempts lost their node 2 times, max_node_losses (2) reached" in task.error, task.error
            reasons = [e.reason for e in client.watch(task_id, follow=False) if e.kind == "state"]
            assert reasons.count("NODE_LOST") == 2, reasons
    finally:
        cluster.close()
