import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from opentinker.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ApiKeyRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    API_KEY_ROLE_UNSPECIFIED: _ClassVar[ApiKeyRole]
    API_KEY_ROLE_ADMIN: _ClassVar[ApiKeyRole]
    API_KEY_ROLE_USER: _ClassVar[ApiKeyRole]
    API_KEY_ROLE_NODE: _ClassVar[ApiKeyRole]
API_KEY_ROLE_UNSPECIFIED: ApiKeyRole
API_KEY_ROLE_ADMIN: ApiKeyRole
API_KEY_ROLE_USER: ApiKeyRole
API_KEY_ROLE_NODE: ApiKeyRole

class ApiKey(_message.Message):
    __slots__ = ("prefix", "owner", "role", "description", "create_time", "revoke_time", "expire_time", "active", "replaced_by")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    REVOKE_TIME_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    REPLACED_BY_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    owner: str
    role: ApiKeyRole
    description: str
    create_time: _timestamp_pb2.Timestamp
    revoke_time: _timestamp_pb2.Timestamp
    expire_time: _timestamp_pb2.Timestamp
    active: bool
    replaced_by: str
    def __init__(self, prefix: _Optional[str] = ..., owner: _Optional[str] = ..., role: _Optional[_Union[ApiKeyRole, str]] = ..., description: _Optional[str] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., revoke_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., active: _Optional[bool] = ..., replaced_by: _Optional[str] = ...) -> None: ...

class CreateApiKeyRequest(_message.Message):
    __slots__ = ("owner", "role", "description")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    owner: str
    role: ApiKeyRole
    description: str
    def __init__(self, owner: _Optional[str] = ..., role: _Optional[_Union[ApiKeyRole, str]] = ..., description: _Optional[str] = ...) -> None: ...

class CreateApiKeyResponse(_message.Message):
    __slots__ = ("key", "api_key")
    KEY_FIELD_NUMBER: _ClassVar[int]
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    key: ApiKey
    api_key: str
    def __init__(self, key: _Optional[_Union[ApiKey, _Mapping]] = ..., api_key: _Optional[str] = ...) -> None: ...

class ListApiKeysRequest(_message.Message):
    __slots__ = ("owner", "include_inactive")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_INACTIVE_FIELD_NUMBER: _ClassVar[int]
    owner: str
    include_inactive: bool
    def __init__(self, owner: _Optional[str] = ..., include_inactive: _Optional[bool] = ...) -> None: ...

class ListApiKeysResponse(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[ApiKey]
    def __init__(self, keys: _Optional[_Iterable[_Union[ApiKey, _Mapping]]] = ...) -> None: ...

class RevokeApiKeyRequest(_message.Message):
    __slots__ = ("prefix",)
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    def __init__(self, prefix: _Optional[str] = ...) -> None: ...

class RevokeApiKeyResponse(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: ApiKey
    def __init__(self, key: _Optional[_Union[ApiKey, _Mapping]] = ...) -> None: ...

class RotateApiKeyRequest(_message.Message):
    __slots__ = ("prefix", "grace")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    GRACE_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    grace: _duration_pb2.Duration
    def __init__(self, prefix: _Optional[str] = ..., grace: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class RotateApiKeyResponse(_message.Message):
    __slots__ = ("key", "api_key", "old_key")
    KEY_FIELD_NUMBER: _ClassVar[int]
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    OLD_KEY_FIELD_NUMBER: _ClassVar[int]
    key: ApiKey
    api_key: str
    old_key: ApiKey
    def __init__(self, key: _Optional[_Union[ApiKey, _Mapping]] = ..., api_key: _Optional[str] = ..., old_key: _Optional[_Union[ApiKey, _Mapping]] = ...) -> None: ...

class ListAuditEventsRequest(_message.Message):
    __slots__ = ("page_size", "before_id", "action")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    BEFORE_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    before_id: int
    action: str
    def __init__(self, page_size: _Optional[int] = ..., before_id: _Optional[int] = ..., action: _Optional[str] = ...) -> None: ...

class AuditEvent(_message.Message):
    __slots__ = ("id", "time", "owner", "role", "key_prefix", "action", "task_id", "outcome", "detail_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    KEY_PREFIX_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    DETAIL_JSON_FIELD_NUMBER: _ClassVar[int]
    id: int
    time: _timestamp_pb2.Timestamp
    owner: str
    role: str
    key_prefix: str
    action: str
    task_id: str
    outcome: str
    detail_json: str
    def __init__(self, id: _Optional[int] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., owner: _Optional[str] = ..., role: _Optional[str] = ..., key_prefix: _Optional[str] = ..., action: _Optional[str] = ..., task_id: _Optional[str] = ..., outcome: _Optional[str] = ..., detail_json: _Optional[str] = ...) -> None: ...

class ListAuditEventsResponse(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[AuditEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[AuditEvent, _Mapping]]] = ...) -> None: ...

class Queue(_message.Message):
    __slots__ = ("name", "gpu_quota", "cpu_task_quota", "gpu_borrowing_limit", "cpu_task_borrowing_limit", "owners", "gpus_in_use", "cpu_tasks_in_use", "pending_tasks", "dominant_share", "limited", "max_pending_per_owner", "submit_rate", "submit_burst", "usage", "overridden", "override_time", "override_by", "configured")
    NAME_FIELD_NUMBER: _ClassVar[int]
    GPU_QUOTA_FIELD_NUMBER: _ClassVar[int]
    CPU_TASK_QUOTA_FIELD_NUMBER: _ClassVar[int]
    GPU_BORROWING_LIMIT_FIELD_NUMBER: _ClassVar[int]
    CPU_TASK_BORROWING_LIMIT_FIELD_NUMBER: _ClassVar[int]
    OWNERS_FIELD_NUMBER: _ClassVar[int]
    GPUS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    CPU_TASKS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    PENDING_TASKS_FIELD_NUMBER: _ClassVar[int]
    DOMINANT_SHARE_FIELD_NUMBER: _ClassVar[int]
    LIMITED_FIELD_NUMBER: _ClassVar[int]
    MAX_PENDING_PER_OWNER_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_RATE_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_BURST_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    OVERRIDDEN_FIELD_NUMBER: _ClassVar[int]
    OVERRIDE_TIME_FIELD_NUMBER: _ClassVar[int]
    OVERRIDE_BY_FIELD_NUMBER: _ClassVar[int]
    CONFIGURED_FIELD_NUMBER: _ClassVar[int]
    name: str
    gpu_quota: int
    cpu_task_quota: int
    gpu_borrowing_limit: int
    cpu_task_borrowing_limit: int
    owners: _containers.RepeatedScalarFieldContainer[str]
    gpus_in_use: int
    cpu_tasks_in_use: int
    pending_tasks: int
    dominant_share: float
    limited: bool
    max_pending_per_owner: int
    submit_rate: float
    submit_burst: int
    usage: _common_pb2.Usage
    overridden: bool
    override_time: _timestamp_pb2.Timestamp
    override_by: str
    configured: Queue
    def __init__(self, name: _Optional[str] = ..., gpu_quota: _Optional[int] = ..., cpu_task_quota: _Optional[int] = ..., gpu_borrowing_limit: _Optional[int] = ..., cpu_task_borrowing_limit: _Optional[int] = ..., owners: _Optional[_Iterable[str]] = ..., gpus_in_use: _Optional[int] = ..., cpu_tasks_in_use: _Optional[int] = ..., pending_tasks: _Optional[int] = ..., dominant_share: _Optional[float] = ..., limited: _Optional[bool] = ..., max_pending_per_owner: _Optional[int] = ..., submit_rate: _Optional[float] = ..., submit_burst: _Optional[int] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., overridden: _Optional[bool] = ..., override_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., override_by: _Optional[str] = ..., configured: _Optional[_Union[Queue, _Mapping]] = ...) -> None: ...

class ListQueuesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListQueuesResponse(_message.Message):
    __slots__ = ("queues",)
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    queues: _containers.RepeatedCompositeFieldContainer[Queue]
    def __init__(self, queues: _Optional[_Iterable[_Union[Queue, _Mapping]]] = ...) -> None: ...

class SetQueueQuotaRequest(_message.Message):
    __slots__ = ("queue",)
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    queue: Queue
    def __init__(self, queue: _Optional[_Union[Queue, _Mapping]] = ...) -> None: ...

class SetQueueQuotaResponse(_message.Message):
    __slots__ = ("queue", "previous")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    queue: Queue
    previous: Queue
    def __init__(self, queue: _Optional[_Union[Queue, _Mapping]] = ..., previous: _Optional[_Union[Queue, _Mapping]] = ...) -> None: ...

class ResetQueueQuotaRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ResetQueueQuotaResponse(_message.Message):
    __slots__ = ("queue", "removed")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    queue: Queue
    removed: Queue
    def __init__(self, queue: _Optional[_Union[Queue, _Mapping]] = ..., removed: _Optional[_Union[Queue, _Mapping]] = ...) -> None: ...

class GetDesiredTrainersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeClassDemand(_message.Message):
    __slots__ = ("node_class", "desired_trainers", "connected_trainers", "pending_gpus")
    NODE_CLASS_FIELD_NUMBER: _ClassVar[int]
    DESIRED_TRAINERS_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_TRAINERS_FIELD_NUMBER: _ClassVar[int]
    PENDING_GPUS_FIELD_NUMBER: _ClassVar[int]
    node_class: str
    desired_trainers: int
    connected_trainers: int
    pending_gpus: int
    def __init__(self, node_class: _Optional[str] = ..., desired_trainers: _Optional[int] = ..., connected_trainers: _Optional[int] = ..., pending_gpus: _Optional[int] = ...) -> None: ...

class GetDesiredTrainersResponse(_message.Message):
    __slots__ = ("node_classes",)
    NODE_CLASSES_FIELD_NUMBER: _ClassVar[int]
    node_classes: _containers.RepeatedCompositeFieldContainer[NodeClassDemand]
    def __init__(self, node_classes: _Optional[_Iterable[_Union[NodeClassDemand, _Mapping]]] = ...) -> None: ...
