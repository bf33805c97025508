"""TLS for the inference server: its certificate and key (PEM), from the trainer's
``--serve-tls-cert`` / ``--serve-tls-key`` (env ``OPENTINKER_SERVE_TLS_CERT`` /
``OPENTINKER_SERVE_TLS_KEY``), which the node agent hands to its inference workers. Torch-free."""

from __future__ import annotations

import os
from typing import Mapping

__all__ = ["ENV_CERT", "ENV_KEY", "ServerTLS", "read_server_tls", "server_tls_from_env"]

from opentinker_trainer.scheduler_link import SERVE_TLS_ENV

ENV_CERT, ENV_KEY = SERVE_TLS_ENV  # OPENTINKER_SERVE_TLS_CERT, OPENTINKER_SERVE_TLS_KEY

#: ``(certificate chain PEM, private key PEM)``.
ServerTLS = tuple[bytes, bytes]


def _read(path: str, what: str, marker: bytes) -> bytes:
    from opentinker_common.net.tls import read_pem_file  # regular files only, read with a bound

    data = read_pem_file(path, what)
    if b"-----BEGIN " not in data or marker not in data:
        kind = "certificate" if marker == b"CERTIFICATE" else "private key"
        raise ValueError(f"{what}: {path!r} is not a PEM {kind}")
    return data


def read_server_tls(
    cert: str | os.PathLike | None,
    key: str | os.PathLike | None,
    *,
    names: tuple[str, str] = ("--serve-tls-cert", "--serve-tls-key"),
) -> ServerTLS | None:
    """Read and check the server certificate and key; ``None`` when neither is given (plaintext).

    Args:
        names: how to call the two settings in errors (flags or environment variables).

    Raises:
        ValueError: one without the other, a file that cannot be read, or one that is not a PEM
            certificate / private key; one line naming the setting.
    """
    cert, key = str(cert or ""), str(key or "")
    if bool(cert) != bool(key):
        raise ValueError(f"{names[0]} and {names[1]}: expected both (TLS for inference servers) or neither")
    if not cert:
        return None
    return _read(cert, names[0], b"CERTIFICATE"), _read(key, names[1], b"PRIVATE KEY")


def server_tls_from_env(env: Mapping[str, str] | None = None) -> ServerTLS | None:
    """:func:`read_server_tls` of ``OPENTINKER_SERVE_TLS_CERT`` / ``OPENTINKER_SERVE_TLS_KEY``."""
    env = os.environ if env is None else env
    return read_server_tls(env.get(ENV_CERT), env.get(ENV_KEY), names=(ENV_CERT, ENV_KEY))
