"""HTTPS on the trainer's HTTP port (--http-tls-cert/--http-tls-key): a real trainer process against
a real scheduler on loopback serves /health, /live and /metrics over TLS to clients that trust the
CA; plain HTTP gets nothing; a stalled handshake blocks nobody; bad flags are one-line errors."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from opentinker_common.net.tls import server_ssl_context
from opentinker_trainer.__main__ import main as trainer_main
from tests.support.http import http_get as get
from tests.support.procs import Cluster, free_port
from tests.support.security import make_certs


def wait_for(check, timeout: float = 60, what: str = ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got = check()
        except OSError:  # not listening yet
            got = None
        if got:
            return got
        time.sleep(0.2)
    raise TimeoutError(f"not reached in {timeout} s: {what}")


@pytest.fixture
def certs(tmp_path):
    return make_certs(tmp_path / "certs")


def test_trainer_process_serves_health_and_metrics_over_https(tmp_path: Path, certs) -> None:
    cluster = Cluster(tmp_path)
    try:
        cluster.start_scheduler()
        port = free_port()
        trainer = cluster.start_trainer(
            "https-node",
            "--simulate-gpus",
            "1",
            "--http-port",
            str(port),
            "--http-host",
            "127.0.0.1",
            "--http-tls-cert",
            str(certs.server_cert),
            "--http-tls-key",
            str(certs.server_key),
        )
        trust = ssl.create_default_context(cafile=str(certs.ca))
        base = f"https://localhost:{port}"
        wait_for(
            lambda: get(base + "/health", trust) == (200, b'{"status": "ok"}'), what="trainer /health ok over https"
        )
        assert json.loads(get(base + "/live", trust)[1]) == {"status": "alive"}
        status, body = get(base + "/metrics", trust)
        assert status == 200
        samples = {s.name: s for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}
        assert samples["opentinker_trainer_connected"].value == 1.0
        assert (
            samples["opentinker_trainer_gpus"].labels == {"simulated": "true"}
            and samples["opentinker_trainer_gpus"].value == 1.0
        )

        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):  # plain HTTP: no answer
            get(f"http://127.0.0.1:{port}/health")
        with pytest.raises(urllib.error.URLError) as err:  # a client that does not trust the CA
            get(base + "/health", ssl.create_default_context())
        assert isinstance(err.value.reason, ssl.SSLCertVerificationError)
        with socket.create_connection(("127.0.0.1", port)):  # connects, never handshakes
            assert get(base + "/health", trust)[0] == 200
        assert trainer.popen.poll() is None
        assert any(
            e.get("event") == "trainer http listening" and e.get("scheme") == "https" for e in trainer.log_events()
        )
    finally:
        cluster.close()


def test_trainer_http_unit_https_with_the_agent_not_connected(certs) -> None:
    from opentinker_trainer.agent import AgentConfig, NodeAgent
    from opentinker_trainer.http import TrainerHttp

    async def scenario() -> None:
        agent = NodeAgent(AgentConfig(target="127.0.0.1:1", node_id="n1"))
        http = TrainerHttp(agent, "127.0.0.1", 0, ssl_context=server_ssl_context(certs.server_cert, certs.server_key))
        http.start()
        try:
            trust = ssl.create_default_context(cafile=str(certs.ca))
            base = f"https://127.0.0.1:{http.port}"
            status, body = await asyncio.to_thread(get, base + "/health", trust)
            assert status == 503 and json.loads(body)["reason"].startswith("not connected to scheduler at 127.0.0.1:1")
            status, body = await asyncio.to_thread(get, base + "/metrics", trust)
            fams = {f.name for f in text_string_to_metric_families(body.decode())}
            assert status == 200 and "opentinker_trainer_connected" in fams
        finally:
            http.stop()
            agent.monitor.close()

    asyncio.run(scenario())


def test_bad_http_tls_flags_are_one_line_errors(tmp_path, certs, capsys, monkeypatch) -> None:
    for var in ("OPENTINKER_HTTP_TLS_CERT", "OPENTINKER_HTTP_TLS_KEY", "OPENTINKER_HTTP_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SCHEDULER_URL", "127.0.0.1:1")
    cases = [
        (
            ["--http-port", "0", "--http-tls-cert", str(certs.server_cert)],
            "--http-tls-cert and --http-tls-key: expected both",
        ),
        (["--http-tls-cert", str(certs.server_cert), "--http-tls-key", str(certs.server_key)], "expected --http-port"),
        (
            ["--http-port", "0", "--http-tls-cert", str(certs.server_cert), "--http-tls-key", str(certs.node_key)],
            "expected a readable PEM certificate and its key",
        ),
        (
            [
                "--http-port",
                "0",
                "--http-tls-cert",
                str(tmp_path / "nope.pem"),
                "--http-tls-key",
                str(certs.server_key),
            ],
            "No such file",
        ),
    ]
    for argv, words in cases:
        with pytest.raises(SystemExit) as exit_:
            trainer_main(["--work-dir", str(tmp_path / "runs"), *argv])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert words in err, err
    # The environment variables work like the flags.
    monkeypatch.setenv("OPENTINKER_HTTP_TLS_CERT", str(certs.server_cert))
    with pytest.raises(SystemExit):
        trainer_main(["--work-dir", str(tmp_path / "runs"), "--http-port", "0"])
    assert "--http-tls-cert and --http-tls-key: expected both" in capsys.readouterr().err
