"""A CPU node shows its host's CPU utilisation and memory (psutil) in ListNodes, `opentinker nodes`
and the scheduler's /metrics, against real scheduler and trainer processes."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil

from opentinker_client import RLClient
from tests.support.http import http_get, metric_samples, metric_value
from tests.support.procs import Cluster
from tests.support.waiting import wait_for


def test_a_cpu_node_reports_cpu_and_memory_everywhere(cluster: Cluster) -> None:
    cluster.start_with_trainer("cpu-node")
    with RLClient(scheduler_url=cluster.url) as client:
        node = wait_for(
            lambda: next((n for n in client.list_nodes() if n.host is not None), None),
            timeout=30,
            what="a heartbeat with host telemetry",
        )
    assert node.node_id == "cpu-node" and node.gpu_count == 0 and not node.telemetry  # no GPU at all
    h = node.host
    assert h.cpu_count == psutil.cpu_count() and 0 <= h.cpu_utilization_percent <= 100
    assert h.memory_total_bytes == psutil.virtual_memory().total and 0 < h.memory_used_bytes <= h.memory_total_bytes
    assert not h.unavailable

    env = {k: v for k, v in os.environ.items() if k not in ("SCHEDULER_URL", "OPENTINKER_API_KEY")}
    out = subprocess.run(
        [sys.executable, "-m", "opentinker_client", "--scheduler-url", cluster.url, "nodes"],
        capture_output=True,
        text=True,
        env={**env, "COLUMNS": "200"},
        timeout=60,
    ).stdout
    header, row = (
        out.splitlines()[1].split(),
        next(x for x in out.splitlines() if x.split()[:1] == ["cpu-node"]).split(),
    )
    assert header[:7] == ["NODE", "CONNECTED", "GPUS", "FREE", "TASKS", "CPU", "MEMORY"]
    assert row[4].endswith("%") and row[5:7] == ["of", str(psutil.cpu_count())] and row[8:10] == ["GiB", "/"]
    assert "no GPUs (CPU nodes)" in out

    def metrics() -> dict:
        return metric_samples(http_get(f"http://127.0.0.1:{cluster.port}/metrics")[1].decode())

    samples = wait_for(
        lambda: m if metric_value(m := metrics(), "opentinker_node_cpu_count", node_id="cpu-node") else None,
        timeout=30,
        what="host telemetry in /metrics",
    )
    assert metric_value(samples, "opentinker_node_cpu_count", node_id="cpu-node") == psutil.cpu_count()
    total = metric_value(samples, "opentinker_node_memory_total_bytes", node_id="cpu-node")
    assert total == psutil.virtual_memory().total
    assert 0 < metric_value(samples, "opentinker_node_memory_used_bytes", node_id="cpu-node") <= total
    assert 0 <= metric_value(samples, "opentinker_node_cpu_utilization_percent", node_id="cpu-node") <= 100
