"""Reading the HTTP ports in tests: one GET that returns the status of an error response too, and
Prometheus text parsed with prometheus-client's own parser."""

from __future__ import annotations

import json
import socket
import ssl
import time
import urllib.error
import urllib.request
from typing import Callable

from prometheus_client.parser import text_string_to_metric_families

from tests.support.waiting import wait_for


def read_until_closed(conn: socket.socket) -> bytes:
    """Bytes until the server closes the connection (a reset counts as closed)."""
    data = b""
    try:
        while chunk := conn.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def http_get(url: str, context: ssl.SSLContext | None = None, timeout: float = 10) -> tuple[int, bytes]:
    """(status, body) of ``GET url``; a 4xx/5xx answer is returned, not raised."""
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def metric_samples(text: str) -> dict[str, list]:
    """name -> [(labels, value)] of every sample in a /metrics body."""
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def metric_value(metrics: dict, name: str, **labels) -> float | None:
    """The value of the first sample of ``name`` whose labels include ``labels`` (None when none)."""
    for got, v in metrics.get(name, []):
        if all(got.get(k) == str(x) for k, x in labels.items()):
            return v
    return None


def assert_slow_clients_are_bounded(
    port: int, set_head_timeout: Callable[[float], None], path: str = "/health"
) -> None:
    """An HTTP port on loopback holds against slowloris clients: with 100 half-sent request heads
    open, its health check ``path`` still answers ``{"status": "ok"}``; a client that trickles its
    head a byte at a time is cut off at the head deadline, which ``set_head_timeout(seconds)`` sets
    for new connections (2 s here, 10 s again after)."""

    def connect() -> socket.socket:
        return socket.create_connection(("127.0.0.1", port), timeout=30)

    base = f"http://127.0.0.1:{port}"
    crowd = []
    try:
        for _ in range(100):
            conn = connect()
            conn.sendall(b"GET %s HTTP/1.1\r\nHost: x\r\nX-Slow: " % path.encode())  # a head that never ends
            crowd.append(conn)
            time.sleep(0.02)  # paced, as a slowloris client opens them: each is accepted before the next
        for _ in range(3):
            status, body = http_get(base + path)
            assert (status, json.loads(body)) == (200, {"status": "ok"})
    finally:
        for conn in crowd:
            conn.close()

    set_head_timeout(2.0)
    try:
        with connect() as slow:
            slow.sendall(b"GET %s HTTP/1.1\r\nHost: x\r\nX-Slow: " % path.encode())
            started = time.monotonic()

            def cut_off() -> bool:
                try:
                    slow.sendall(b"a")  # a byte at a time, as a slowloris client sends
                    slow.settimeout(0.5)
                    return slow.recv(1) == b""
                except TimeoutError:
                    return False
                except (BrokenPipeError, ConnectionResetError):
                    return True

            wait_for(cut_off, what="the port to close a connection whose head never ends")
            assert time.monotonic() - started >= 1.5  # the deadline, not some earlier refusal
    finally:
        set_head_timeout(10.0)
    assert http_get(base + path)[0] == 200
