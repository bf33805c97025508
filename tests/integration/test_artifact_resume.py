"""Checkpoints without a shared filesystem: a real scheduler, two trainers whose work dirs are
private tmpfs mounts (``unshare -m``), a LoRA GRPO task with ``checkpoint_every``, kill -9 of the
first trainer mid-task; the task finishes on the second trainer, resumed from the newest complete
checkpoint in the artifact store (``local`` over gRPC, or ``s3`` on a real SeaweedFS, the trainers
holding no S3 credentials: they move bytes by URLs the scheduler presigns).

Through the same store, on both backends: the task starts from an imported adapter
(``init_from``), trains on an uploaded prompts dataset (with ``s3`` read from the bucket, the
scheduler never sending it; with ``local`` from the scheduler), and its newest checkpoint is
downloaded (``opentinker download``). On ``s3`` it is also served (``RLClient.serve``: an
inference task on the private node; the ``local`` backend's serving: test_inference.py)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

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
    for k, v in s3.env().items():  # the operator's credentials, for the scheduler only (see _no_s3_credentials)
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
    _no_s3_credentials(monkeypatch)  # trainers move bytes by the URLs the scheduler presigns
    first = cluster.start_trainer("node-a", private=True)
    cluster.wait_nodes(1)
    with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
        imported = client.upload_adapter(_adapter(cluster.tmp / "adapter", tiny_model_dir), model=str(tiny_model_dir))
        dataset = client.upload_dataset(_prompts(cluster.tmp / "prompts.jsonl"), format="prompts")
        task_id = client.submit_task(
            workload_type="lora_finetune",
            model=str(tiny_model_dir),
            init_from=imported.task_id,
            env_config={"env_id": "prompts", "dataset_id": dataset.dataset_id, "reward": {"verifier": "numeric"}},
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
        if backend == "s3":  # a server for the base model, loading on node-b while the task trains there
            server_id = client.submit_task(
                workload_type="inference", model=str(tiny_model_dir), hyperparameters={"ttl_s": 600}
            )
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
            _serve(cluster, client, second, task_id, server_id)
    mine = [e for e in second.log_events() if e.get("task_id") == task_id]
    resumed = [e for e in mine if e.get("event") == "resumed"]
    assert resumed and resumed[0]["step"] == resume_step
    fetched = [e for e in mine if e.get("event") == "artifact cache: hit"]
    assert not fetched  # a new node: downloaded, not cached
    stored = [e for e in mine if e.get("event") == "checkpoint stored"]
    assert stored and all(e["key"].startswith(f"tasks/{task_id}/a2/") for e in stored)
    # init_from: the imported adapter came through the store into node-a's cache
    loads = [e for e in first.log_events() if e.get("event") == "loading model" and e.get("task_id") == task_id]
    assert loads and "artifact-cache" in loads[0]["init_checkpoint"]
    # the dataset: node-b (a cold cache) read it from the bucket on s3, from the scheduler on local
    key = f"datasets/{dataset.dataset_id.removeprefix('sha256:')}"
    from_store = [e for e in mine if e.get("event") == "dataset from the artifact store"]
    sent = [e for e in cluster.scheduler.log_events() if e.get("event") == "dataset sent to a trainer"]
    if backend == "s3":
        assert [e["key"] for e in from_store] == [key] and not sent, (from_store, sent)
        fetched = [e["key"] for e in mine if e.get("event") == "artifact cache: fetched"]
        assert key in fetched  # downloaded on node-b, not found in a cache
    else:
        assert not from_store and [e["dataset_id"] for e in sent] == [dataset.dataset_id] * 2, sent  # node-a, node-b


def _no_s3_credentials(monkeypatch) -> None:
    """No AWS credentials for the processes started from here on (the trainers)."""
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")


def _adapter(folder: Path, model: Path) -> Path:
    """A PEFT LoRA adapter (rank HP["lora_rank"] on every q_proj) for the tiny model at ``model``,
    written without loading it: its shapes come from the model's config.json."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model / "config.json").read_text())
    hidden, r = config["hidden_size"], HP["lora_rank"]
    folder.mkdir()
    (folder / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": r,
                "lora_alpha": 2 * r,
                "target_modules": ["q_proj"],
                "base_model_name_or_path": str(model),
            }
        )
    )
    torch.manual_seed(0)
    weights = {}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        weights[f"{prefix}.lora_A.weight"] = torch.randn(r, hidden) * 0.01
        weights[f"{prefix}.lora_B.weight"] = torch.zeros(hidden, r)
    save_file(weights, folder / "adapter_model.safetensors")
    return folder


def _prompts(path: Path) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": i + 1}) + "\n" for i in range(4)))
    return path


def _serve(cluster, client: RLClient, node, task_id: str, server_id: str) -> None:
    """Serve the cancelled task's adapter from the s3 store on ``node``, whose disk is private
    (``RLClient.serve`` takes the running server ``server_id`` of the same base model)."""
    with client.serve(task_id, ttl=600, timeout=300) as llm:
        out = llm.generate("What is 2 + 3?", temperature=0, max_tokens=3)
        assert out.adapter == task_id and 1 <= len(out.samples[0].token_ids) <= 3
        server = cluster.get(llm.task_id)
    assert server.task_id == server_id and server.node_id == "node-b"
    client.cancel(llm.task_id)  # its exit is not waited for: teardown ends it
    # the adapter came by its key in the store (through node-b's cache), not from the path it was written at
    served = [e.get("key") for e in node.log_events() if e.get("task_id") == server.task_id and e.get("key")]
    assert served and all(k.startswith(f"tasks/{task_id}/a2/") for k in served), served
