"""PEM files are regular files of at most 1 MiB, checked before they are read (issue 6, second
round): ``--tls-ca /dev/zero`` used to read without bound and a FIFO to hang. Also the trainer's
``--tls-cert``/``--tls-key`` pair, checked at start instead of retrying forever with
"Invalid private key". Real files, FIFOs, the real CLI and real trainer processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from opentinker_client import RLClient
from opentinker_client.cli.commands import main as cli_main
from opentinker_common.net.tls import MAX_PEM_BYTES, channel_credentials, check_key_pair, check_pem_path, read_pem_file

from tests.support.security import make_certs

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("pem-files") / "certs")


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "ca.fifo"
    os.mkfifo(path)  # no writer: opening it for reading would block
    return path


@pytest.fixture
def big(tmp_path, certs):
    path = tmp_path / "big.pem"
    path.write_bytes(certs.ca.read_bytes() + b"#" * MAX_PEM_BYTES)
    return path


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENTINKER_", "SCHEDULER_URL", "NODE_ID"))}
    env.update(extra)
    return env


def test_dev_zero_a_fifo_a_directory_and_a_big_file_are_refused_naming_the_argument(certs, fifo, big, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"^root_certificates: '/dev/zero' is not a regular file$"):
        channel_credentials("/dev/zero")
    with pytest.raises(ValueError, match=r"^root_certificates: '.*ca\.fifo' is not a regular file$"):
        channel_credentials(fifo)
    with pytest.raises(ValueError, match=r"^root_certificates: .* is not a regular file$"):
        channel_credentials(tmp_path)
    with pytest.raises(
        ValueError,
        match=rf"^root_certificates: '.*big\.pem' is {MAX_PEM_BYTES + len(certs.ca.read_bytes())} bytes, more than the 1048576 bytes \(1 MiB\)",
    ):
        channel_credentials(big)
    with pytest.raises(ValueError, match=r"^client_cert: '/dev/zero' is not a regular file$"):
        channel_credentials(certs.ca, "/dev/zero", certs.node_key)
    with pytest.raises(ValueError, match=r"^client_key: '.*ca\.fifo' is not a regular file$"):
        channel_credentials(certs.ca, certs.node_cert, fifo)
    with pytest.raises(ValueError, match=r"^root_certificates: cannot read '.*nope\.pem': No such file"):
        channel_credentials(tmp_path / "nope.pem")


def test_rlclient_and_the_environment_variable_are_checked_the_same_way(certs, fifo, monkeypatch) -> None:
    with pytest.raises(ValueError, match=r"^root_certificates: '/dev/zero' is not a regular file$"):
        RLClient("https://localhost:1", root_certificates="/dev/zero")
    monkeypatch.setenv("OPENTINKER_TLS_CA", str(fifo))
    with pytest.raises(ValueError, match=r"^root_certificates: '.*ca\.fifo' is not a regular file$"):
        RLClient("localhost:1")


def test_a_file_of_exactly_the_limit_is_read_and_one_byte_more_is_not(certs, tmp_path) -> None:
    pem = certs.ca.read_bytes()
    ok = tmp_path / "ok.pem"
    ok.write_bytes(pem + b"#" * (MAX_PEM_BYTES - len(pem)))
    assert read_pem_file(ok, "ca") == ok.read_bytes()
    assert channel_credentials(ok) is not None
    over = tmp_path / "over.pem"
    over.write_bytes(ok.read_bytes() + b"#")
    with pytest.raises(ValueError, match="ca: .* is 1048577 bytes"):
        read_pem_file(over, "ca")
    check_pem_path(ok, "ca")  # no exception


def test_the_cli_exits_2_with_one_line_for_dev_zero_and_a_fifo(fifo, capsys) -> None:
    for path in ("/dev/zero", str(fifo)):
        assert cli_main(["--scheduler-url", "https://localhost:1", "--tls-ca", path, "list"]) == 2
        err = capsys.readouterr().err
        assert (
            err.count("\n") == 1 and err.startswith("error: root_certificates: ") and "is not a regular file" in err
        ), err


def test_check_key_pair_names_a_mismatch_and_the_wrong_files(certs, tmp_path) -> None:
    check_key_pair(certs.node_cert, certs.node_key)
    names = ("--tls-cert", "--tls-key")
    with pytest.raises(
        ValueError,
        match=r"^--tls-key: expected the private key of --tls-cert \('.*node\.pem'\), got '.*server\.key' \(KEY_VALUES_MISMATCH\)$",
    ):
        check_key_pair(certs.node_cert, certs.server_key, names=names)
    with pytest.raises(ValueError, match=r"^--tls-cert: .*node\.key' holds no -----BEGIN CERTIFICATE----- block"):
        check_key_pair(certs.node_key, certs.node_cert, names=names)
    with pytest.raises(ValueError, match=r"^--tls-key: .*ca\.pem' holds no PRIVATE KEY block"):
        check_key_pair(certs.node_cert, certs.ca, names=names)
    with pytest.raises(ValueError, match=r"^--tls-key: '/dev/zero' is not a regular file$"):
        check_key_pair(certs.node_cert, "/dev/zero", names=names)
    from cryptography.hazmat.primitives import serialization as s
    from cryptography.hazmat.primitives.asymmetric import ec

    encrypted = tmp_path / "enc.key"
    encrypted.write_bytes(
        ec.generate_private_key(ec.SECP256R1()).private_bytes(
            s.Encoding.PEM, s.PrivateFormat.PKCS8, s.BestAvailableEncryption(b"pw")
        )
    )
    with pytest.raises(
        ValueError, match=r"^--tls-key: .*enc\.key' is an encrypted private key"
    ):  # never a pass-phrase prompt
        check_key_pair(certs.node_cert, encrypted, names=names)


def _trainer(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "opentinker_trainer", "--scheduler-url", "127.0.0.1:1", *argv],
                          capture_output=True, text=True, env=env or _env(), cwd=REPO, timeout=120)  # fmt: skip


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
