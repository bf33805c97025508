from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Space(_message.Message):
    __slots__ = ("discrete", "box")
    DISCRETE_FIELD_NUMBER: _ClassVar[int]
    BOX_FIELD_NUMBER: _ClassVar[int]
    discrete: DiscreteSpace
    box: BoxSpace
    def __init__(self, discrete: _Optional[_Union[DiscreteSpace, _Mapping]] = ..., box: _Optional[_Union[BoxSpace, _Mapping]] = ...) -> None: ...

class DiscreteSpace(_message.Message):
    __slots__ = ("n",)
    N_FIELD_NUMBER: _ClassVar[int]
    n: int
    def __init__(self, n: _Optional[int] = ...) -> None: ...

class BoxSpace(_message.Message):
    __slots__ = ("shape",)
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, shape: _Optional[_Iterable[int]] = ...) -> None: ...

class Observation(_message.Message):
    __slots__ = ("discrete", "box")
    DISCRETE_FIELD_NUMBER: _ClassVar[int]
    BOX_FIELD_NUMBER: _ClassVar[int]
    discrete: int
    box: BoxValue
    def __init__(self, discrete: _Optional[int] = ..., box: _Optional[_Union[BoxValue, _Mapping]] = ...) -> None: ...

class BoxValue(_message.Message):
    __slots__ = ("shape", "values")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class Action(_message.Message):
    __slots__ = ("discrete", "box")
    DISCRETE_FIELD_NUMBER: _ClassVar[int]
    BOX_FIELD_NUMBER: _ClassVar[int]
    discrete: int
    box: BoxValue
    def __init__(self, discrete: _Optional[int] = ..., box: _Optional[_Union[BoxValue, _Mapping]] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("action_space", "observation_space", "action_names", "name")
    ACTION_SPACE_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_SPACE_FIELD_NUMBER: _ClassVar[int]
    ACTION_NAMES_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    action_space: Space
    observation_space: Space
    action_names: _containers.RepeatedScalarFieldContainer[str]
    name: str
    def __init__(self, action_space: _Optional[_Union[Space, _Mapping]] = ..., observation_space: _Optional[_Union[Space, _Mapping]] = ..., action_names: _Optional[_Iterable[str]] = ..., name: _Optional[str] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("session_id", "items")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    items: _containers.RepeatedCompositeFieldContainer[ResetItem]
    def __init__(self, session_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[ResetItem, _Mapping]]] = ...) -> None: ...

class ResetItem(_message.Message):
    __slots__ = ("env_index", "seed")
    ENV_INDEX_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    env_index: int
    seed: int
    def __init__(self, env_index: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ResetResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ResetResult, _Mapping]]] = ...) -> None: ...

class ResetResult(_message.Message):
    __slots__ = ("env_index", "observation", "info")
    ENV_INDEX_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    env_index: int
    observation: Observation
    info: _struct_pb2.Struct
    def __init__(self, env_index: _Optional[int] = ..., observation: _Optional[_Union[Observation, _Mapping]] = ..., info: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("session_id", "items")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    items: _containers.RepeatedCompositeFieldContainer[StepItem]
    def __init__(self, session_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[StepItem, _Mapping]]] = ...) -> None: ...

class StepItem(_message.Message):
    __slots__ = ("env_index", "action")
    ENV_INDEX_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    env_index: int
    action: Action
    def __init__(self, env_index: _Optional[int] = ..., action: _Optional[_Union[Action, _Mapping]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[StepResult]
    def __init__(self, results: _Optional[_Iterable[_Union[StepResult, _Mapping]]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("env_index", "observation", "reward", "terminated", "truncated", "info")
    ENV_INDEX_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    TERMINATED_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    env_index: int
    observation: Observation
    reward: float
    terminated: bool
    truncated: bool
    info: _struct_pb2.Struct
    def __init__(self, env_index: _Optional[int] = ..., observation: _Optional[_Union[Observation, _Mapping]] = ..., reward: _Optional[float] = ..., terminated: _Optional[bool] = ..., truncated: _Optional[bool] = ..., info: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ScoreItem]
    def __init__(self, items: _Optional[_Iterable[_Union[ScoreItem, _Mapping]]] = ...) -> None: ...

class ScoreItem(_message.Message):
    __slots__ = ("prompt", "completion", "metadata")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    completion: str
    metadata: _struct_pb2.Struct
    def __init__(self, prompt: _Optional[str] = ..., completion: _Optional[str] = ..., metadata: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ScoreResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ScoreResult, _Mapping]]] = ...) -> None: ...

class ScoreResult(_message.Message):
    __slots__ = ("reward", "error")
    REWARD_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    reward: float
    error: str
    def __init__(self, reward: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...
