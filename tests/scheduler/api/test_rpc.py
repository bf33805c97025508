"""api/rpc.py: one mapping from domain errors to status codes, and one spelling of an audited
refusal (the status code's name) for every action, whichever check refused it."""

from __future__ import annotations

import sqlite3

import grpc
import pytest

from opentinker.scheduler.v1 import admin_pb2 as A, admin_pb2_grpc
from opentinker_scheduler.api.rpc import outcome, refusal
from opentinker_scheduler.errors import AlreadyExists, FailedPrecondition, NotFound, PermissionDenied, ResourceExhausted

from tests.support.security import LoopbackScheduler, metadata


def test_refusals_map_through_the_status_table_and_others_are_not_refusals() -> None:
    assert refusal(PermissionDenied("no")) == (grpc.StatusCode.PERMISSION_DENIED, "no")
    assert refusal(NotFound("gone")) == (grpc.StatusCode.NOT_FOUND, "gone")
    assert refusal(sqlite3.OperationalError("disk I/O error")) == (
        grpc.StatusCode.UNAVAILABLE,
        "state store unavailable: disk I/O error",
    )
    assert refusal(ValueError("a bug")) is None
    assert [
        outcome(e)
        for e in (None, PermissionDenied(""), ResourceExhausted(""), FailedPrecondition(""), AlreadyExists(""))
    ] == ["OK", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ALREADY_EXISTS"]
    assert outcome(ValueError("a bug")) == "INTERNAL"


@pytest.fixture
def sched(tmp_path):
    with LoopbackScheduler(tmp_path / "state", "auth: {enabled: true}\n") as s:
        yield s


def test_refused_key_actions_are_audited_with_the_status_code_name(sched) -> None:
    admin = sched.admin_key
    with sched.channel() as ch:
        stub = admin_pb2_grpc.AdminServiceStub(ch)
        root = metadata(admin)
        alice_key = stub.CreateApiKey(A.CreateApiKeyRequest(owner="alice", role=A.API_KEY_ROLE_USER), metadata=root)
        alice_node = stub.CreateApiKey(A.CreateApiKeyRequest(owner="alice", role=A.API_KEY_ROLE_NODE), metadata=root)
        alice = metadata(alice_key.api_key)
        for call, request in (
            (stub.RevokeApiKey, A.RevokeApiKeyRequest(prefix=alice_node.key.prefix)),
            (stub.RotateApiKey, A.RotateApiKeyRequest(prefix=alice_node.key.prefix)),
            (stub.CreateApiKey, A.CreateApiKeyRequest(owner="alice", role=A.API_KEY_ROLE_USER)),
        ):
            with pytest.raises(grpc.RpcError) as err:
                call(request, metadata=alice)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        events = stub.ListAuditEvents(A.ListAuditEventsRequest(), metadata=root).events
    refused = {e.action: e for e in events if e.outcome != "OK"}
    assert {a: e.outcome for a, e in refused.items()} == {
        "key.revoke": "PERMISSION_DENIED",
        "key.rotate": "PERMISSION_DENIED",
        "key.create": "PERMISSION_DENIED",
    }
    assert all(e.owner == "alice" and e.key_prefix == alice_key.key.prefix for e in refused.values())
    assert alice_node.key.prefix in refused["key.revoke"].detail_json
    assert "may not revoke" in refused["key.revoke"].detail_json
