"""Endpoint tokens on a real scheduler with auth on: who may get one, what it opens (the trainer
endpoint of its own task, through AuthorizeEndpoint) and what it never opens (every other RPC)."""

from __future__ import annotations

import base64
import json
import time

import grpc
import pytest

from opentinker.common.v1 import common_pb2
from opentinker.scheduler.v1 import admin_pb2 as A
from opentinker.scheduler.v1 import admin_pb2_grpc
from opentinker.scheduler.v1 import scheduler_pb2 as S
from opentinker.scheduler.v1 import scheduler_pb2_grpc
from opentinker_client import (
    EndpointTokens,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    RLClient,
)
from opentinker_client.connection import SchedulerConnection

from tests.support.security import AUTH_LOCAL_MODELS, LoopbackScheduler, metadata


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    with LoopbackScheduler(tmp_path_factory.mktemp("endpoint-tokens") / "state", AUTH_LOCAL_MODELS) as sched:
        with RLClient(sched.target, api_key=sched.admin_key) as root:
            _, alice = root.keys.create("alice", "user")
            _, bob = root.keys.create("bob", "user")
            _, node = root.keys.create("rack-1", "node")
        with RLClient(sched.target, api_key=alice) as c:
            serving = c.submit_task(workload_type="inference", model="/models/m")
            trained = c.submit_task(workload_type="lora_finetune", model="/models/m")
        yield {"sched": sched, "alice": alice, "bob": bob, "node": node, "serving": serving, "trained": trained}


def _authorize(sched, credential: str, endpoint: str, task: str = "") -> grpc.StatusCode:
    with grpc.insecure_channel(sched.target) as ch:
        try:
            scheduler_pb2_grpc.SchedulerServiceStub(ch).AuthorizeEndpoint(
                S.AuthorizeEndpointRequest(endpoint_task_id=endpoint, task_id=task),
                metadata=metadata(credential),
                timeout=30,
            )
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def test_an_endpoint_token_is_refused_by_every_other_rpc(world) -> None:
    sched, serving = world["sched"], world["serving"]
    with RLClient(sched.target, api_key=world["alice"]) as alice:
        token = alice.endpoint_token(serving).token
    assert token.startswith("ote_") and _authorize(sched, token, serving) == grpc.StatusCode.OK
    spec = common_pb2.TaskSpec(workload_type="inference", model="/models/m")
    with grpc.insecure_channel(sched.target) as ch:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        admin = admin_pb2_grpc.AdminServiceStub(ch)
        for call in (
            lambda md: stub.GetTask(S.GetTaskRequest(task_id=serving), metadata=md, timeout=30),
            lambda md: stub.ListTasks(S.ListTasksRequest(), metadata=md, timeout=30),
            lambda md: stub.SubmitTask(S.SubmitTaskRequest(spec=spec), metadata=md, timeout=30),
            lambda md: stub.CancelTask(S.CancelTaskRequest(task_id=serving), metadata=md, timeout=30),
            lambda md: stub.IssueEndpointToken(S.IssueEndpointTokenRequest(task_id=serving), metadata=md, timeout=30),
            lambda md: list(stub.WatchTask(S.WatchTaskRequest(task_id=serving), metadata=md, timeout=30)),
            lambda md: admin.ListApiKeys(A.ListApiKeysRequest(), metadata=md, timeout=30),
        ):
            with pytest.raises(grpc.RpcError) as err:
                call(metadata(token))
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
            assert f"opens the endpoints of task {serving} on trainer nodes only" in err.value.details()
            assert token not in err.value.details()
    # And an API key may not ask AuthorizeEndpoint: only the tokens that endpoints received.
    assert _authorize(sched, world["alice"], serving) == grpc.StatusCode.PERMISSION_DENIED
    assert _authorize(sched, sched.admin_key, serving) == grpc.StatusCode.PERMISSION_DENIED


def test_a_token_opens_its_own_task_and_the_owners_adapters_only(world) -> None:
    sched, serving = world["sched"], world["serving"]
    with RLClient(sched.target, api_key=world["alice"]) as alice:
        token = alice.endpoint_token(serving).token
        other = alice.submit_task(workload_type="inference", model="/models/m")
    with RLClient(sched.target, api_key=world["bob"]) as bob:
        bobs_trained = bob.submit_task(workload_type="lora_finetune", model="/models/m")
    assert _authorize(sched, token, serving, world["trained"]) == grpc.StatusCode.OK  # her adapter, here
    assert _authorize(sched, token, other) == grpc.StatusCode.PERMISSION_DENIED  # her other endpoint
    assert _authorize(sched, token, serving, bobs_trained) == grpc.StatusCode.NOT_FOUND  # not hers
    # The payload names the task; changing it breaks the signature.
    payload, signature = token[4:].split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    forged = base64.urlsafe_b64encode(json.dumps({**claims, "t": other}).encode()).rstrip(b"=").decode()
    assert _authorize(sched, f"ote_{forged}.{signature}", other) == grpc.StatusCode.UNAUTHENTICATED


def test_who_may_get_a_token_and_for_how_long(world) -> None:
    sched, serving = world["sched"], world["serving"]
    with RLClient(sched.target, api_key=world["alice"]) as alice:
        t = alice.endpoint_token(serving, ttl=0)  # 0: the default, one hour
        assert 3590 < t.expire_time - time.time() <= 3601
        with pytest.raises(InvalidArgumentError, match=r"ttl: expected 1 s to 86400 s \(24 h\), got 90000 s") as err:
            alice.endpoint_token(serving, ttl=90000)
        assert err.value.field == "ttl"
        with pytest.raises(FailedPreconditionError, match="lora_finetune task, which serves no endpoint"):
            alice.endpoint_token(world["trained"])
    with RLClient(sched.target, api_key=world["bob"]) as bob:
        with pytest.raises(NotFoundError):  # another owner's task is never confirmed to exist
            bob.endpoint_token(serving)
    with RLClient(sched.target, api_key=world["node"]) as node:
        with pytest.raises(PermissionDeniedError):
            node.endpoint_token(serving)
    with RLClient(sched.target, api_key=sched.admin_key) as root:  # an admin's token opens any task
        assert _authorize(sched, root.endpoint_token(serving).token, serving) == grpc.StatusCode.OK


def test_revoking_or_rotating_the_key_ends_its_tokens_at_once(world) -> None:
    sched, serving = world["sched"], world["serving"]
    with RLClient(sched.target, api_key=sched.admin_key) as root:
        one, first = root.keys.create("alice", "user", description="revoked below")
        two, second = root.keys.create("alice", "user", description="rotated below")
        tokens = []
        for key in (first, second):
            with RLClient(sched.target, api_key=key) as c:
                tokens.append(c.endpoint_token(serving).token)
        assert [_authorize(sched, t, serving) for t in tokens] == [grpc.StatusCode.OK] * 2
        root.keys.revoke(one.prefix)
        root.keys.rotate(two.prefix)
    assert [_authorize(sched, t, serving) for t in tokens] == [grpc.StatusCode.UNAUTHENTICATED] * 2


def test_an_expired_token_is_refused(world) -> None:
    sched, serving = world["sched"], world["serving"]
    with RLClient(sched.target, api_key=world["alice"]) as alice:
        t = alice.endpoint_token(serving, ttl=1)
    while time.time() < t.expire_time:  # the token's own expiry, from the scheduler's answer
        time.sleep(0.05)
    with grpc.insecure_channel(sched.target) as ch:
        with pytest.raises(grpc.RpcError) as err:
            scheduler_pb2_grpc.SchedulerServiceStub(ch).AuthorizeEndpoint(
                S.AuthorizeEndpointRequest(endpoint_task_id=serving), metadata=metadata(t.token), timeout=30
            )
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert f"endpoint token for task {serving} expired" in err.value.details()


def test_the_client_renews_its_token_before_it_expires(world) -> None:
    sched, serving = world["sched"], world["serving"]
    now = [time.time()]
    with SchedulerConnection(sched.target, timeout=30, api_key=world["alice"]) as connection:
        tokens = EndpointTokens(connection, serving, ttl=600, clock=lambda: now[0])
        first = tokens.metadata()
        held = tokens._current
        assert first[0][1].startswith("Bearer ote_") and tokens.metadata() == first and tokens._current is held
        now[0] = held.expire_time - 600 * 0.25 + 1  # less than a quarter of its lifetime left: a new one
        renewed = tokens.metadata()
        assert tokens._current is not held
        assert _authorize(sched, renewed[0][1].removeprefix("Bearer "), serving) == grpc.StatusCode.OK
    with SchedulerConnection(sched.target, timeout=30, api_key="") as anonymous:
        assert EndpointTokens(anonymous, serving).metadata() == ()  # no key: nothing asked, nothing sent
