"""Checkpoints without a shared filesystem: a real scheduler, two trainers whose work dirs are
private tmpfs mounts (``unshare -m``), a LoRA GRPO task with ``checkpoint_every``, kill -9 of the
first trainer mid-task; the task finishes on the second trainer, resumed from the newest complete
checkpoint in the artifact store (``local`` over gRPC, or ``s3`` on a real SeaweedFS). Its newest
checkpoint is then downloaded (``opentinker download``), served (``RLClient.serve``: an inference
task on the private node) and started from (``init_from``), each through the same store."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from opentinker.common.v1 import common_pb2
from opentinker_client import RLClient

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="private work dirs need root and unshare -m"
)

HP = {"steps": 10, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4, "lora_rank": 4, "checkpoint_every": 2}


def _config(backend: str, request, monkeypatch) -> str:
    base = "heartbeat_interval: 0.5\nlease: 3\n"
    if backend == "local":
        return base + "artifacts: {backend: local, keep_checkpoints: 2}\n"
    s3 = request.getfixturevalue("seaweedfs")
    for k, v in s3.env().items():  # the operator's credentials, for scheduler and trainers alike
        monkeypatch.setenv(k, v)
    prefix = f"resume-{os.getpid()}-{id(request)}/"
    return base + (
        f"artifacts: {{backend: s3, keep_checkpoints: 2, "
        f"s3: {{endpoint: '{s3.endpoint}', bucket: {s3.bucket}, prefix: '{prefix}'}}}}\n"
    )


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_kill9_mid_task_resumes_on_another_private_node(backend, cluster, tiny_model_dir: Path, request, monkeypatch):
    cluster.config_path.write_text(_config(backend, request, monkeypatch))
    cluster.start_scheduler()
    first = cluster.start_trainer("node-a", private=True)
    cluster.wait_nodes(1)
    with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
        task_id = client.submit_task(
            workload_type="lora_finetune",
            model=str(tiny_model_dir),
            hyperparameters={**HP, "steps": 400},
            max_attempts=3,
        )
        cluster.wait_state(task_id, 3, what=lambda t: t.latest_checkpoint.step >= 4)
        first.kill9()  # agent and worker, like a machine dying; its disk goes with its namespace
        task = cluster.wait_state(task_id, 1)
        ck = task.latest_checkpoint
        assert ck.artifact.key.startswith(f"tasks/{task_id}/a1/step_") and ck.artifact.backend == backend
        resume_step = ck.step
        assert ck.path and not Path(ck.path).exists()  # written on node-a's private disk: gone for everyone else
        second = cluster.start_trainer("node-b", private=True)
        task = cluster.wait_state(task_id, 3, what=lambda t: t.latest_step > resume_step + 2)
        assert task.node_id == "node-b" and task.attempt == 2
        client.cancel(task_id)
        events = list(client.watch(task_id))
        lost = max(i for i, e in enumerate(events) if e.kind == "state" and e.reason == "NODE_LOST")
        after = [e.step for e in events[lost:] if e.kind == "metric"]
        assert after[0] == resume_step + 1, (resume_step, after[:5])
        # `opentinker download`: from the store, though no process but the trainers ever had the files
        newest = cluster.get(task_id).latest_checkpoint
        assert newest.attempt == 2 and newest.artifact.key.startswith(f"tasks/{task_id}/a2/")
        got = client.download_checkpoint(task_id, cluster.tmp / "download")
        assert (got / "adapter_model.safetensors").exists() and (got / "trainer_state.pt").exists()
        import torch

        state = torch.load(got / "trainer_state.pt", weights_only=False)
        assert state["step"] == newest.step  # the step count went on from the resumed checkpoint
        # the optimizer continued too: AdamW counted every update of both attempts, not only the second's
        moments = next(iter(state["optimizer"]["state"].values()))
        assert int(moments["step"]) == newest.step, (int(moments["step"]), newest.step, resume_step)
        if backend == "s3":
            _serve_and_start_from(cluster, client, second, task_id, tiny_model_dir)
    mine = [e for e in second.log_events() if e.get("task_id") == task_id]
    resumed = [e for e in mine if e.get("event") == "resumed"]
    assert resumed and resumed[0]["step"] == resume_step
    fetched = [e for e in mine if e.get("event") == "artifact cache: hit"]
    assert not fetched  # a new node: downloaded, not cached
    stored = [e for e in mine if e.get("event") == "checkpoint stored"]
    assert stored and all(e["key"].startswith(f"tasks/{task_id}/a2/") for e in stored)


def _serve_and_start_from(cluster, client: RLClient, node, task_id: str, model: Path) -> None:
    """On the s3 backend (the local backend's serve and init_from: test_inference.py, test_sft.py,
    test_checkpoints_leave.py): serve the cancelled task's adapter and start a task from it
    (init_from) on ``node``, whose disk is private, both workers at once. The new task trains on an
    uploaded prompts dataset, which its worker reads from the bucket, not from the scheduler."""
    rows = [{"prompt": f"What is {i} + 1?", "answer": i + 1} for i in range(4)]
    data = cluster.tmp / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dataset = client.upload_dataset(data, format="prompts")
    warm = client.submit_task(
        workload_type="lora_finetune",
        model=str(model),
        init_from=task_id,
        env_config={"env_id": "prompts", "dataset_id": dataset.dataset_id, "reward": {"verifier": "numeric"}},
        hyperparameters={**HP, "steps": 1, "checkpoint_every": 0},
    )
    with client.serve(task_id, ttl=600, timeout=300) as llm:
        out = llm.generate("What is 2 + 3?", temperature=0, max_tokens=3)
        assert out.adapter == task_id and 1 <= len(out.samples[0].token_ids) <= 3
        server = cluster.get(llm.task_id)
    assert server.node_id == "node-b"
    client.cancel(llm.task_id)  # neither worker's exit is waited for: teardown ends them
    trained = (common_pb2.TASK_STATE_RUNNING, common_pb2.TASK_STATE_SUCCEEDED)
    assert cluster.wait_state(warm, trained, what=lambda t: t.latest_step >= 1).spec.init_from == task_id
    events = node.log_events()
    # the init_from task and the server read the cancelled task's checkpoint by its key in the store
    loads = [e for e in events if e.get("event") == "loading model" and e.get("task_id") == warm]
    assert loads and "artifact-cache" in loads[0]["init_checkpoint"]
    served = [e.get("key") for e in events if e.get("task_id") == server.task_id and e.get("key")]
    assert served and all(k.startswith(f"tasks/{task_id}/a2/") for k in served), served
    # the dataset came from the bucket (datasets/<hex>), and the scheduler never sent it
    hex_ = dataset.dataset_id.removeprefix("sha256:")
    read = [e for e in events if e.get("event") == "dataset from the artifact store" and e.get("task_id") == warm]
    assert read and read[0]["key"] == f"datasets/{hex_}", read
    sent = [e for e in cluster.scheduler.log_events() if e.get("event") == "dataset sent to a trainer"]
    assert not sent, sent
