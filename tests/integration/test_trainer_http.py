"""The trainer's HTTP port (/health, /live, /metrics) on a real trainer process against a real
scheduler process on loopback: /metrics parses with prometheus-client's own parser and moves when
a task runs; /health follows the scheduler stream (503 with a reason when the scheduler is gone,
ok again when it is back)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from opentinker_trainer.http import StepRate
from tests.support.http import http_get, metric_samples, metric_value as value
from tests.support.procs import LONG_TINY_LORA_HP, free_port
from tests.support.waiting import wait_for, wait_progress


def get(port: int, path: str) -> tuple[int, bytes]:
    try:
        return http_get(f"http://127.0.0.1:{port}{path}", timeout=5)
    except OSError:  # not listening yet
        return 0, b""


def samples(port: int) -> dict[str, list]:
    """name -> [(labels, value)] from /metrics, parsed by prometheus-client's parser."""
    status, body = get(port, "/metrics")
    assert status == 200
    return metric_samples(body.decode())


def test_metrics_move_with_a_task_and_health_follows_the_scheduler(cluster, tiny_model_dir: Path) -> None:
    from opentinker_client import RLClient

    cluster.start_scheduler()
    port = free_port()
    trainer = cluster.start_trainer("http-node", "--simulate-gpus", "2", "--http-port", str(port))
    wait_for(lambda: get(port, "/health") == (200, b'{"status": "ok"}'), what="trainer /health ok")
    assert get(port, "/live")[0] == 200
    assert get(port, "/nope")[0] == 404

    m = samples(port)
    assert value(m, "opentinker_trainer_connected") == 1.0
    assert value(m, "opentinker_trainer_running_tasks") == 0.0
    assert value(m, "opentinker_trainer_gpus", simulated="true") == 2.0
    for gpu in ("0", "1"):
        assert (
            value(m, "opentinker_gpu_memory_total_bytes", node_id="http-node", gpu=gpu, simulated="true") == 80 * 2**30
        )
        assert value(m, "opentinker_gpu_utilization_percent", gpu=gpu) == 0.0
        # simulated devices have no temperature: absent, with the reason, never a made-up 0
        assert value(m, "opentinker_gpu_temperature_celsius", gpu=gpu) is None
        assert (
            value(m, "opentinker_gpu_field_unavailable", gpu=gpu, field="temperature_c", reason="simulated device")
            == 1.0
        )
    assert "opentinker_task_step" not in m

    with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
        task_id = client.submit_task(
            workload_type="lora_finetune", model=str(tiny_model_dir), gpu_count=0, hyperparameters=LONG_TINY_LORA_HP
        )
        m = wait_progress(
            lambda: (lambda s: s if (value(s, "opentinker_task_step", task_id=task_id) or 0) >= 3 else None)(
                samples(port)
            ),
            lambda: cluster.said_about(task_id),
            what="3 steps on /metrics",
        )
        assert value(m, "opentinker_trainer_running_tasks") == 1.0
        assert value(m, "opentinker_task_steps_per_second", task_id=task_id, attempt=1) > 0
        assert value(m, "opentinker_task_reward", task_id=task_id) is not None
        assert value(m, "opentinker_task_loss", task_id=task_id) is not None
        assert any(labels["task_id"] == task_id for labels, _ in m["opentinker_task_perf"])
        assert value(m, "opentinker_trainer_metric_reports_total") >= 3
        later = wait_progress(
            lambda: (
                lambda s: (
                    s
                    if value(s, "opentinker_task_step", task_id=task_id)
                    > value(m, "opentinker_task_step", task_id=task_id)
                    else None
                )
            )(samples(port)),
            lambda: cluster.said_about(task_id),
            what="the step on /metrics moves",
        )
        assert value(later, "opentinker_trainer_metric_reports_total") > value(
            m, "opentinker_trainer_metric_reports_total"
        )
        client.cancel(task_id, reason="enough")
        gone = wait_for(
            lambda: (lambda s: s if value(s, "opentinker_trainer_running_tasks") == 0.0 else None)(samples(port)),
            what="worker gone",
        )
        assert value(gone, "opentinker_task_step", task_id=task_id) is None  # an ended attempt is forgotten

    cluster.scheduler.kill9()
    status, body = wait_for(lambda: (lambda r: r if r[0] == 503 else None)(get(port, "/health")), what="/health 503")
    reason = json.loads(body)
    assert reason["status"] == "unavailable" and "not connected to scheduler at 127.0.0.1:" in reason["reason"]
    assert get(port, "/live")[0] == 200  # waiting for the scheduler is not a reason to restart the node
    assert value(samples(port), "opentinker_trainer_connected") == 0.0

    cluster.start_scheduler()  # same ports and state: the node reconnects with backoff
    wait_for(lambda: get(port, "/health") == (200, b'{"status": "ok"}'), timeout=60, what="/health ok again")
    assert trainer.popen.poll() is None
    assert any(e.get("event") == "trainer http listening" and e.get("http_port") == port for e in trainer.log_events())


def test_step_rate_from_reports() -> None:
    r = StepRate(window=3)
    assert r.rate() is None
    r.add(1, {"perf/step_s": 0.5}, 100.0)
    assert r.rate() == pytest.approx(2.0)  # one report: 1 / perf/step_s
    r.add(2, {}, 100.25)
    r.add(3, {}, 100.5)
    assert r.rate() == pytest.approx(4.0)  # 2 steps in 0.5 s
    r.add(4, {}, 101.5)  # window of 3: (4 - 2) / (101.5 - 100.25)
    assert r.rate() == pytest.approx(2 / 1.25)
    assert r.step == 4 and r.reports == 4


def run_trainer(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    base = {k: v for k, v in os.environ.items() if k not in ("SCHEDULER_URL", "OPENTINKER_HTTP_PORT")}
    return subprocess.run(
        [sys.executable, "-m", "opentinker_trainer", *args],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (
            ("--http-port", "70000"),
            {},
            "argument --http-port: expected a port number 0-65535 (0 = any free port), got '70000'",
        ),
        (("--http-port", "x"), {}, "argument --http-port: expected a port number 0-65535"),
        (
            (),
            {"OPENTINKER_HTTP_PORT": "-1"},
            "environment variable OPENTINKER_HTTP_PORT: expected a port number 0-65535",
        ),
    ],
)
def test_bad_http_port_exits_2_with_one_line(args, env, message) -> None:
    proc = run_trainer(*args, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert message in proc.stderr.strip().splitlines()[-1]


def test_http_port_in_use_exits_1_with_one_line(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = run_trainer(
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(port),
            "--work-dir",
            str(tmp_path),
            env={"SCHEDULER_URL": f"127.0.0.1:{free_port()}"},
        )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"error: cannot listen on HTTP port 127.0.0.1:{port}" in proc.stderr
