"""TLS for the scheduler's gRPC ports, and mTLS for trainer nodes.

``tls:`` in ``scheduler_config.yaml`` (paths relative to the config file)::

    tls:
      cert: certs/scheduler.pem    # server certificate chain (PEM)
      key: certs/scheduler.key     # its private key (PEM)
      client_ca: certs/ca.pem      # optional: CA that signs node (and client) certificates -> mTLS
      client_auth: nodes           # nodes (default) | all
      node_port: 8890              # with client_auth: nodes, the mTLS port trainers connect to

* Without ``tls`` the gRPC port is plaintext (local use, ``make demo``).
* ``cert`` + ``key``: the gRPC port speaks TLS; clients pass the CA that signed ``cert``
  (``RLClient(root_certificates=...)``, ``--tls-ca``, ``$OPENTINKER_TLS_CA``).
* ``client_ca`` with ``client_auth: all``: every connection must present a client certificate
  signed by ``client_ca`` (checked in the TLS handshake).
* ``client_ca`` with ``client_auth: nodes``: the main port stays server-side TLS for clients, a
  second port ``node_port`` requires client certificates, and NodeService refuses any call that did
  not come with a verified client certificate (UNAUTHENTICATED). The certificate's common name is
  recorded in the ``node.join`` audit record.

The HTTP port (``/health``, ``/metrics``) stays plain HTTP; keep it on a private network.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

CLIENT_AUTH = ("nodes", "all")


@dataclass(frozen=True)
class TlsConfig:
    cert: Path
    key: Path
    client_ca: Path | None = None
    client_auth: str = "nodes"
    node_port: int | None = None

    @property
    def node_cert_required(self) -> bool:
        """NodeService calls must carry a verified client certificate."""
        return self.client_ca is not None


def _pem_file(r, m, name: str, base_dir: Path | None) -> Path:
    node = m[name][1]
    text = r.scalar(node, f"tls.{name}", str)
    path = Path(text)
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    try:
        head = path.read_bytes()[:65536]
    except OSError as exc:
        raise r.fail(node, f"tls.{name}", f"a readable PEM file, got {text!r} ({exc.strerror or exc})") from None
    if b"-----BEGIN " not in head:
        raise r.fail(node, f"tls.{name}", f"a PEM file (-----BEGIN ...), got {text!r}")
    return path


def parse_tls(r, node, base_dir: Path | None) -> TlsConfig:
    """Parse ``tls:`` with the config reader ``r``; the files must exist and look like PEM.

    Raises:
        ConfigError: unknown key, missing cert/key, unreadable or non-PEM file, bad
            client_auth, ``client_auth: nodes`` with a client_ca but no node_port.
    """
    m = r.mapping(node, "tls", {"cert": "", "key": "", "client_ca": "", "client_auth": "", "node_port": ""})
    for required in ("cert", "key"):
        if required not in m:
            raise r.fail(node, f"tls.{required}", "a PEM file path (required when tls is set)")
    kw = {"cert": _pem_file(r, m, "cert", base_dir), "key": _pem_file(r, m, "key", base_dir)}
    if "client_ca" in m:
        kw["client_ca"] = _pem_file(r, m, "client_ca", base_dir)
    if "client_auth" in m:
        mode = r.scalar(m["client_auth"][1], "tls.client_auth", str)
        if mode not in CLIENT_AUTH:
            raise r.fail(m["client_auth"][1], "tls.client_auth", f"one of {', '.join(CLIENT_AUTH)}, got {mode!r}")
        kw["client_auth"] = mode
    if "node_port" in m:
        kw["node_port"] = r.scalar(m["node_port"][1], "tls.node_port", int, 0, 65535)
    cfg = TlsConfig(**kw)
    if cfg.client_ca is not None and cfg.client_auth == "nodes" and cfg.node_port is None:
        raise r.fail(node, "tls.node_port", "a port for the mTLS node listener when client_ca is set with client_auth: nodes (or client_auth: all)")
    return cfg


def server_credentials(cfg: TlsConfig, *, require_client_cert: bool) -> grpc.ServerCredentials:
    pair = (cfg.key.read_bytes(), cfg.cert.read_bytes())
    ca = cfg.client_ca.read_bytes() if cfg.client_ca is not None and require_client_cert else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def bind(server: grpc.aio.Server, cfg: TlsConfig | None, host: str, port: int) -> tuple[int, int | None]:
    """Add the gRPC port (and the mTLS node port) to ``server``; returns the bound ports
    (0 for one that could not be bound)."""

    def add(p: int, creds) -> int:
        try:
            return server.add_secure_port(f"{host}:{p}", creds) if creds is not None else server.add_insecure_port(f"{host}:{p}")
        except RuntimeError:
            return 0

    if cfg is None:
        return add(port, None), None
    main = add(port, server_credentials(cfg, require_client_cert=cfg.client_ca is not None and cfg.client_auth == "all"))
    node = None
    if cfg.client_ca is not None and cfg.client_auth == "nodes":
        node = add(cfg.node_port or 0, server_credentials(cfg, require_client_cert=True))
    return main, node
