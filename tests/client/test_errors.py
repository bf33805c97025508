import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

import opentinker_client as ot
from opentinker_client.types import TaskInfo
from opentinker_client.errors import from_rpc_error, from_spec_error
from opentinker_common.spec import SpecError


class FakeRpcError(grpc.RpcError, grpc.Call):
    """Stands in for the error object grpc raises."""

    def __init__(self, code, details, trailers=()):
        self._code, self._details, self._trailers = code, details, tuple(trailers)

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailers

    def initial_metadata(self):
        return ()

    def is_active(self):
        return False

    def time_remaining(self):
        return None

    def cancel(self):
        return False

    def add_callback(self, callback):
        return False


@pytest.mark.parametrize(
    "code, cls",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, ot.InvalidArgumentError),
        (grpc.StatusCode.NOT_FOUND, ot.NotFoundError),
        (grpc.StatusCode.FAILED_PRECONDITION, ot.FailedPreconditionError),
        (grpc.StatusCode.ALREADY_EXISTS, ot.AlreadyExistsError),
        (grpc.StatusCode.UNAUTHENTICATED, ot.UnauthenticatedError),
        (grpc.StatusCode.PERMISSION_DENIED, ot.PermissionDeniedError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ot.ResourceExhaustedError),
        (grpc.StatusCode.UNAVAILABLE, ot.UnavailableError),
        (grpc.StatusCode.DEADLINE_EXCEEDED, ot.DeadlineExceededError),
        (grpc.StatusCode.INTERNAL, ot.OpenTinkerError),
        (grpc.StatusCode.UNIMPLEMENTED, ot.OpenTinkerError),
    ],
)
def test_mapping(code, cls):
    err = from_rpc_error(FakeRpcError(code, "something"))
    assert type(err) is cls
    assert err.code is code
    assert err.details == "something"
    assert str(err) == f"{code.name}: something"
    assert isinstance(err, ot.OpenTinkerError)


def test_field_from_message():
    err = from_rpc_error(FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "spec.hyperparameters.lr: expected one of ..."))
    assert err.field == "spec.hyperparameters.lr"
    err = from_rpc_error(FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "page_token is bad"))
    assert err.field is None


def test_field_from_rich_status():
    bad = error_details_pb2.BadRequest(
        field_violations=[error_details_pb2.BadRequest.FieldViolation(field="spec.model", description="x")]
    )
    detail = any_pb2.Any()
    detail.Pack(bad)
    status = status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message="model is bad", details=[detail])
    trailers = (("grpc-status-details-bin", status.SerializeToString()),)
    err = from_rpc_error(FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "model is bad", trailers))
    assert err.field == "spec.model"
    assert err.status is not None and err.status.message == "model is bad"


def test_missing_details_and_code():
    err = from_rpc_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE, ""))
    assert isinstance(err, ot.UnavailableError) and err.details == "unavailable"
    err = from_rpc_error(grpc.RpcError("plain"))
    assert err.code is grpc.StatusCode.UNKNOWN and "plain" in err.details


def test_deadline_is_a_timeout_error():
    assert issubclass(ot.DeadlineExceededError, TimeoutError)


def test_spec_error_mapping():
    err = from_spec_error(SpecError("spec.hyperparameters.steps", "an integer in [1, 100000]", 0))
    assert isinstance(err, ot.InvalidArgumentError)
    assert err.code is grpc.StatusCode.INVALID_ARGUMENT
    assert err.field == "spec.hyperparameters.steps"
    assert str(err) == "INVALID_ARGUMENT: spec.hyperparameters.steps: expected an integer in [1, 100000], got 0"
    err = from_spec_error(SpecError("spec.hyperparameters.lr", "one of the known keys (a, b)"))
    assert str(err) == "INVALID_ARGUMENT: spec.hyperparameters.lr: unknown key, expected one of the known keys (a, b)"


def test_task_failed_error():
    task = TaskInfo(task_id="t1", state="failed", error="CUDA out of memory")
    err = ot.TaskFailedError(task)
    assert err.task is task and err.code is None
    assert str(err) == "task t1 FAILED: CUDA out of memory"


def test_config_error():
    err = ot.ConfigError("unknown key", source="t.yaml", line=3, key="foo")
    assert isinstance(err, ot.InvalidArgumentError)
    assert (err.source, err.line, err.key, err.field) == ("t.yaml", 3, "foo", "foo")
    assert str(err) == "INVALID_ARGUMENT: t.yaml:3: foo: unknown key"
    err = ot.ConfigError("unknown key", source="t.yaml", line=3, column=5, key="foo")
    assert (err.line, err.column) == (3, 5)
    assert str(err) == "INVALID_ARGUMENT: t.yaml:3:5: foo: unknown key"


def test_a_local_spec_refusal_with_several_problems_lists_each_as_a_violation():
    from opentinker_common.spec import TaskSpecModel

    with pytest.raises(SpecError) as spec_err:
        TaskSpecModel.from_parts(
            workload_type="lora_finetune", model="/m", env_config={}, hyperparameters={"steps": 0, "seed": "x"}
        )
    err = from_spec_error(spec_err.value)
    assert [f for f, _ in err.violations] == ["spec.hyperparameters.steps", "spec.hyperparameters.seed"]
    assert err.field == "spec.hyperparameters.steps"
    assert err.violations[1][1].startswith("expected an integer")
    assert from_spec_error(SpecError("spec.x", "y")).violations == (("spec.x", "expected y"),)
