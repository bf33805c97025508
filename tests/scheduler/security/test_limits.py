"""Limits: each one reached through the real SubmitTask / WatchTask on a loopback scheduler gives
RESOURCE_EXHAUSTED naming the limit, and nothing is stored; plus the limiter units."""

from __future__ import annotations

import time

import grpc
import pytest

from opentinker.common.v1 import common_pb2 as C
from opentinker.scheduler.v1 import scheduler_pb2 as S, scheduler_pb2_grpc
from opentinker_client import InvalidArgumentError, RLClient, ResourceExhaustedError
from opentinker_scheduler.config import ConfigError, parse_config
from opentinker_scheduler.errors import ResourceExhausted
from opentinker_scheduler.security.limits import Limits, LimitsConfig, TokenBucket

from tests.support.security import LoopbackScheduler, metadata


def _submit(client: RLClient, **kw) -> str:
    return client.submit_task(workload_type="lora_finetune", model="/models/m", **kw)


@pytest.fixture
def make(tmp_path):
    made = []

    def _make(text: str) -> LoopbackScheduler:
        s = LoopbackScheduler(
            tmp_path / f"state{len(made)}", text + "paths: {model_dirs: [/models]}\n"
        )  # specs name /models/m
        made.append(s)
        return s

    yield _make
    for s in made:
        s.close()


def test_pending_per_owner_limit_counts_each_owner_separately(make) -> None:
    s = make("auth: {enabled: true}\nlimits: {max_pending_per_owner: 2}\n")
    with RLClient(s.target, api_key=s.admin_key) as root:
        _, alice_key = root.keys.create("alice", "user")
        _, bob_key = root.keys.create("bob", "user")
    with RLClient(s.target, api_key=alice_key) as alice, RLClient(s.target, api_key=bob_key) as bob:
        first = _submit(alice)
        _submit(alice)
        with pytest.raises(
            ResourceExhaustedError,
            match=r"already has 2 PENDING task\(s\), the limit is 2 \(limits.max_pending_per_owner\)",
        ):
            _submit(alice)
        assert len(alice.list_tasks()) == 2  # nothing stored for the refused one
        _submit(bob)  # another owner is not affected
        alice.cancel(first)
        _submit(alice)  # room again


def test_submit_rate_per_key_is_a_token_bucket(make) -> None:
    s = make("auth: {enabled: true}\nlimits: {submit_rate: 0.001, submit_burst: 2}\n")
    with RLClient(s.target, api_key=s.admin_key) as root:
        _, k1 = root.keys.create("alice", "user")
        _, k2 = root.keys.create("alice", "user")  # same owner, another key: its own bucket
    with RLClient(s.target, api_key=k1) as a, RLClient(s.target, api_key=k2) as b:
        _submit(a)
        _submit(a)
        with pytest.raises(ResourceExhaustedError, match=r"submit rate limit: .* \(limits.submit_rate\); retry in"):
            _submit(a)
        _submit(b)
        assert len(a.list_tasks()) == 3


def test_spec_size_limit(make) -> None:
    s = make("limits: {max_spec_bytes: 1024}\n")
    with grpc.insecure_channel(s.target) as ch:  # raw stub: RLClient would refuse the name locally
        stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        spec = C.TaskSpec(workload_type="lora_finetune", model="/models/m", name="x" * 2000)
        with pytest.raises(grpc.RpcError) as err:
            stub.SubmitTask(S.SubmitTaskRequest(spec=spec))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "more than the limit of 1024 (limits.max_spec_bytes)" in err.value.details()
        assert not stub.ListTasks(S.ListTasksRequest()).tasks
        stub.SubmitTask(
            S.SubmitTaskRequest(spec=C.TaskSpec(workload_type="lora_finetune", model="/models/m", name="small"))
        )


def test_message_size_limit_applies_to_what_the_server_receives(make) -> None:
    s = make("limits: {max_message_bytes: 65536}\n")
    with grpc.insecure_channel(s.target) as ch:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        spec = C.TaskSpec(workload_type="lora_finetune", model="/models/m", name="x" * 100_000)
        with pytest.raises(grpc.RpcError) as err:
            stub.SubmitTask(S.SubmitTaskRequest(spec=spec), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in err.value.details()
        assert not stub.ListTasks(S.ListTasksRequest()).tasks


def test_concurrent_streams_per_key(make) -> None:
    s = make("auth: {enabled: true}\nlimits: {max_streams_per_key: 1}\n")
    with RLClient(s.target, api_key=s.admin_key) as root:
        _, key = root.keys.create("alice", "user")
        _, other = root.keys.create("bob", "user")
    with RLClient(s.target, api_key=key) as alice:
        own = _submit(alice)  # pending for good (no nodes), so a watch of it stays open
    md = metadata(key)
    with grpc.insecure_channel(s.target) as ch:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        req = S.WatchTaskRequest(task_id=own)
        first = stub.WatchTask(S.WatchTaskRequest(task_id=own), metadata=md)
        assert next(first).event.state_change.to_state == C.TASK_STATE_PENDING  # the stream is open
        with pytest.raises(grpc.RpcError) as err:
            next(stub.WatchTask(S.WatchTaskRequest(task_id=own), metadata=md))
        assert (
            err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            and "limits.max_streams_per_key" in err.value.details()
        )
        # Another key has its own slots (bob's watch of a task he cannot see is NOT_FOUND, not exhausted).
        with pytest.raises(grpc.RpcError) as err:
            next(stub.WatchTask(req, metadata=metadata(other)))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        first.cancel()
        deadline = time.monotonic() + 10
        while s.security.limits.open_streams(key[:12]) and time.monotonic() < deadline:
            time.sleep(0.05)
        again = stub.WatchTask(S.WatchTaskRequest(task_id=own), metadata=md)
        assert next(again).event.state_change.to_state == C.TASK_STATE_PENDING
        again.cancel()


def test_spec_fields_are_bounded_with_invalid_argument(make) -> None:
    s = make("")
    with RLClient(s.target) as c:
        for kw, field in (
            ({"name": "n" * 300}, "spec.name"),
            ({"hyperparameters": {"steps": 10**12}}, "spec.hyperparameters.steps"),
            ({"model": "m" * 2000}, "spec.model"),
        ):
            with pytest.raises(InvalidArgumentError) as err:
                c.submit_task(workload_type="lora_finetune", **{"model": "/models/m", **kw})
            assert err.value.field == field, err.value
        assert c.list_tasks() == []


def test_defaults_depend_on_auth_and_explicit_values_always_apply() -> None:
    off = LimitsConfig().resolved(auth_enabled=False)
    on = LimitsConfig().resolved(auth_enabled=True)
    assert (off.submit_rate, off.max_pending_per_owner, off.max_streams_per_key) == (0, 0, 0)
    assert on.submit_rate > 0 and on.max_pending_per_owner > 0 and on.max_streams_per_key > 0
    assert off.max_message_bytes == on.max_message_bytes == 64 * 1024 * 1024
    assert LimitsConfig(submit_rate=3).resolved(auth_enabled=False).submit_rate == 3


def test_limits_config_errors_name_the_key() -> None:
    for text, key in (
        ("limits: {submit_rate: -1}\n", "limits.submit_rate"),
        ("limits: {max_message_bytes: 10}\n", "limits.max_message_bytes"),
        ("limits: {max_pending_per_owner: many}\n", "limits.max_pending_per_owner"),
        ("limits: [1]\n", "limits"),
    ):
        with pytest.raises(ConfigError, match=rf"x\.yaml:1:\d+: {key}"):
            parse_config(text, "x.yaml")


def test_token_bucket_refills_at_its_rate() -> None:
    b = TokenBucket(rate=2.0, burst=3, now=0.0)
    assert [b.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.take(0.0) == pytest.approx(0.5)
    assert b.take(0.5) == 0.0  # one token came back after 0.5 s
    assert b.take(10.0) == 0.0 and b.tokens == pytest.approx(2.0)  # capped at burst


def test_limits_unit_streams_release_and_rate_with_a_fake_clock() -> None:
    now = [0.0]
    lim = Limits(
        LimitsConfig(
            submit_rate=1.0, submit_burst=1, max_streams_per_key=2, max_spec_bytes=10, max_pending_per_owner=1
        ),
        clock=lambda: now[0],
    )
    lim.check_submit_rate("k")
    with pytest.raises(ResourceExhausted, match="retry in 1.00 s"):
        lim.check_submit_rate("k")
    now[0] = 1.0
    lim.check_submit_rate("k")
    with lim.stream("k"), lim.stream("k"):
        with pytest.raises(ResourceExhausted):
            lim.acquire_stream("k")
        lim.acquire_stream("other")
    assert lim.open_streams("k") == 0
    with pytest.raises(ResourceExhausted):
        lim.check_spec_size(11)
    lim.check_pending("o", lambda: 0)
    with pytest.raises(ResourceExhausted):
        lim.check_pending("o", lambda: 1)
