"""A training session that does not start serving within the caller's timeout: the error names
it as a training session, says it is still queued on the scheduler and how to cancel it; the
task is left as it is (a real scheduler on loopback, no trainer)."""

from __future__ import annotations

import pytest

from opentinker_client import DeadlineExceededError, RLClient

from tests.support.security import LoopbackScheduler


def test_a_session_not_serving_in_time_says_it_is_still_queued_and_how_to_cancel_it(tmp_path) -> None:
    with LoopbackScheduler(tmp_path / "state") as s, RLClient(s.target, min_poll_interval=0) as client:
        with pytest.raises(DeadlineExceededError) as err:
            client.create_training_session("/models/m", lora_rank=4, timeout=1)
        text = str(err.value)
        assert "training session task-" in text and "did not start serving within 1 s (state: pending)" in text
        (task,) = client.list_tasks()
        assert task.workload_type == "lora_session" and task.state == "pending"  # left queued, as the message says
        assert "it is still pending on the scheduler" in text and f"opentinker cancel {task.task_id}" in text
