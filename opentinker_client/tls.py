"""TLS channel credentials shared by the client, the CLI and trainer node agents.

Files are PEM. Each argument left ``None`` is read from its environment variable:

* ``root_certificates`` — ``$OPENTINKER_TLS_CA``: the CA that signed the scheduler's certificate.
  Setting it turns TLS on.
* ``client_cert`` / ``client_key`` — ``$OPENTINKER_TLS_CERT`` / ``$OPENTINKER_TLS_KEY``: this side's
  certificate and key for mTLS (trainer nodes; clients too when the scheduler has
  ``tls.client_auth: all``).
"""

from __future__ import annotations

import os
from pathlib import Path

import grpc

ENV_CA, ENV_CERT, ENV_KEY = "OPENTINKER_TLS_CA", "OPENTINKER_TLS_CERT", "OPENTINKER_TLS_KEY"


def _read(path: str | os.PathLike | None, what: str) -> bytes | None:
    if path is None or str(path) == "":
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {str(path)!r}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what}: {str(path)!r} is not a PEM file")
    return data


def channel_credentials(
    root_certificates: str | os.PathLike | None = None,
    client_cert: str | os.PathLike | None = None,
    client_key: str | os.PathLike | None = None,
) -> grpc.ChannelCredentials | None:
    """Credentials for a TLS channel, or ``None`` for plaintext (no CA given or in the environment).

    Raises:
        ValueError: a file that cannot be read or is not PEM, a certificate without its key (or
            the reverse), or a client certificate without a CA, naming the argument.
    """
    ca = _read(root_certificates if root_certificates is not None else os.environ.get(ENV_CA), "root_certificates")
    cert = _read(client_cert if client_cert is not None else os.environ.get(ENV_CERT), "client_cert")
    key = _read(client_key if client_key is not None else os.environ.get(ENV_KEY), "client_key")
    if (cert is None) != (key is None):
        raise ValueError("client_cert and client_key: expected both (mTLS) or neither")
    if ca is None:
        if cert is not None:
            raise ValueError("root_certificates: expected the CA of the scheduler's certificate when a client certificate is given")
        return None
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
