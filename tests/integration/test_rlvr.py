"""RL on a prompt dataset through real scheduler and trainer processes: upload a prompts JSONL,
a YAML task whose verifier does not fit the data refused over the wire naming the lines, then
a run whose reward is a function served from this test's process (RLClient.serve_reward)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from opentinker_client import RLClient
from opentinker_client.errors import InvalidArgumentError

from tests.support.procs import Cluster

CONFIG = """heartbeat_interval: 0.5
lease: 3
workload_types:
  - type: lora_finetune
    priority: 1
"""


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path, CONFIG)
    yield c
    c.close()


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prompt_dataset_refusals_and_a_client_reward_run(cluster: Cluster, tiny_model_dir: Path, tmp_path: Path):
    cluster.start_with_trainer()
    rows = [{"prompt": f"What is {i} + 1?", "answer": i + 1} for i in range(8)]
    write(tmp_path / "bad.jsonl", [*rows[:2], {"prompt": "What is two + 1?", "answer": "three"}, *rows[2:]])
    task_yaml = tmp_path / "task.yaml"
    task_yaml.write_text(
        f"workload_type: lora_finetune\nmodel: {tiny_model_dir}\ndataset: bad.jsonl\n"
        "env: {env_id: prompts, reward: {verifier: numeric}}\nhyperparameters: {steps: 2}\n"
    )
    scored: list[tuple[str, str, dict]] = []
    lock = threading.Lock()

    def reward(prompts, completions, metadata):
        with lock:
            scored.extend(zip(prompts, completions, metadata))
        return [float(len(c) % 2) for c in completions]

    with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
        # dataset: is uploaded as prompts; the scheduler reads the sample and refuses the verifier
        with pytest.raises(InvalidArgumentError) as err:
            client.submit_config(task_yaml)
        assert err.value.field == "spec.env_config.reward.verifier"
        assert "line 3: \"answer\": expected a number, got 'three'" in str(err.value)
        assert client.list_tasks() == []

        info = client.upload_dataset(write(tmp_path / "good.jsonl", rows), format="prompts")
        assert (info.num_examples, info.format) == (8, "prompts")
        with client.serve_reward(reward, timeout_s=30) as server:
            task_id = client.submit_task(
                workload_type="lora_finetune",
                model=str(tiny_model_dir),
                env_config={"env_id": "prompts", "dataset_id": info.dataset_id, "reward": server.reward_config,
                            "eval_fraction": 0.25, "eval_threshold": 1.0},
                hyperparameters={"steps": 2, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 3},
            )  # fmt: skip
            task = cluster.wait_done(client, task_id)
        assert task.state == "succeeded", task.error
        # the local artifact store: the worker fetched the dataset from the scheduler (FetchDataset)
        sent = [e for e in cluster.scheduler.log_events() if e.get("event") == "dataset sent to a trainer"]
        assert [e["dataset_id"] for e in sent] == [info.dataset_id], sent
        history = dict(client.get_metric_history(task_id))
    assert sorted(history) == [1, 2]
    assert "eval/accuracy_start" in history[1] and history[2]["eval/prompts"] == 2.0
    assert history[2]["reward/client_missing"] == 0.0
    # 4 samples a step, plus 2 eval replies before the first update and after the last
    assert len(scored) == 2 * 4 + 2 * 2
    assert all(p == f"What is {m['answer'] - 1} + 1?" for p, _, m in scored)
