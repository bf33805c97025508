"""Which host name a server on a trainer node tells clients to dial (torch-free)."""

from __future__ import annotations

import socket

__all__ = ["default_advertise_host", "is_loopback"]


def is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    return host in ("localhost", "::1") or host.startswith("127.")


def default_advertise_host(scheduler_target: str) -> str:
    """``127.0.0.1`` when the scheduler is on loopback (everything on one machine), else this
    machine's host name. Override with the trainer's ``--advertise-host``."""
    host = scheduler_target.rsplit(":", 1)[0] if ":" in scheduler_target else scheduler_target
    return "127.0.0.1" if is_loopback(host) else socket.gethostname()
