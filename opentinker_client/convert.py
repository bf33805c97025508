"""Protobuf <-> Python conversions: tasks, events, nodes, ``Struct``, times and states.

The client returns these frozen dataclasses instead of protobuf messages; the scheduler may reuse
:func:`dict_to_struct` / :func:`struct_to_dict` and the state helpers. Times are timezone-aware
:class:`datetime.datetime` in UTC (``None`` when unset); lengths of time are float seconds.
"""

from __future__ import annotations

import datetime as _dt
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from google.protobuf import duration_pb2, struct_pb2, timestamp_pb2

from opentinker.common.v1 import common_pb2
from opentinker.scheduler.v1 import scheduler_pb2

__all__ = [
    "TERMINAL_STATES",
    "TaskInfo",
    "TaskEvent",
    "NodeInfo",
    "DeviceInfo",
    "DeviceTelemetry",
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
    "DatasetInfo",
    "dataset_from_proto",
]

_STATE_PREFIX = "TASK_STATE_"

#: Lowercase names of the states a task never leaves.
TERMINAL_STATES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})

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


def _field_time(msg: Any, name: str) -> _dt.datetime | None:
    return timestamp_to_datetime(getattr(msg, name)) if msg.HasField(name) else None


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


@dataclass(frozen=True)
class TaskInfo:
    """A task as the scheduler reports it.

    Attributes:
        task_id: the scheduler's id for the task.
        state: ``"pending"``, ``"assigned"``, ``"running"``, ``"succeeded"``, ``"failed"`` or
            ``"cancelled"``.
        attempt: 1 for the first attempt, +1 each time the task is requeued.
        name, workload_type, model: from the spec (``model`` as the scheduler resolved it).
        priority: effective priority; larger numbers are scheduled first.
        gpu_count: GPUs asked for (0 = CPU task).
        owner: who submitted it.
        node_id: node it is assigned to or running on; ``""`` when pending or finished.
        device_indices: device indices on that node.
        pending_reason: why a pending task has not started (for a person to read).
        error: why it failed or was cancelled (for a person to read).
        latest_step: newest training step reported (0 before the first).
        latest_metrics: that step's values (``loss``, ``reward``, namespaced keys ...).
        checkpoint_path: folder of the newest checkpoint on its node, ``""`` when none.
        checkpoint_step: the step that checkpoint was written after (0 when none).
        create_time, update_time, start_time, end_time: UTC datetimes or ``None``.
        env_config, hyperparameters: the spec's mappings as plain dicts.
        max_runtime: wall-clock limit of one attempt in seconds, ``None`` for none.
        max_attempts: attempts allowed (0 = scheduler default).
        init_from: id of the task whose final checkpoint this one started from, ``""`` for none.
        proto: the underlying ``common_pb2.Task`` (not compared, not shown).
    """

    task_id: str
    state: str
    attempt: int = 0
    name: str = ""
    workload_type: str = ""
    model: str = ""
    priority: int = 0
    gpu_count: int = 0
    owner: str = ""
    node_id: str = ""
    device_indices: tuple[int, ...] = ()
    pending_reason: str = ""
    error: str = ""
    latest_step: int = 0
    latest_metrics: Mapping[str, float] = field(default_factory=dict)
    checkpoint_path: str = ""
    checkpoint_step: int = 0
    endpoint: str = ""  # host:port a RUNNING inference task serves on
    create_time: _dt.datetime | None = None
    update_time: _dt.datetime | None = None
    start_time: _dt.datetime | None = None
    end_time: _dt.datetime | None = None
    env_config: Mapping[str, Any] = field(default_factory=dict)
    hyperparameters: Mapping[str, Any] = field(default_factory=dict)
    max_runtime: float | None = None
    max_attempts: int = 0
    init_from: str = ""
    proto: Any = field(default=None, repr=False, compare=False)

    @property
    def done(self) -> bool:
        """True once the task is SUCCEEDED, FAILED or CANCELLED."""
        return self.state in TERMINAL_STATES

    @property
    def succeeded(self) -> bool:
        return self.state == "succeeded"


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
        create_time=_field_time(task, "create_time"),
        update_time=_field_time(task, "update_time"),
        start_time=_field_time(task, "start_time"),
        end_time=_field_time(task, "end_time"),
        env_config=struct_to_dict(spec.env_config),
        hyperparameters=struct_to_dict(spec.hyperparameters),
        max_runtime=duration_to_seconds(limits.max_runtime) if limits.HasField("max_runtime") else None,
        max_attempts=limits.max_attempts,
        init_from=spec.init_from,
        proto=task,
    )


# ---------------------------------------------------------------------------------------------
# Events.


@dataclass(frozen=True)
class TaskEvent:
    """One entry of a task's event log, as :meth:`RLClient.watch` yields it.

    ``kind`` says which fields are filled:

    - ``"state"``: ``from_state``, ``to_state`` (lowercase state names), ``attempt``, ``reason``
      (machine-readable: ``SUBMITTED``, ``STARTED``, ``NODE_LOST`` ...), ``message``, ``node_id``.
    - ``"metric"``: ``step`` and ``metrics`` (``loss``, ``reward``, namespaced keys ...).
    - ``"checkpoint"``: ``step``, ``attempt``, ``node_id``, ``checkpoint_path``,
      ``checkpoint_format`` (``peft_lora`` ...) and ``final``.
    - ``"unknown"``: an event kind this client does not know (a newer scheduler).

    Attributes:
        task_id: the task.
        sequence: position in the task's log, from 1; resume a watch after it.
        time: when the scheduler recorded it (UTC), or ``None``.
    """

    task_id: str
    sequence: int
    time: _dt.datetime | None
    kind: str
    from_state: str = ""
    to_state: str = ""
    attempt: int = 0
    reason: str = ""
    message: str = ""
    node_id: str = ""
    step: int = 0
    metrics: Mapping[str, float] = field(default_factory=dict)
    checkpoint_path: str = ""
    checkpoint_format: str = ""
    final: bool = False

    @property
    def is_terminal(self) -> bool:
        """True for the state change that ends the task (to SUCCEEDED, FAILED or CANCELLED)."""
        return self.kind == "state" and self.to_state in TERMINAL_STATES


def event_from_proto(event: common_pb2.TaskEvent) -> TaskEvent:
    """``common_pb2.TaskEvent`` -> :class:`TaskEvent`."""
    base = dict(task_id=event.task_id, sequence=event.sequence, time=_field_time(event, "time"))
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
        return TaskEvent(**base, kind="metric", step=mp.step, metrics=dict(mp.values))
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
    return TaskEvent(**base, kind="unknown")


# ---------------------------------------------------------------------------------------------
# Nodes.


@dataclass(frozen=True)
class DeviceInfo:
    """A device of a node. ``memory_total_bytes`` in bytes; ``simulated`` for ``--simulate-gpus``."""

    index: int
    uuid: str = ""
    name: str = ""
    memory_total_bytes: int = 0
    simulated: bool = False


@dataclass(frozen=True)
class DeviceTelemetry:
    """Latest telemetry of one device. A value NVML could not give is ``None`` and
    ``unavailable[field]`` says why.

    Units: ``utilization_percent`` %, memory in bytes, ``temperature_c`` degrees Celsius,
    ``power_w`` watts, ``sm_clock_mhz`` MHz, ``ecc_errors`` a count.
    """

    index: int
    utilization_percent: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    sm_clock_mhz: int | None = None
    ecc_errors: int | None = None
    unavailable: Mapping[str, str] = field(default_factory=dict)
    simulated: bool = False


@dataclass(frozen=True)
class NodeInfo:
    """A trainer node as the scheduler sees it.

    Attributes:
        connected: its stream is open and its lease fresh.
        gpu_count: GPUs the scheduler places on; ``gpus_free`` of them are free now.
        max_tasks: tasks it may run at once; ``running_task_ids`` runs now.
        last_heartbeat_time: UTC datetime or ``None``.
        notes: things a person should see (simulated devices, config/NVML disagreement ...).
    """

    node_id: str
    connected: bool = False
    gpu_count: int = 0
    gpus_free: int = 0
    max_tasks: int = 0
    running_task_ids: tuple[str, ...] = ()
    devices: tuple[DeviceInfo, ...] = ()
    telemetry: tuple[DeviceTelemetry, ...] = ()
    last_heartbeat_time: _dt.datetime | None = None
    version: str = ""
    notes: tuple[str, ...] = ()
    proto: Any = field(default=None, repr=False, compare=False)


def _opt(msg: Any, name: str) -> Any:
    return getattr(msg, name) if msg.HasField(name) else None


def _telemetry_from_proto(t: common_pb2.DeviceTelemetry) -> DeviceTelemetry:
    return DeviceTelemetry(
        index=t.index,
        utilization_percent=_opt(t, "utilization_percent"),
        memory_used_bytes=_opt(t, "memory_used_bytes"),
        memory_total_bytes=_opt(t, "memory_total_bytes"),
        temperature_c=_opt(t, "temperature_c"),
        power_w=_opt(t, "power_w"),
        sm_clock_mhz=_opt(t, "sm_clock_mhz"),
        ecc_errors=_opt(t, "ecc_errors"),
        unavailable=dict(t.unavailable),
        simulated=t.simulated,
    )


def node_from_proto(node: scheduler_pb2.Node) -> NodeInfo:
    """``scheduler_pb2.Node`` -> :class:`NodeInfo`."""
    return NodeInfo(
        node_id=node.node_id,
        connected=node.connected,
        gpu_count=node.gpu_count,
        gpus_free=node.gpus_free,
        max_tasks=node.max_tasks,
        running_task_ids=tuple(node.running_task_ids),
        devices=tuple(
            DeviceInfo(
                index=d.index, uuid=d.uuid, name=d.name, memory_total_bytes=d.memory_total_bytes, simulated=d.simulated
            )
            for d in node.devices
        ),
        telemetry=tuple(_telemetry_from_proto(t) for t in node.telemetry),
        last_heartbeat_time=_field_time(node, "last_heartbeat_time"),
        version=node.version,
        notes=tuple(node.notes),
        proto=node,
    )


def metric_points(points: Iterable[common_pb2.MetricPoint]) -> list[tuple[int, dict[str, float]]]:
    """MetricPoints -> ``[(step, {key: value})]`` in the order given."""
    return [(p.step, dict(p.values)) for p in points]


# ---------------------------------------------------------------------------------------------
# Datasets.


@dataclass(frozen=True)
class DatasetInfo:
    """An uploaded dataset (``RLClient.upload_dataset``).

    Attributes:
        dataset_id: ``sha256:<hex>``, what ``env_config.dataset_id`` names.
        name: the name given at upload (the file name by default).
        size_bytes: bytes.
        num_examples: examples (non-blank lines).
    """

    dataset_id: str
    name: str = ""
    size_bytes: int = 0
    num_examples: int = 0


def dataset_from_proto(info: scheduler_pb2.DatasetInfo) -> DatasetInfo:
    """``scheduler_pb2.DatasetInfo`` -> :class:`DatasetInfo`."""
    return DatasetInfo(
        dataset_id=info.dataset_id, name=info.name, size_bytes=info.size_bytes, num_examples=info.num_examples
    )
