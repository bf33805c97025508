"""A state store that fails under a server stream ends it with UNAVAILABLE ("state store
unavailable", ErrorInfo STORE_UNAVAILABLE), as it does a unary call: a client retries it. Before,
the error left the stream unmapped and the client got UNKNOWN."""

from __future__ import annotations

import json
import sqlite3

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from opentinker.common.v1 import common_pb2 as C
from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from opentinker_scheduler.errors import StoreUnavailable

from tests.support.security import LoopbackScheduler


@pytest.fixture
def sched(tmp_path):
    with LoopbackScheduler(tmp_path / "state") as s:
        yield s


def _reason(err: grpc.RpcError) -> str:
    for detail in rpc_status.from_call(err).details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info.reason
    return ""


def _failing(*_args, **_kw):
    raise sqlite3.OperationalError("disk I/O error")


def test_watch_task_ends_unavailable_when_the_store_fails(sched, monkeypatch) -> None:
    with sched.channel() as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        spec = C.TaskSpec(workload_type="lora_finetune", model="/models/m")
        task = stub.SubmitTask(scheduler_pb2.SubmitTaskRequest(spec=spec), timeout=30).task
        monkeypatch.setattr(sched.core.store, "events_after", _failing)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.WatchTask(scheduler_pb2.WatchTaskRequest(task_id=task.task_id), timeout=30))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
    assert info.value.details() == "state store unavailable: disk I/O error"
    assert _reason(info.value) == "STORE_UNAVAILABLE"


def test_upload_dataset_ends_unavailable_when_its_owner_row_cannot_be_written(sched, monkeypatch, tmp_path) -> None:
    def unavailable(*_args, **_kw):
        raise StoreUnavailable("state store unavailable: the connection of this transaction was lost")

    monkeypatch.setattr(sched.core.store, "add_dataset_owner", unavailable)
    line = json.dumps({"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]})
    data = (line + "\n").encode()
    request = scheduler_pb2.UploadDatasetRequest(name="tiny", total_bytes=len(data), chunk=data, format="chat")
    with sched.channel() as channel:
        with pytest.raises(grpc.RpcError) as info:
            scheduler_pb2_grpc.SchedulerServiceStub(channel).UploadDataset(iter([request]), timeout=30)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
    assert "connection of this transaction was lost" in info.value.details()
    assert _reason(info.value) == "STORE_UNAVAILABLE"
