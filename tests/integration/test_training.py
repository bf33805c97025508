"""The main job through real scheduler and trainer processes on loopback, with RLClient."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from opentinker_client import Environment, RLClient, TaskFailedError

from tests.support.waiting import wait_for

TINY_HP = {
    "steps": 3,
    "prompts_per_step": 2,
    "group_size": 2,
    "max_new_tokens": 4,
    "lora_rank": 4,
    "checkpoint_every": 2,
}


def test_lora_task_runs_to_success_with_metrics_and_peft_checkpoint(cluster, tiny_model_dir: Path) -> None:
    cluster.start_scheduler()
    trainer = cluster.start_trainer("node-a")
    cluster.wait_nodes(1)
    with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
        env = Environment(action_space=4, observation_space=100)
        task_id = client.submit_task(
            env_config=env.to_dict(),
            workload_type="lora_finetune",
            gpu_count=0,
            model=str(tiny_model_dir),
            hyperparameters=TINY_HP,
        )
        events = list(client.watch(task_id))
        task = client.get_task(task_id)
        assert task.state == "succeeded", task.error
        states = [e.to_state for e in events if e.kind == "state"]
        assert states == ["pending", "assigned", "running", "succeeded"]
        steps = [e.step for e in events if e.kind == "metric"]
        assert steps == [1, 2, 3]
        for e in events:
            if e.kind == "metric":
                assert {"loss", "reward", "reward_std", "zero_std_frac", "optim/grad_norm"} <= set(e.metrics)
        ckpts = [e for e in events if e.kind == "checkpoint"]
        assert [c.step for c in ckpts] == [2, 3] and ckpts[-1].final
        metrics = client.get_metrics(task_id)
        assert metrics["step"] == 3 and "loss" in metrics and "reward" in metrics
        assert [s for s, _ in client.get_metric_history(task_id)] == [1, 2, 3]
        # Resuming a watch after a sequence gives exactly the rest.
        tail = list(client.watch(task_id, after_sequence=events[-3].sequence))
        assert [e.sequence for e in tail] == [e.sequence for e in events[-2:]]
        assert client.is_task_complete(task_id)

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ckpt = Path(task.checkpoint_path)
    assert (ckpt / "adapter_config.json").exists() and (ckpt / "adapter_model.safetensors").exists()
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), ckpt)
    assert any("lora_A" in n for n, _ in model.named_parameters())
    started = [e for e in trainer.log_events() if e.get("event") == "Task started"]
    assert started and started[0]["task_id"] == task_id and started[0]["attempt"] == 1
    # The worker's own log lines carry task_id, attempt and node_id too.
    loading = [e for e in trainer.log_events() if e.get("event") == "loading model"]
    assert loading and {(e["task_id"], e["attempt"], e["node_id"]) for e in loading} == {(task_id, 1, "node-a")}


def test_missing_model_fails_without_retry_and_services_keep_serving(cluster, tiny_model_dir: Path) -> None:
    cluster.start_scheduler()
    cluster.start_trainer("node-a")
    cluster.wait_nodes(1)
    with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
        bad = client.submit_task(workload_type="lora_finetune", model="/no/such/model", hyperparameters=TINY_HP)
        with pytest.raises(TaskFailedError) as err:
            cluster.wait_done(client, bad)
        task = err.value.task
        assert task.state == "failed" and task.attempt == 1
        assert "/no/such/model" in task.error
        good = client.submit_task(workload_type="lora_finetune", model=str(tiny_model_dir), hyperparameters=TINY_HP)
        assert cluster.wait_done(client, good).state == "succeeded"
    assert cluster.health() == {"status": "ok"}


def test_trainer_killed_mid_task_is_requeued_and_finishes_elsewhere(backend_cluster, tiny_model_dir: Path) -> None:
    cluster = backend_cluster  # on SQLite and on PostgreSQL
    cluster.start_scheduler()
    first = cluster.start_trainer("node-a")
    cluster.wait_nodes(1)
    with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
        hp = {**TINY_HP, "steps": 400, "checkpoint_every": 2}
        task_id = client.submit_task(
            workload_type="lora_finetune", model=str(tiny_model_dir), hyperparameters=hp, max_attempts=2
        )
        cluster.wait_state(task_id, 3, what=lambda t: t.latest_checkpoint.step >= 2)  # RUNNING, checkpointed
        first.kill9()  # the agent and its worker, like a machine dying
        task = cluster.wait_state(task_id, 1)  # PENDING again after the 3 s lease
        assert task.attempt == 2
        resume_step = task.latest_checkpoint.step
        lost_at = task.latest_step  # the lost attempt's last step (its reports are refused from here)
        second = cluster.start_trainer("node-b")
        # Past every step attempt 1 reported: attempt 2 has reported steps of its own.
        task = cluster.wait_state(task_id, 3, what=lambda t: t.latest_step > max(lost_at, resume_step + 1))
        assert task.node_id == "node-b" and task.attempt == 2
        client.cancel(task_id)
        # The second attempt resumed from the newest checkpoint: its first step is the next one.
        events = list(client.watch(task_id))
        lost = max(i for i, e in enumerate(events) if e.kind == "state" and e.reason == "NODE_LOST")
        after = [e.step for e in events[lost:] if e.kind == "metric"]
        assert after[0] == resume_step + 1, (resume_step, after[:5])
        # Steps the lost attempt ran past its checkpoint were reported twice; the history
        # keeps each step once, with the resumed attempt's values.
        history = [step for step, _ in client.get_metric_history(task_id)]
        assert history == sorted(set(history)) and history[-1] == max(e.step for e in events if e.kind == "metric")
        assert client.get_task(task_id).state == "cancelled"
        reasons = [e.reason for e in client.watch(task_id) if e.kind == "state"]
        assert "NODE_LOST" in reasons
    # The cancel kills the worker (SIGTERM, then SIGKILL after the 3 s grace): a fixed wait.
    ended = wait_for(
        lambda: [e for e in second.log_events() if e.get("event") == "Task ended"], timeout=60, what="Task ended"
    )
    assert ended[0]["state"] == "TASK_STATE_CANCELLED"
    pid = [e for e in second.log_events() if e.get("event") == "Task started"][0]["pid"]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
