"""The suite's waits on real processes end: a task that does not move fails ``wait_state`` and
``wait_done`` after the stall, naming the task and where its progress stopped, even while the
cluster is busy with another task (whose log lines are no progress of this one)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from opentinker.common.v1 import common_pb2 as C
from opentinker_client import RLClient

from tests.support.procs import LONG_TINY_LORA_HP


def test_a_task_that_never_moves_fails_the_waits_after_the_stall(cluster, tiny_model_dir: Path) -> None:
    cluster.start_scheduler()
    cluster.start_trainer("node-a", "--max-tasks", "1")
    cluster.wait_nodes(1)
    with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
        busy = client.submit_task(
            workload_type="lora_finetune", model=str(tiny_model_dir), hyperparameters=LONG_TINY_LORA_HP
        )
        cluster.wait_state(busy, C.TASK_STATE_RUNNING, what=lambda t: t.latest_step >= 1)
        waiting = client.submit_task(
            workload_type="lora_finetune", model=str(tiny_model_dir), hyperparameters=LONG_TINY_LORA_HP
        )  # PENDING behind it: the node takes one task at a time
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=rf"no progress for .*task {waiting} in \['TASK_STATE_SUCCEEDED'\]"):
            cluster.wait_state(waiting, C.TASK_STATE_SUCCEEDED, stall=3)
        assert 3 <= time.monotonic() - start < 60
        with pytest.raises(TimeoutError, match=rf"task {waiting} ended .*progress stuck at \(\('TASK_STATE_PENDING'"):
            cluster.wait_done(client, waiting, stall=3)
        moving = cluster.get(busy)
        assert moving.state == C.TASK_STATE_RUNNING and cluster.get(waiting).state == C.TASK_STATE_PENDING
        # The busy task moved all along: the same wait on it arrives.
        cluster.wait_state(busy, C.TASK_STATE_RUNNING, what=lambda t: t.latest_step >= moving.latest_step + 5, stall=3)
        client.cancel(busy)
        client.cancel(waiting)
