"""The trainer's HTTP side port holds against hostile clients, as the scheduler's HTTP port does
(tests/scheduler/api/test_http_port_bounds.py): 100 half-sent requests leave ``/health`` answering,
a client that trickles its request head is cut off at the head deadline, and a body is refused
before it is read. A real :class:`TrainerHttp` on loopback, its agent marked connected."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from opentinker_trainer.agent import AgentConfig, NodeAgent
from opentinker_trainer.http import TrainerHttp
from tests.support.http import assert_slow_clients_are_bounded


@pytest.fixture(scope="module")
def side_port():
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, name="agent-loop", daemon=True)
    runner.start()

    async def start() -> TrainerHttp:
        agent = NodeAgent(AgentConfig(target="127.0.0.1:1", node_id="n1"))
        agent.connected.set()  # /health answers 200 while the node is registered
        http = TrainerHttp(agent, "127.0.0.1", 0)
        http.start()
        return http

    async def stop(http: TrainerHttp) -> None:
        http.stop()
        http.agent.monitor.close()

    http = asyncio.run_coroutine_threadsafe(start(), loop).result()
    try:
        yield http
    finally:
        asyncio.run_coroutine_threadsafe(stop(http), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        runner.join()
        loop.close()


def _connect(http: TrainerHttp) -> socket.socket:
    return socket.create_connection(("127.0.0.1", http.port), timeout=30)


def test_health_answers_with_100_half_sent_requests_open_and_a_trickling_client_is_cut_off(side_port) -> None:
    assert_slow_clients_are_bounded(side_port.port, lambda s: setattr(side_port, "head_timeout_s", s))


def test_a_body_is_refused_before_it_is_read(side_port) -> None:
    with _connect(side_port) as conn:
        conn.sendall(b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 209715200\r\n\r\n")
        answer = b""
        try:
            while chunk := conn.recv(65536):  # no body byte was sent: the answer cannot have waited for one
                answer += chunk
        except ConnectionResetError:
            pass
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:300]
