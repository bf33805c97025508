"""The scheduler's ``tls:`` files are checked when the config is loaded:
a key of another certificate, a CA certificate given as ``tls.cert``, a private key given as
``tls.client_ca``, ``/dev/zero``, a FIFO and oversized files are ConfigErrors naming file, line
and key (exit 2), not gRPC's "Unable to create secure server" when the port is bound. (The
scheduler process exiting 2 for a mismatched pair: tests/integration/test_tls_scheduler_start.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from opentinker_scheduler.config import ConfigError, parse_config

from tests.support.security import LoopbackScheduler, make_certs


@pytest.fixture
def certs(tmp_path):
    return make_certs(tmp_path / "certs")


def _encrypted_key(folder: Path) -> Path:
    from cryptography.hazmat.primitives import serialization as s
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    path = folder / "encrypted.key"
    path.write_bytes(key.private_bytes(s.Encoding.PEM, s.PrivateFormat.PKCS8, s.BestAvailableEncryption(b"secret")))
    return path


@pytest.mark.parametrize(
    "tls, words",
    [
        (
            "cert: certs/server.pem, key: certs/node.key",
            r"tls\.key: expected the private key of tls\.cert .*node\.key.*\(KEY_VALUES_MISMATCH\)",
        ),
        (
            "cert: certs/ca.pem, key: certs/server.key",
            r"tls\.key: expected the private key of tls\.cert .*ca\.pem.*\(KEY_VALUES_MISMATCH\)",
        ),
        ("cert: certs/server.key, key: certs/server.pem", r"tls\.cert: expected a PEM certificate chain"),
        ("cert: certs/server.pem, key: certs/ca.pem", r"tls\.key: expected the private key of tls\.cert"),
        ("cert: certs/server.pem, key: certs/encrypted.key", r"tls\.key: expected .*encrypted private key"),
        (
            "cert: certs/server.pem, key: certs/server.key, client_ca: certs/server.key, node_port: 0",
            r"tls\.client_ca: expected a PEM CA certificate",
        ),
        (
            "cert: certs/server.pem, key: certs/server.key, client_ca: certs/both.pem, node_port: 0",
            r"tls\.client_ca: expected a PEM CA certificate .*which holds a private key",
        ),
        (
            "cert: /dev/zero, key: certs/server.key",
            r"tls\.cert: expected a readable PEM file, got '/dev/zero' \('/dev/zero' is not a regular file\)",
        ),
        (
            "cert: certs/server.pem, key: /dev/zero",
            r"tls\.key: expected a readable PEM file, got '/dev/zero' \(.*not a regular file\)",
        ),
        (
            "cert: certs/server.pem, key: certs/server.key, client_ca: /dev/zero, node_port: 0",
            r"tls\.client_ca: .*not a regular file",
        ),
        ("cert: certs/big.pem, key: certs/server.key", r"tls\.cert: .*more than the 1048576 bytes \(1 MiB\)"),
        ("cert: certs/fifo.pem, key: certs/server.key", r"tls\.cert: .*fifo\.pem' is not a regular file"),
    ],
)
def test_bad_tls_files_are_config_errors_naming_file_line_and_key(tmp_path, certs, tls, words) -> None:
    _encrypted_key(tmp_path / "certs")
    (tmp_path / "certs" / "both.pem").write_bytes(certs.ca.read_bytes() + certs.server_key.read_bytes())
    (tmp_path / "certs" / "big.pem").write_bytes(certs.server_cert.read_bytes() + b"#" * (1024 * 1024))
    os.mkfifo(tmp_path / "certs" / "fifo.pem")  # opening it for reading would block: it must not be opened
    with pytest.raises(ConfigError, match=rf"^c\.yaml:1:\d+: {words}"):
        parse_config(f"tls: {{{tls}}}\n", "c.yaml", base_dir=tmp_path)


def test_http_tls_gets_the_same_checks(tmp_path, certs) -> None:
    with pytest.raises(
        ConfigError,
        match=r"^c\.yaml:1:41: http_tls\.key: expected the private key of http_tls\.cert .*\(KEY_VALUES_MISMATCH\)",
    ):
        parse_config("http_tls: {cert: certs/server.pem, key: certs/node.key}\n", "c.yaml", base_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"^c\.yaml:1:18: http_tls\.cert: .*'/dev/zero' is not a regular file"):
        parse_config("http_tls: {cert: /dev/zero, key: certs/server.key}\n", "c.yaml", base_dir=tmp_path)


def test_a_good_pair_with_a_client_ca_still_serves_tls(tmp_path, certs) -> None:
    from opentinker_client import RLClient

    text = "tls: {cert: certs/server.pem, key: certs/server.key, client_ca: certs/ca.pem, node_port: 0}\n"
    s = LoopbackScheduler(tmp_path / "state", text, base_dir=tmp_path)
    try:
        with RLClient(s.target, root_certificates=certs.ca, timeout=5) as c:
            assert c.list_tasks() == []
    finally:
        s.close()


def test_a_ca_certificate_with_its_own_key_is_not_a_server_certificate(tmp_path) -> None:
    """A CA's certificate and key load as a matching pair, but clients would fail hostname
    verification: refused at load, naming tls.cert (and http_tls.cert)."""
    from tests.support.security import _Pki

    pki = _Pki(tmp_path / "certs")
    key, cert = pki.ca("some-ca")
    pki.cert("ca2.pem", cert)
    pki.key("ca2.key", key)
    for section in ("tls", "http_tls"):
        with pytest.raises(
            ConfigError,
            match=rf"^c\.yaml:1:\d+: {section}\.cert: expected the server's own certificate .*a CA certificate",
        ):
            parse_config(f"{section}: {{cert: certs/ca2.pem, key: certs/ca2.key}}\n", "c.yaml", base_dir=tmp_path)
