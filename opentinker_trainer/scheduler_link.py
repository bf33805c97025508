"""How a task worker reaches the scheduler (dataset download, adapter lookup).

The node agent hands its own connection settings to every worker it starts, as environment
variables: ``OPENTINKER_SCHEDULER_URL`` (``host:port``, or several separated by commas, the leader
first, when the node was given several schedulers: the worker's calls then follow the leader too;
``OPENTINKER_SCHEDULER_TLS=1`` when the node's URL was ``https://``), ``OPENTINKER_API_KEY`` and
``OPENTINKER_TLS_CA`` / ``OPENTINKER_TLS_CERT`` / ``OPENTINKER_TLS_KEY`` (TLS, and the node's client
certificate for mTLS). The node's key is never handed on: with auth on, ``OPENTINKER_API_KEY`` of
a task worker is its attempt's credential (``AssignTask.worker_credential``), and a model host's
tenants pass theirs (``WorkerContext.scheduler_env``). The worker writes only its own attempt's
checkpoints and reads only its task owner's tasks and datasets.
"""

from __future__ import annotations

import os
from typing import Mapping

import grpc

__all__ = ["WORKER_ENV", "SCHEDULER_TLS_ENV", "worker_env", "scheduler_channel", "scheduler_credentials"]

#: Environment variables a worker reads (set by the agent from its config).
WORKER_ENV = (
    "OPENTINKER_SCHEDULER_URL",
    "OPENTINKER_API_KEY",
    "OPENTINKER_TLS_CA",
    "OPENTINKER_TLS_CERT",
    "OPENTINKER_TLS_KEY",
)
#: The inference server's own certificate and key (PEM; the trainer's --serve-tls-cert/--serve-tls-key).
SERVE_TLS_ENV = ("OPENTINKER_SERVE_TLS_CERT", "OPENTINKER_SERVE_TLS_KEY")
#: "1" when the node's scheduler URL was https:// or grpcs://: TLS even without OPENTINKER_TLS_CA
#: (the system roots), so that workers make the same choice as their node.
SCHEDULER_TLS_ENV = "OPENTINKER_SCHEDULER_TLS"


def worker_env(
    target: str,
    *,
    api_key: str = "",
    tls_ca: str = "",
    tls_cert: str = "",
    tls_key: str = "",
    serve_tls_cert: str = "",
    serve_tls_key: str = "",
    scheduler_tls: bool = False,
) -> dict[str, str]:
    """The variables the agent sets for a worker (empty values are left out). ``scheduler_tls``:
    the node reaches the scheduler over TLS even without a CA (an ``https://`` URL)."""
    values = dict(zip(WORKER_ENV, (target, api_key, tls_ca, tls_cert, tls_key)))
    values[SCHEDULER_TLS_ENV] = "1" if scheduler_tls else ""
    values.update(zip(SERVE_TLS_ENV, (serve_tls_cert, serve_tls_key)))
    return {k: v for k, v in values.items() if v}


def scheduler_channel(
    target: str | None = None, env: Mapping[str, str] | None = None
) -> tuple[grpc.Channel, tuple[tuple[str, str], ...]]:
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
    creds = scheduler_credentials(env)

    def make(one: str) -> grpc.Channel:
        return grpc.insecure_channel(one) if creds is None else grpc.secure_channel(one, creds)

    if "," in target:  # several schedulers (the node's list, its leader first): follow the leader
        from opentinker_common.net.leader import FollowingChannel

        return FollowingChannel([t.strip() for t in target.split(",") if t.strip()], make), metadata  # type: ignore[return-value]
    return make(target), metadata


def scheduler_credentials(env: Mapping[str, str] | None = None) -> grpc.ChannelCredentials | None:
    """TLS credentials for the scheduler as the node uses them, or None for plaintext: TLS when
    ``OPENTINKER_TLS_CA`` is set (that CA) or ``OPENTINKER_SCHEDULER_TLS`` is ``1`` (the system
    roots), with the node's client certificate when ``OPENTINKER_TLS_CERT``/``_KEY`` are set.

    Raises:
        ValueError: a TLS file cannot be read or is not PEM.
    """
    env = os.environ if env is None else env
    ca = env.get("OPENTINKER_TLS_CA", "")
    tls = env.get(SCHEDULER_TLS_ENV, "") == "1"
    if not ca and not tls:
        return None
    from opentinker_common.net.tls import channel_credentials

    # "" (not None) for unset values, so nothing is read from os.environ behind an explicit env.
    return channel_credentials(ca, env.get("OPENTINKER_TLS_CERT", ""), env.get("OPENTINKER_TLS_KEY", ""), tls=tls)
