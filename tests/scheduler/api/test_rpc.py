"""api/rpc.py: one mapping from domain errors to status codes, and one spelling of an audited
refusal (the status code's name) for every action, whichever check refused it."""

from __future__ import annotations

import sqlite3

import grpc
import pytest

from google.rpc import error_details_pb2
from grpc_status import rpc_status

from opentinker.scheduler.v1 import admin_pb2 as A, admin_pb2_grpc, scheduler_pb2 as S, scheduler_pb2_grpc
from opentinker_scheduler.api.rpc import outcome, refusal
from opentinker_scheduler.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)

from tests.support.scheduler_core import spec
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


def test_invalid_argument_names_its_field_from_the_message_prefix() -> None:
    assert InvalidArgument("spec.hyperparameters.learning_rate: expected a number").field == (
        "spec.hyperparameters.learning_rate"
    )
    assert InvalidArgument("spec.datasets[0].uri: expected a URI").field == "spec.datasets[0].uri"
    assert InvalidArgument("page_size: expected 1..1000, got 0").field == "page_size"
    assert InvalidArgument("dataset line 3: expected JSON").field is None
    assert InvalidArgument("name, total_bytes: expected only in the first message").field is None


def _bad_request(err: grpc.RpcError) -> list[tuple[str, str]]:
    """``(field, description)`` of the BadRequest detail in the trailers of ``err``."""
    status = rpc_status.from_call(err)
    assert status is not None, "no google.rpc.Status in the trailers"
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and status.message == err.details()
    (detail,) = status.details
    bad = error_details_pb2.BadRequest()
    assert detail.Unpack(bad)
    return [(v.field, v.description) for v in bad.field_violations]


def test_invalid_arguments_carry_their_field_as_a_bad_request_detail(tmp_path) -> None:
    with LoopbackScheduler(tmp_path / "state") as sched, sched.channel() as ch:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.SubmitTask(S.SubmitTaskRequest(spec=spec(learning_rate="fast")))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("spec.hyperparameters.learning_rate: expected")
        ((field, description),) = _bad_request(err.value)
        assert field == "spec.hyperparameters.learning_rate"
        assert description == err.value.details().removeprefix(f"{field}: ")

        with pytest.raises(grpc.RpcError) as err:
            stub.ListTasks(S.ListTasksRequest(page_size=5000))
        assert _bad_request(err.value) == [("page_size", "expected 1..1000, got 5000")]

        with pytest.raises(grpc.RpcError) as err:  # a streaming handler maps the same way
            next(iter(stub.WatchTask(S.WatchTaskRequest(task_id=""))))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [f for f, _ in _bad_request(err.value)] == ["task_id"]

        with pytest.raises(grpc.RpcError) as err:  # other refusals keep a plain status
            stub.GetTask(S.GetTaskRequest(task_id="task-nope"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and rpc_status.from_call(err.value) is None


def test_a_spec_with_several_bad_fields_is_refused_once_with_a_violation_for_each(tmp_path) -> None:
    bad = spec(learning_rate="fast", steps=0, stesp=3)
    bad.resources.gpu_count = 5000
    with LoopbackScheduler(tmp_path / "state") as sched, sched.channel() as ch:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.SubmitTask(S.SubmitTaskRequest(spec=bad))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        violations = dict(_bad_request(err.value))
        assert set(violations) == {
            "spec.resources.gpu_count",
            "spec.hyperparameters.stesp",
            "spec.hyperparameters.learning_rate",
            "spec.hyperparameters.steps",
        }
        assert violations["spec.hyperparameters.steps"].startswith("expected an integer in [1, ")
        assert "did you mean 'steps'?" in violations["spec.hyperparameters.stesp"]
        # the message is the first refusal's, then the others' fields
        first = err.value.details().split(" (and ")[0]
        field, _, description = first.partition(": ")
        assert violations[field] == description
        assert err.value.details().endswith("(and 3 more: " + ", ".join(f for f in violations if f != field) + ")")
        # the client's error carries them all, and the CLI prints a line for each
        from opentinker_client.errors import from_rpc_error

        assert dict(from_rpc_error(err.value).violations) == violations
        # nothing was kept of it
        assert list(stub.ListTasks(S.ListTasksRequest()).tasks) == []
