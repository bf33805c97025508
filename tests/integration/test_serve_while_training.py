"""`opentinker serve` of a lora_finetune task while it trains, against a real scheduler and
trainer: before its first checkpoint one clear line (exit 2, naming checkpoint_every); once it has
one, an inference task serves it and a request for the task gets its newest checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from opentinker.common.v1 import common_pb2
from opentinker_client import InferenceClient, RLClient

from tests.integration.test_model_host import _wait
from tests.support.procs import Cluster

#: Long enough to outlive the test (it is cancelled); a checkpoint every second step.
TRAIN_HP = {
    "steps": 10000,
    "prompts_per_step": 1,
    "group_size": 2,
    "max_new_tokens": 4,
    "lora_rank": 4,
    "checkpoint_every": 2,
}


def cli(url: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("SCHEDULER_URL", "OPENTINKER_API_KEY")}
    return subprocess.run(
        [sys.executable, "-m", "opentinker_client", "--scheduler-url", url, *args],
        capture_output=True,
        text=True,
        env={**env, "COLUMNS": "250"},
        timeout=600,
    )


def test_serve_a_training_task_from_its_newest_checkpoint(cluster: Cluster, tiny_model_dir: Path) -> None:
    cluster.start_scheduler()
    with RLClient(cluster.url, min_poll_interval=0) as client:
        trained = client.submit_task(workload_type="lora_finetune", model=str(tiny_model_dir), hyperparameters=TRAIN_HP)
        early = cli(cluster.url, "serve", trained)  # no trainer yet: pending, no checkpoint
        assert early.returncode == 2 and early.stdout == ""
        assert early.stderr.strip() == (
            f"error: task {trained} is PENDING and has no checkpoint yet; there is no adapter to serve until its "
            "first checkpoint (it writes one every 2 steps, checkpoint_every) [FAILED_PRECONDITION]"
        )

        cluster.start_trainer("node-a", "--max-tasks", "2")
        _wait(cluster, client, trained, common_pb2.TASK_STATE_RUNNING, lambda t: t.latest_checkpoint.step >= 2)
        served = cli(cluster.url, "serve", trained)
        assert served.returncode == 0, served.stderr
        line = served.stdout.splitlines()[0]  # the next line says how to try it
        assert (
            line.startswith(f"adapter {trained} (last complete checkpoint, step ") and "(the task is RUNNING)" in line
        )
        assert "later requests get its newer checkpoints" in line
        endpoint = line.rsplit(" at ", 1)[1]
        with InferenceClient(endpoint, adapter=trained) as llm:
            out = llm.generate("What is 2 + 3?", temperature=0, max_tokens=4)
            assert out.adapter == trained and out.samples[0].token_ids
            # Checkpoints of the running task: the one serve loaded, and a newer one the request got.
            steps = [int(a.name.split("@")[1]) for a in llm.list_adapters() if a.name.startswith(f"{trained}@")]
            assert 1 <= len(steps) <= 2 and min(steps) >= 2
        assert client.get_task(trained).state == "running"
        client.cancel(trained)
