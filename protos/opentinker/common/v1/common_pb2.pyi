import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TaskState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_STATE_UNSPECIFIED: _ClassVar[TaskState]
    TASK_STATE_PENDING: _ClassVar[TaskState]
    TASK_STATE_ASSIGNED: _ClassVar[TaskState]
    TASK_STATE_RUNNING: _ClassVar[TaskState]
    TASK_STATE_SUCCEEDED: _ClassVar[TaskState]
    TASK_STATE_FAILED: _ClassVar[TaskState]
    TASK_STATE_CANCELLED: _ClassVar[TaskState]
TASK_STATE_UNSPECIFIED: TaskState
TASK_STATE_PENDING: TaskState
TASK_STATE_ASSIGNED: TaskState
TASK_STATE_RUNNING: TaskState
TASK_STATE_SUCCEEDED: TaskState
TASK_STATE_FAILED: TaskState
TASK_STATE_CANCELLED: TaskState

class Resources(_message.Message):
    __slots__ = ("gpu_count", "nodes")
    GPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    gpu_count: int
    nodes: int
    def __init__(self, gpu_count: _Optional[int] = ..., nodes: _Optional[int] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_runtime", "max_attempts")
    MAX_RUNTIME_FIELD_NUMBER: _ClassVar[int]
    MAX_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    max_runtime: _duration_pb2.Duration
    max_attempts: int
    def __init__(self, max_runtime: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., max_attempts: _Optional[int] = ...) -> None: ...

class TaskSpec(_message.Message):
    __slots__ = ("workload_type", "model", "env_config", "hyperparameters", "resources", "limits", "priority", "name", "init_from", "tracking")
    WORKLOAD_TYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENV_CONFIG_FIELD_NUMBER: _ClassVar[int]
    HYPERPARAMETERS_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    INIT_FROM_FIELD_NUMBER: _ClassVar[int]
    TRACKING_FIELD_NUMBER: _ClassVar[int]
    workload_type: str
    model: str
    env_config: _struct_pb2.Struct
    hyperparameters: _struct_pb2.Struct
    resources: Resources
    limits: Limits
    priority: int
    name: str
    init_from: str
    tracking: _struct_pb2.Struct
    def __init__(self, workload_type: _Optional[str] = ..., model: _Optional[str] = ..., env_config: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., hyperparameters: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., resources: _Optional[_Union[Resources, _Mapping]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., priority: _Optional[int] = ..., name: _Optional[str] = ..., init_from: _Optional[str] = ..., tracking: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class MetricPoint(_message.Message):
    __slots__ = ("step", "time", "values", "attempt")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    step: int
    time: _timestamp_pb2.Timestamp
    values: _containers.ScalarMap[str, float]
    attempt: int
    def __init__(self, step: _Optional[int] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., values: _Optional[_Mapping[str, float]] = ..., attempt: _Optional[int] = ...) -> None: ...

class Checkpoint(_message.Message):
    __slots__ = ("task_id", "attempt", "step", "path", "create_time", "node_id", "format", "final", "artifact", "expire_time")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    attempt: int
    step: int
    path: str
    create_time: _timestamp_pb2.Timestamp
    node_id: str
    format: str
    final: bool
    artifact: ArtifactRef
    expire_time: _timestamp_pb2.Timestamp
    def __init__(self, task_id: _Optional[str] = ..., attempt: _Optional[int] = ..., step: _Optional[int] = ..., path: _Optional[str] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., node_id: _Optional[str] = ..., format: _Optional[str] = ..., final: _Optional[bool] = ..., artifact: _Optional[_Union[ArtifactRef, _Mapping]] = ..., expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ArtifactRef(_message.Message):
    __slots__ = ("key", "manifest_sha256", "total_bytes", "backend")
    KEY_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    key: str
    manifest_sha256: str
    total_bytes: int
    backend: str
    def __init__(self, key: _Optional[str] = ..., manifest_sha256: _Optional[str] = ..., total_bytes: _Optional[int] = ..., backend: _Optional[str] = ...) -> None: ...

class Device(_message.Message):
    __slots__ = ("index", "uuid", "name", "memory_total_bytes", "simulated")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SIMULATED_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    name: str
    memory_total_bytes: int
    simulated: bool
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., name: _Optional[str] = ..., memory_total_bytes: _Optional[int] = ..., simulated: _Optional[bool] = ...) -> None: ...

class DeviceTelemetry(_message.Message):
    __slots__ = ("index", "utilization_percent", "memory_used_bytes", "memory_total_bytes", "temperature_c", "power_w", "sm_clock_mhz", "ecc_errors", "unavailable", "simulated")
    class UnavailableEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_PERCENT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_C_FIELD_NUMBER: _ClassVar[int]
    POWER_W_FIELD_NUMBER: _ClassVar[int]
    SM_CLOCK_MHZ_FIELD_NUMBER: _ClassVar[int]
    ECC_ERRORS_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    SIMULATED_FIELD_NUMBER: _ClassVar[int]
    index: int
    utilization_percent: float
    memory_used_bytes: int
    memory_total_bytes: int
    temperature_c: float
    power_w: float
    sm_clock_mhz: int
    ecc_errors: int
    unavailable: _containers.ScalarMap[str, str]
    simulated: bool
    def __init__(self, index: _Optional[int] = ..., utilization_percent: _Optional[float] = ..., memory_used_bytes: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ..., temperature_c: _Optional[float] = ..., power_w: _Optional[float] = ..., sm_clock_mhz: _Optional[int] = ..., ecc_errors: _Optional[int] = ..., unavailable: _Optional[_Mapping[str, str]] = ..., simulated: _Optional[bool] = ...) -> None: ...

class ModelHost(_message.Message):
    __slots__ = ("model", "device_indices", "task_ids", "pid", "max_tenants", "dtype", "base_bytes_estimate", "tenant_bytes_estimate")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDICES_FIELD_NUMBER: _ClassVar[int]
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    MAX_TENANTS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BASE_BYTES_ESTIMATE_FIELD_NUMBER: _ClassVar[int]
    TENANT_BYTES_ESTIMATE_FIELD_NUMBER: _ClassVar[int]
    model: str
    device_indices: _containers.RepeatedScalarFieldContainer[int]
    task_ids: _containers.RepeatedScalarFieldContainer[str]
    pid: int
    max_tenants: int
    dtype: str
    base_bytes_estimate: int
    tenant_bytes_estimate: int
    def __init__(self, model: _Optional[str] = ..., device_indices: _Optional[_Iterable[int]] = ..., task_ids: _Optional[_Iterable[str]] = ..., pid: _Optional[int] = ..., max_tenants: _Optional[int] = ..., dtype: _Optional[str] = ..., base_bytes_estimate: _Optional[int] = ..., tenant_bytes_estimate: _Optional[int] = ...) -> None: ...

class HostTelemetry(_message.Message):
    __slots__ = ("cpu_utilization_percent", "cpu_count", "memory_used_bytes", "memory_total_bytes", "unavailable")
    class UnavailableEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CPU_UTILIZATION_PERCENT_FIELD_NUMBER: _ClassVar[int]
    CPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    cpu_utilization_percent: float
    cpu_count: int
    memory_used_bytes: int
    memory_total_bytes: int
    unavailable: _containers.ScalarMap[str, str]
    def __init__(self, cpu_utilization_percent: _Optional[float] = ..., cpu_count: _Optional[int] = ..., memory_used_bytes: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ..., unavailable: _Optional[_Mapping[str, str]] = ...) -> None: ...

class StateChange(_message.Message):
    __slots__ = ("from_state", "to_state", "attempt", "reason", "message", "node_id")
    FROM_STATE_FIELD_NUMBER: _ClassVar[int]
    TO_STATE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    from_state: TaskState
    to_state: TaskState
    attempt: int
    reason: str
    message: str
    node_id: str
    def __init__(self, from_state: _Optional[_Union[TaskState, str]] = ..., to_state: _Optional[_Union[TaskState, str]] = ..., attempt: _Optional[int] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ..., node_id: _Optional[str] = ...) -> None: ...

class TaskPhase(_message.Message):
    __slots__ = ("attempt", "phase", "detail")
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    attempt: int
    phase: str
    detail: str
    def __init__(self, attempt: _Optional[int] = ..., phase: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class TaskEvent(_message.Message):
    __slots__ = ("task_id", "sequence", "time", "state_change", "metric", "checkpoint", "phase", "checkpoint_failed", "artifacts_deleted", "checkpoint_expiry")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    STATE_CHANGE_FIELD_NUMBER: _ClassVar[int]
    METRIC_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FAILED_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_DELETED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EXPIRY_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    sequence: int
    time: _timestamp_pb2.Timestamp
    state_change: StateChange
    metric: MetricPoint
    checkpoint: Checkpoint
    phase: TaskPhase
    checkpoint_failed: CheckpointFailure
    artifacts_deleted: ArtifactsDeleted
    checkpoint_expiry: CheckpointExpiry
    def __init__(self, task_id: _Optional[str] = ..., sequence: _Optional[int] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., state_change: _Optional[_Union[StateChange, _Mapping]] = ..., metric: _Optional[_Union[MetricPoint, _Mapping]] = ..., checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ..., phase: _Optional[_Union[TaskPhase, _Mapping]] = ..., checkpoint_failed: _Optional[_Union[CheckpointFailure, _Mapping]] = ..., artifacts_deleted: _Optional[_Union[ArtifactsDeleted, _Mapping]] = ..., checkpoint_expiry: _Optional[_Union[CheckpointExpiry, _Mapping]] = ...) -> None: ...

class CheckpointExpiry(_message.Message):
    __slots__ = ("key", "expire_time")
    KEY_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    key: str
    expire_time: _timestamp_pb2.Timestamp
    def __init__(self, key: _Optional[str] = ..., expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ArtifactsDeleted(_message.Message):
    __slots__ = ("deleted_keys", "deleted_bytes", "deleted_by", "by_retention", "keys")
    DELETED_KEYS_FIELD_NUMBER: _ClassVar[int]
    DELETED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DELETED_BY_FIELD_NUMBER: _ClassVar[int]
    BY_RETENTION_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    deleted_keys: int
    deleted_bytes: int
    deleted_by: str
    by_retention: bool
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, deleted_keys: _Optional[int] = ..., deleted_bytes: _Optional[int] = ..., deleted_by: _Optional[str] = ..., by_retention: _Optional[bool] = ..., keys: _Optional[_Iterable[str]] = ...) -> None: ...

class CheckpointFailure(_message.Message):
    __slots__ = ("step", "attempt", "node_id", "error", "fatal", "failures_in_a_row")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FATAL_FIELD_NUMBER: _ClassVar[int]
    FAILURES_IN_A_ROW_FIELD_NUMBER: _ClassVar[int]
    step: int
    attempt: int
    node_id: str
    error: str
    fatal: bool
    failures_in_a_row: int
    def __init__(self, step: _Optional[int] = ..., attempt: _Optional[int] = ..., node_id: _Optional[str] = ..., error: _Optional[str] = ..., fatal: _Optional[bool] = ..., failures_in_a_row: _Optional[int] = ...) -> None: ...

class Task(_message.Message):
    __slots__ = ("task_id", "owner", "spec", "state", "attempt", "priority", "create_time", "update_time", "start_time", "end_time", "node_id", "device_indices", "pending_reason", "error", "latest_metrics", "latest_step", "latest_checkpoint", "endpoint", "usage", "queue", "handed_back", "openai_endpoint")
    class LatestMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    UPDATE_TIME_FIELD_NUMBER: _ClassVar[int]
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    END_TIME_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDICES_FIELD_NUMBER: _ClassVar[int]
    PENDING_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LATEST_METRICS_FIELD_NUMBER: _ClassVar[int]
    LATEST_STEP_FIELD_NUMBER: _ClassVar[int]
    LATEST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    HANDED_BACK_FIELD_NUMBER: _ClassVar[int]
    OPENAI_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    owner: str
    spec: TaskSpec
    state: TaskState
    attempt: int
    priority: int
    create_time: _timestamp_pb2.Timestamp
    update_time: _timestamp_pb2.Timestamp
    start_time: _timestamp_pb2.Timestamp
    end_time: _timestamp_pb2.Timestamp
    node_id: str
    device_indices: _containers.RepeatedScalarFieldContainer[int]
    pending_reason: str
    error: str
    latest_metrics: _containers.ScalarMap[str, float]
    latest_step: int
    latest_checkpoint: Checkpoint
    endpoint: str
    usage: Usage
    queue: str
    handed_back: int
    openai_endpoint: str
    def __init__(self, task_id: _Optional[str] = ..., owner: _Optional[str] = ..., spec: _Optional[_Union[TaskSpec, _Mapping]] = ..., state: _Optional[_Union[TaskState, str]] = ..., attempt: _Optional[int] = ..., priority: _Optional[int] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., update_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., start_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., end_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., node_id: _Optional[str] = ..., device_indices: _Optional[_Iterable[int]] = ..., pending_reason: _Optional[str] = ..., error: _Optional[str] = ..., latest_metrics: _Optional[_Mapping[str, float]] = ..., latest_step: _Optional[int] = ..., latest_checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ..., endpoint: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., queue: _Optional[str] = ..., handed_back: _Optional[int] = ..., openai_endpoint: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("gpu_seconds", "cpu_task_seconds", "tokens_generated", "tokens_trained", "env_steps", "cost", "attempts")
    GPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CPU_TASK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    ENV_STEPS_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    gpu_seconds: float
    cpu_task_seconds: float
    tokens_generated: float
    tokens_trained: float
    env_steps: float
    cost: float
    attempts: int
    def __init__(self, gpu_seconds: _Optional[float] = ..., cpu_task_seconds: _Optional[float] = ..., tokens_generated: _Optional[float] = ..., tokens_trained: _Optional[float] = ..., env_steps: _Optional[float] = ..., cost: _Optional[float] = ..., attempts: _Optional[int] = ...) -> None: ...
