"""Plain HTTP/1.1 ``GET /health`` and ``/metrics`` on the scheduler's gRPC port (the seed curls
``http://scheduler-host:8888/health``), beside gRPC itself, against a real scheduler process."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from opentinker_client import RLClient
from opentinker_client.errors import UnauthenticatedError
from tests.support.http import http_get, metric_samples, metric_value
from tests.support.procs import Cluster
from tests.support.security import make_certs
from tests.support.waiting import wait_for


def curl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["curl", "-sS", *args], capture_output=True, text=True, timeout=30)


def raw(port: int, data: bytes) -> bytes:
    """Send ``data`` on a new connection and read the answer until the scheduler closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_curl_health_and_metrics_on_the_grpc_port_and_grpc_beside_them(cluster: Cluster) -> None:
    cluster.start_with_trainer()
    r = curl("-i", f"http://127.0.0.1:{cluster.port}/health")
    assert r.returncode == 0, r.stderr
    head, _, body = r.stdout.partition("\n\n")  # text mode: CRLF read as LF
    assert head.startswith("HTTP/1.1 200 OK") and json.loads(body) == {"status": "ok"}
    assert f"X-OpenTinker-Grpc-Port: {cluster.port}" in head

    def metrics() -> dict:
        status, body = http_get(f"http://127.0.0.1:{cluster.port}/metrics")
        assert status == 200
        return metric_samples(body.decode())

    samples = wait_for(  # the snapshot the HTTP answers read is published about once a second
        lambda: m if metric_value(m := metrics(), "opentinker_nodes", status="connected") == 1 else None,
        timeout=30,
        what="the node in /metrics",
    )
    assert "opentinker_queue_depth" in samples
    # the side port answers the same
    assert http_get(f"http://127.0.0.1:{cluster.http_port}/health") == (200, b'{"status": "ok"}')
    # gRPC on the same port: the client, the health service, grpcurl's reflection
    with RLClient(scheduler_url=cluster.url) as client:
        assert [n.node_id for n in client.list_nodes() if n.connected] == ["node-a"]
    with grpc.insecure_channel(f"127.0.0.1:{cluster.port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    grpcurl = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")  # make install: .venv/bin
    listed = subprocess.run(
        [grpcurl, "-plaintext", f"127.0.0.1:{cluster.port}", "list"], capture_output=True, text=True, timeout=30
    )
    assert "opentinker.scheduler.v1.SchedulerService" in listed.stdout, listed.stderr


def test_other_http_requests_get_a_clear_http_answer(cluster: Cluster) -> None:
    cluster.start_scheduler()
    assert http_get(f"http://127.0.0.1:{cluster.port}/nope")[0] == 404
    head = raw(cluster.port, b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and head.endswith(b"\r\n\r\n")  # no body
    assert raw(cluster.port, b"POST /health HTTP/1.1\r\nContent-Length: 0\r\n\r\n").startswith(b"HTTP/1.1 405")
    garbage = raw(cluster.port, b"hello there\r\n\r\n")
    assert garbage.startswith(b"HTTP/1.1 400") and b"GET /health" in garbage
    assert raw(cluster.port, b"GET /" + b"x" * 9000).startswith(b"HTTP/1.1 431")
    with RLClient(scheduler_url=cluster.url) as client:  # gRPC still fine after all of that
        assert client.list_tasks() == []


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("host", ["127.0.0.1", "[::1]"])
def test_an_https_url_to_the_plaintext_port_is_told_to_use_http_at_once(cluster: Cluster, host: str) -> None:
    """A TLS ClientHello on the plaintext front is answered at once (not after the 10 s wait for
    a request head), so the client says "use http://" instead of "it may be stopped". The front
    listens on IPv6 too (``localhost`` often resolves to ``::1`` first), as gRPC's port does."""
    if host == "[::1]" and not _ipv6_loopback():
        pytest.skip("no IPv6 loopback on this machine")
    cluster.start_scheduler(host=None)  # the default address: every one, IPv4 and IPv6
    if host == "[::1]":
        r = curl(f"http://[::1]:{cluster.port}/health")
        assert r.returncode == 0 and json.loads(r.stdout) == {"status": "ok"}, r.stderr
        with RLClient(scheduler_url=f"[::1]:{cluster.port}") as client:
            assert client.list_tasks() == []
    hello = bytes.fromhex("16030100") + b"\x00" * 40  # a TLS handshake record's start
    answer = raw(cluster.port, hello)
    assert answer.startswith(b"HTTP/1.1 400") and b"use http://" in answer
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRPC_", "OPENTINKER_", "SCHEDULER_URL"))}
    r = subprocess.run(
        [sys.executable, "-m", "opentinker_client", "--scheduler-url", f"https://{host}:{cluster.port}", "list"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and "it answered without TLS" in r.stderr, r.stderr
    assert f"use http://{host}:{cluster.port}" in r.stderr and "may be stopped" not in r.stderr


def _clients_of(port: int) -> set[int]:
    """Ports of the clients connected to 127.0.0.1:``port``: the remote ends of its accepted
    IPv4 TCP connections (/proc/net/tcp)."""
    out = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, remote, state = line.split()[1:4]
            if local == f"0100007F:{port:04X}" and state == "01":  # ESTABLISHED
                out.add(int(remote.split(":")[1], 16))
    return out


def test_the_audit_log_names_the_clients_own_address_not_the_splice(tmp_path) -> None:
    c = Cluster(tmp_path, "heartbeat_interval: 0.5\nlease: 3\nauth: {enabled: true}\n")
    try:
        c.start_scheduler()
        with RLClient(scheduler_url=c.url, api_key="") as client:
            with pytest.raises(UnauthenticatedError):
                client.list_tasks()
            client_ports = _clients_of(c.port)  # the client's connection is still open here
            record = wait_for(
                lambda: next((e for e in c.scheduler.log_events() if e.get("action") == "auth.refused"), None),
                timeout=30,
                what="the audit record",
            )
        peer_port = int(record["peer"].rsplit(":", 1)[1])
        assert record["peer"].startswith("ipv4:127.0.0.1:") and peer_port in client_ports
    finally:
        c.close()


def test_with_tls_the_grpc_port_is_grpcs_only_and_health_stays_on_the_side_port(tmp_path) -> None:
    certs = make_certs(tmp_path / "certs")
    c = Cluster(
        tmp_path,
        f"heartbeat_interval: 0.5\nlease: 3\ntls: {{cert: {certs.server_cert}, key: {certs.server_key}}}\n",
    )
    try:
        c.start_scheduler()  # waits on the side port's /health
        listening = [e for e in c.scheduler.log_events() if e.get("event") == "scheduler listening"]
        assert listening[0]["http_on_grpc_port"] is False and listening[0]["tls"] is True
        r = curl(f"http://127.0.0.1:{c.port}/health")
        assert r.returncode != 0  # gRPC's own TLS port: no plaintext HTTP there
        with RLClient(scheduler_url=f"https://localhost:{c.port}", root_certificates=certs.ca) as client:
            assert client.list_tasks() == []
    finally:
        c.close()


def test_http_on_grpc_port_false_leaves_the_port_to_grpc_alone(tmp_path) -> None:
    c = Cluster(tmp_path, "heartbeat_interval: 0.5\nlease: 3\nhttp_on_grpc_port: false\n")
    try:
        c.start_scheduler()
        r = curl(f"http://127.0.0.1:{c.port}/health")
        assert r.returncode != 0 and "HTTP/0.9" in r.stderr  # what the seed's check got before
        with RLClient(scheduler_url=c.url) as client:
            assert client.list_tasks() == []
    finally:
        c.close()
