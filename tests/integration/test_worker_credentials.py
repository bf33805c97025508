"""A task worker holds its attempt's credential, never its node's key, with real processes: a
scheduler with API keys, a trainer with a node key, a LoRA task that checkpoints. The worker's
environment carries an ``otw_`` credential and no trace of the node key; its checkpoints are
stored under its attempt's prefix all the same."""

from __future__ import annotations

from pathlib import Path

from opentinker_client import RLClient

from tests.support.procs import Cluster, wait_connected
from tests.support.waiting import wait_for

HP = {"steps": 4, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4, "lora_rank": 4, "checkpoint_every": 2}


def _worker_environ(task_id: str) -> dict[str, str] | None:
    """The environment of the worker process of ``task_id`` (found by its command line), or None."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            if b"opentinker_trainer.worker" not in cmdline or not any(task_id.encode() in a for a in cmdline):
                continue
            raw = (proc / "environ").read_bytes()
        except OSError:
            continue  # gone, or not ours
        return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
    return None


def test_a_worker_holds_its_attempt_credential_not_the_node_key(tmp_path: Path, tiny_model_dir: Path) -> None:
    models = f"paths: {{model_dirs: [{tiny_model_dir.parent}]}}\n"
    cluster = Cluster(tmp_path, "heartbeat_interval: 0.5\nlease: 3\nauth: {enabled: true}\n" + models)
    try:
        cluster.start_scheduler()
        with RLClient(cluster.url, api_key=cluster.admin_key()) as root:
            _, node_key = root.keys.create("rack-1", "node")
            _, alice_key = root.keys.create("alice", "user")
            cluster.start_trainer("node-a", "--api-key", node_key)
            wait_connected(root, 1)
        with RLClient(cluster.url, api_key=alice_key, min_poll_interval=0) as alice:
            task_id = alice.submit_task(
                workload_type="lora_finetune", gpu_count=0, model=str(tiny_model_dir), hyperparameters=HP
            )
            env = wait_for(lambda: _worker_environ(task_id), 120, f"the worker process of {task_id}")
            assert env["OPENTINKER_API_KEY"].startswith("otw_")
            assert not any(node_key in value for value in env.values())
            task = cluster.wait_done(alice, task_id)
            assert task.state == "succeeded"
            stored = alice.list_checkpoints(task_id)
            assert stored and any(c.final for c in stored) and {c.attempt for c in stored} == {1}
            got = alice.download_checkpoint(task_id, tmp_path / "download")
            assert (got / "adapter_model.safetensors").exists()
    finally:
        cluster.close()
