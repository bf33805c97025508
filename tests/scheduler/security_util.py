"""Helpers for the security tests: certificates made with ``cryptography`` (a CA, a server
certificate for localhost/127.0.0.1, client certificates) and a real scheduler on loopback in a
background event loop."""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import grpc

from opentinker_scheduler.config import SchedulerConfig, parse_config
from opentinker_scheduler.server import start_scheduler


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    node_cert: Path
    node_key: Path
    #: A client certificate signed by another CA (must be refused).
    rogue_cert: Path
    rogue_key: Path
    #: A CA that did not sign the server certificate (clients trusting it must fail).
    other_ca: Path


def make_certs(folder: Path) -> Certs:
    """A CA, a server certificate (SAN localhost, 127.0.0.1), a node certificate (CN node-a) and a
    rogue client certificate from another CA, as PEM files under ``folder``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def ca(cn: str):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder().subject_name(name(cn)).issuer_name(name(cn)).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1)).add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256())
        )
        return key, cert

    def leaf(ca_key, ca_cert, cn: str, server: bool):
        key = ec.generate_private_key(ec.SECP256R1())
        b = (
            x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
        )
        if server:
            b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        return key, b.sign(ca_key, hashes.SHA256())

    def write(path: str, data: bytes) -> Path:
        p = folder / path
        p.write_bytes(data)
        return p

    def pem_cert(c) -> bytes:
        return c.public_bytes(serialization.Encoding.PEM)

    def pem_key(k) -> bytes:
        return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())

    ca_key, ca_cert = ca("opentinker-test-ca")
    other_key, other_cert = ca("some-other-ca")
    sk, sc = leaf(ca_key, ca_cert, "localhost", True)
    nk, nc = leaf(ca_key, ca_cert, "node-a", False)
    rk, rc = leaf(other_key, other_cert, "node-rogue", False)
    return Certs(
        ca=write("ca.pem", pem_cert(ca_cert)), server_cert=write("server.pem", pem_cert(sc)), server_key=write("server.key", pem_key(sk)),
        node_cert=write("node.pem", pem_cert(nc)), node_key=write("node.key", pem_key(nk)),
        rogue_cert=write("rogue.pem", pem_cert(rc)), rogue_key=write("rogue.key", pem_key(rk)), other_ca=write("other-ca.pem", pem_cert(other_cert)),
    )


class LoopbackScheduler:
    """A real scheduler (grpc.aio server, SQLite state) on 127.0.0.1 in a background event loop."""

    def __init__(self, state_dir: Path, config_text: str = "", *, base_dir: Path | None = None, **overrides) -> None:
        cfg = parse_config(config_text, "test.yaml", base_dir=base_dir) if config_text else SchedulerConfig()
        self.config = replace(cfg, state_dir=state_dir, **overrides)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        try:
            self.running = self.call(start_scheduler(self.config, host="127.0.0.1", port=0, http_port=None))
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            raise
        self.target = f"127.0.0.1:{self.running.port}"

    @property
    def core(self):
        return self.running.core

    @property
    def security(self):
        return self.running.security

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def do(self, fn, *args, **kwargs):
        """Run ``fn`` on the scheduler's loop (the core is single-threaded) and return its result."""

        async def run():
            out = fn(*args, **kwargs)
            await self.core.durable()
            return out

        return self.call(run())

    def channel(self, **options) -> grpc.Channel:
        return grpc.insecure_channel(self.target)

    def close(self) -> None:
        try:
            self.call(self.running.stop(0))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


def metadata(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


@dataclass(frozen=True)
class NodeCerts:
    """A CA, a server certificate for localhost/127.0.0.1, and client certificates by name."""

    ca: Path
    server_cert: Path
    server_key: Path
    #: common name -> (certificate, key) PEM files.
    nodes: dict


def make_node_certs(folder: Path, names: dict[str, tuple[str, ...]]) -> NodeCerts:
    """Like :func:`make_certs`, with one client certificate per entry of ``names``: common name ->
    DNS subject alternative names (may be empty). Files are ``<cn>.pem`` / ``<cn>.key``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def builder(subject: str, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder().subject_name(name(subject)).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
        )

    def write(path: str, data: bytes) -> Path:
        p = folder / path
        p.write_bytes(data)
        return p

    def pem_cert(c) -> bytes:
        return c.public_bytes(serialization.Encoding.PEM)

    def pem_key(k) -> bytes:
        return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = builder("opentinker-test-ca", name("opentinker-test-ca"), ca_key.public_key()).add_extension(
        x509.BasicConstraints(ca=True, path_length=None), critical=True
    ).sign(ca_key, hashes.SHA256())
    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = builder("localhost", ca_cert.subject, server_key.public_key()).add_extension(
        x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
    ).sign(ca_key, hashes.SHA256())
    nodes = {}
    for cn, dns in names.items():
        key = ec.generate_private_key(ec.SECP256R1())
        b = builder(cn, ca_cert.subject, key.public_key())
        if dns:
            b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName(d) for d in dns]), critical=False)
        nodes[cn] = (write(f"{cn}.pem", pem_cert(b.sign(ca_key, hashes.SHA256()))), write(f"{cn}.key", pem_key(key)))
    return NodeCerts(
        ca=write("ca.pem", pem_cert(ca_cert)), server_cert=write("server.pem", pem_cert(server_cert)),
        server_key=write("server.key", pem_key(server_key)), nodes=nodes,
    )
