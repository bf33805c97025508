"""Servers that look like a frozen (SIGSTOPped) process: connections are accepted, nothing answers."""

from __future__ import annotations

import socket
import threading
import time
from concurrent import futures
from typing import Iterator

import grpc

from opentinker.scheduler.v1 import scheduler_pb2_grpc


def silent_socket() -> socket.socket:
    """A listening TCP socket on 127.0.0.1 that never accepts: the kernel completes the TCP
    handshake (the backlog) and nobody ever speaks HTTP/2, as with a stopped process."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


class SilentScheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    """A servicer whose GetTask and WatchTask never answer until :meth:`release` (a scheduler
    that froze after the HTTP/2 handshake)."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def release(self) -> None:
        self.released.set()

    def GetTask(self, request, context):
        self.released.wait()
        context.abort(grpc.StatusCode.UNAVAILABLE, "released")

    def WatchTask(self, request, context) -> Iterator:
        self.released.wait()
        context.abort(grpc.StatusCode.UNAVAILABLE, "released")
        yield  # pragma: no cover


def silent_grpc_server() -> tuple[grpc.Server, SilentScheduler, int]:
    """A started gRPC server with a :class:`SilentScheduler`: (server, servicer, port)."""
    servicer = SilentScheduler()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, servicer, port


def raises_within(fn, bound: float) -> BaseException:
    """Run ``fn`` in a thread; return what it raised, failing if it had not ended within ``bound`` s."""
    out: dict[str, BaseException] = {}

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["exc"] = exc

    t = threading.Thread(target=run, daemon=True)
    start = time.monotonic()
    t.start()
    t.join(bound)
    assert not t.is_alive(), f"still blocked after {bound:g} s"
    assert "exc" in out, "returned instead of raising"
    print(f"raised {type(out['exc']).__name__} after {time.monotonic() - start:.1f} s")
    return out["exc"]
