import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason

class Tensor(_message.Message):
    __slots__ = ("shape", "values")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class ActRequest(_message.Message):
    __slots__ = ("policy", "observations")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    policy: str
    observations: Tensor
    def __init__(self, policy: _Optional[str] = ..., observations: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ActResponse(_message.Message):
    __slots__ = ("actions", "values", "policy", "step")
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    actions: Tensor
    values: _containers.RepeatedScalarFieldContainer[float]
    policy: str
    step: int
    def __init__(self, actions: _Optional[_Union[Tensor, _Mapping]] = ..., values: _Optional[_Iterable[float]] = ..., policy: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_tokens", "stop", "seed", "n", "ignore_eos")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    n: int
    ignore_eos: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ..., n: _Optional[int] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("index", "text", "token_ids", "logprobs", "finish_reason")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: FinishReason
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "adapter", "messages", "text", "sampling")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    model: str
    adapter: str
    messages: ChatMessages
    text: str
    sampling: SamplingParams
    def __init__(self, model: _Optional[str] = ..., adapter: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., text: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("samples", "usage", "model", "adapter")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    usage: Usage
    model: str
    adapter: str
    def __init__(self, samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., model: _Optional[str] = ..., adapter: _Optional[str] = ...) -> None: ...

class GenerateStreamRequest(_message.Message):
    __slots__ = ("model", "adapter", "messages", "text", "sampling")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    model: str
    adapter: str
    messages: ChatMessages
    text: str
    sampling: SamplingParams
    def __init__(self, model: _Optional[str] = ..., adapter: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., text: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("index", "text", "token_ids", "logprobs", "finish_reason", "usage")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: FinishReason
    usage: Usage
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Adapter(_message.Message):
    __slots__ = ("name", "path", "size_bytes", "load_time", "last_used_time", "in_use")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_TIME_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_TIME_FIELD_NUMBER: _ClassVar[int]
    IN_USE_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    size_bytes: int
    load_time: _timestamp_pb2.Timestamp
    last_used_time: _timestamp_pb2.Timestamp
    in_use: int
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., size_bytes: _Optional[int] = ..., load_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., last_used_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., in_use: _Optional[int] = ...) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("model", "adapters", "max_resident_adapters", "context_length")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_RESIDENT_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    model: str
    adapters: _containers.RepeatedCompositeFieldContainer[Adapter]
    max_resident_adapters: int
    context_length: int
    def __init__(self, model: _Optional[str] = ..., adapters: _Optional[_Iterable[_Union[Adapter, _Mapping]]] = ..., max_resident_adapters: _Optional[int] = ..., context_length: _Optional[int] = ...) -> None: ...
