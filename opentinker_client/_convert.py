"""Protobuf <-> Python conversion behind the client: ``Struct``, times, task states, and the
value types of :mod:`opentinker_client.types` from their messages.

Private to the client (the scheduler and trainers have their own). Times come back as
timezone-aware :class:`datetime.datetime` in UTC (``None`` when unset, the zero timestamp
included); lengths of time are float seconds.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
from typing import Any, Iterable, Mapping

from google.protobuf import duration_pb2, struct_pb2, timestamp_pb2

from opentinker.common.v1 import common_pb2
from opentinker.inference.v1 import inference_pb2
from opentinker.scheduler.v1 import scheduler_pb2
from opentinker_client.types import (
    AdapterInfo,
    CheckpointInfo,
    DatasetInfo,
    DeviceInfo,
    DeviceTelemetry,
    GpuMemoryEstimate,
    HostTelemetry,
    Generation,
    ModelHostInfo,
    NodeInfo,
    Sample,
    StreamChunk,
    TaskEvent,
    TaskInfo,
)

__all__ = [
    "dict_to_struct",
    "struct_to_dict",
    "value_to_python",
    "state_name",
    "state_enum",
    "timestamp_to_datetime",
    "seconds_to_duration",
    "duration_to_seconds",
    "task_from_proto",
    "event_from_proto",
    "node_from_proto",
    "metric_points",
    "dataset_from_proto",
    "checkpoint_from_proto",
    "generation_from_proto",
    "stream_chunk_from_proto",
    "adapter_from_proto",
]

_STATE_PREFIX = "TASK_STATE_"

# Integers up to 2**53 survive a trip through a double exactly.
_MAX_EXACT_INT = 2**53


# ---------------------------------------------------------------------------------------------
# States.


def state_name(state: int) -> str:
    """``common_pb2.TASK_STATE_RUNNING`` -> ``"running"``; 0 -> ``"unspecified"``;
    a value this client does not know (a newer scheduler) -> ``"state_<n>"``."""
    try:
        name = common_pb2.TaskState.Name(state)
    except ValueError:
        return f"state_{int(state)}"
    return name[len(_STATE_PREFIX) :].lower() if name.startswith(_STATE_PREFIX) else name.lower()


def state_enum(state: str | int) -> int:
    """``"running"`` / ``"RUNNING"`` / ``"TASK_STATE_RUNNING"`` / an enum value -> the enum value.

    Raises:
        ValueError: not a known state; the message lists the known ones.
    """
    if isinstance(state, int) and not isinstance(state, bool):
        return state
    if isinstance(state, str):
        name = state.strip().upper()
        if not name.startswith(_STATE_PREFIX):
            name = _STATE_PREFIX + name
        try:
            value = common_pb2.TaskState.Value(name)
        except ValueError:
            value = 0
        if value != 0:
            return value
    known = ", ".join(state_name(v) for v in common_pb2.TaskState.values() if v != 0)
    raise ValueError(f"unknown task state {state!r}; expected one of {known}")


# ---------------------------------------------------------------------------------------------
# Struct <-> dict.


def _set_value(target: struct_pb2.Value, value: Any, path: str) -> None:
    if value is None:
        target.null_value = struct_pb2.NULL_VALUE
    elif isinstance(value, bool):
        target.bool_value = value
    elif isinstance(value, (int, float)):
        if isinstance(value, int) and abs(value) > _MAX_EXACT_INT:
            raise ValueError(f"{path}: integer {value} is too large to send exactly (limit 2**53)")
        target.number_value = float(value)
    elif isinstance(value, str):
        target.string_value = value
    elif isinstance(value, Mapping):
        target.struct_value.Clear()
        _fill_struct(target.struct_value, value, path)
    elif isinstance(value, (list, tuple)):
        target.list_value.Clear()
        for i, item in enumerate(value):
            _set_value(target.list_value.values.add(), item, f"{path}[{i}]")
    else:
        raise ValueError(
            f"{path}: {type(value).__name__} values cannot be sent (use numbers, strings, booleans, lists and mappings)"
        )


def _fill_struct(struct: struct_pb2.Struct, data: Mapping[str, Any], path: str) -> None:
    for key, value in data.items():
        if not isinstance(key, str):
            raise ValueError(f"{path}: keys must be strings, got {key!r}")
        _set_value(struct.fields[key], value, f"{path}.{key}" if path else key)


def dict_to_struct(data: Mapping[str, Any] | None) -> struct_pb2.Struct:
    """A mapping of JSON-like values (None, bool, int, float, str, list/tuple, nested mappings)
    -> ``google.protobuf.Struct``. ``None`` gives an empty Struct.

    Raises:
        ValueError: a key that is not a string, a value of another type, or an integer beyond
            2**53 (a Struct carries every number as a double); the message names the key path.
    """
    struct = struct_pb2.Struct()
    if data is not None:
        if not isinstance(data, Mapping):
            raise ValueError(f"expected a mapping, got {type(data).__name__}")
        _fill_struct(struct, data, "")
    return struct


def value_to_python(value: struct_pb2.Value, *, integral_as_int: bool = True) -> Any:
    """One ``google.protobuf.Value`` -> Python. With ``integral_as_int`` a whole number
    (``15.0``) comes back as ``int`` (``15``), since a Struct carries every number as a double."""
    kind = value.WhichOneof("kind")
    if kind is None or kind == "null_value":
        return None
    if kind == "bool_value":
        return value.bool_value
    if kind == "number_value":
        num = value.number_value
        if integral_as_int and math.isfinite(num) and num.is_integer() and abs(num) <= _MAX_EXACT_INT:
            return int(num)
        return num
    if kind == "string_value":
        return value.string_value
    if kind == "struct_value":
        return struct_to_dict(value.struct_value, integral_as_int=integral_as_int)
    if kind == "list_value":
        return [value_to_python(v, integral_as_int=integral_as_int) for v in value.list_value.values]
    raise ValueError(f"unknown google.protobuf.Value kind {kind!r}")  # pragma: no cover


def struct_to_dict(struct: struct_pb2.Struct | None, *, integral_as_int: bool = True) -> dict[str, Any]:
    """``google.protobuf.Struct`` -> a plain dict (nested Structs become dicts, lists lists).
    Whole numbers come back as ``int`` unless ``integral_as_int=False``."""
    if struct is None:
        return {}
    return {k: value_to_python(v, integral_as_int=integral_as_int) for k, v in struct.fields.items()}


# ---------------------------------------------------------------------------------------------
# Times.


def timestamp_to_datetime(ts: timestamp_pb2.Timestamp | None) -> _dt.datetime | None:
    """Timestamp -> aware UTC datetime; ``None`` for ``None`` or the zero timestamp."""
    if ts is None or (ts.seconds == 0 and ts.nanos == 0):
        return None
    return ts.ToDatetime(tzinfo=_dt.timezone.utc)


def seconds_to_duration(seconds: float | _dt.timedelta) -> duration_pb2.Duration:
    """Seconds (or a timedelta) -> ``google.protobuf.Duration``."""
    if isinstance(seconds, _dt.timedelta):
        seconds = seconds.total_seconds()
    d = duration_pb2.Duration()
    whole = math.floor(seconds)
    d.seconds = int(whole)
    d.nanos = int(round((seconds - whole) * 1e9))
    if d.nanos >= 1_000_000_000:
        d.seconds += 1
        d.nanos -= 1_000_000_000
    return d


def duration_to_seconds(d: duration_pb2.Duration) -> float:
    """``google.protobuf.Duration`` -> float seconds."""
    return d.seconds + d.nanos / 1e9


# ---------------------------------------------------------------------------------------------
# Tasks.


def task_from_proto(task: common_pb2.Task) -> TaskInfo:
    """``common_pb2.Task`` -> :class:`TaskInfo`."""
    spec = task.spec
    ckpt = task.latest_checkpoint if task.HasField("latest_checkpoint") else None
    limits = spec.limits
    return TaskInfo(
        task_id=task.task_id,
        state=state_name(task.state),
        attempt=task.attempt,
        name=spec.name,
        workload_type=spec.workload_type,
        model=spec.model,
        priority=task.priority,
        gpu_count=spec.resources.gpu_count,
        owner=task.owner,
        node_id=task.node_id,
        device_indices=tuple(task.device_indices),
        pending_reason=task.pending_reason,
        error=task.error,
        latest_step=task.latest_step,
        latest_metrics=dict(task.latest_metrics),
        checkpoint_path=ckpt.path if ckpt is not None else "",
        checkpoint_step=ckpt.step if ckpt is not None else 0,
        endpoint=task.endpoint,
        openai_endpoint=task.openai_endpoint,
        create_time=timestamp_to_datetime(task.create_time),
        update_time=timestamp_to_datetime(task.update_time),
        start_time=timestamp_to_datetime(task.start_time),
        end_time=timestamp_to_datetime(task.end_time),
        env_config=struct_to_dict(spec.env_config),
        hyperparameters=struct_to_dict(spec.hyperparameters),
        max_runtime=duration_to_seconds(limits.max_runtime) if limits.HasField("max_runtime") else None,
        max_attempts=limits.max_attempts,
        handed_back=task.handed_back,
        init_from=spec.init_from,
        queue=task.queue,
        usage=usage_dict(task.usage) if task.HasField("usage") else {},
        proto=task,
    )


#: The fields of ``common_pb2.Usage``, in the order they are shown.
USAGE_FIELDS = (
    "gpu_seconds",
    "cpu_task_seconds",
    "tokens_generated",
    "tokens_trained",
    "env_steps",
    "cost",
    "attempts",
)


def usage_dict(usage: common_pb2.Usage) -> dict[str, float]:
    """``common_pb2.Usage`` -> a plain dict of its fields (:data:`USAGE_FIELDS`)."""
    return {k: getattr(usage, k) for k in USAGE_FIELDS}


# ---------------------------------------------------------------------------------------------
# Events.


def event_from_proto(event: common_pb2.TaskEvent) -> TaskEvent:
    """``common_pb2.TaskEvent`` -> :class:`TaskEvent`."""
    base = dict(task_id=event.task_id, sequence=event.sequence, time=timestamp_to_datetime(event.time))
    which = event.WhichOneof("event")
    if which == "state_change":
        sc = event.state_change
        return TaskEvent(
            **base,
            kind="state",
            from_state=state_name(sc.from_state),
            to_state=state_name(sc.to_state),
            attempt=sc.attempt,
            reason=sc.reason,
            message=sc.message,
            node_id=sc.node_id,
        )
    if which == "metric":
        mp = event.metric
        return TaskEvent(**base, kind="metric", step=mp.step, metrics=dict(mp.values), attempt=mp.attempt)
    if which == "checkpoint":
        ck = event.checkpoint
        return TaskEvent(
            **base,
            kind="checkpoint",
            step=ck.step,
            attempt=ck.attempt,
            node_id=ck.node_id,
            checkpoint_path=ck.path,
            checkpoint_format=ck.format,
            final=ck.final,
        )
    if which == "phase":
        ph = event.phase
        return TaskEvent(**base, kind="phase", attempt=ph.attempt, phase=ph.phase, message=ph.detail)
    if which == "checkpoint_failed":
        cf = event.checkpoint_failed
        return TaskEvent(
            **base,
            kind="checkpoint_failed",
            step=cf.step,
            attempt=cf.attempt,
            node_id=cf.node_id,
            message=cf.error,
            fatal=cf.fatal,
            failures_in_a_row=cf.failures_in_a_row,
        )
    if which == "artifacts_deleted":
        ad = event.artifacts_deleted
        by = f" by {ad.deleted_by}" if ad.deleted_by else ""
        if ad.by_retention:
            message = f"{ad.deleted_keys} older checkpoint(s) deleted by retention: {', '.join(ad.keys)}"
        else:
            message = f"{ad.deleted_keys} artifact(s), {ad.deleted_bytes} bytes deleted from the store{by}"
            message += f": {', '.join(ad.keys)}" if ad.keys else ""
        return TaskEvent(**base, kind="artifacts_deleted", message=message)
    if which == "checkpoint_expiry":
        ce = event.checkpoint_expiry
        when = timestamp_to_datetime(ce.expire_time) if ce.HasField("expire_time") else None
        message = f"checkpoint {ce.key} " + (f"expires at {when.isoformat()}" if when else "never expires")
        return TaskEvent(**base, kind="checkpoint_expiry", message=message)
    return TaskEvent(**base, kind="unknown")


# ---------------------------------------------------------------------------------------------
# Messages whose fields the value types name alike.


def _by_name(cls: Any, msg: Any, **converted: Any) -> Any:
    """An instance of the dataclass ``cls``: the fields in ``converted`` as given, every other
    field copied from the field of the same name of ``msg``."""
    copied = {f.name: getattr(msg, f.name) for f in dataclasses.fields(cls) if f.name not in converted}
    return cls(**copied, **converted)


def _present(cls: Any, msg: Any, **converted: Any) -> Any:
    """As :func:`_by_name`, for optional fields: a field ``msg`` does not have set is ``None``."""
    copied = {
        f.name: getattr(msg, f.name) if msg.HasField(f.name) else None
        for f in dataclasses.fields(cls)
        if f.name not in converted
    }
    return cls(**copied, **converted)


# ---------------------------------------------------------------------------------------------
# Nodes.


def node_from_proto(node: scheduler_pb2.Node) -> NodeInfo:
    """``scheduler_pb2.Node`` -> :class:`NodeInfo`."""
    return _by_name(
        NodeInfo,
        node,
        running_task_ids=tuple(node.running_task_ids),
        devices=tuple(_by_name(DeviceInfo, d) for d in node.devices),
        telemetry=tuple(
            _present(DeviceTelemetry, t, index=t.index, unavailable=dict(t.unavailable), simulated=t.simulated)
            for t in node.telemetry
        ),
        last_heartbeat_time=timestamp_to_datetime(node.last_heartbeat_time),
        notes=tuple(node.notes),
        host=_present(HostTelemetry, node.host, unavailable=dict(node.host.unavailable))
        if node.HasField("host")
        else None,
        model_hosts=tuple(
            ModelHostInfo(
                model=h.model,
                device_indices=tuple(h.device_indices),
                task_ids=tuple(h.task_ids),
                pid=h.pid,
                max_tenants=h.max_tenants,
                dtype=h.dtype,
                base_bytes_estimate=h.base_bytes_estimate,
                tenant_bytes_estimate=h.tenant_bytes_estimate,
            )
            for h in node.model_hosts
        ),
        gpu_memory_estimates=tuple(_by_name(GpuMemoryEstimate, g) for g in node.gpu_memory_estimates),
        proto=node,
    )


def metric_points(points: Iterable[common_pb2.MetricPoint]) -> list[tuple[int, dict[str, float]]]:
    """MetricPoints -> ``[(step, {key: value})]`` in the order given."""
    return [(p.step, dict(p.values)) for p in points]


def timed_metric_points(points: Iterable[common_pb2.MetricPoint]) -> list[tuple[int, float, dict[str, float]]]:
    """MetricPoints -> ``[(step, unix seconds, {key: value})]`` in the order given (time 0.0 when unset)."""
    return [(p.step, p.time.ToNanoseconds() / 1e9 if p.HasField("time") else 0.0, dict(p.values)) for p in points]


# ---------------------------------------------------------------------------------------------
# Datasets and checkpoints.


def dataset_from_proto(info: scheduler_pb2.DatasetInfo) -> DatasetInfo:
    """``scheduler_pb2.DatasetInfo`` -> :class:`DatasetInfo`."""
    return _by_name(DatasetInfo, info)


def checkpoint_from_proto(ck: common_pb2.Checkpoint) -> CheckpointInfo:
    """A checkpoint record -> :class:`CheckpointInfo`."""
    return _by_name(CheckpointInfo, ck, create_time=timestamp_to_datetime(ck.create_time))


# ---------------------------------------------------------------------------------------------
# Inference.

_FINISH = {inference_pb2.FINISH_REASON_STOP: "stop", inference_pb2.FINISH_REASON_LENGTH: "length"}


def generation_from_proto(resp: inference_pb2.GenerateResponse) -> Generation:
    """``GenerateResponse`` -> :class:`Generation` (an unknown finish reason reads ``""``)."""
    return Generation(
        samples=tuple(
            Sample(s.index, s.text, tuple(s.token_ids), tuple(s.logprobs), _FINISH.get(s.finish_reason, ""))
            for s in resp.samples
        ),
        prompt_tokens=resp.usage.prompt_tokens,
        completion_tokens=resp.usage.completion_tokens,
        model=resp.model,
        adapter=resp.adapter or None,
    )


def stream_chunk_from_proto(m: inference_pb2.GenerateStreamResponse) -> StreamChunk:
    """One ``GenerateStreamResponse`` -> :class:`StreamChunk` (``finish_reason`` ``None`` until
    the sample's last chunk; ``usage`` only on the stream's last one)."""
    return StreamChunk(
        index=m.index,
        text=m.text,
        token_ids=tuple(m.token_ids),
        logprobs=tuple(m.logprobs),
        finish_reason=_FINISH.get(m.finish_reason),
        usage=(m.usage.prompt_tokens, m.usage.completion_tokens) if m.HasField("usage") else None,
    )


def adapter_from_proto(a: inference_pb2.Adapter) -> AdapterInfo:
    """A loaded adapter's record -> :class:`AdapterInfo`."""
    load_time, last_used_time = timestamp_to_datetime(a.load_time), timestamp_to_datetime(a.last_used_time)
    return _by_name(AdapterInfo, a, load_time=load_time, last_used_time=last_used_time)
