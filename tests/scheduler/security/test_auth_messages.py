"""How refusals read: a malformed ``authorization`` header is "malformed", not
"missing", on the scheduler, on an inference server's access checker and on a client-hosted
EnvironmentServer, never echoing the value; a user key naming another owner in ListApiKeys is
PERMISSION_DENIED. Real servers on loopback."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from opentinker.environment.v1 import environment_pb2 as pb
from opentinker.environment.v1 import environment_pb2_grpc as pb_grpc
from opentinker.scheduler.v1 import admin_pb2 as A, admin_pb2_grpc, scheduler_pb2 as S, scheduler_pb2_grpc
from opentinker_client import PermissionDeniedError, RLClient
from opentinker_client.hosting.server import EnvironmentServer

from tests.support.environments import Corridor
from tests.support.security import LoopbackScheduler, metadata

AUTH = "auth: {enabled: true}\n"
SECRET = "otk_0123abcd_" + "s" * 43


@pytest.fixture(scope="module")
def sched(tmp_path_factory):
    with LoopbackScheduler(tmp_path_factory.mktemp("auth-messages") / "state", AUTH) as s:
        yield s


@pytest.fixture(scope="module")
def keys(sched):
    admin = sched.admin_key
    with RLClient(sched.target, api_key=admin) as root:
        _, alice = root.keys.create("alice", "user")
        bob_info, bob = root.keys.create("bob", "user")
        _, bob2 = root.keys.create("bob", "user", description="second")
    return {"admin": admin, "alice": alice, "bob": bob, "bob_prefix": bob_info.prefix}


# value -> what the refusal says it got (None: "missing API key")
CASES = {
    None: None,
    SECRET: "got a bare key without the 'Bearer ' scheme",
    "Basic dXNlcjpwYXNzd29yZA==": "got a 'Basic' value",
    "Bearer": "got a 'Bearer' value without a key",
    "Token " + SECRET: "got a 'Token' value",
    "hunter2hunter2 " + SECRET: "got a value without a known scheme",
}


def _md(value):
    return (("authorization", value),) if value is not None else ()


def _check(details: str, value, want) -> None:
    if want is None:
        assert details.startswith("missing API key: send metadata 'authorization: Bearer otk_...'"), details
        return
    assert details == f"malformed authorization metadata: expected 'Bearer otk_...', {want}", details
    assert "missing" not in details
    assert (
        "s" * 20 not in details and "hunter2" not in details and "dXNlcjpw" not in details
    )  # the value is never echoed


def test_the_scheduler_tells_a_malformed_header_from_a_missing_key(sched, monkeypatch) -> None:
    audit = sched.security.audit
    reasons: list[str] = []
    original = audit.refused

    def refused(**kw):  # the real audit call, observed (stdout capture depends on how logging was set up)
        reasons.append(kw["reason"])
        original(**kw)

    monkeypatch.setattr(audit, "refused", refused)
    with grpc.insecure_channel(sched.target) as ch:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        admin_stub = admin_pb2_grpc.AdminServiceStub(ch)
        for value, want in CASES.items():
            for call in (
                lambda: stub.ListTasks(S.ListTasksRequest(), metadata=_md(value), timeout=10),
                lambda: admin_stub.ListApiKeys(A.ListApiKeysRequest(), metadata=_md(value), timeout=10),
            ):
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                _check(err.value.details(), value, want)
    # The audit record of each refusal gives the same reason, and no secret.
    logged = "\n".join(reasons)
    assert len(reasons) == 2 * len(CASES)
    assert "got a 'Basic' value" in logged and "s" * 20 not in logged and "dXNlcjpw" not in logged


def test_the_inference_access_checker_words_it_as_the_scheduler_does(sched, keys) -> None:
    from opentinker_trainer.inference.access import AccessChecker, AccessRefused

    with RLClient(sched.target, api_key=keys["alice"]) as alice:
        serving = alice.submit_task(
            workload_type="inference", model="org/model"
        )  # a hub id: local paths need paths.model_dirs
        token = alice.endpoint_token(serving).token

    async def main() -> None:
        checker = AccessChecker(sched.target, env={}, ttl=60)
        try:
            await checker.check(_md(f"Bearer {token}"), serving)
            for value, want in CASES.items():
                with pytest.raises(AccessRefused) as err:
                    await checker.check(_md(value), serving)
                assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
                message = err.value.message
                if value is None:
                    assert message.startswith("missing endpoint token: send 'authorization: Bearer ote_...'")
                elif SECRET in value:  # an API key in any form: refused on the node, never sent on
                    assert "takes an endpoint token (Bearer ote_...), not an API key" in message
                    assert "s" * 20 not in message
                else:
                    _check(message, value, want)
        finally:
            await checker.close()

    asyncio.run(main())


def test_the_environment_server_words_it_the_same_way() -> None:
    with EnvironmentServer(Corridor()) as server:  # every call is refused before the environment
        stub = pb_grpc.EnvironmentServiceStub(grpc.insecure_channel(server.endpoint))
        for value, want in (
            (None, None),
            (server.token, "got a value without a known scheme"),  # a bare token: never echoed
            ("Basic dXNlcjpwYXNzd29yZA==", "got a 'Basic' value"),
            ("Bearer", "got a 'Bearer' value without a key"),
        ):
            with pytest.raises(grpc.RpcError) as err:
                stub.Describe(pb.DescribeRequest(), metadata=_md(value), timeout=10)
            details = err.value.details()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and server.token not in details
            if want is None:
                assert details.startswith("missing access token")
            else:
                assert details.startswith(
                    f"malformed authorization metadata: expected 'Bearer <token>', {want} "
                    "(the access token is env_config.token"
                )
        assert (
            stub.Describe(
                pb.DescribeRequest(), metadata=_md(f"Bearer {server.token}"), timeout=10
            ).action_space.discrete.n
            == 2
        )


# ------------------------------------------------------------------------ ListApiKeys owner


def test_a_user_key_naming_another_owner_is_permission_denied(sched, keys) -> None:
    with RLClient(sched.target, api_key=keys["bob"]) as bob:
        own = bob.keys.list()
        assert {k.owner for k in own} == {"bob"} and len(own) == 2
        assert [k.prefix for k in bob.keys.list(owner="bob")] == [k.prefix for k in own]  # naming itself is fine
        with pytest.raises(PermissionDeniedError) as err:
            bob.keys.list(owner="alice")
        assert (
            "user keys list their own owner's keys only" in err.value.details
            and keys["bob_prefix"] in err.value.details
        )
    with RLClient(sched.target, api_key=keys["admin"]) as root:  # an admin names any owner
        assert {k.owner for k in root.keys.list(owner="alice")} == {"alice"}
        assert {k.owner for k in root.keys.list()} >= {"admin", "alice", "bob"}
    with grpc.insecure_channel(sched.target) as ch:  # the raw status code
        with pytest.raises(grpc.RpcError) as err:
            admin_pb2_grpc.AdminServiceStub(ch).ListApiKeys(
                A.ListApiKeysRequest(owner="alice"), metadata=metadata(keys["bob"]), timeout=10
            )
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
