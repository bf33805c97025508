"""Trainer SIGTERM = drain: checkpoint, hand the task back, exit; the task resumes elsewhere."""

from __future__ import annotations

import signal
from pathlib import Path

from opentinker.common.v1 import common_pb2 as C
from opentinker_client import RLClient
from opentinker_client.cli.commands import main

HP = {"steps": 40, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4, "lora_rank": 4}


def test_sigterm_drains_and_task_resumes_from_checkpoint_on_another_node(cluster, tiny_model_dir: Path, capsys) -> None:
    cluster.start_scheduler()
    first = cluster.start_trainer("node-a", "--kill-grace", "60")  # time to checkpoint under load
    cluster.wait_nodes(1)
    with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
        task_id = client.submit_task(workload_type="lora_finetune", model=str(tiny_model_dir), hyperparameters=HP)
        cluster.wait_state(task_id, C.TASK_STATE_RUNNING, what=lambda t: t.latest_step >= 3)
        first.popen.send_signal(signal.SIGTERM)
        assert first.wait_exit(what="node-a drains and exits") == 0, first.log_text()[-2000:]
        task = cluster.wait_state(task_id, C.TASK_STATE_PENDING)
        assert task.attempt == 2
        handed_at = task.latest_checkpoint.step
        assert handed_at >= 3, "the drained worker wrote a checkpoint before handing back"
        cluster.start_trainer("node-b")
        task = cluster.wait_state(task_id, C.TASK_STATE_SUCCEEDED)
        assert task.attempt == 2
        events = list(client.watch(task_id))
        reasons = [e.reason for e in events if e.kind == "state"]
        assert "HANDED_BACK" in reasons
        handed = next(e.message for e in events if e.kind == "state" and e.reason == "HANDED_BACK")
        assert handed.startswith(f"node node-a drained; checkpointed at step {handed_at} and handed back"), handed
        assert handed.endswith(f"resumes from step {handed_at}"), handed
        steps = [e.step for e in events if e.kind == "metric"]
        # The second attempt continues after the checkpoint's step instead of starting over.
        rest = HP["steps"] - handed_at
        assert steps[-rest:] == list(range(handed_at + 1, HP["steps"] + 1))
        assert steps.count(1) == 1, "step 1 ran once: the second attempt did not start from scratch"
        # `opentinker logs` says where the second attempt resumed, not only where it would.
        assert main(["--scheduler-url", cluster.url, "logs", task_id]) == 0
        logs = capsys.readouterr().out
        assert f"resumed from step {handed_at} (attempt 2)" in logs, logs
    assert any(e.get("event") == "draining" for e in first.log_events())
