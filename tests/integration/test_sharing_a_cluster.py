"""Sharing a cluster, with real processes: a scheduler with API keys and a trainer with
``--simulate-gpus 4``. Two owners at equal priority: alice floods 20 one-GPU tasks and fills the
node, bob submits 2; each time one of alice's running tasks stops (a slot frees), the next
placement round starts one of bob's (fair share: bob's dominant share is the lower), never one of
alice's queued ones. A quota queue
set at run time with ``opentinker queues set`` holds carol's task back with a reason naming the
queue; ``opentinker usage`` and ``opentinker get`` show the GPU-seconds and cost; /metrics
exports usage and ``opentinker_desired_trainers``."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from opentinker_client import RLClient

from tests.support.procs import Cluster, task_fields, wait_connected
from tests.support.waiting import wait_for, wait_progress

CONFIG = """\
heartbeat_interval: 0.5
lease: 3
auth: {enabled: true}
max_tasks_per_gpu: 1
usage: {currency: USD, prices: {default: 3.6}}
"""
HP = {"steps": 100000, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4, "lora_rank": 4}


def cli(cluster: Cluster, key: str, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("SCHEDULER_URL", "OPENTINKER_API_KEY")}
    env["COLUMNS"] = "250"
    proc = subprocess.run(
        [sys.executable, "-m", "opentinker_client", "--scheduler-url", cluster.url, "--api-key", key, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    return proc.stdout


def wait_state(cluster: Cluster, client: RLClient, task_id: str, states: set[str]):
    """The task once in one of ``states``, waiting while it or the cluster's logs about it move."""
    seen: list = [None]

    def arrived():
        seen[0] = info = client.get_task(task_id)
        return info if info.state in states else None

    return wait_progress(
        arrived,
        lambda: (task_fields(seen[0].proto if seen[0] else None), cluster.said_about(task_id)),
        what=f"task {task_id} in {sorted(states)}",
    )


def test_two_owners_share_a_node_fairly_with_quotas_usage_and_scale_signal(tmp_path: Path, tiny_model_dir) -> None:
    cluster = Cluster(tmp_path, CONFIG + f"paths: {{model_dirs: [{str(Path(tiny_model_dir).parent)!r}]}}\n")
    try:
        cluster.start_scheduler()
        admin_key = cluster.admin_key()
        with RLClient(cluster.url, api_key=admin_key) as root:
            _, node_key = root.keys.create("rack-1", "node")
            keys = {name: root.keys.create(name, "user")[1] for name in ("alice", "bob", "carol")}
            cluster.start_trainer("node-a", "--simulate-gpus", "4", "--max-tasks", "4", "--api-key", node_key)
            wait_connected(root, 1)
        clients = {name: RLClient(cluster.url, api_key=key, min_poll_interval=0) for name, key in keys.items()}
        alice, bob, carol = clients["alice"], clients["bob"], clients["carol"]

        def submit(client: RLClient, gpus: int = 1) -> str:
            return client.submit_task(
                workload_type="lora_finetune", model=str(tiny_model_dir), hyperparameters=HP, gpu_count=gpus
            )

        flood = [submit(alice) for _ in range(20)]
        running = [wait_state(cluster, alice, t, {"assigned", "running"}).task_id for t in flood[:4]]
        late = [submit(bob) for _ in range(2)]
        assert {alice.get_task(t).state for t in flood[4:]} == {"pending"}
        for slot, bobs in zip(running, late):
            alice.cancel(slot)  # its worker stops; the node reports it gone and frees its GPU
            wait_state(cluster, bob, bobs, {"assigned", "running"})
            assert {alice.get_task(t).state for t in flood[4:]} == {"pending"}, "alice's queued tasks waited"

        # A quota queue set now, without a restart: carol's queue has no GPUs.
        said = cli(
            cluster, admin_key, "queues", "set", "team-c", "--gpus", "0", "--borrow-gpus", "0", "--owner", "carol"
        )
        assert said.startswith("queue team-c: 0 GPUs")
        held = carol.get_task(submit(carol, gpus=1))
        assert held.state == "pending" and held.queue == "team-c"
        assert held.pending_reason.startswith("queue team-c is at its quota: 0 GPUs in use of a nominal quota of 0")
        table = cli(cluster, admin_key, "queues")
        assert "team-c" in table and "carol" in table
        audit = [r for r in root_audit(cluster, admin_key) if r.action == "queue.set"]
        assert audit and audit[0].detail["queue"] == "team-c" and audit[0].outcome == "OK"

        # Usage: the cancelled tasks' attempts are accounted, per task, owner and queue.
        done = alice.get_task(running[0])
        assert done.state == "cancelled" and done.usage["attempts"] == 1 and done.usage["gpu_seconds"] > 0
        assert abs(done.usage["cost"] - done.usage["gpu_seconds"] / 3600 * 3.6) < 1e-6
        shown = cli(cluster, keys["alice"], "get", running[0])
        assert "GPU-h" in shown and "cost" in shown
        report = alice.usage()
        assert set(report["owners"]) == {"alice"} and report["owners"]["alice"]["gpu_seconds"] > 0
        assert "alice" in cli(cluster, admin_key, "usage", "--since", "1d")

        def scrape() -> str | None:
            url = f"http://127.0.0.1:{cluster.http_port}/metrics"  # owners are named to admin keys only
            req = urllib.request.Request(url, headers={"Authorization": f"Bearer {admin_key}"})
            with urllib.request.urlopen(req, timeout=10) as resp:
                text = resp.read().decode()
            return text if 'opentinker_usage_gpu_seconds_total{owner="alice",queue="alice"}' in text else None

        # The usage rollup on /metrics is recomputed every USAGE_EXPORT_INTERVAL_S (a store query):
        # the series appears at the next recomputation after the attempts were accounted.
        metrics = wait_for(scrape, what="alice's usage on /metrics")
        # The busy node, and 16 queued one-GPU tasks of alice (carol's is over quota): 4 nodes more.
        assert 'opentinker_desired_trainers{node_class="default"} 5.0' in metrics, metrics
        for client in clients.values():
            client.close()
    finally:
        cluster.close()


def root_audit(cluster: Cluster, admin_key: str):
    with RLClient(cluster.url, api_key=admin_key) as root:
        return root.keys.audit(limit=20)
