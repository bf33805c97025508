import datetime as dt

import pytest
from google.protobuf import struct_pb2, timestamp_pb2

from opentinker.common.v1 import common_pb2
from opentinker.scheduler.v1 import scheduler_pb2
from opentinker_client._convert import (
    dict_to_struct,
    duration_to_seconds,
    event_from_proto,
    node_from_proto,
    seconds_to_duration,
    state_enum,
    state_name,
    struct_to_dict,
    task_from_proto,
    timestamp_to_datetime,
)
from opentinker_client.types import TaskEvent, TaskInfo

T0 = timestamp_pb2.Timestamp(seconds=1_700_000_000, nanos=500_000_000)


def test_struct_round_trip():
    data = {"a": 1, "b": 2.5, "c": "x", "d": True, "e": None, "f": [1, "two", [3]], "g": {"h": {"i": -4}}, "t": (1, 2)}
    struct = dict_to_struct(data)
    back = struct_to_dict(struct)
    assert back == {**data, "t": [1, 2]}
    assert isinstance(back["a"], int) and isinstance(back["b"], float)
    assert struct_to_dict(struct, integral_as_int=False)["a"] == 1.0
    assert isinstance(struct_to_dict(struct, integral_as_int=False)["a"], float)
    assert dict_to_struct(None) == struct_pb2.Struct()
    assert struct_to_dict(None) == {}


@pytest.mark.parametrize("bad", [{"x": object()}, {1: "a"}, {"x": 2**60}, {"x": {"y": [1, {2}]}}])
def test_struct_refuses(bad):
    with pytest.raises(ValueError):
        dict_to_struct(bad)


def test_struct_error_names_path():
    with pytest.raises(ValueError, match=r"^x\.y\[1\]: "):
        dict_to_struct({"x": {"y": [1, {2}]}})


def test_states():
    assert state_name(common_pb2.TASK_STATE_RUNNING) == "running"
    assert state_name(0) == "unspecified"
    assert state_name(99) == "state_99"
    assert state_enum("running") == common_pb2.TASK_STATE_RUNNING
    assert state_enum("CANCELLED") == common_pb2.TASK_STATE_CANCELLED
    assert state_enum("TASK_STATE_FAILED") == common_pb2.TASK_STATE_FAILED
    assert state_enum(3) == 3
    with pytest.raises(ValueError, match="expected one of pending, assigned"):
        state_enum("runing")
    with pytest.raises(ValueError):
        state_enum("unspecified")


def test_times():
    assert timestamp_to_datetime(T0) == dt.datetime(2023, 11, 14, 22, 13, 20, 500000, tzinfo=dt.timezone.utc)
    assert timestamp_to_datetime(timestamp_pb2.Timestamp()) is None
    assert duration_to_seconds(seconds_to_duration(600)) == 600
    assert duration_to_seconds(seconds_to_duration(1.25)) == 1.25
    assert duration_to_seconds(seconds_to_duration(dt.timedelta(minutes=2))) == 120


def test_task_from_proto():
    proto = common_pb2.Task(
        task_id="t1",
        owner="alice",
        spec=common_pb2.TaskSpec(
            workload_type="lora_finetune",
            model="m",
            name="demo",
            env_config=dict_to_struct({"env_id": "arithmetic"}),
            hyperparameters=dict_to_struct({"steps": 15}),
            resources=common_pb2.Resources(gpu_count=2),
            limits=common_pb2.Limits(max_runtime=seconds_to_duration(60), max_attempts=4),
        ),
        state=common_pb2.TASK_STATE_RUNNING,
        attempt=2,
        priority=7,
        create_time=T0,
        start_time=T0,
        node_id="gpu-node-01",
        device_indices=[0, 1],
        latest_metrics={"loss": 0.5, "reward": 0.25},
        latest_step=3,
        latest_checkpoint=common_pb2.Checkpoint(path="/ckpt/3", step=3),
    )
    info = task_from_proto(proto)
    assert isinstance(info, TaskInfo)
    assert (info.task_id, info.state, info.attempt, info.priority) == ("t1", "running", 2, 7)
    assert (info.name, info.workload_type, info.model, info.owner, info.gpu_count) == (
        "demo",
        "lora_finetune",
        "m",
        "alice",
        2,
    )
    assert info.node_id == "gpu-node-01" and info.device_indices == (0, 1)
    assert info.latest_metrics == {"loss": 0.5, "reward": 0.25} and info.latest_step == 3
    assert (info.checkpoint_path, info.checkpoint_step) == ("/ckpt/3", 3)
    assert info.create_time == timestamp_to_datetime(T0) and info.end_time is None and info.update_time is None
    assert info.env_config == {"env_id": "arithmetic"} and info.hyperparameters == {"steps": 15}
    assert info.max_runtime == 60 and info.max_attempts == 4
    assert info.proto is proto and not info.done
    with pytest.raises(AttributeError):
        info.state = "failed"  # type: ignore[misc]

    empty = task_from_proto(common_pb2.Task(task_id="t2", state=common_pb2.TASK_STATE_SUCCEEDED))
    assert empty.done and empty.succeeded and empty.checkpoint_path == "" and empty.max_runtime is None


def test_events():
    ev = event_from_proto(
        common_pb2.TaskEvent(
            task_id="t",
            sequence=4,
            time=T0,
            state_change=common_pb2.StateChange(
                from_state=common_pb2.TASK_STATE_RUNNING,
                to_state=common_pb2.TASK_STATE_PENDING,
                attempt=2,
                reason="NODE_LOST",
                message="gpu-node-01 silent for 30 s",
                node_id="gpu-node-01",
            ),
        )
    )
    assert isinstance(ev, TaskEvent)
    assert (ev.kind, ev.sequence, ev.from_state, ev.to_state, ev.attempt, ev.reason) == (
        "state",
        4,
        "running",
        "pending",
        2,
        "NODE_LOST",
    )
    assert ev.time == timestamp_to_datetime(T0) and not ev.is_terminal

    ev = event_from_proto(
        common_pb2.TaskEvent(
            task_id="t", sequence=5, metric=common_pb2.MetricPoint(step=2, values={"loss": 1.0, "reward": 0.5})
        )
    )
    assert (ev.kind, ev.step, dict(ev.metrics), ev.time) == ("metric", 2, {"loss": 1.0, "reward": 0.5}, None)

    ev = event_from_proto(
        common_pb2.TaskEvent(
            task_id="t",
            sequence=6,
            checkpoint=common_pb2.Checkpoint(
                step=15, path="/c", format="peft_lora", final=True, attempt=1, node_id="n"
            ),
        )
    )
    assert (ev.kind, ev.step, ev.checkpoint_path, ev.checkpoint_format, ev.final) == (
        "checkpoint",
        15,
        "/c",
        "peft_lora",
        True,
    )

    ev = event_from_proto(
        common_pb2.TaskEvent(
            task_id="t",
            sequence=7,
            state_change=common_pb2.StateChange(to_state=common_pb2.TASK_STATE_SUCCEEDED),
        )
    )
    assert ev.is_terminal
    assert event_from_proto(common_pb2.TaskEvent(task_id="t", sequence=8)).kind == "unknown"
    gone = common_pb2.ArtifactsDeleted(deleted_keys=3, deleted_bytes=4096, deleted_by="alice")
    ev = event_from_proto(common_pb2.TaskEvent(task_id="t", sequence=9, artifacts_deleted=gone))
    assert (ev.kind, ev.message) == ("artifacts_deleted", "3 artifact(s), 4096 bytes deleted from the store by alice")
    retired = common_pb2.ArtifactsDeleted(deleted_keys=1, by_retention=True, keys=["tasks/t/a1/step_2"])
    ev = event_from_proto(common_pb2.TaskEvent(task_id="t", sequence=10, artifacts_deleted=retired))
    assert ev.message == "1 older checkpoint(s) deleted by retention: tasks/t/a1/step_2"


def test_node_from_proto():
    node = node_from_proto(
        scheduler_pb2.Node(
            node_id="n1",
            connected=True,
            gpu_count=2,
            gpus_free=1,
            max_tasks=8,
            running_task_ids=["t1"],
            devices=[common_pb2.Device(index=0, name="H200", memory_total_bytes=2**37, simulated=False)],
            telemetry=[
                common_pb2.DeviceTelemetry(
                    index=0, utilization_percent=55.0, memory_used_bytes=2**30, unavailable={"power_w": "NotSupported"}
                )
            ],
            last_heartbeat_time=T0,
            notes=["simulated"],
        )
    )
    assert node.node_id == "n1" and node.connected and node.running_task_ids == ("t1",)
    t = node.telemetry[0]
    assert t.utilization_percent == 55.0 and t.memory_used_bytes == 2**30
    assert t.power_w is None and t.temperature_c is None and t.unavailable == {"power_w": "NotSupported"}
    assert node.devices[0].name == "H200" and node.notes == ("simulated",)
