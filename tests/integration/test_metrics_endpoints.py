"""The scheduler's /metrics on a real scheduler process: it parses with prometheus-client's own
parser, and tasks by state, queue depth, nodes, per-GPU telemetry and the scheduling-latency
histogram move when tasks and nodes move."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

from tests.support.http import metric_samples, metric_value as value
from tests.support.procs import LONG_TINY_LORA_HP, Cluster


def scrape(cluster: Cluster) -> dict[str, list]:
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.http_port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return metric_samples(text)


def until(cluster: Cluster, check, what: str, timeout: float = 60) -> dict:
    """Scrape until ``check(metrics)`` holds (the HTTP snapshot is refreshed about once a second)."""
    deadline = time.monotonic() + timeout
    m: dict = {}
    while time.monotonic() < deadline:
        m = scrape(cluster)
        if check(m):
            return m
        time.sleep(0.2)
    raise TimeoutError(f"/metrics never showed {what}: {m}")


def test_scheduler_metrics_follow_tasks_and_nodes(cluster, tiny_model_dir: Path) -> None:
    from opentinker_client import RLClient

    cluster.start_scheduler()
    m = scrape(cluster)
    for family in ("opentinker_queue_depth", "opentinker_nodes", "opentinker_scheduling_latency_seconds_count"):
        assert family in m
    assert value(m, "opentinker_queue_depth") == 0.0
    assert value(m, "opentinker_nodes", status="connected") == 0.0
    assert value(m, "opentinker_scheduling_latency_seconds_count") == 0.0

    with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
        task_id = client.submit_task(
            workload_type="lora_finetune", model=str(tiny_model_dir), gpu_count=0, hyperparameters=LONG_TINY_LORA_HP
        )
        m = until(cluster, lambda m: value(m, "opentinker_tasks", state="pending") == 1.0, "a pending task")
        assert value(m, "opentinker_queue_depth") == 1.0

        cluster.start_trainer("metrics-node", "--simulate-gpus", "2")
        m = until(cluster, lambda m: value(m, "opentinker_tasks", state="running") == 1.0, "the task running")
        assert value(m, "opentinker_queue_depth") == 0.0
        assert value(m, "opentinker_tasks", state="pending") in (None, 0.0)
        assert value(m, "opentinker_nodes", status="connected") == 1.0
        assert value(m, "opentinker_scheduling_latency_seconds_count") == 1.0
        assert value(m, "opentinker_scheduling_latency_seconds_sum") > 0
        m = until(
            cluster,
            lambda m: value(m, "opentinker_gpu_memory_total_bytes", node_id="metrics-node", gpu=1) is not None,
            "GPU telemetry",
        )
        assert (
            value(m, "opentinker_gpu_memory_total_bytes", node_id="metrics-node", gpu=0, simulated="true") == 80 * 2**30
        )
        assert value(m, "opentinker_node_messages_total", kind="heartbeat") > 0

        client.cancel(task_id)
        m = until(cluster, lambda m: value(m, "opentinker_tasks", state="cancelled") == 1.0, "the task cancelled")
        assert value(m, "opentinker_tasks", state="running") in (None, 0.0)
