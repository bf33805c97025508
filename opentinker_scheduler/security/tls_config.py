"""Binding the scheduler's gRPC ports with TLS, and mTLS on the node port. The ``tls:`` and
``http_tls:`` sections themselves (what each key means, how the files are checked) are
:mod:`opentinker_scheduler.config.tls`."""

from __future__ import annotations

import grpc

from opentinker_scheduler.config.tls import CLIENT_AUTH, HttpTlsConfig, TlsConfig  # noqa: F401 - the section types, re-exported


def server_credentials(cfg: TlsConfig, *, require_client_cert: bool) -> grpc.ServerCredentials:
    pair = (cfg.key.read_bytes(), cfg.cert.read_bytes())
    ca = cfg.client_ca.read_bytes() if cfg.client_ca is not None and require_client_cert else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def bind(server: grpc.aio.Server, cfg: TlsConfig | None, host: str, port: int) -> tuple[int, int | None]:
    """Add the gRPC port (and the mTLS node port) to ``server``; returns the bound ports
    (0 for one that could not be bound)."""

    def add(p: int, creds) -> int:
        try:
            return (
                server.add_secure_port(f"{host}:{p}", creds)
                if creds is not None
                else server.add_insecure_port(f"{host}:{p}")
            )
        except RuntimeError:
            return 0

    if cfg is None:
        return add(port, None), None
    main = add(
        port, server_credentials(cfg, require_client_cert=cfg.client_ca is not None and cfg.client_auth == "all")
    )
    node = None
    if cfg.client_ca is not None and cfg.client_auth == "nodes":
        node = add(cfg.node_port or 0, server_credentials(cfg, require_client_cert=True))
    return main, node
