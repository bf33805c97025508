"""A training session through real scheduler and trainer processes on loopback: the client-side
SFT and GRPO examples run on a tiny model, the loss falls, and a saved state becomes a checkpoint
of the task in the artifact store."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from opentinker_client import RLClient

ROOT = Path(__file__).resolve().parents[2]
CONFIG = """heartbeat_interval: 0.5
lease: 3
workload_types:
  - type: lora_session
    priority: 3
"""


def example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def cluster(tmp_path):
    from tests.support.procs import Cluster

    cluster = Cluster(tmp_path, CONFIG)
    try:
        yield cluster
    finally:
        cluster.close()


def test_own_sft_and_grpo_loops_train_a_session_task(cluster, tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    cluster.start_scheduler()
    cluster.start_trainer("node-a")
    cluster.wait_nodes(1)
    with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
        session = client.create_training_session(str(tiny_model_dir), lora_rank=4, max_attempts=3, timeout=300)
        task = client.get_task(session.task_id)
        assert task.workload_type == "lora_session" and task.state == "running" and task.endpoint == session.endpoint

        # SFT client-side: the same kind of batch, step after step; the loss falls.
        sft = example("own_loop_sft")
        losses = sft.train(
            session,
            AutoTokenizer.from_pretrained(tiny_model_dir),
            steps=4,
            batch_size=4,
            learning_rate=2e-2,
            log=lambda _: None,
        )
        assert losses[-1] < losses[0]
        # GRPO client-side: sample, score, importance_sampling, optim_step.
        rewards = example("own_loop_rl").train(
            session, steps=2, problems_per_step=2, group_size=4, max_tokens=4, log=lambda _: None
        )
        assert len(rewards) == 2 and all(0.0 <= r <= 1.0 for r in rewards)
        saved = session.save_state("after-sft").result(timeout=120)
        assert saved.step == session.get_info().step >= 4 and saved.artifact_key
        # The state is a checkpoint of the task in the artifact store (what a resumed attempt loads).
        assert [c.step for c in client.list_checkpoints(session.task_id)][-1] == saved.step
        session.close()
        client.cancel(session.task_id)
