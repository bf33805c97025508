"""PEM files are regular files of at most 1 MiB, checked before they are read: ``/dev/zero`` is
refused instead of read without bound, a FIFO instead of waited on; a key pair that does not match
names both files. Real files and FIFOs, RLClient and the CLI in-process. (The trainer process
refusing them at start: tests/integration/test_tls_trainer_start.py.)"""

from __future__ import annotations

import os

import pytest

from opentinker_client import RLClient
from opentinker_client.cli.commands import main as cli_main
from opentinker_common.net.tls import MAX_PEM_BYTES, channel_credentials, check_key_pair, check_pem_path, read_pem_file

from tests.support.security import make_certs


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


def test_dev_zero_a_fifo_a_directory_and_a_big_file_are_refused_naming_the_argument(certs, fifo, big, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"^root_certificates: '/dev/zero' is not a regular file$"):
        channel_credentials("/dev/zero")
    with pytest.raises(ValueError, match=r"^root_certificates: '.*ca\.fifo' is not a regular file$"):
        channel_credentials(fifo)
    with pytest.raises(ValueError, match=r"^root_certificates: .* is not a regular file$"):
        channel_credentials(tmp_path)
    with pytest.raises(
        ValueError,
        match=rf"^root_certificates: '.*big\.pem' is {MAX_PEM_BYTES + len(certs.ca.read_bytes())} bytes, more "
        r"than the 1048576 bytes \(1 MiB\)",
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
        match=r"^--tls-key: expected the private key of --tls-cert \('.*node\.pem'\), got '.*server\.key' "
        r"\(KEY_VALUES_MISMATCH\)$",
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
