"""gRPC channel and server options shared by every OpenTinker process: message limits and the
keepalive settings that the scheduler, trainers, inference servers and clients agree on.

The agreement: servers ping idle connections every 30 s and accept client pings no more often
than every 10 s, with or without calls in flight; trainer node agents ping every 20 s (their
``NodeService.Connect`` stream must outlive quiet minutes), clients every 30 s and only while a
call is open, so nobody is dropped with ``too_many_pings``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_MESSAGE_BYTES", "message_limits", "server_options", "client_keepalive", "node_keepalive"]

#: Largest gRPC message any OpenTinker peer sends or accepts, in bytes (64 MiB): a checkpoint
#: chunk, a batch of client-hosted observations, a long generation.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

Options = list[tuple[str, Any]]


def message_limits(most: int = MAX_MESSAGE_BYTES) -> Options:
    """``grpc.max_send_message_length`` / ``grpc.max_receive_message_length`` at ``most`` bytes."""
    return [("grpc.max_send_message_length", most), ("grpc.max_receive_message_length", most)]


def server_options(*, max_pings_without_data: bool = True) -> Options:
    """Options for a ``grpc.aio.server``: one process per port (``so_reuseport`` off, so a second
    server on the same port fails instead of sharing it), the agreed keepalive, 64 MiB messages.

    Args:
        max_pings_without_data: also allow unlimited pings on a connection without data frames
            (the scheduler: node streams are quiet between heartbeats).
    """
    options: Options = [
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ]
    if max_pings_without_data:
        options.append(("grpc.http2.max_pings_without_data", 0))
    return options + message_limits()


def client_keepalive() -> Options:
    """Keepalive for a client channel: every 30 s, only while a call is open (a watch stream)."""
    return [
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 0),
    ]


def node_keepalive() -> Options:
    """Keepalive for a trainer node's channel: every 20 s, with or without calls, never stopping
    on a quiet stream (gRPC's default stops after 2 pings without data)."""
    return [
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
