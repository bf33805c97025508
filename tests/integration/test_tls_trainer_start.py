"""Trainer-side TLS and API-key mistakes, caught early and worded for what they are:
a serving key that does not match its certificate, a client certificate the scheduler refuses,
a node key with a newline, a plaintext trainer dialling a TLS environment server, PEM flags that
name /dev/zero or a FIFO. Real trainer
processes, a real scheduler and real servers on loopback; certificates made with ``cryptography``."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from opentinker_client import RLClient
from opentinker_trainer.agent import TLS_REFUSAL_HINT

from tests.support.procs import Proc
from tests.support.security import LoopbackScheduler, make_certs

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("serve-tls") / "certs")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENTINKER_", "SCHEDULER_URL", "NODE_ID"))}
    env.update(extra)
    return env


def _trainer(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m opentinker_trainer`` that is expected to exit at once."""
    return subprocess.run(
        [sys.executable, "-m", "opentinker_trainer", "--scheduler-url", "127.0.0.1:1", *argv],
        capture_output=True,
        text=True,
        env=env or _env(),
        cwd=REPO,
        timeout=120,
    )


# --------------------------------------------------- a serving key of another certificate


def test_a_mismatched_serve_tls_pair_stops_the_trainer_at_start(certs) -> None:
    for argv, env in (
        (["--serve-tls-cert", str(certs.server_cert), "--serve-tls-key", str(certs.node_key)], None),
        ([], _env(OPENTINKER_SERVE_TLS_CERT=str(certs.server_cert), OPENTINKER_SERVE_TLS_KEY=str(certs.rogue_key))),
    ):
        r = _trainer(*argv, env=env)
        assert r.returncode == 2 and "Traceback" not in r.stderr
        last = r.stderr.strip().splitlines()[-1]  # argparse: the usage line, then the one error line
        assert last.startswith(
            "opentinker-trainer: error: --serve-tls-cert/--serve-tls-key: the key does not match the certificate"
        ), r.stderr
        assert "in use" not in r.stderr


def test_start_inference_server_says_tls_credentials_refused_not_in_use(certs, tiny_model_dir, monkeypatch) -> None:
    from opentinker_trainer.inference import server as server_mod
    from opentinker_trainer.inference.serve_tls import read_server_tls

    from tests.support.inference import tiny_runtime

    good = read_server_tls(certs.server_cert, certs.server_key)
    mismatched = (good[0], certs.node_key.read_bytes())
    server_mod.check_tls_pair(good)
    with pytest.raises(ValueError, match=r"^TLS credentials refused: the private key does not match the certificate"):
        server_mod.check_tls_pair(mismatched)
    runtime = tiny_runtime(tiny_model_dir)
    try:
        with pytest.raises(ValueError, match="TLS credentials refused"):
            asyncio.run(server_mod.start_inference_server(runtime, host="127.0.0.1", port=0, tls=mismatched))
        # Were the pair to pass the check, gRPC's own refusal at bind time is worded the same way.
        monkeypatch.setattr(server_mod, "check_tls_pair", lambda tls: None)
        with pytest.raises(OSError) as err:
            asyncio.run(server_mod.start_inference_server(runtime, host="127.0.0.1", port=0, tls=mismatched))
        assert "TLS credentials refused" in str(err.value) and "in use" not in str(err.value)

        async def serve_good() -> int:  # the right pair serves
            running = await server_mod.start_inference_server(runtime, host="127.0.0.1", port=0, tls=good)
            await running.stop(0)
            return running.port

        assert asyncio.run(serve_good()) > 0
    finally:
        runtime.close()


# ------------------------------------------------------ the node key from a file or a flag


def test_the_trainers_api_key_is_stripped_and_inner_whitespace_is_refused(tmp_path) -> None:
    s = LoopbackScheduler(tmp_path / "state", "auth: {enabled: true}\n")
    proc = None
    try:
        admin = (s.config.state_dir / "admin.key").read_text().strip()
        with RLClient(s.target, api_key=admin, min_poll_interval=0) as root:
            _, node_key = root.keys.create("rack-1", "node")
            r = _trainer("--api-key", node_key[:12] + " " + node_key[12:])
            assert r.returncode == 2 and "--api-key: expected an API key of printable ASCII characters" in r.stderr
            assert node_key[13:] not in r.stderr and "Traceback" not in r.stderr
            r = _trainer(env=_env(OPENTINKER_API_KEY=node_key + "\n\x07"))
            assert r.returncode == 2 and "environment variable OPENTINKER_API_KEY: expected an API key" in r.stderr
            # `OPENTINKER_API_KEY="$(cat node.key)"`-style values with a newline register fine.
            proc = Proc(
                ["-m", "opentinker_trainer", "--node-id", "node-nl", "--work-dir", str(tmp_path / "runs")],
                tmp_path / "trainer.log",
                env={"SCHEDULER_URL": s.target, "OPENTINKER_API_KEY": node_key + "\n"},
            )
            deadline = time.monotonic() + 60
            while not any(n.node_id == "node-nl" and n.connected for n in root.list_nodes()):
                assert time.monotonic() < deadline and proc.popen.poll() is None, proc.log_text()[-2000:]
                time.sleep(0.2)
    finally:
        if proc is not None:
            proc.terminate()
            proc.close()
        s.close()


# --------------------------------------------------- a client certificate the scheduler refuses


def test_a_refused_client_certificate_gets_a_hint_once_per_streak(tmp_path, certs) -> None:
    config = f"tls: {{cert: {certs.server_cert}, key: {certs.server_key}, client_ca: {certs.ca}, node_port: 0}}\n"
    s = LoopbackScheduler(tmp_path / "state", config)
    node_target = f"127.0.0.1:{s.running.node_port}"
    procs = {}
    try:
        for name, tls in (
            (
                "rogue",
                ["--tls-ca", str(certs.ca), "--tls-cert", str(certs.rogue_cert), "--tls-key", str(certs.rogue_key)],
            ),  # another CA
            ("nocert", ["--tls-ca", str(certs.ca)]),  # no client certificate at all
            ("plain", []),  # plaintext to the TLS port: not a certificate problem, no TLS hint
        ):
            argv = ["-m", "opentinker_trainer", "--node-id", f"node-{name}", "--work-dir", str(tmp_path / name), *tls]
            procs[name] = Proc(argv, tmp_path / f"{name}.log", env={"SCHEDULER_URL": node_target})
        deadline = time.monotonic() + 60

        def broken(p: Proc) -> list[dict]:
            return [e for e in p.log_events() if e.get("event") == "stream to scheduler broken"]

        while min(len(broken(p)) for p in procs.values()) < 3:
            assert time.monotonic() < deadline, {n: p.log_text()[-1500:] for n, p in procs.items()}
            time.sleep(0.3)
    finally:
        for p in procs.values():
            p.terminate(timeout=10)
            p.close()
        s.close()
    for name in ("rogue", "nocert"):
        hints = [e for e in procs[name].log_events() if str(e.get("event", "")).startswith("hint:")]
        assert len(hints) == 1, procs[name].log_text()[-3000:]  # once per streak, not once per retry
        assert hints[0]["event"] == "hint: " + TLS_REFUSAL_HINT
        assert (
            "--tls-cert is signed by the scheduler's tls.client_ca" in TLS_REFUSAL_HINT
            and "node_port" in TLS_REFUSAL_HINT
        )
    assert not [e for e in procs["plain"].log_events() if str(e.get("event", "")).startswith("hint:")]


# ------------------------------------------ a plaintext trainer and a TLS environment server


def test_a_plaintext_trainer_against_a_tls_environment_server_says_so(certs) -> None:
    from opentinker_client.hosting.server import EnvironmentServer
    from opentinker_common.spec import validate_env_config
    from opentinker_trainer.context import UserError
    from opentinker_trainer.envs.remote import close_all_sessions, make_client_env

    from tests.support.environments import OneStep

    close_all_sessions()
    try:
        with EnvironmentServer(
            OneStep(), tls_cert=certs.server_cert, tls_key=certs.server_key, tls_ca=certs.ca
        ) as server:
            spec = {**server.env_config, "tls": False, "tls_root_certificates": "", "grace_s": 0.5}
            env = make_client_env(validate_env_config(spec), seed=None)
            with pytest.raises(UserError) as err:
                env.reset()
        msg = str(err.value)
        assert msg.startswith(f"client environment at {server.endpoint} unreachable for grace_s=0.5 s")
        assert "or it serves TLS while env_config.tls is false" in msg and server.token not in msg
    finally:
        close_all_sessions()
    with pytest.raises(UserError) as gone:  # nobody listening: word for word the same (no probing)
        make_client_env(validate_env_config({**spec, "endpoint": "127.0.0.1:1"}), seed=None).reset()
    assert str(gone.value).replace("127.0.0.1:1", "EP") == msg.replace(server.endpoint, "EP")
    close_all_sessions()


# ------------------------------------------- PEM files and the client pair, checked at start


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "ca.fifo"
    os.mkfifo(path)  # no writer: opening it for reading would block
    return path


def _last_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    return r.stderr.strip().splitlines()[-1]


def test_the_trainer_refuses_a_mismatched_client_pair_at_start(certs, tmp_path) -> None:
    r = _trainer(
        "--work-dir",
        str(tmp_path / "runs"),
        "--tls-ca",
        str(certs.ca),
        "--tls-cert",
        str(certs.node_cert),
        "--tls-key",
        str(certs.rogue_key),
    )
    last = _last_error(r)
    assert last.startswith(
        "opentinker-trainer: error: --tls-key: expected the private key of --tls-cert"
    ) and last.endswith("(KEY_VALUES_MISMATCH)"), r.stderr
    assert "Invalid private key" not in r.stderr and "scheduler" not in last
    # the same through the environment variables
    r = _trainer(
        "--work-dir",
        str(tmp_path / "runs"),
        env=_env(
            OPENTINKER_TLS_CA=str(certs.ca),
            OPENTINKER_TLS_CERT=str(certs.node_cert),
            OPENTINKER_TLS_KEY=str(certs.server_key),
        ),
    )
    assert "KEY_VALUES_MISMATCH" in _last_error(r)


def test_the_trainer_refuses_dev_zero_and_fifos_for_every_pem_flag(certs, fifo, tmp_path) -> None:
    runs = str(tmp_path / "runs")
    cases = [
        (["--tls-ca", "/dev/zero"], "root_certificates: '/dev/zero' is not a regular file"),
        (
            ["--tls-ca", str(certs.ca), "--tls-cert", str(fifo), "--tls-key", str(certs.node_key)],
            "--tls-cert: '" + str(fifo) + "' is not a regular file",
        ),
        (
            ["--serve-tls-cert", "/dev/zero", "--serve-tls-key", str(certs.server_key)],
            "--serve-tls-cert: '/dev/zero' is not a regular file",
        ),
        (["--serve-tls-cert", str(certs.server_cert), "--serve-tls-key", str(fifo)], "is not a regular file"),
        (
            ["--http-port", "0", "--http-tls-cert", "/dev/zero", "--http-tls-key", str(certs.server_key)],
            "--http-tls-cert: '/dev/zero' is not a regular file",
        ),
    ]
    for argv, words in cases:
        r = _trainer("--work-dir", runs, *argv)
        assert words in _last_error(r), (argv, r.stderr)
