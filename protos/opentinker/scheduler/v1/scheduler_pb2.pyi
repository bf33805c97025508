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

class SubmitTaskRequest(_message.Message):
    __slots__ = ("spec", "request_id", "dry_run", "dataset_uploaded_at_submit")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    DATASET_UPLOADED_AT_SUBMIT_FIELD_NUMBER: _ClassVar[int]
    spec: _common_pb2.TaskSpec
    request_id: str
    dry_run: bool
    dataset_uploaded_at_submit: bool
    def __init__(self, spec: _Optional[_Union[_common_pb2.TaskSpec, _Mapping]] = ..., request_id: _Optional[str] = ..., dry_run: _Optional[bool] = ..., dataset_uploaded_at_submit: _Optional[bool] = ...) -> None: ...

class SubmitTaskResponse(_message.Message):
    __slots__ = ("task", "estimate", "estimate_basis")
    TASK_FIELD_NUMBER: _ClassVar[int]
    ESTIMATE_FIELD_NUMBER: _ClassVar[int]
    ESTIMATE_BASIS_FIELD_NUMBER: _ClassVar[int]
    task: _common_pb2.Task
    estimate: _common_pb2.Usage
    estimate_basis: str
    def __init__(self, task: _Optional[_Union[_common_pb2.Task, _Mapping]] = ..., estimate: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., estimate_basis: _Optional[str] = ...) -> None: ...

class GetTaskRequest(_message.Message):
    __slots__ = ("task_id",)
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    def __init__(self, task_id: _Optional[str] = ...) -> None: ...

class GetTaskResponse(_message.Message):
    __slots__ = ("task",)
    TASK_FIELD_NUMBER: _ClassVar[int]
    task: _common_pb2.Task
    def __init__(self, task: _Optional[_Union[_common_pb2.Task, _Mapping]] = ...) -> None: ...

class ListTasksRequest(_message.Message):
    __slots__ = ("states", "page_size", "page_token")
    STATES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedScalarFieldContainer[_common_pb2.TaskState]
    page_size: int
    page_token: str
    def __init__(self, states: _Optional[_Iterable[_Union[_common_pb2.TaskState, str]]] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListTasksResponse(_message.Message):
    __slots__ = ("tasks", "next_page_token")
    TASKS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[_common_pb2.Task]
    next_page_token: str
    def __init__(self, tasks: _Optional[_Iterable[_Union[_common_pb2.Task, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class CancelTaskRequest(_message.Message):
    __slots__ = ("task_id", "reason")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    reason: str
    def __init__(self, task_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelTaskResponse(_message.Message):
    __slots__ = ("task",)
    TASK_FIELD_NUMBER: _ClassVar[int]
    task: _common_pb2.Task
    def __init__(self, task: _Optional[_Union[_common_pb2.Task, _Mapping]] = ...) -> None: ...

class DeleteTaskArtifactsRequest(_message.Message):
    __slots__ = ("task_id",)
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    def __init__(self, task_id: _Optional[str] = ...) -> None: ...

class DeleteTaskArtifactsResponse(_message.Message):
    __slots__ = ("task", "deleted_keys", "deleted_bytes")
    TASK_FIELD_NUMBER: _ClassVar[int]
    DELETED_KEYS_FIELD_NUMBER: _ClassVar[int]
    DELETED_BYTES_FIELD_NUMBER: _ClassVar[int]
    task: _common_pb2.Task
    deleted_keys: _containers.RepeatedScalarFieldContainer[str]
    deleted_bytes: int
    def __init__(self, task: _Optional[_Union[_common_pb2.Task, _Mapping]] = ..., deleted_keys: _Optional[_Iterable[str]] = ..., deleted_bytes: _Optional[int] = ...) -> None: ...

class DeleteCheckpointRequest(_message.Message):
    __slots__ = ("task_id", "artifact_key")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_KEY_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    artifact_key: str
    def __init__(self, task_id: _Optional[str] = ..., artifact_key: _Optional[str] = ...) -> None: ...

class DeleteCheckpointResponse(_message.Message):
    __slots__ = ("deleted_bytes",)
    DELETED_BYTES_FIELD_NUMBER: _ClassVar[int]
    deleted_bytes: int
    def __init__(self, deleted_bytes: _Optional[int] = ...) -> None: ...

class SetCheckpointTtlRequest(_message.Message):
    __slots__ = ("task_id", "artifact_key", "ttl")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_KEY_FIELD_NUMBER: _ClassVar[int]
    TTL_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    artifact_key: str
    ttl: _duration_pb2.Duration
    def __init__(self, task_id: _Optional[str] = ..., artifact_key: _Optional[str] = ..., ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class SetCheckpointTtlResponse(_message.Message):
    __slots__ = ("expire_time",)
    EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    expire_time: _timestamp_pb2.Timestamp
    def __init__(self, expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class WatchTaskRequest(_message.Message):
    __slots__ = ("task_id", "after_sequence", "history_only")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    HISTORY_ONLY_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    after_sequence: int
    history_only: bool
    def __init__(self, task_id: _Optional[str] = ..., after_sequence: _Optional[int] = ..., history_only: _Optional[bool] = ...) -> None: ...

class WatchTaskResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: _common_pb2.TaskEvent
    def __init__(self, event: _Optional[_Union[_common_pb2.TaskEvent, _Mapping]] = ...) -> None: ...

class GetMetricsRequest(_message.Message):
    __slots__ = ("task_id", "after_step", "include_history")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_STEP_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_HISTORY_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    after_step: int
    include_history: bool
    def __init__(self, task_id: _Optional[str] = ..., after_step: _Optional[int] = ..., include_history: _Optional[bool] = ...) -> None: ...

class GetMetricsResponse(_message.Message):
    __slots__ = ("task_id", "latest", "latest_step", "points")
    class LatestEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    LATEST_STEP_FIELD_NUMBER: _ClassVar[int]
    POINTS_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    latest: _containers.ScalarMap[str, float]
    latest_step: int
    points: _containers.RepeatedCompositeFieldContainer[_common_pb2.MetricPoint]
    def __init__(self, task_id: _Optional[str] = ..., latest: _Optional[_Mapping[str, float]] = ..., latest_step: _Optional[int] = ..., points: _Optional[_Iterable[_Union[_common_pb2.MetricPoint, _Mapping]]] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelNamesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelNamesResponse(_message.Message):
    __slots__ = ("model_names",)
    MODEL_NAMES_FIELD_NUMBER: _ClassVar[int]
    model_names: _containers.RepeatedCompositeFieldContainer[ModelName]
    def __init__(self, model_names: _Optional[_Iterable[_Union[ModelName, _Mapping]]] = ...) -> None: ...

class ModelName(_message.Message):
    __slots__ = ("name", "folder")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FOLDER_FIELD_NUMBER: _ClassVar[int]
    name: str
    folder: str
    def __init__(self, name: _Optional[str] = ..., folder: _Optional[str] = ...) -> None: ...

class Node(_message.Message):
    __slots__ = ("node_id", "connected", "devices", "gpu_count", "gpus_free", "max_tasks", "running_task_ids", "telemetry", "last_heartbeat_time", "version", "notes", "host", "model_hosts", "gpu_memory_estimates")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    GPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    GPUS_FREE_FIELD_NUMBER: _ClassVar[int]
    MAX_TASKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    TELEMETRY_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_TIME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    MODEL_HOSTS_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_ESTIMATES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    connected: bool
    devices: _containers.RepeatedCompositeFieldContainer[_common_pb2.Device]
    gpu_count: int
    gpus_free: int
    max_tasks: int
    running_task_ids: _containers.RepeatedScalarFieldContainer[str]
    telemetry: _containers.RepeatedCompositeFieldContainer[_common_pb2.DeviceTelemetry]
    last_heartbeat_time: _timestamp_pb2.Timestamp
    version: str
    notes: _containers.RepeatedScalarFieldContainer[str]
    host: _common_pb2.HostTelemetry
    model_hosts: _containers.RepeatedCompositeFieldContainer[_common_pb2.ModelHost]
    gpu_memory_estimates: _containers.RepeatedCompositeFieldContainer[GpuMemoryEstimate]
    def __init__(self, node_id: _Optional[str] = ..., connected: _Optional[bool] = ..., devices: _Optional[_Iterable[_Union[_common_pb2.Device, _Mapping]]] = ..., gpu_count: _Optional[int] = ..., gpus_free: _Optional[int] = ..., max_tasks: _Optional[int] = ..., running_task_ids: _Optional[_Iterable[str]] = ..., telemetry: _Optional[_Iterable[_Union[_common_pb2.DeviceTelemetry, _Mapping]]] = ..., last_heartbeat_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., version: _Optional[str] = ..., notes: _Optional[_Iterable[str]] = ..., host: _Optional[_Union[_common_pb2.HostTelemetry, _Mapping]] = ..., model_hosts: _Optional[_Iterable[_Union[_common_pb2.ModelHost, _Mapping]]] = ..., gpu_memory_estimates: _Optional[_Iterable[_Union[GpuMemoryEstimate, _Mapping]]] = ...) -> None: ...

class GpuMemoryEstimate(_message.Message):
    __slots__ = ("index", "booked_bytes", "total_bytes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    BOOKED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    index: int
    booked_bytes: int
    total_bytes: int
    def __init__(self, index: _Optional[int] = ..., booked_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[Node]
    def __init__(self, nodes: _Optional[_Iterable[_Union[Node, _Mapping]]] = ...) -> None: ...

class UploadDatasetRequest(_message.Message):
    __slots__ = ("name", "total_bytes", "chunk", "format")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    name: str
    total_bytes: int
    chunk: bytes
    format: str
    def __init__(self, name: _Optional[str] = ..., total_bytes: _Optional[int] = ..., chunk: _Optional[bytes] = ..., format: _Optional[str] = ...) -> None: ...

class DatasetInfo(_message.Message):
    __slots__ = ("dataset_id", "name", "size_bytes", "num_examples", "format")
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    dataset_id: str
    name: str
    size_bytes: int
    num_examples: int
    format: str
    def __init__(self, dataset_id: _Optional[str] = ..., name: _Optional[str] = ..., size_bytes: _Optional[int] = ..., num_examples: _Optional[int] = ..., format: _Optional[str] = ...) -> None: ...

class UploadDatasetResponse(_message.Message):
    __slots__ = ("dataset",)
    DATASET_FIELD_NUMBER: _ClassVar[int]
    dataset: DatasetInfo
    def __init__(self, dataset: _Optional[_Union[DatasetInfo, _Mapping]] = ...) -> None: ...

class DownloadDatasetRequest(_message.Message):
    __slots__ = ("dataset_id",)
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    dataset_id: str
    def __init__(self, dataset_id: _Optional[str] = ...) -> None: ...

class DownloadDatasetResponse(_message.Message):
    __slots__ = ("dataset", "chunk")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    dataset: DatasetInfo
    chunk: bytes
    def __init__(self, dataset: _Optional[_Union[DatasetInfo, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class ListCheckpointsRequest(_message.Message):
    __slots__ = ("task_id",)
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    def __init__(self, task_id: _Optional[str] = ...) -> None: ...

class ListCheckpointsResponse(_message.Message):
    __slots__ = ("checkpoints", "artifacts_deleted", "deleted_keys")
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_DELETED_FIELD_NUMBER: _ClassVar[int]
    DELETED_KEYS_FIELD_NUMBER: _ClassVar[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[_common_pb2.Checkpoint]
    artifacts_deleted: _common_pb2.TaskEvent
    deleted_keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, checkpoints: _Optional[_Iterable[_Union[_common_pb2.Checkpoint, _Mapping]]] = ..., artifacts_deleted: _Optional[_Union[_common_pb2.TaskEvent, _Mapping]] = ..., deleted_keys: _Optional[_Iterable[str]] = ...) -> None: ...

class DownloadCheckpointRequest(_message.Message):
    __slots__ = ("task_id", "step", "artifact_key")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_KEY_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    step: int
    artifact_key: str
    def __init__(self, task_id: _Optional[str] = ..., step: _Optional[int] = ..., artifact_key: _Optional[str] = ...) -> None: ...

class CheckpointFile(_message.Message):
    __slots__ = ("path", "size_bytes", "sha256")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    path: str
    size_bytes: int
    sha256: str
    def __init__(self, path: _Optional[str] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class CheckpointManifest(_message.Message):
    __slots__ = ("checkpoint", "files", "total_bytes")
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    checkpoint: _common_pb2.Checkpoint
    files: _containers.RepeatedCompositeFieldContainer[CheckpointFile]
    total_bytes: int
    def __init__(self, checkpoint: _Optional[_Union[_common_pb2.Checkpoint, _Mapping]] = ..., files: _Optional[_Iterable[_Union[CheckpointFile, _Mapping]]] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class ImportAdapterRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: ImportAdapterHeader
    chunk: CheckpointChunk
    def __init__(self, header: _Optional[_Union[ImportAdapterHeader, _Mapping]] = ..., chunk: _Optional[_Union[CheckpointChunk, _Mapping]] = ...) -> None: ...

class ImportAdapterHeader(_message.Message):
    __slots__ = ("model", "name", "files")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    model: str
    name: str
    files: _containers.RepeatedCompositeFieldContainer[CheckpointFile]
    def __init__(self, model: _Optional[str] = ..., name: _Optional[str] = ..., files: _Optional[_Iterable[_Union[CheckpointFile, _Mapping]]] = ...) -> None: ...

class ImportAdapterResponse(_message.Message):
    __slots__ = ("task",)
    TASK_FIELD_NUMBER: _ClassVar[int]
    task: _common_pb2.Task
    def __init__(self, task: _Optional[_Union[_common_pb2.Task, _Mapping]] = ...) -> None: ...

class CheckpointChunk(_message.Message):
    __slots__ = ("file_index", "offset", "data")
    FILE_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    file_index: int
    offset: int
    data: bytes
    def __init__(self, file_index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class DownloadCheckpointResponse(_message.Message):
    __slots__ = ("manifest", "chunk")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    manifest: CheckpointManifest
    chunk: CheckpointChunk
    def __init__(self, manifest: _Optional[_Union[CheckpointManifest, _Mapping]] = ..., chunk: _Optional[_Union[CheckpointChunk, _Mapping]] = ...) -> None: ...

class GetUsageRequest(_message.Message):
    __slots__ = ("owner", "since")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    owner: str
    since: _timestamp_pb2.Timestamp
    def __init__(self, owner: _Optional[str] = ..., since: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class UsageRow(_message.Message):
    __slots__ = ("name", "usage", "queue")
    NAME_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    usage: _common_pb2.Usage
    queue: str
    def __init__(self, name: _Optional[str] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., queue: _Optional[str] = ...) -> None: ...

class GetUsageResponse(_message.Message):
    __slots__ = ("owners", "queues", "currency")
    OWNERS_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    CURRENCY_FIELD_NUMBER: _ClassVar[int]
    owners: _containers.RepeatedCompositeFieldContainer[UsageRow]
    queues: _containers.RepeatedCompositeFieldContainer[UsageRow]
    currency: str
    def __init__(self, owners: _Optional[_Iterable[_Union[UsageRow, _Mapping]]] = ..., queues: _Optional[_Iterable[_Union[UsageRow, _Mapping]]] = ..., currency: _Optional[str] = ...) -> None: ...

class IssueEndpointTokenRequest(_message.Message):
    __slots__ = ("task_id", "ttl")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    ttl: _duration_pb2.Duration
    def __init__(self, task_id: _Optional[str] = ..., ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class IssueEndpointTokenResponse(_message.Message):
    __slots__ = ("token", "expire_time")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    token: str
    expire_time: _timestamp_pb2.Timestamp
    def __init__(self, token: _Optional[str] = ..., expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class AuthorizeEndpointRequest(_message.Message):
    __slots__ = ("endpoint_task_id", "task_id")
    ENDPOINT_TASK_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    endpoint_task_id: str
    task_id: str
    def __init__(self, endpoint_task_id: _Optional[str] = ..., task_id: _Optional[str] = ...) -> None: ...

class AuthorizeEndpointResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
