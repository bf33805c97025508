"""The ``tls:`` and ``http_tls:`` sections: TLS for the scheduler's gRPC ports, mTLS for trainer nodes, and
TLS for the HTTP port (binding the ports: :mod:`opentinker_scheduler.security.tls_config`).

``tls:`` and ``http_tls:`` in ``scheduler_config.yaml`` (paths relative to the config file)::

    tls:
      cert: certs/scheduler.pem    # server certificate chain (PEM)
      key: certs/scheduler.key     # its private key (PEM)
      client_ca: certs/ca.pem      # optional: CA that signs node (and client) certificates -> mTLS
      client_auth: nodes           # nodes (default) | all
      node_port: 8890              # with client_auth: nodes, the mTLS port trainers connect to
      node_id_must_match_cert: true  # default true with client_ca: Register node_id = cert CN or DNS name
    http_tls:                      # optional: /health and /metrics over HTTPS
      cert: certs/scheduler-http.pem
      key: certs/scheduler-http.key

* Without ``tls`` the gRPC port is plaintext (local use, ``make demo``).
* ``cert`` + ``key``: the gRPC port speaks TLS; clients pass the CA that signed ``cert``
  (``RLClient(root_certificates=...)``, ``--tls-ca``, ``$OPENTINKER_TLS_CA``).
* ``client_ca`` with ``client_auth: all``: every connection must present a client certificate
  signed by ``client_ca`` (checked in the TLS handshake).
* ``client_ca`` with ``client_auth: nodes``: the main port stays server-side TLS for clients, a
  second port ``node_port`` requires client certificates, and NodeService refuses any call that did
  not come with a verified client certificate (UNAUTHENTICATED). The certificate's common name is
  recorded in the ``node.join`` audit record.
* With a ``client_ca``, a node's ``Register`` ``node_id`` must be the common name of its verified
  certificate or one of its DNS subject alternative names, else the stream is refused
  (PERMISSION_DENIED, audited as ``node.join``): a stolen certificate of one node cannot register
  as another. ``node_id_must_match_cert: false`` lets one certificate serve a whole fleet (one
  Kubernetes secret for a DaemonSet), at the price that any holder of it may take any node id.
* ``http_tls`` (its own ``cert`` and ``key``, which may be the same files as ``tls``): the HTTP
  port speaks HTTPS only (``https://host:8889/health``); without it the port is plain HTTP. The
  pair is loaded at start, so a key that does not match its certificate is a config error.
* Checked when the config is loaded (exit 2 with ``file:line: key: expected ...``), not when the
  port is bound: every file is a regular file of at most 1 MiB holding PEM; ``tls.cert`` holds a
  certificate and ``tls.key`` a private key, and the two load as a pair into an
  :class:`ssl.SSLContext` (a key of another certificate, or a CA certificate given as
  ``tls.cert``: ``tls.key: expected the private key of tls.cert ... (KEY_VALUES_MISMATCH)``);
  ``tls.client_ca`` holds a ``CERTIFICATE`` block and no private key.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

CLIENT_AUTH = ("nodes", "all")


@dataclass(frozen=True)
class TlsConfig:
    cert: Path
    key: Path
    client_ca: Path | None = None
    client_auth: str = "nodes"
    node_port: int | None = None
    #: A node's Register node_id must equal its certificate's CN or one of its DNS names.
    node_id_must_match_cert: bool = False

    @property
    def node_cert_required(self) -> bool:
        """NodeService calls must carry a verified client certificate."""
        return self.client_ca is not None


@dataclass(frozen=True)
class HttpTlsConfig:
    """``http_tls:``: certificate chain and key (PEM) of the HTTPS side port."""

    cert: Path
    key: Path

    def server_context(self) -> ssl.SSLContext:
        """A TLS server context with this pair (TLS 1.2 or newer).

        Raises:
            ssl.SSLError, OSError: the files cannot be loaded or do not match.
        """
        from opentinker_common.net.tls import server_ssl_context

        return server_ssl_context(self.cert, self.key)


#: What each file must hold: (block that must be there, block that must not, words).
_HOLDS = {
    "cert": (b"-----BEGIN CERTIFICATE-----", None, "a PEM certificate chain (-----BEGIN CERTIFICATE-----)"),
    "key": (b"PRIVATE KEY-----", None, "the private key of {section}.cert (-----BEGIN ... PRIVATE KEY-----)"),
    "client_ca": (
        b"-----BEGIN CERTIFICATE-----",
        b"PRIVATE KEY-----",
        "a PEM CA certificate (-----BEGIN CERTIFICATE-----, no private key)",
    ),
}


def _pem_file(r, m, name: str, base_dir: Path | None, section: str = "tls") -> Path:
    """The path of PEM file ``section.name``: a regular file of at most 1 MiB holding what
    :data:`_HOLDS` says (ConfigError naming file, line and key otherwise)."""
    from opentinker_common.net.tls import read_pem_file

    node = m[name][1]
    text = r.scalar(node, f"{section}.{name}", str)
    path = Path(text)
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    try:
        data = read_pem_file(path, f"{section}.{name}")
    except ValueError as exc:
        why = str(exc).split(": ", 1)[-1]  # without the key, which r.fail names
        raise r.fail(node, f"{section}.{name}", f"a readable PEM file, got {text!r} ({why})") from None
    if b"-----BEGIN " not in data:
        raise r.fail(node, f"{section}.{name}", f"a PEM file (-----BEGIN ...), got {text!r}")
    must, must_not, words = _HOLDS[name]
    words = words.format(section=section)
    if must not in data:
        raise r.fail(node, f"{section}.{name}", f"{words}, got {text!r}")
    if must_not is not None and must_not in data:
        raise r.fail(node, f"{section}.{name}", f"{words}, got {text!r}, which holds a private key")
    return path


def _check_pair(r, m, cfg, section: str) -> None:
    """Load ``cert``/``key`` into an :class:`ssl.SSLContext`; a mismatch is a ConfigError at
    ``section.key`` (gRPC would only say "Unable to create secure server" when binding)."""
    from opentinker_common.net.tls import check_key_pair

    try:
        check_key_pair(cfg.cert, cfg.key, names=(f"{section}.cert", f"{section}.key"))
    except ValueError as exc:
        which = "cert" if str(exc).startswith(f"{section}.cert:") else "key"  # the message names the file at fault
        why = str(exc).split(": expected ", 1)[-1] if ": expected " in str(exc) else str(exc).split(": ", 1)[-1]
        raise r.fail(m[which][1], f"{section}.{which}", why) from None


def parse_http_tls(r, node, base_dir: Path | None) -> HttpTlsConfig:
    """Parse ``http_tls:``; both files must exist, be PEM and load as a matching pair.

    Raises:
        ConfigError: unknown key, missing cert/key, unreadable or non-PEM file, or a key that
            is not the certificate's (file:line:key named).
    """
    m = r.mapping(node, "http_tls", {"cert": "", "key": ""})
    for required in ("cert", "key"):
        if required not in m:
            raise r.fail(node, f"http_tls.{required}", "a PEM file path (required when http_tls is set)")
    cfg = HttpTlsConfig(
        cert=_pem_file(r, m, "cert", base_dir, "http_tls"), key=_pem_file(r, m, "key", base_dir, "http_tls")
    )
    _check_pair(r, m, cfg, "http_tls")
    return cfg


def parse_tls(r, node, base_dir: Path | None) -> TlsConfig:
    """Parse ``tls:`` with the config reader ``r``; the files must be PEM, and cert/key must
    load as a pair.

    Raises:
        ConfigError: unknown key, missing cert/key, unreadable, non-regular, over 1 MiB or
            non-PEM file, a cert without a certificate, a key without a private key or of
            another certificate (KEY_VALUES_MISMATCH), a client_ca without a certificate or with
            a private key, bad client_auth, ``client_auth: nodes`` with a client_ca but no node_port,
            ``node_id_must_match_cert: true`` without a client_ca.
    """
    m = r.mapping(
        node,
        "tls",
        {"cert": "", "key": "", "client_ca": "", "client_auth": "", "node_port": "", "node_id_must_match_cert": ""},
    )
    for required in ("cert", "key"):
        if required not in m:
            raise r.fail(node, f"tls.{required}", "a PEM file path (required when tls is set)")
    kw = {"cert": _pem_file(r, m, "cert", base_dir), "key": _pem_file(r, m, "key", base_dir)}
    _check_pair(r, m, HttpTlsConfig(kw["cert"], kw["key"]), "tls")
    if "client_ca" in m:
        kw["client_ca"] = _pem_file(r, m, "client_ca", base_dir)
    if "client_auth" in m:
        mode = r.scalar(m["client_auth"][1], "tls.client_auth", str)
        if mode not in CLIENT_AUTH:
            raise r.fail(m["client_auth"][1], "tls.client_auth", f"one of {', '.join(CLIENT_AUTH)}, got {mode!r}")
        kw["client_auth"] = mode
    if "node_port" in m:
        kw["node_port"] = r.scalar(m["node_port"][1], "tls.node_port", int, 0, 65535)
    kw["node_id_must_match_cert"] = "client_ca" in kw  # default: on whenever nodes present certificates
    if "node_id_must_match_cert" in m:
        match = r.scalar(m["node_id_must_match_cert"][1], "tls.node_id_must_match_cert", bool)
        if match and "client_ca" not in kw:
            raise r.fail(
                m["node_id_must_match_cert"][1],
                "tls.node_id_must_match_cert",
                "false without tls.client_ca (nodes present no certificate to match)",
            )
        kw["node_id_must_match_cert"] = match
    cfg = TlsConfig(**kw)
    if cfg.client_ca is not None and cfg.client_auth == "nodes" and cfg.node_port is None:
        raise r.fail(
            node,
            "tls.node_port",
            "a port for the mTLS node listener when client_ca is set with client_auth: nodes (or client_auth: all)",
        )
    return cfg
