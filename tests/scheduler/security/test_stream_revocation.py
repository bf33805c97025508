"""A revoked or expired API key ends the streams it opened (opentinker_scheduler/security/key_streams.py):
WatchTask streams and a real node agent's Connect on a real scheduler on loopback, rotation with
a grace period, keys revoked behind AdminService's back, and the race helper on its own."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import grpc
import pytest

from opentinker.common.v1 import common_pb2 as C
from opentinker.node.v1 import node_pb2 as N, node_pb2_grpc
from opentinker.scheduler.v1 import scheduler_pb2 as S, scheduler_pb2_grpc
from opentinker_client import RLClient
from opentinker_scheduler.config import ConfigError, parse_config
from opentinker_scheduler.security.key_streams import KeyStreams, until_ended

from tests.support.security import LoopbackScheduler, metadata


def _auth(recheck: float) -> str:
    return f"auth: {{enabled: true, stream_recheck_interval: {recheck}}}\npaths: {{model_dirs: [/models]}}\n"


def _wait(check, timeout: float = 30, what: str = ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)
    raise TimeoutError(f"not reached in {timeout} s: {what}")


class Watch:
    """A raw WatchTask stream read in a thread; ``error`` is the RpcError it ended with."""

    def __init__(self, target: str, task_id: str, key: str) -> None:
        self.channel = grpc.insecure_channel(target)
        stub = scheduler_pb2_grpc.SchedulerServiceStub(self.channel)
        self.stream = stub.WatchTask(S.WatchTaskRequest(task_id=task_id), metadata=metadata(key), timeout=60)
        self.events: list = []
        self.error: grpc.RpcError | None = None
        self.first = threading.Event()
        self.done = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        assert self.first.wait(30), "no first event"

    def _read(self) -> None:
        try:
            for ev in self.stream:
                self.events.append(ev.event)
                self.first.set()
        except grpc.RpcError as err:
            self.error = err
        finally:
            self.first.set()
            self.done.set()

    def close(self) -> None:
        self.stream.cancel()
        self.done.wait(10)
        self.channel.close()


def _users(s: LoopbackScheduler, *owners: str) -> list[tuple[object, str, str]]:
    """(key record, key, task id of a pending task of theirs) per owner."""
    out = []
    with RLClient(s.target, api_key=s.admin_key) as root:
        for owner in owners:
            info, key = root.keys.create(owner, "user")
            with RLClient(s.target, api_key=key) as c:
                task_id = c.submit_task(workload_type="lora_finetune", model="/models/m")  # PENDING: no node
            out.append((info, key, task_id))
    return out


@contextlib.contextmanager
def _watching(tmp_path, recheck: float):
    """A loopback scheduler with auth on (stream re-check every ``recheck`` seconds) and a
    ``watch(task_id, key) -> Watch`` that opens a WatchTask stream on it: ``(s, watch)``. On exit
    every watch opened is closed, then the scheduler."""
    s = LoopbackScheduler(tmp_path / "state", _auth(recheck))
    watches: list[Watch] = []

    def watch(task_id: str, key: str) -> Watch:
        w = Watch(s.target, task_id, key)
        watches.append(w)
        return w

    try:
        yield s, watch
    finally:
        for w in watches:
            w.close()
        s.close()


def _open_streams(s: LoopbackScheduler, prefix: str) -> int:
    return s.do(lambda: s.security.interceptor.streams.count(prefix))


def test_revoke_ends_the_keys_watch_streams_at_once_and_leaves_other_keys_alone(tmp_path) -> None:
    # A re-check interval of an hour: only the revoke notification can end the stream in time.
    with _watching(tmp_path, 3600) as (s, watch):
        (alice, alice_key, alice_task), (bob, bob_key, bob_task) = _users(s, "alice", "bob")
        a1, a2, b = watch(alice_task, alice_key), watch(alice_task, alice_key), watch(bob_task, bob_key)
        assert _open_streams(s, alice.prefix) == 2 and s.security.limits.open_streams("alice") == 2
        with RLClient(s.target, api_key=s.admin_key) as root:
            root.keys.revoke(alice.prefix)
        for w in (a1, a2):
            assert w.done.wait(30), "the revoked key's stream is still open"
            assert w.error.code() == grpc.StatusCode.UNAUTHENTICATED
            assert w.error.details() == f"API key {alice.prefix} was revoked"
        # The handler's finally blocks ran: the streams are unregistered and their slots released.
        _wait(
            lambda: _open_streams(s, alice.prefix) == 0 and s.security.limits.open_streams("alice") == 0,
            what="slots released",
        )
        # Bob's stream runs on and still delivers events.
        assert not b.done.is_set() and _open_streams(s, bob.prefix) == 1
        with RLClient(s.target, api_key=bob_key) as c:
            c.cancel(bob_task)
        assert b.done.wait(30) and b.error is None  # ended normally: the task is terminal
        assert b.events[-1].HasField("state_change") and b.events[-1].state_change.to_state == C.TASK_STATE_CANCELLED


def test_a_real_node_agent_is_cut_off_when_its_key_is_revoked(tmp_path) -> None:
    from opentinker_trainer.agent import AgentConfig, FatalRegistrationError, NodeAgent

    s = LoopbackScheduler(tmp_path / "state", _auth(3600), heartbeat_interval_s=0.2, lease_s=5)
    try:
        with RLClient(s.target, api_key=s.admin_key) as root:
            node_info, node_key = root.keys.create("rack-1", "node")
            other_info, other_key = root.keys.create("rack-2", "node")

        async def scenario() -> str:
            agents = [
                NodeAgent(
                    AgentConfig(
                        target=s.target,
                        node_id=node_id,
                        api_key=key,
                        work_dir=tmp_path / node_id,
                        reconnect_initial_s=0.05,
                    )
                )
                for node_id, key in (("node-r", node_key), ("node-other", other_key))
            ]
            runs = [asyncio.create_task(a.run()) for a in agents]
            try:
                for a in agents:
                    await asyncio.wait_for(a.connected.wait(), 30)
                with RLClient(s.target, api_key=s.admin_key) as root:
                    assert {n.node_id for n in await asyncio.to_thread(root.list_nodes) if n.connected} == {
                        "node-r",
                        "node-other",
                    }
                    await asyncio.to_thread(root.keys.revoke, node_info.prefix)
                with pytest.raises(FatalRegistrationError) as err:
                    await asyncio.wait_for(runs[0], 30)
                assert agents[1].connected.is_set() and not runs[1].done()  # another key's node runs on
                return str(err.value)
            finally:
                for a, r in zip(agents, runs):
                    await a.stop_now()
                    r.cancel()
                    await asyncio.gather(r, return_exceptions=True)
                    a.monitor.close()

        message = asyncio.run(scenario())
        assert message == f"UNAUTHENTICATED: API key {node_info.prefix} was revoked"
        # The scheduler ran its disconnect handling for the node.
        with RLClient(s.target, api_key=s.admin_key) as root:
            nodes = {n.node_id: n.connected for n in root.list_nodes()}
        assert nodes["node-r"] is False
        # Connecting again with the revoked key is refused like any call.
        with grpc.insecure_channel(s.target) as ch:
            stream = node_pb2_grpc.NodeServiceStub(ch).Connect(
                iter([N.ConnectRequest(register=N.Register(node_id="node-r", max_tasks=1))]),
                metadata=metadata(node_key),
                timeout=10,
            )
            with pytest.raises(grpc.RpcError) as refused:
                next(stream)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED and "was revoked" in refused.value.details()
    finally:
        s.close()


def test_rotation_with_grace_ends_the_old_keys_stream_when_the_grace_ends(tmp_path) -> None:
    # An hour between re-checks: the timer set at the rotation ends the stream.
    with _watching(tmp_path, 3600) as (s, watch):
        ((info, key, task_id),) = _users(s, "alice")
        old = watch(task_id, key)
        with RLClient(s.target, api_key=key) as alice:
            new, new_key, _ = alice.keys.rotate(info.prefix, grace=4)
        assert _open_streams(s, info.prefix) == 1 and not old.done.is_set()  # within the grace period
        fresh = watch(task_id, new_key)
        assert old.done.wait(30), "the old key's stream outlived the grace period"
        assert old.error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert old.error.details() == f"API key {info.prefix} expired after rotation; use {new.prefix}"
        assert not fresh.done.is_set() and _open_streams(s, new.prefix) == 1


def test_periodic_recheck_ends_streams_of_keys_expired_or_revoked_behind_admin_service(tmp_path) -> None:
    with _watching(tmp_path, 0.2) as (s, watch):
        (a, a_key, a_task), (b, b_key, b_task), (c, c_key, c_task) = _users(s, "alice", "bob", "carol")
        with RLClient(s.target, api_key=s.admin_key) as root:
            root.keys.rotate(a.prefix, grace=3600)
        wa, wb, wc = watch(a_task, a_key), watch(b_task, b_key), watch(c_task, c_key)
        keys = s.security.keys
        real = keys.clock
        keys.clock = lambda: real() + 3601  # alice's grace period is over
        try:
            s.do(lambda: keys.revoke(b.prefix))  # straight in the store: no notification
            for w, words in ((wa, "expired after rotation"), (wb, "was revoked")):
                assert w.done.wait(30)
                assert w.error.code() == grpc.StatusCode.UNAUTHENTICATED and words in w.error.details()
        finally:
            keys.clock = real
        assert not wc.done.is_set() and _open_streams(s, c.prefix) == 1


def test_an_upload_in_flight_ends_when_its_key_is_revoked_and_leaves_nothing_behind(tmp_path) -> None:
    s = LoopbackScheduler(tmp_path / "state", _auth(3600))
    release = threading.Event()
    try:
        ((info, key, _),) = _users(s, "alice")
        data = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'

        def requests():
            yield S.UploadDatasetRequest(name="chat.jsonl", total_bytes=len(data), chunk=data[:10])
            release.wait(30)  # the rest never comes while the key is valid

        outcome: dict = {}

        def upload() -> None:
            with grpc.insecure_channel(s.target) as ch:
                try:
                    scheduler_pb2_grpc.SchedulerServiceStub(ch).UploadDataset(
                        requests(), metadata=metadata(key), timeout=60
                    )
                except grpc.RpcError as err:
                    outcome["error"] = err

        t = threading.Thread(target=upload)
        t.start()
        _wait(lambda: _open_streams(s, info.prefix) == 1, what="upload registered")
        with RLClient(s.target, api_key=s.admin_key) as root:
            root.keys.revoke(info.prefix)
        t.join(30)
        release.set()
        err = outcome["error"]
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED and err.details() == f"API key {info.prefix} was revoked"
        leftovers = (
            [p for p in (s.config.state_dir / "datasets").rglob("*") if p.is_file()]
            if (s.config.state_dir / "datasets").exists()
            else []
        )
        assert leftovers == []  # the partial upload was removed
    finally:
        release.set()
        s.close()


def test_stream_recheck_interval_config() -> None:
    assert parse_config("auth: {enabled: true, stream_recheck_interval: 0.5}\n").auth.stream_recheck_interval_s == 0.5
    assert parse_config("auth: {enabled: true}\n").auth.stream_recheck_interval_s == 5.0
    for bad in ("0", "-1", "soon", "7200"):
        with pytest.raises(
            ConfigError, match=r"x\.yaml:1:48: auth\.stream_recheck_interval: expected a number in \[0\.05, 3600\]"
        ):
            parse_config(f"auth: {{enabled: true, stream_recheck_interval: {bad}}}\n", "x.yaml")


# ------------------------------------------------------------------ the race on its own


def test_until_ended_cancels_the_handler_so_its_finally_runs_and_passes_errors_through() -> None:
    async def scenario() -> None:
        refusals: dict[str, str | None] = {"otk_aaaaaaaa": None}
        streams = KeyStreams(refusals.get, recheck_interval_s=0.01)
        cleaned = []

        async def handler():
            try:
                yield 1
                await asyncio.Event().wait()  # waits for ever, like a quiet watch
                yield 2
            finally:
                cleaned.append("finally")

        stream = streams.open("otk_aaaaaaaa", "/m")
        got = []

        async def consume():
            async for item in until_ended(handler(), stream):
                got.append(item)

        consumer = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        assert got == [1] and not consumer.done()
        refusals["otk_aaaaaaaa"] = "API key otk_aaaaaaaa was revoked"  # the periodic re-check notices
        await asyncio.wait_for(consumer, 5)
        assert cleaned == ["finally"] and stream.ended.is_set() and stream.reason == "API key otk_aaaaaaaa was revoked"
        streams.close(stream)
        assert streams.count() == 0 and streams._watcher is None

        async def failing():
            yield "a"
            raise ValueError("handler error")

        other = streams.open("otk_bbbbbbbb")
        with pytest.raises(ValueError, match="handler error"):
            async for _ in until_ended(failing(), other):
                pass
        assert [x async for x in until_ended(_items(3), other)] == [0, 1, 2]  # a stream that ends by itself
        assert not other.ended.is_set()
        streams.close(other)

    asyncio.run(scenario())


async def _items(n: int):
    for i in range(n):
        yield i


def test_key_streams_refuses_a_bad_interval() -> None:
    with pytest.raises(ValueError, match="recheck_interval_s"):
        KeyStreams(lambda p: None, recheck_interval_s=0)
