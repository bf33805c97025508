"""HTTPS on the scheduler's HTTP port (``http_tls:``): a real scheduler on loopback serves /health
and /metrics over TLS to clients that trust its CA, refuses plain HTTP, is not blocked by a client
that never finishes its handshake, and bad files are refused at start with file:line:key; the
dashboard's login cookie is marked Secure there (HttpOnly and SameSite=Strict always)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import ssl
import threading
import urllib.error
import urllib.request
from dataclasses import replace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from opentinker_scheduler.api.http import HttpEndpoint
from opentinker_scheduler.config import ConfigError, parse_config
from opentinker_scheduler.server import start_scheduler

from tests.support.http import http_get as get
from tests.support.security import make_certs


@contextlib.contextmanager
def running(config):
    """A real scheduler (gRPC and HTTP on free loopback ports) in a background event loop."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        sched = asyncio.run_coroutine_threadsafe(
            start_scheduler(config, host="127.0.0.1", port=0, http_port=0), loop
        ).result(60)
        try:
            yield sched
        finally:
            asyncio.run_coroutine_threadsafe(sched.stop(0), loop).result(60)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@pytest.fixture
def certs(tmp_path):
    return make_certs(tmp_path / "certs")


def _config(tmp_path, text: str):
    return replace(parse_config(text, "x.yaml", base_dir=tmp_path), state_dir=tmp_path / "state")


def test_health_and_metrics_over_https_with_the_ca(tmp_path, certs) -> None:
    cfg = _config(tmp_path, "http_tls: {cert: certs/server.pem, key: certs/server.key}\n")
    assert cfg.http_tls.cert == certs.server_cert and cfg.http_tls.key == certs.server_key
    trust = ssl.create_default_context(cafile=str(certs.ca))
    with running(cfg) as sched:
        assert sched.http.scheme == "https"
        base = f"https://localhost:{sched.http.port}"
        assert get(base + "/health", trust) == (200, b'{"status": "ok"}')
        status, body = get(base + "/metrics", trust)
        assert status == 200
        names = {f.name for f in text_string_to_metric_families(body.decode())}
        assert {
            "opentinker_queue_depth",
            "opentinker_tasks",
            "opentinker_nodes",
            "opentinker_scheduling_latency_seconds",
        } <= names
        assert get(base + "/nope", trust)[0] == 404

        # Plain HTTP to the HTTPS port gets no answer.
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            get(f"http://127.0.0.1:{sched.http.port}/health")
        # A client that does not trust the CA fails the handshake with a certificate error.
        with pytest.raises(urllib.error.URLError) as err:
            get(base + "/health", ssl.create_default_context())
        assert isinstance(err.value.reason, ssl.SSLCertVerificationError)

        # A client that connects and never starts its handshake blocks nobody.
        with socket.create_connection(("127.0.0.1", sched.http.port)):
            assert get(base + "/health", trust)[0] == 200


def test_a_stalled_handshake_is_dropped_after_the_head_deadline(tmp_path, certs, monkeypatch) -> None:
    monkeypatch.setattr(HttpEndpoint, "head_timeout_s", 1.0)
    cfg = _config(tmp_path, "http_tls: {cert: certs/server.pem, key: certs/server.key}\n")
    trust = ssl.create_default_context(cafile=str(certs.ca))
    with running(cfg) as sched:
        with socket.create_connection(("127.0.0.1", sched.http.port)) as stalled:
            stalled.settimeout(30)
            assert stalled.recv(1) == b""  # closed by the server
        assert get(f"https://localhost:{sched.http.port}/health", trust)[0] == 200


def test_plain_http_port_without_http_tls_is_unchanged(tmp_path) -> None:
    cfg = _config(tmp_path, "heartbeat_interval: 1\n")
    assert cfg.http_tls is None
    with running(cfg) as sched:
        assert sched.http.scheme == "http"
        status, body = get(f"http://127.0.0.1:{sched.http.port}/health")
        assert (status, json.loads(body)) == (200, {"status": "ok"})


def test_bad_http_tls_files_are_refused_at_start_with_file_line_and_key(tmp_path, certs) -> None:
    (tmp_path / "certs" / "junk.pem").write_text("not pem")
    cases = {
        "http_tls: {cert: certs/server.pem}\n": "http_tls.key: expected a PEM file path",
        "http_tls: {key: certs/server.key}\n": "http_tls.cert: expected a PEM file path",
        "http_tls: {cert: certs/server.pem, key: certs/server.key, ca: x}\n": (
            "http_tls.ca: expected one of the known keys"
        ),
        "http_tls: {cert: certs/nope.pem, key: certs/server.key}\n": (
            "http_tls.cert: expected a readable PEM file, got 'certs/nope.pem'"
        ),
        "http_tls: {cert: certs/junk.pem, key: certs/server.key}\n": "http_tls.cert: expected a PEM file",
        # a key that is not the certificate's (the node's key with the server's certificate)
        "http_tls: {cert: certs/server.pem, key: certs/node.key}\n": (
            "http_tls.key: expected the private key of http_tls.cert"
        ),
        # a certificate given as the key
        "http_tls: {cert: certs/server.pem, key: certs/ca.pem}\n": (
            "http_tls.key: expected the private key of http_tls.cert"
        ),
        "http_tls: yes\n": "http_tls: expected a mapping",
    }
    for text, message in cases.items():
        with pytest.raises(ConfigError) as err:
            parse_config(text, "x.yaml", base_dir=tmp_path)
        assert re.match(rf"x\.yaml:1:\d+: {re.escape(message)}", str(err.value)), str(err.value)


def test_the_dashboards_login_cookie_is_secure_over_https(tmp_path, certs) -> None:
    import http.client
    import urllib.parse

    cfg = _config(tmp_path, "auth: {enabled: true}\nhttp_tls: {cert: certs/server.pem, key: certs/server.key}\n")
    trust = ssl.create_default_context(cafile=str(certs.ca))
    with running(cfg) as sched:
        key = (tmp_path / "state" / "admin.key").read_text().strip()
        conn = http.client.HTTPSConnection("localhost", sched.http.port, context=trust, timeout=30)
        try:
            conn.request("GET", "/ui/login")
            page = conn.getresponse()
            csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page.read().decode()).group(1)
            nonce = page.getheader("Set-Cookie").split(";")[0]
            assert {"HttpOnly", "SameSite=Strict", "Secure"} <= {
                a.strip() for a in page.getheader("Set-Cookie").split(";")
            }
            form = urllib.parse.urlencode({"api_key": key, "next": "/ui/queue", "csrf": csrf})
            headers = {"Content-Type": "application/x-www-form-urlencoded", "Cookie": nonce}
            conn.request("POST", "/ui/login", form, headers)
            resp = conn.getresponse()
            resp.read()
        finally:
            conn.close()
        assert resp.status == 303 and resp.getheader("Location") == "/ui/queue"
        attrs = [a.strip() for a in resp.getheader("Set-Cookie").split(";")]
        assert attrs[0] == f"otk_key={key}" and {"HttpOnly", "SameSite=Strict", "Secure", "Path=/"} <= set(attrs)
