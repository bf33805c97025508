"""Helpers for the security tests: certificates made with ``cryptography`` (a CA, a server
certificate for localhost/127.0.0.1, client certificates) and a real scheduler on loopback in a
background event loop."""

from __future__ import annotations

import asyncio
import contextvars
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


class _Pki:
    """Makes EC keys and certificates (``cryptography``) and writes them as PEM under ``folder``."""

    def __init__(self, folder: Path) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        self.x509, self.hashes, self.serialization, self.ec, self.NameOID = x509, hashes, serialization, ec, NameOID
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.now = dt.datetime.now(dt.timezone.utc)

    def name(self, cn: str):
        return self.x509.Name([self.x509.NameAttribute(self.NameOID.COMMON_NAME, cn)])

    def _builder(self, subject: str, issuer, public_key):
        return (
            self.x509.CertificateBuilder()
            .subject_name(self.name(subject))
            .issuer_name(issuer)
            .public_key(public_key)
            .serial_number(self.x509.random_serial_number())
            .not_valid_before(self.now - dt.timedelta(minutes=5))
            .not_valid_after(self.now + dt.timedelta(days=1))
        )

    def ca(self, cn: str):
        """``(key, certificate)`` of a self-signed CA."""
        key = self.ec.generate_private_key(self.ec.SECP256R1())
        cert = (
            self._builder(cn, self.name(cn), key.public_key())
            .add_extension(self.x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, self.hashes.SHA256())
        )
        return key, cert

    def leaf(self, ca, cn: str, *, dns: tuple[str, ...] = (), ip: tuple[str, ...] = ()):
        """``(key, certificate)`` signed by ``ca`` (a :meth:`ca` pair), with DNS/IP alt names."""
        ca_key, ca_cert = ca
        key = self.ec.generate_private_key(self.ec.SECP256R1())
        b = self._builder(cn, ca_cert.subject, key.public_key())
        names = [self.x509.DNSName(d) for d in dns] + [self.x509.IPAddress(ipaddress.ip_address(a)) for a in ip]
        if names:
            b = b.add_extension(self.x509.SubjectAlternativeName(names), critical=False)
        return key, b.sign(ca_key, self.hashes.SHA256())

    def cert(self, filename: str, cert) -> Path:
        return self._write(filename, cert.public_bytes(self.serialization.Encoding.PEM))

    def key(self, filename: str, key) -> Path:
        s = self.serialization
        return self._write(filename, key.private_bytes(s.Encoding.PEM, s.PrivateFormat.PKCS8, s.NoEncryption()))

    def _write(self, filename: str, data: bytes) -> Path:
        p = self.folder / filename
        p.write_bytes(data)
        return p


def make_certs(folder: Path) -> Certs:
    """A CA, a server certificate (SAN localhost, 127.0.0.1), a node certificate (CN node-a) and a
    rogue client certificate from another CA, as PEM files under ``folder``."""
    pki = _Pki(folder)
    ca, other = pki.ca("opentinker-test-ca"), pki.ca("some-other-ca")
    sk, sc = pki.leaf(ca, "localhost", dns=("localhost",), ip=("127.0.0.1",))
    nk, nc = pki.leaf(ca, "node-a")
    rk, rc = pki.leaf(other, "node-rogue")
    return Certs(
        ca=pki.cert("ca.pem", ca[1]),
        server_cert=pki.cert("server.pem", sc),
        server_key=pki.key("server.key", sk),
        node_cert=pki.cert("node.pem", nc),
        node_key=pki.key("node.key", nk),
        rogue_cert=pki.cert("rogue.pem", rc),
        rogue_key=pki.key("rogue.key", rk),
        other_ca=pki.cert("other-ca.pem", other[1]),
    )


#: Scheduler config with API keys on and local models allowed under ``/models`` (specs name /models/m).
AUTH_LOCAL_MODELS = "auth: {enabled: true}\npaths: {model_dirs: [/models]}\n"


class LoopbackScheduler:
    """A real scheduler (grpc.aio server, SQLite state) on 127.0.0.1 in a background event loop.

    Usable as a context manager: ``with LoopbackScheduler(...) as s:`` closes it on exit."""

    def __init__(
        self,
        state_dir: Path,
        config_text: str = "",
        *,
        base_dir: Path | None = None,
        http_port: int | None = None,
        **overrides,
    ) -> None:
        cfg = parse_config(config_text, "test.yaml", base_dir=base_dir) if config_text else SchedulerConfig()
        self.config = replace(cfg, state_dir=state_dir, **overrides)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        try:
            self.running = self.call(start_scheduler(self.config, host="127.0.0.1", port=0, http_port=http_port))
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            raise
        self.target = f"127.0.0.1:{self.running.port}"

    def __enter__(self) -> LoopbackScheduler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def admin_key(self) -> str:
        """The bootstrap admin API key the scheduler wrote to ``<state_dir>/admin.key`` (auth on,
        no key from the environment); FileNotFoundError where it wrote none."""
        return (self.config.state_dir / "admin.key").read_text().strip()

    @property
    def core(self):
        return self.running.core

    @property
    def security(self):
        return self.running.security

    def call(self, coro):
        """Run ``coro`` on the scheduler's loop and return its result.

        It runs in an empty context, as in a scheduler process: a task copies the context of the
        thread that starts it, and the test thread's context variables must not reach the
        scheduler. A rate refusal that a unit test marked on that thread would otherwise hold every
        later refusal of the scheduler for ``limits.rate_wait`` seconds."""
        return contextvars.Context().run(asyncio.run_coroutine_threadsafe, coro, self.loop).result(60)

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


def user_with_task(sched: LoopbackScheduler, owner: str, **task):
    """A user key for ``owner`` (made with the admin key; auth on) and a task it submitted
    (``RLClient.submit_task(**task)``): ``(key info, key, task id)``."""
    from opentinker_client import RLClient

    with RLClient(sched.target, api_key=sched.admin_key) as root:
        info, key = root.keys.create(owner, "user")
    with RLClient(sched.target, api_key=key) as user:
        task_id = user.submit_task(**task)
    return info, key, task_id


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
    pki = _Pki(folder)
    ca = pki.ca("opentinker-test-ca")
    sk, sc = pki.leaf(ca, "localhost", dns=("localhost",), ip=("127.0.0.1",))
    nodes = {}
    for cn, dns in names.items():
        key, cert = pki.leaf(ca, cn, dns=tuple(dns))
        nodes[cn] = (pki.cert(f"{cn}.pem", cert), pki.key(f"{cn}.key", key))
    return NodeCerts(
        ca=pki.cert("ca.pem", ca[1]),
        server_cert=pki.cert("server.pem", sc),
        server_key=pki.key("server.key", sk),
        nodes=nodes,
    )


def node_tls_args(certs: Certs) -> list[str]:
    """A trainer's ``--tls-ca/--tls-cert/--tls-key`` for ``certs``'s node certificate (CN node-a)."""
    return ["--tls-ca", str(certs.ca), "--tls-cert", str(certs.node_cert), "--tls-key", str(certs.node_key)]


def auth_tls_config(certs: Certs, node_port: int, model_dir: Path, extra: str = "") -> str:
    """A scheduler config with API keys on, TLS on ``certs`` and an mTLS node port, whose specs may
    name ``model_dir``'s folder; ``extra`` is more YAML."""
    return (
        "heartbeat_interval: 0.5\nlease: 3\n"
        f"{extra}"
        "auth: {enabled: true}\n"
        f"paths: {{model_dirs: [{model_dir.parent}]}}\n"
        f"tls: {{cert: {certs.server_cert}, key: {certs.server_key}, client_ca: {certs.ca}, node_port: {node_port}}}\n"
    )
