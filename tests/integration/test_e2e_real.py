"""End to end on the real SmolLM2-135M-Instruct and the real arithmetic task, through the real
scheduler and trainer processes and the seed's client API (small step budget)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from opentinker_client import Environment, RLClient


@pytest.mark.e2e
def test_real_model_through_the_services(cluster, real_model_dir: Path) -> None:
    cluster.start_scheduler()
    cluster.start_trainer("node-real")
    cluster.wait_nodes(1)
    env = Environment(action_space=4, observation_space=100, env_id="arithmetic", min_digits=1, max_digits=1)
    with RLClient(scheduler_url=cluster.url) as client:
        task_id = client.submit_task(
            env_config=env.to_dict(),
            workload_type="lora_finetune",
            gpu_count=0,
            model=str(real_model_dir),
            hyperparameters={"steps": 2, "prompts_per_step": 2, "group_size": 4},
        )
        seen = []
        while not client.is_task_complete(task_id):  # the seed's loop
            metrics = client.get_metrics(task_id)
            seen.append(metrics)
            line = f"Loss: {metrics['loss']:.4f}, Reward: {metrics['reward']:.2f}"  # never raises
            assert line.startswith("Loss: ")
        task = client.get_task(task_id)
        assert task.state == "succeeded", task.error
        assert math.isnan(seen[0]["reward"]) or 0.0 <= seen[0]["reward"] <= 1.0
        history = client.get_metric_history(task_id)
        assert [s for s, _ in history] == [1, 2]
        assert all(0.0 <= m["reward"] <= 1.0 and math.isfinite(m["loss"]) for _, m in history)
        assert all(m["perf/tokens_per_s"] > 0 for _, m in history)

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(real_model_dir), task.checkpoint_path)
    assert model.peft_config["default"].r == 16
