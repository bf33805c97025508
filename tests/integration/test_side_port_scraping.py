"""Scraping the side ports of a real trainer and a real scheduler (processes, auth on) while a
task runs: the trainer's /metrics wants a client certificate (mTLS) and the scrape token, and
with --http-no-task-labels names no task; /health stays open to probes (with a certificate).
The scheduler's /metrics (its HTTP port and the HTTP answers of its gRPC port) wants the token of
http_metrics_token_file, and names no task either (owners and queues only, in its accounting)."""

from __future__ import annotations

import ssl
from pathlib import Path

from opentinker_client import RLClient

from tests.support.http import http_get, metric_samples, metric_value
from tests.support.procs import Cluster, free_port
from tests.support.security import make_certs
from tests.support.waiting import wait_for, wait_progress

TOKEN = "scrape-token-0123456789abcdef"


def _context(certs, *, client_cert: bool) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(certs.ca))
    if client_cert:
        ctx.load_cert_chain(str(certs.node_cert), str(certs.node_key))
    return ctx


def _get(url: str, ctx: ssl.SSLContext | None, token: str | None = None) -> tuple[int, bytes]:
    import urllib.request

    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()
    except OSError:
        return 0, b""  # not listening yet, or the handshake was refused


def test_trainer_metrics_need_a_token_and_a_certificate_and_can_drop_task_labels(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs")
    token_file = tmp_path / "scrape.token"
    token_file.write_text(TOKEN + "\n")
    cluster = Cluster(
        tmp_path,
        f"auth: {{enabled: true}}\nhttp_metrics_token_file: {token_file}\n",
    )
    try:
        cluster.start_scheduler()
        with RLClient(cluster.url, api_key=cluster.admin_key()) as root:
            _, node_key = root.keys.create("rack-1", "node")
            _, alice_key = root.keys.create("alice", "user")
        port = free_port()
        cluster.start_trainer(
            "scrape-node",
            "--api-key",
            node_key,
            "--http-port",
            str(port),
            "--http-tls-cert",
            str(certs.server_cert),
            "--http-tls-key",
            str(certs.server_key),
            "--http-tls-client-ca",
            str(certs.ca),
            "--http-metrics-token-file",
            str(token_file),
            "--http-no-task-labels",
        )
        base = f"https://localhost:{port}"
        with_cert = _context(certs, client_cert=True)
        wait_for(lambda: _get(f"{base}/health", with_cert)[0] == 200, what="trainer /health ok (no token needed)")
        assert _get(f"{base}/metrics", _context(certs, client_cert=False), TOKEN) == (0, b"")  # no certificate
        status, body = _get(f"{base}/metrics", with_cert)
        assert status == 401 and b"missing bearer token" in body and TOKEN.encode() not in body
        status, body = _get(f"{base}/metrics", with_cert, "wrong-token-0123456789")
        assert status == 401 and b"wrong bearer token" in body

        with RLClient(cluster.url, api_key=alice_key, min_poll_interval=0) as alice:
            task_id = alice.submit_task(  # PPO on CartPole: the quickest worker to report a step
                env_config={"env_id": "CartPole-v1"},
                workload_type="full_rl",
                model="mlp",
                hyperparameters={"total_timesteps": 10_000_000},
            )
            wait_progress(
                lambda: alice.get_task(task_id).latest_step >= 1,
                lambda: cluster.said_about(task_id),
                what="the task reported a step",
            )
            status, body = _get(f"{base}/metrics", with_cert, TOKEN)
            assert status == 200
            m = metric_samples(body.decode())
            assert metric_value(m, "opentinker_trainer_running_tasks") == 1.0  # the task runs here ...
            assert metric_value(m, "opentinker_trainer_metric_reports_total") >= 1  # ... and reported ...
            assert task_id not in body.decode() and "task_id" not in body.decode()  # ... yet nothing names it

            # The scheduler's HTTP port and its gRPC port's HTTP answers take the same token ...
            for base_url in (f"http://127.0.0.1:{cluster.http_port}", cluster.url):
                status, body = http_get(f"{base_url}/metrics")
                assert status == 401 and b"missing bearer token" in body, base_url
                assert http_get(f"{base_url}/health")[0] == 200  # probes need none
            status, sched_body = _get(f"{cluster.url}/metrics", None, TOKEN)
            assert status == 200
            # ... and its /metrics has counts by state, node telemetry and per-owner accounting (the
            # usage and quota-queue series name owners and queues), never a task.
            text = sched_body.decode()
            assert metric_value(metric_samples(text), "opentinker_tasks", state="running") == 1.0
            assert task_id not in text and "task_id" not in text
            assert metric_value(metric_samples(text), "opentinker_queue_cpu_tasks_in_use", queue="alice") == 1.0
            alice.cancel(task_id)
    finally:
        cluster.close()
