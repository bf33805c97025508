"""How a task worker reaches the scheduler (dataset download, adapter lookup).

The node agent hands its own connection settings to every worker it starts, as environment
variables: ``OPENTINKER_SCHEDULER_URL`` (``host:port``), ``OPENTINKER_API_KEY`` (the node's key,
when the scheduler has auth on) and ``OPENTINKER_TLS_CA`` / ``OPENTINKER_TLS_CERT`` /
``OPENTINKER_TLS_KEY`` (TLS, and the node's client certificate for mTLS). A worker therefore
calls the scheduler exactly as its node does, with the node role.
"""

from __future__ import annotations

import os
from typing import Mapping

import grpc

__all__ = ["WORKER_ENV", "worker_env", "scheduler_channel"]

#: Environment variables a worker reads (set by the agent from its config).
WORKER_ENV = ("OPENTINKER_SCHEDULER_URL", "OPENTINKER_API_KEY", "OPENTINKER_TLS_CA", "OPENTINKER_TLS_CERT", "OPENTINKER_TLS_KEY")


def worker_env(target: str, *, api_key: str = "", tls_ca: str = "", tls_cert: str = "", tls_key: str = "") -> dict[str, str]:
    """The variables the agent sets for a worker (empty values are left out)."""
    values = dict(zip(WORKER_ENV, (target, api_key, tls_ca, tls_cert, tls_key)))
    return {k: v for k, v in values.items() if v}


def scheduler_channel(target: str | None = None, env: Mapping[str, str] | None = None) -> tuple[grpc.Channel, tuple[tuple[str, str], ...]]:
    """A blocking channel to the scheduler and the call metadata to send on it.

    Args:
        target: ``host:port``; default ``OPENTINKER_SCHEDULER_URL``.
        env: where to read the variables (default ``os.environ``).

    Returns:
        ``(channel, metadata)``; metadata carries ``authorization: Bearer <key>`` when a key is set.

    Raises:
        ValueError: no target known.
        OSError: a TLS file cannot be read.
    """
    env = os.environ if env is None else env
    target = target or env.get("OPENTINKER_SCHEDULER_URL", "")
    if not target:
        raise ValueError("the scheduler's address is unknown (OPENTINKER_SCHEDULER_URL is not set)")
    key = env.get("OPENTINKER_API_KEY", "")
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    ca = env.get("OPENTINKER_TLS_CA", "")
    if not ca:
        return grpc.insecure_channel(target), metadata
    from opentinker_client.tls import channel_credentials

    creds = channel_credentials(ca, env.get("OPENTINKER_TLS_CERT") or None, env.get("OPENTINKER_TLS_KEY") or None)
    return grpc.secure_channel(target, creds), metadata
