"""The gateway's port holds against bad clients, as the scheduler's HTTP port does: a keyed route
refuses a missing or unknown key before it reads the body; a bad ``Content-Length`` is a 400 and
an oversized one a 413, the body never read; 100 half-sent requests leave ``healthz`` answering,
and a client that trickles its request head or its body is cut off at its deadline. A scheduler
``RESOURCE_EXHAUSTED`` reaches the SDK as a Tinker-shaped 429, which the SDK retries until it
passes; a JSON body nested too deep is a Tinker-shaped 400 naming the body, not a 500 the SDK
retries; ``telemetry`` takes the SDK's own body with no key and refuses a large or malformed one.

A real scheduler (auth on, no trainer) and a real :class:`GatewayServer`, both in-process on
loopback, so that the test sets the gateway's head timeout."""

from __future__ import annotations

import asyncio
import platform
import socket
import time
import uuid
from datetime import datetime, timezone

import httpx
import pytest
from tinker import types
from tinker._client import AsyncTinker
from tinker._version import __version__ as sdk_version
from tinker.lib.telemetry import _to_send_request, get_process_uuid
from tinker.types.generic_event import GenericEvent
from tinker.types.session_start_event import SessionStartEvent
from tinker.types.telemetry_batch import TelemetryBatch
from tinker.types.telemetry_send_request import TelemetrySendRequest

from opentinker_client import RLClient
from opentinker_gateway.app import GatewayConfig
from opentinker_gateway.server import MIN_BODY_BYTES_PER_S, GatewayServer
from tests.support.gateway import MODEL_NAME, model_names
from tests.support.http import assert_slow_clients_are_bounded, read_until_closed
from tests.support.loop_thread import LoopThread
from tests.support.security import LoopbackScheduler
from tests.support.waiting import wait_for

MAX_BODY_MB = 64


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("gateway-port")
    config = (
        "auth: {enabled: true}\nlimits: {max_pending_per_owner: 1}\n"
        f"paths: {{model_dirs: [{tiny_model_dir.parent}]}}\n"
        "workload_types:\n  - type: lora_session\n    priority: 3\n" + model_names(tiny_model_dir)
    )
    with LoopbackScheduler(tmp / "state", config) as sched:
        with RLClient(sched.target, api_key=sched.admin_key) as root:
            _, alice = root.keys.create("alice", "user")
        loop = LoopThread()

        async def start() -> tuple[GatewayServer, asyncio.Task]:
            config = GatewayConfig(scheduler=sched.target, max_body_bytes=MAX_BODY_MB * 1024 * 1024)
            server = GatewayServer(config, "127.0.0.1", 0)
            return server, asyncio.get_running_loop().create_task(server.serve())

        server, serving = loop.call(start())
        try:
            yield {"sched": sched, "server": server, "alice": f"tml-{alice}", "url": f"http://127.0.0.1:{server.port}"}
        finally:
            server.stop()
            loop.call(asyncio.wait_for(serving, 30))
            loop.close()


def _connect(world) -> socket.socket:
    return socket.create_connection(("127.0.0.1", world["server"].port), timeout=30)


@pytest.mark.parametrize("key", [None, "tml-otk_notakey", "otk_without_prefix"])
def test_a_keyed_route_refuses_a_bad_key_before_reading_the_body(world, key) -> None:
    header = f"X-API-Key: {key}\r\n" if key else ""
    with _connect(world) as conn:
        conn.sendall(
            f"POST /api/v1/create_session HTTP/1.1\r\nHost: x\r\n{header}Content-Type: application/json\r\n"
            f"Content-Length: {60 * 1024 * 1024}\r\n\r\n".encode()
        )
        answer = read_until_closed(conn)  # no body byte was sent: the answer cannot have waited for one
    assert answer.startswith(b"HTTP/1.1 401 "), answer[:300]
    assert b'"category":"user"' in answer and b'"detail":' in answer, answer[:500]


def test_a_good_key_passes(world) -> None:
    with httpx.Client(base_url=world["url"], timeout=60) as http:
        r = http.post(
            "/api/v1/create_session", json={"sdk_version": sdk_version}, headers={"X-API-Key": world["alice"]}
        )
    assert r.status_code == 200 and r.json()["session_id"].startswith("ses-"), r.text


@pytest.mark.parametrize("length", ["-1", "-5", "12abc"])
def test_a_bad_content_length_is_a_400_and_the_body_is_never_read(world, length) -> None:
    with _connect(world) as conn:
        conn.sendall(f"POST /api/v1/telemetry HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode())
        conn.sendall(b"a" * 65536)  # the start of a body the client means to send for ever
        answer = read_until_closed(conn)
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]


@pytest.mark.parametrize("depth", [65, 100_000])
def test_json_nested_too_deep_is_a_400_naming_the_body(world, depth) -> None:
    inner = b"[" * depth + b"]" * depth
    body = b'{"sdk_version": "' + sdk_version.encode() + b'", "x": ' + inner + b"}"
    with httpx.Client(base_url=world["url"], timeout=60) as http:
        r = http.post(
            "/api/v1/create_session",
            content=body,
            headers={"X-API-Key": world["alice"], "Content-Type": "application/json"},
        )
    assert r.status_code == 400, r.text
    assert r.json()["category"] == "user" and r.json()["detail"].startswith("body: expected JSON nested at most 64")


def test_a_body_over_the_limit_is_refused_before_it_is_read(world) -> None:
    with _connect(world) as conn:
        conn.sendall(
            f"POST /api/v1/create_session HTTP/1.1\r\nHost: x\r\nX-API-Key: {world['alice']}\r\n"
            "Content-Length: 209715200\r\n\r\n".encode()
        )
        answer = read_until_closed(conn)
    assert answer.startswith(b"HTTP/1.1 413 ") and b"at most 67108864 bytes" in answer, answer[:300]


def test_a_client_still_sending_a_refused_body_reads_its_answer(world) -> None:
    """The body over the limit keeps coming after the 413: the gateway drops it rather than reset
    the connection, so the client's sending does not fail and it reads the answer."""
    with _connect(world) as conn:
        conn.sendall(
            f"POST /api/v1/forward_backward HTTP/1.1\r\nHost: x\r\nX-API-Key: {world['alice']}\r\n"
            f"Content-Length: {MAX_BODY_MB * 1024 * 1024 + 1}\r\n\r\n".encode()
        )
        for _ in range(64):  # 8 MiB, well past what the socket buffers hold
            conn.sendall(b"\0" * (128 * 1024))
        conn.shutdown(socket.SHUT_WR)
        answer = read_until_closed(conn)
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:300]


def test_healthz_answers_with_100_half_sent_requests_open_and_a_trickling_client_is_cut_off(world) -> None:
    server = world["server"]
    assert_slow_clients_are_bounded(server.port, lambda s: setattr(server, "head_timeout_s", s), path="/api/v1/healthz")


def test_a_stalled_body_is_cut_off_at_its_deadline(world) -> None:
    server = world["server"]
    server.head_timeout_s = 2.0
    try:
        with _connect(world) as conn:
            conn.sendall(
                f"POST /api/v1/create_session HTTP/1.1\r\nHost: x\r\nX-API-Key: {world['alice']}\r\n"
                "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{".encode()
            )
            started = time.monotonic()
            answer = read_until_closed(conn)  # the rest of the body never comes
            waited = time.monotonic() - started
    finally:
        server.head_timeout_s = 10.0
    assert answer == b"" and waited >= 1.5, (answer[:200], waited)


def test_a_large_upload_gets_time_in_proportion_to_its_size(world) -> None:
    server = world["server"]
    big = {"path": "/api/v1/forward_backward", "headers": [(b"content-length", b"%d" % (256 * 1024 * 1024))]}
    small = {"path": "/api/v1/telemetry", "headers": [(b"transfer-encoding", b"chunked")]}
    assert server.body_timeout_s(big) == server.head_timeout_s + 256 * 1024 * 1024 / MIN_BODY_BYTES_PER_S
    assert server.body_timeout_s(small) < server.head_timeout_s + 1


def test_resource_exhausted_is_a_tinker_429_that_the_sdk_retries(world) -> None:
    """``limits.max_pending_per_owner: 1`` and no trainer: alice's second model waits for her first."""
    sched, alice = world["sched"], world["alice"]
    body = {"session_id": "ses-0", "model_seq_id": 0, "base_model": MODEL_NAME, "lora_config": {"rank": 2}}
    with httpx.Client(base_url=world["url"], timeout=60, headers={"X-API-Key": alice}) as http:
        first = http.post("/api/v1/create_model", json=body)
        assert first.status_code == 200, first.text
        r = http.post("/api/v1/create_model", json={**body, "model_seq_id": 1})
    assert r.status_code == 429, r.text
    assert r.json()["category"] == "server" and "max_pending_per_owner" in r.json()["detail"], r.text

    async def create_second():
        client = AsyncTinker(base_url=world["url"], api_key=alice)
        try:
            request = types.CreateModelRequest(
                session_id="ses-0", model_seq_id=2, base_model=MODEL_NAME, lora_config=types.LoraConfig(rank=2)
            )
            return await client.models.create(request=request)
        finally:
            await client.close()

    retried = LoopThread()
    try:
        second = asyncio.run_coroutine_threadsafe(create_second(), retried.loop)
        with RLClient(sched.target, api_key=sched.admin_key) as root:
            pending = wait_for(
                lambda: [t for t in root.list_tasks(states="pending") if t.owner == "alice"],
                what="alice's first model pending",
            )

            def refusals() -> int:
                records = root.keys.audit(action="task.submit")
                return sum(r.owner == "alice" and r.outcome == "RESOURCE_EXHAUSTED" for r in records)

            # Ours above, then the SDK's first try and at least one retry after its 429.
            wait_for(lambda: refusals() >= 3, what="the SDK to retry its refused create_model")
            assert not second.done()
            root.cancel(pending[0].task_id, reason="make room")
        future = second.result(120)  # the SDK's own retries got it through
    finally:
        retried.close()
    assert future.request_id.startswith("create#"), future


def _sdk_telemetry() -> TelemetrySendRequest:
    """A telemetry body built as the SDK's ``Telemetry._batch`` builds one: a session start and an event."""
    now = datetime.now(timezone.utc)
    common = {"event_session_index": 0, "timestamp": now, "severity": "INFO"}
    events = [
        SessionStartEvent(event="SESSION_START", event_id=str(uuid.uuid4()), **common),
        GenericEvent(
            event="GENERIC_EVENT", event_id=str(uuid.uuid4()), event_name="x", event_data={"a": [1, {"b": 2}]}, **common
        ),
    ]
    batch = TelemetryBatch(
        platform=platform.system(),
        sdk_version=sdk_version,
        session_id="ses-0",
        process_uuid=get_process_uuid(),
        events=events,
    )
    return _to_send_request(batch)


def test_telemetry_takes_the_sdks_own_body_without_a_key(world) -> None:
    async def send():
        client = AsyncTinker(base_url=world["url"], api_key="tml-otk_notakey", max_retries=0)
        try:
            return await client.telemetry.send(request=_sdk_telemetry())
        finally:
            await client.close()

    assert asyncio.run(send()).status == "accepted"
    with httpx.Client(base_url=world["url"], timeout=60) as http:
        big = http.post("/api/v1/telemetry", content=b"{" + b" " * (65 * 1024) + b"}")
        bad = http.post("/api/v1/telemetry", content=b"{not json", headers={"Content-Type": "application/json"})
    assert big.status_code == 413 and big.json()["category"] == "user", big.text
    assert bad.status_code == 400 and bad.json()["detail"].startswith("body: expected JSON"), bad.text
