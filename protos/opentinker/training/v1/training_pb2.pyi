from opentinker.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LossFn(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOSS_FN_UNSPECIFIED: _ClassVar[LossFn]
    LOSS_FN_CROSS_ENTROPY: _ClassVar[LossFn]
    LOSS_FN_IMPORTANCE_SAMPLING: _ClassVar[LossFn]
    LOSS_FN_PPO: _ClassVar[LossFn]
    LOSS_FN_CISPO: _ClassVar[LossFn]
    LOSS_FN_DRO: _ClassVar[LossFn]
    LOSS_FN_GSPO: _ClassVar[LossFn]
    LOSS_FN_STABLE_REINFORCE: _ClassVar[LossFn]

class StopReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STOP_REASON_UNSPECIFIED: _ClassVar[StopReason]
    STOP_REASON_STOP: _ClassVar[StopReason]
    STOP_REASON_LENGTH: _ClassVar[StopReason]
LOSS_FN_UNSPECIFIED: LossFn
LOSS_FN_CROSS_ENTROPY: LossFn
LOSS_FN_IMPORTANCE_SAMPLING: LossFn
LOSS_FN_PPO: LossFn
LOSS_FN_CISPO: LossFn
LOSS_FN_DRO: LossFn
LOSS_FN_GSPO: LossFn
LOSS_FN_STABLE_REINFORCE: LossFn
STOP_REASON_UNSPECIFIED: StopReason
STOP_REASON_STOP: StopReason
STOP_REASON_LENGTH: StopReason

class Datum(_message.Message):
    __slots__ = ("input_tokens", "target_tokens", "weights", "advantages", "sampling_logprobs", "sequence_ratio_mask", "model_input_spans", "loss_fn_input_spans")
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_RATIO_MASK_FIELD_NUMBER: _ClassVar[int]
    MODEL_INPUT_SPANS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_INPUT_SPANS_FIELD_NUMBER: _ClassVar[int]
    input_tokens: _containers.RepeatedScalarFieldContainer[int]
    target_tokens: _containers.RepeatedScalarFieldContainer[int]
    weights: _containers.RepeatedScalarFieldContainer[float]
    advantages: _containers.RepeatedScalarFieldContainer[float]
    sampling_logprobs: _containers.RepeatedScalarFieldContainer[float]
    sequence_ratio_mask: _containers.RepeatedScalarFieldContainer[float]
    model_input_spans: _containers.RepeatedCompositeFieldContainer[ProvenanceSpan]
    loss_fn_input_spans: _containers.RepeatedCompositeFieldContainer[ProvenanceSpan]
    def __init__(self, input_tokens: _Optional[_Iterable[int]] = ..., target_tokens: _Optional[_Iterable[int]] = ..., weights: _Optional[_Iterable[float]] = ..., advantages: _Optional[_Iterable[float]] = ..., sampling_logprobs: _Optional[_Iterable[float]] = ..., sequence_ratio_mask: _Optional[_Iterable[float]] = ..., model_input_spans: _Optional[_Iterable[_Union[ProvenanceSpan, _Mapping]]] = ..., loss_fn_input_spans: _Optional[_Iterable[_Union[ProvenanceSpan, _Mapping]]] = ...) -> None: ...

class ProvenanceSpan(_message.Message):
    __slots__ = ("sequence_id", "offset", "length", "sampled")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    offset: int
    length: int
    sampled: bool
    def __init__(self, sequence_id: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., sampled: _Optional[bool] = ...) -> None: ...

class LossFnConfig(_message.Message):
    __slots__ = ("clip_low_threshold", "clip_high_threshold", "beta", "kl_coeff")
    CLIP_LOW_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    CLIP_HIGH_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    BETA_FIELD_NUMBER: _ClassVar[int]
    KL_COEFF_FIELD_NUMBER: _ClassVar[int]
    clip_low_threshold: float
    clip_high_threshold: float
    beta: float
    kl_coeff: float
    def __init__(self, clip_low_threshold: _Optional[float] = ..., clip_high_threshold: _Optional[float] = ..., beta: _Optional[float] = ..., kl_coeff: _Optional[float] = ...) -> None: ...

class BatchHeader(_message.Message):
    __slots__ = ("sequence", "datum_count", "loss_fn", "loss_fn_config")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    DATUM_COUNT_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_CONFIG_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    datum_count: int
    loss_fn: LossFn
    loss_fn_config: LossFnConfig
    def __init__(self, sequence: _Optional[int] = ..., datum_count: _Optional[int] = ..., loss_fn: _Optional[_Union[LossFn, str]] = ..., loss_fn_config: _Optional[_Union[LossFnConfig, _Mapping]] = ...) -> None: ...

class DatumChunk(_message.Message):
    __slots__ = ("datums",)
    DATUMS_FIELD_NUMBER: _ClassVar[int]
    datums: _containers.RepeatedCompositeFieldContainer[Datum]
    def __init__(self, datums: _Optional[_Iterable[_Union[Datum, _Mapping]]] = ...) -> None: ...

class ForwardBackwardRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: BatchHeader
    chunk: DatumChunk
    def __init__(self, header: _Optional[_Union[BatchHeader, _Mapping]] = ..., chunk: _Optional[_Union[DatumChunk, _Mapping]] = ...) -> None: ...

class DatumOutput(_message.Message):
    __slots__ = ("logprobs", "loss")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    loss: float
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ..., loss: _Optional[float] = ...) -> None: ...

class ForwardBackwardResponse(_message.Message):
    __slots__ = ("sequence", "outputs", "loss", "metrics", "accumulated_calls")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    ACCUMULATED_CALLS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    outputs: _containers.RepeatedCompositeFieldContainer[DatumOutput]
    loss: float
    metrics: _containers.ScalarMap[str, float]
    accumulated_calls: int
    def __init__(self, sequence: _Optional[int] = ..., outputs: _Optional[_Iterable[_Union[DatumOutput, _Mapping]]] = ..., loss: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ..., accumulated_calls: _Optional[int] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: BatchHeader
    chunk: DatumChunk
    def __init__(self, header: _Optional[_Union[BatchHeader, _Mapping]] = ..., chunk: _Optional[_Union[DatumChunk, _Mapping]] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("sequence", "outputs")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    outputs: _containers.RepeatedCompositeFieldContainer[DatumOutput]
    def __init__(self, sequence: _Optional[int] = ..., outputs: _Optional[_Iterable[_Union[DatumOutput, _Mapping]]] = ...) -> None: ...

class AdamParams(_message.Message):
    __slots__ = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "max_grad_norm")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    max_grad_norm: float
    def __init__(self, learning_rate: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ..., max_grad_norm: _Optional[float] = ...) -> None: ...

class OptimStepRequest(_message.Message):
    __slots__ = ("sequence", "adam")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ADAM_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    adam: AdamParams
    def __init__(self, sequence: _Optional[int] = ..., adam: _Optional[_Union[AdamParams, _Mapping]] = ...) -> None: ...

class OptimStepResponse(_message.Message):
    __slots__ = ("sequence", "step", "grad_norm")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    step: int
    grad_norm: float
    def __init__(self, sequence: _Optional[int] = ..., step: _Optional[int] = ..., grad_norm: _Optional[float] = ...) -> None: ...

class TokenPrompt(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatPrompt(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos", "return_logprobs", "prompt_logprobs", "topk_prompt_logprobs")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOPK_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    return_logprobs: bool
    prompt_logprobs: bool
    topk_prompt_logprobs: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., return_logprobs: _Optional[bool] = ..., prompt_logprobs: _Optional[bool] = ..., topk_prompt_logprobs: _Optional[int] = ...) -> None: ...

class SampleRequest(_message.Message):
    __slots__ = ("sequence", "tokens", "messages", "n", "seed", "params")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    tokens: TokenPrompt
    messages: ChatPrompt
    n: int
    seed: int
    params: SamplingParams
    def __init__(self, sequence: _Optional[int] = ..., tokens: _Optional[_Union[TokenPrompt, _Mapping]] = ..., messages: _Optional[_Union[ChatPrompt, _Mapping]] = ..., n: _Optional[int] = ..., seed: _Optional[int] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class SampledSequence(_message.Message):
    __slots__ = ("tokens", "logprobs", "text", "stop_reason", "sampling_logprobs")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    text: str
    stop_reason: StopReason
    sampling_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., text: _Optional[str] = ..., stop_reason: _Optional[_Union[StopReason, str]] = ..., sampling_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("tokens", "logprobs")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SampleResponse(_message.Message):
    __slots__ = ("sequence", "prompt_tokens", "samples", "step", "prompt_logprobs", "topk_prompt_logprobs")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOPK_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    samples: _containers.RepeatedCompositeFieldContainer[SampledSequence]
    step: int
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    topk_prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    def __init__(self, sequence: _Optional[int] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., samples: _Optional[_Iterable[_Union[SampledSequence, _Mapping]]] = ..., step: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., topk_prompt_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ...) -> None: ...

class SnapshotPrompt(_message.Message):
    __slots__ = ("tokens", "messages", "num_samples", "seed", "record_sequence_ids")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    RECORD_SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    tokens: TokenPrompt
    messages: ChatPrompt
    num_samples: int
    seed: int
    record_sequence_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tokens: _Optional[_Union[TokenPrompt, _Mapping]] = ..., messages: _Optional[_Union[ChatPrompt, _Mapping]] = ..., num_samples: _Optional[int] = ..., seed: _Optional[int] = ..., record_sequence_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class SampleSnapshotRequest(_message.Message):
    __slots__ = ("sampler", "base_model", "prompts", "params")
    SAMPLER_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    sampler: str
    base_model: bool
    prompts: _containers.RepeatedCompositeFieldContainer[SnapshotPrompt]
    params: SamplingParams
    def __init__(self, sampler: _Optional[str] = ..., base_model: _Optional[bool] = ..., prompts: _Optional[_Iterable[_Union[SnapshotPrompt, _Mapping]]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class SnapshotSamples(_message.Message):
    __slots__ = ("prompt_tokens", "samples", "prompt_logprobs", "topk_prompt_logprobs")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOPK_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    samples: _containers.RepeatedCompositeFieldContainer[SampledSequence]
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    topk_prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    def __init__(self, prompt_tokens: _Optional[_Iterable[int]] = ..., samples: _Optional[_Iterable[_Union[SampledSequence, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., topk_prompt_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ...) -> None: ...

class SampleSnapshotResponse(_message.Message):
    __slots__ = ("results", "step")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SnapshotSamples]
    step: int
    def __init__(self, results: _Optional[_Iterable[_Union[SnapshotSamples, _Mapping]]] = ..., step: _Optional[int] = ...) -> None: ...

class SaveStateRequest(_message.Message):
    __slots__ = ("sequence", "name")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    name: str
    def __init__(self, sequence: _Optional[int] = ..., name: _Optional[str] = ...) -> None: ...

class SaveStateResponse(_message.Message):
    __slots__ = ("sequence", "name", "step", "artifact_key")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_KEY_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    name: str
    step: int
    artifact_key: str
    def __init__(self, sequence: _Optional[int] = ..., name: _Optional[str] = ..., step: _Optional[int] = ..., artifact_key: _Optional[str] = ...) -> None: ...

class LoadStateRequest(_message.Message):
    __slots__ = ("sequence", "name", "with_optimizer", "artifact")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    WITH_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    name: str
    with_optimizer: bool
    artifact: _common_pb2.ArtifactRef
    def __init__(self, sequence: _Optional[int] = ..., name: _Optional[str] = ..., with_optimizer: _Optional[bool] = ..., artifact: _Optional[_Union[_common_pb2.ArtifactRef, _Mapping]] = ...) -> None: ...

class LoadStateResponse(_message.Message):
    __slots__ = ("sequence", "name", "step")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    name: str
    step: int
    def __init__(self, sequence: _Optional[int] = ..., name: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class SaveWeightsForSamplerRequest(_message.Message):
    __slots__ = ("sequence", "name")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    name: str
    def __init__(self, sequence: _Optional[int] = ..., name: _Optional[str] = ...) -> None: ...

class SaveWeightsForSamplerResponse(_message.Message):
    __slots__ = ("sequence", "name", "step", "artifact_key", "adapter")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_KEY_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    name: str
    step: int
    artifact_key: str
    adapter: str
    def __init__(self, sequence: _Optional[int] = ..., name: _Optional[str] = ..., step: _Optional[int] = ..., artifact_key: _Optional[str] = ..., adapter: _Optional[str] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("model", "tokenizer", "chat_template", "model_config_json", "lora_rank", "lora_alpha", "target_modules", "next_sequence", "step", "attempt", "resumed_from", "max_datums_per_call", "max_tokens_per_call", "max_in_flight_calls", "stop_token_ids", "accumulated_calls", "states", "full_weights")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    LORA_ALPHA_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FROM_FIELD_NUMBER: _ClassVar[int]
    MAX_DATUMS_PER_CALL_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_CALL_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_CALLS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ACCUMULATED_CALLS_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    FULL_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    tokenizer: str
    chat_template: str
    model_config_json: str
    lora_rank: int
    lora_alpha: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    next_sequence: int
    step: int
    attempt: int
    resumed_from: str
    max_datums_per_call: int
    max_tokens_per_call: int
    max_in_flight_calls: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    accumulated_calls: int
    states: _containers.RepeatedScalarFieldContainer[str]
    full_weights: bool
    def __init__(self, model: _Optional[str] = ..., tokenizer: _Optional[str] = ..., chat_template: _Optional[str] = ..., model_config_json: _Optional[str] = ..., lora_rank: _Optional[int] = ..., lora_alpha: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ..., next_sequence: _Optional[int] = ..., step: _Optional[int] = ..., attempt: _Optional[int] = ..., resumed_from: _Optional[str] = ..., max_datums_per_call: _Optional[int] = ..., max_tokens_per_call: _Optional[int] = ..., max_in_flight_calls: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., accumulated_calls: _Optional[int] = ..., states: _Optional[_Iterable[str]] = ..., full_weights: _Optional[bool] = ...) -> None: ...
