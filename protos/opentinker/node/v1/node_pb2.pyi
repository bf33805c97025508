import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from opentinker.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LookupTaskRequest(_message.Message):
    __slots__ = ("task_id", "include_checkpoints")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    include_checkpoints: bool
    def __init__(self, task_id: _Optional[str] = ..., include_checkpoints: _Optional[bool] = ...) -> None: ...

class LookupTaskResponse(_message.Message):
    __slots__ = ("task", "artifacts_deleted", "checkpoints")
    TASK_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_DELETED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    task: _common_pb2.Task
    artifacts_deleted: _common_pb2.TaskEvent
    checkpoints: _containers.RepeatedCompositeFieldContainer[_common_pb2.Checkpoint]
    def __init__(self, task: _Optional[_Union[_common_pb2.Task, _Mapping]] = ..., artifacts_deleted: _Optional[_Union[_common_pb2.TaskEvent, _Mapping]] = ..., checkpoints: _Optional[_Iterable[_Union[_common_pb2.Checkpoint, _Mapping]]] = ...) -> None: ...

class FetchDatasetRequest(_message.Message):
    __slots__ = ("dataset_id",)
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    dataset_id: str
    def __init__(self, dataset_id: _Optional[str] = ...) -> None: ...

class FetchDatasetResponse(_message.Message):
    __slots__ = ("chunk", "size_bytes")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    chunk: bytes
    size_bytes: int
    def __init__(self, chunk: _Optional[bytes] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class ConnectRequest(_message.Message):
    __slots__ = ("register", "heartbeat", "task_report", "goodbye")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    TASK_REPORT_FIELD_NUMBER: _ClassVar[int]
    GOODBYE_FIELD_NUMBER: _ClassVar[int]
    register: Register
    heartbeat: Heartbeat
    task_report: TaskReport
    goodbye: Goodbye
    def __init__(self, register: _Optional[_Union[Register, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., task_report: _Optional[_Union[TaskReport, _Mapping]] = ..., goodbye: _Optional[_Union[Goodbye, _Mapping]] = ...) -> None: ...

class ConnectResponse(_message.Message):
    __slots__ = ("registered", "assign_task", "cancel_task", "drain", "report_ack")
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    ASSIGN_TASK_FIELD_NUMBER: _ClassVar[int]
    CANCEL_TASK_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    REPORT_ACK_FIELD_NUMBER: _ClassVar[int]
    registered: Registered
    assign_task: AssignTask
    cancel_task: CancelTask
    drain: Drain
    report_ack: ReportAck
    def __init__(self, registered: _Optional[_Union[Registered, _Mapping]] = ..., assign_task: _Optional[_Union[AssignTask, _Mapping]] = ..., cancel_task: _Optional[_Union[CancelTask, _Mapping]] = ..., drain: _Optional[_Union[Drain, _Mapping]] = ..., report_ack: _Optional[_Union[ReportAck, _Mapping]] = ...) -> None: ...

class RunningTask(_message.Message):
    __slots__ = ("task_id", "attempt")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    attempt: int
    def __init__(self, task_id: _Optional[str] = ..., attempt: _Optional[int] = ...) -> None: ...

class Register(_message.Message):
    __slots__ = ("node_id", "version", "devices", "max_tasks", "running", "hostname", "cpu_count", "gpu_note", "finished", "pending", "node_class", "tenants_per_host", "tracking_loggers", "tracking_reported")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    MAX_TASKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    CPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    GPU_NOTE_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    NODE_CLASS_FIELD_NUMBER: _ClassVar[int]
    TENANTS_PER_HOST_FIELD_NUMBER: _ClassVar[int]
    TRACKING_LOGGERS_FIELD_NUMBER: _ClassVar[int]
    TRACKING_REPORTED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    version: str
    devices: _containers.RepeatedCompositeFieldContainer[_common_pb2.Device]
    max_tasks: int
    running: _containers.RepeatedCompositeFieldContainer[RunningTask]
    hostname: str
    cpu_count: int
    gpu_note: str
    finished: _containers.RepeatedCompositeFieldContainer[TaskReport]
    pending: _containers.RepeatedCompositeFieldContainer[TaskReport]
    node_class: str
    tenants_per_host: int
    tracking_loggers: _containers.RepeatedScalarFieldContainer[str]
    tracking_reported: bool
    def __init__(self, node_id: _Optional[str] = ..., version: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[_common_pb2.Device, _Mapping]]] = ..., max_tasks: _Optional[int] = ..., running: _Optional[_Iterable[_Union[RunningTask, _Mapping]]] = ..., hostname: _Optional[str] = ..., cpu_count: _Optional[int] = ..., gpu_note: _Optional[str] = ..., finished: _Optional[_Iterable[_Union[TaskReport, _Mapping]]] = ..., pending: _Optional[_Iterable[_Union[TaskReport, _Mapping]]] = ..., node_class: _Optional[str] = ..., tenants_per_host: _Optional[int] = ..., tracking_loggers: _Optional[_Iterable[str]] = ..., tracking_reported: _Optional[bool] = ...) -> None: ...

class Registered(_message.Message):
    __slots__ = ("node_id", "heartbeat_interval", "lease", "gpu_count", "max_tasks", "stale", "report_ack")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    GPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    MAX_TASKS_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    REPORT_ACK_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    heartbeat_interval: _duration_pb2.Duration
    lease: _duration_pb2.Duration
    gpu_count: int
    max_tasks: int
    stale: _containers.RepeatedCompositeFieldContainer[RunningTask]
    report_ack: int
    def __init__(self, node_id: _Optional[str] = ..., heartbeat_interval: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., lease: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., gpu_count: _Optional[int] = ..., max_tasks: _Optional[int] = ..., stale: _Optional[_Iterable[_Union[RunningTask, _Mapping]]] = ..., report_ack: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("time", "devices", "running", "draining", "host", "model_hosts")
    TIME_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    MODEL_HOSTS_FIELD_NUMBER: _ClassVar[int]
    time: _timestamp_pb2.Timestamp
    devices: _containers.RepeatedCompositeFieldContainer[_common_pb2.DeviceTelemetry]
    running: _containers.RepeatedCompositeFieldContainer[RunningTask]
    draining: bool
    host: _common_pb2.HostTelemetry
    model_hosts: _containers.RepeatedCompositeFieldContainer[_common_pb2.ModelHost]
    def __init__(self, time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., devices: _Optional[_Iterable[_Union[_common_pb2.DeviceTelemetry, _Mapping]]] = ..., running: _Optional[_Iterable[_Union[RunningTask, _Mapping]]] = ..., draining: _Optional[bool] = ..., host: _Optional[_Union[_common_pb2.HostTelemetry, _Mapping]] = ..., model_hosts: _Optional[_Iterable[_Union[_common_pb2.ModelHost, _Mapping]]] = ...) -> None: ...

class TaskReport(_message.Message):
    __slots__ = ("task_id", "attempt", "state", "metrics", "checkpoint", "error", "retryable", "endpoint", "seq", "phase", "checkpoint_failed", "openai_endpoint")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FAILED_FIELD_NUMBER: _ClassVar[int]
    OPENAI_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    attempt: int
    state: _common_pb2.TaskState
    metrics: _containers.RepeatedCompositeFieldContainer[_common_pb2.MetricPoint]
    checkpoint: _common_pb2.Checkpoint
    error: str
    retryable: bool
    endpoint: str
    seq: int
    phase: _common_pb2.TaskPhase
    checkpoint_failed: _common_pb2.CheckpointFailure
    openai_endpoint: str
    def __init__(self, task_id: _Optional[str] = ..., attempt: _Optional[int] = ..., state: _Optional[_Union[_common_pb2.TaskState, str]] = ..., metrics: _Optional[_Iterable[_Union[_common_pb2.MetricPoint, _Mapping]]] = ..., checkpoint: _Optional[_Union[_common_pb2.Checkpoint, _Mapping]] = ..., error: _Optional[str] = ..., retryable: _Optional[bool] = ..., endpoint: _Optional[str] = ..., seq: _Optional[int] = ..., phase: _Optional[_Union[_common_pb2.TaskPhase, _Mapping]] = ..., checkpoint_failed: _Optional[_Union[_common_pb2.CheckpointFailure, _Mapping]] = ..., openai_endpoint: _Optional[str] = ...) -> None: ...

class Goodbye(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class AssignTask(_message.Message):
    __slots__ = ("task_id", "attempt", "spec", "device_indices", "resume_from", "owner", "init_checkpoint", "local_paths_restricted", "worker_credential", "gang")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDICES_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    INIT_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PATHS_RESTRICTED_FIELD_NUMBER: _ClassVar[int]
    WORKER_CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    GANG_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    attempt: int
    spec: _common_pb2.TaskSpec
    device_indices: _containers.RepeatedScalarFieldContainer[int]
    resume_from: _common_pb2.Checkpoint
    owner: str
    init_checkpoint: _common_pb2.Checkpoint
    local_paths_restricted: bool
    worker_credential: str
    gang: GangMember
    def __init__(self, task_id: _Optional[str] = ..., attempt: _Optional[int] = ..., spec: _Optional[_Union[_common_pb2.TaskSpec, _Mapping]] = ..., device_indices: _Optional[_Iterable[int]] = ..., resume_from: _Optional[_Union[_common_pb2.Checkpoint, _Mapping]] = ..., owner: _Optional[str] = ..., init_checkpoint: _Optional[_Union[_common_pb2.Checkpoint, _Mapping]] = ..., local_paths_restricted: _Optional[bool] = ..., worker_credential: _Optional[str] = ..., gang: _Optional[_Union[GangMember, _Mapping]] = ...) -> None: ...

class GangMember(_message.Message):
    __slots__ = ("world_size", "rank_offset", "local_world_size", "member_index", "members", "rendezvous_host", "rendezvous_port", "member_nodes")
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LOCAL_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEMBER_INDEX_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_HOST_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_PORT_FIELD_NUMBER: _ClassVar[int]
    MEMBER_NODES_FIELD_NUMBER: _ClassVar[int]
    world_size: int
    rank_offset: int
    local_world_size: int
    member_index: int
    members: int
    rendezvous_host: str
    rendezvous_port: int
    member_nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, world_size: _Optional[int] = ..., rank_offset: _Optional[int] = ..., local_world_size: _Optional[int] = ..., member_index: _Optional[int] = ..., members: _Optional[int] = ..., rendezvous_host: _Optional[str] = ..., rendezvous_port: _Optional[int] = ..., member_nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class CancelTask(_message.Message):
    __slots__ = ("task_id", "attempt", "reason")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    attempt: int
    reason: str
    def __init__(self, task_id: _Optional[str] = ..., attempt: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ReportAck(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class Drain(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...
