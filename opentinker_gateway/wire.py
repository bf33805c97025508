"""Tinker's wire format to and from ``opentinker.training.v1``.

The protobuf messages are the SDK's own (``tinker.proto.tinker_public_pb2``, from the pinned
wheel); nothing here re-types them. A refusal names the field as the SDK's request spells it
(``data[2].loss_fn_inputs.weights``).
"""

from __future__ import annotations

import math

import numpy as np
from tinker.proto import tinker_public_pb2 as tpb

from opentinker.training.v1 import training_pb2

from opentinker_gateway.errors import ApiError

__all__ = [
    "LOSSES",
    "datums_from_proto",
    "loss_config",
    "forward_backward_output",
    "adam_params",
]

#: Tinker loss names and the session's loss for each (``cross_entropy`` -> LOSS_FN_CROSS_ENTROPY ...).
LOSSES = {name[len("LOSS_FN_") :].lower(): value for name, value in training_pb2.LossFn.items() if value}

#: Tinker's ``loss_fn_config`` keys, the session's LossFnConfig fields of the same names.
CONFIG_KEYS = tuple(f.name for f in training_pb2.LossFnConfig.DESCRIPTOR.fields)

_NUMPY = {
    tpb.DTYPE_FLOAT32: np.dtype("<f4"),
    tpb.DTYPE_INT64: np.dtype("<i8"),
    tpb.DTYPE_INT32: np.dtype("<i4"),
}
_INTEGER = (tpb.DTYPE_INT64, tpb.DTYPE_INT32)

#: loss_fn_inputs keys and the session's Datum field each fills.
_INPUTS = {
    "target_tokens": "target_tokens",
    "weights": "weights",
    "advantages": "advantages",
    "logprobs": "sampling_logprobs",
    "sequence_ratio_mask": "sequence_ratio_mask",
}


def _tensor(t: tpb.Tensor, field: str, n: int, *, integer: bool) -> list:
    if t.HasField("sparse_csr"):
        raise ApiError(f"{field}: expected a dense tensor, got a sparse one")
    dtype = _NUMPY.get(t.dtype)
    if dtype is None:
        raise ApiError(f"{field}: expected dtype float32 or int64, got {tpb.DType.Name(t.dtype)}")
    if integer and t.dtype not in _INTEGER:
        raise ApiError(f"{field}: expected dtype int64 (token ids), got {tpb.DType.Name(t.dtype)}")
    if not integer and t.dtype in _INTEGER:
        raise ApiError(f"{field}: expected dtype float32, got {tpb.DType.Name(t.dtype)}")
    if len(t.dense) % dtype.itemsize:
        raise ApiError(f"{field}: {len(t.dense)} bytes is not a whole number of {dtype.name} values")
    values = np.frombuffer(t.dense, dtype=dtype)
    shape = list(t.shape)
    if shape and math.prod(shape) != values.size:
        raise ApiError(f"{field}: shape {shape} holds {math.prod(shape)} values, the data has {values.size}")
    if len(shape) > 1:
        raise ApiError(f"{field}: expected a 1-D tensor (one value per input token), got shape {shape}")
    if values.size != n:
        raise ApiError(f"{field}: expected {n} values (one per input token), got {values.size}")
    return values.tolist()


def _tokens(datum: tpb.Datum, field: str) -> list[int]:
    out: list[int] = []
    for j, chunk in enumerate(datum.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise ApiError(f"{field}.model_input.chunks[{j}]: expected an encoded_text chunk, got {kind}")
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise ApiError(f"{field}.model_input.chunks[{j}].tokens: expected int32 values, got {len(raw)} bytes")
        out += np.frombuffer(raw, dtype="<i4").tolist()
    if not out:
        raise ApiError(f"{field}.model_input: expected at least one token, got none")
    return out


def datums_from_proto(request: tpb.ForwardBackwardRequest) -> list[training_pb2.Datum]:
    """The session's datums of a Tinker ``ForwardBackwardRequest``, checked field by field."""
    if not request.data:
        raise ApiError("data: expected at least one datum, got none")
    datums = []
    for i, datum in enumerate(request.data):
        field = f"data[{i}]"
        tokens = _tokens(datum, field)
        fields: dict[str, list] = {"input_tokens": tokens}
        for name, tensor in datum.loss_fn_inputs.items():
            target = _INPUTS.get(name)
            if target is None:
                raise ApiError(
                    f"{field}.loss_fn_inputs.{name}: expected one of {', '.join(sorted(_INPUTS))}, got {name!r}"
                )
            fields[target] = _tensor(
                tensor, f"{field}.loss_fn_inputs.{name}", len(tokens), integer=name == "target_tokens"
            )
        if "target_tokens" not in fields:
            raise ApiError(f"{field}.loss_fn_inputs.target_tokens: required, missing")
        spans = {name: _spans(getattr(datum, name), f"{field}.{name}", len(tokens)) for name in _SPANS}
        if bool(spans["model_input_spans"]) != bool(spans["loss_fn_input_spans"]):
            raise ApiError(f"{field}.model_input_spans: provenance comes as a pair, set both span lists or neither")
        datums.append(training_pb2.Datum(**fields, **spans))
    return datums


#: A Datum's provenance fields, the session's Datum fields of the same names.
_SPANS = ("model_input_spans", "loss_fn_input_spans")


def _spans(spans, field: str, n: int) -> list[training_pb2.ProvenanceSpan]:
    """The session's provenance spans of a datum's, which must tile its ``n`` positions; the
    session checks them against its records."""
    out = []
    for k, span in enumerate(spans):
        kind = span.WhichOneof("span")
        if kind is None:
            raise ApiError(f"{field}[{k}]: expected a prompt_tokens or sampled_tokens span, got neither")
        arm = getattr(span, kind)
        if arm.offset < 0 or arm.length < 0:
            raise ApiError(f"{field}[{k}]: expected offset and length >= 0, got {arm.offset} and {arm.length}")
        out.append(
            training_pb2.ProvenanceSpan(
                sequence_id=arm.sequence_id, offset=arm.offset, length=arm.length, sampled=kind == "sampled_tokens"
            )
        )
    total = sum(s.length for s in out)
    if out and total != n:
        raise ApiError(f"{field}: the spans cover {total} positions, the datum has {n}; they must tile it exactly")
    return out


def loss_config(request: tpb.ForwardBackwardRequest) -> training_pb2.LossFnConfig:
    """The session's LossFnConfig of Tinker's ``loss_fn_config``, key by key; the session checks
    which keys its loss reads and their ranges."""
    config: dict[str, float] = {}
    for k, v in request.loss_fn_config_v2.items():
        if v.WhichOneof("value") == "text":
            raise ApiError(f"loss_fn_config.{k}: expected a number, got {v.text!r}")
        config[k] = v.number
    for k, v in request.loss_fn_config.items():
        config.setdefault(k, v)
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise ApiError(f"loss_fn_config.{unknown[0]}: expected one of {', '.join(CONFIG_KEYS)}, got {unknown[0]!r}")
    return training_pb2.LossFnConfig(**config)


def _batched(rows: list[list[float]]) -> tpb.BatchedTensor:
    arrays = [np.asarray(r, dtype="<f4") for r in rows]
    offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype("<i8")
    data = b"".join(a.tobytes() for a in arrays)
    return tpb.BatchedTensor(data=data, offsets=offsets.tobytes(), dtype=tpb.DTYPE_FLOAT32)


def forward_backward_output(outputs, metrics) -> bytes:
    """Tinker's protobuf ``ForwardBackwardOutput``: each datum's ``logprobs``, and the session's
    ``metrics`` as they are, keyed ``name:reduction`` (``loss:sum``, ``tokens:sum``,
    ``importance_ratio:mean``, ``clip_fraction:mean``) so that the SDK combines the answers of a
    split batch by the reduction. ``loss:sum`` is 0 for forward, which computes no loss."""
    record = tpb.ArrayRecord(num_datums=len(outputs))
    record.fields["logprobs"].CopyFrom(_batched([list(o.logprobs) for o in outputs]))
    out = tpb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record])
    out.metrics["loss:sum"] = 0.0
    out.metrics.update(metrics)
    return out.SerializeToString(deterministic=True)  # map keys sorted: every instance answers the same bytes


def adam_params(params: dict) -> training_pb2.AdamParams:
    """The session's AdamW settings of Tinker's ``adam_params``, with Tinker's defaults (beta2 0.95,
    eps 1e-12, no gradient clipping)."""
    if not isinstance(params, dict):
        raise ApiError("adam_params: expected an object")
    values = {}
    for name, default in (
        ("learning_rate", 1e-4),
        ("beta1", 0.9),
        ("beta2", 0.95),
        ("eps", 1e-12),
        ("weight_decay", 0.0),
        ("grad_clip_norm", 0.0),
    ):
        v = params.get(name, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ApiError(f"adam_params.{name}: expected a finite number, got {v!r}")
        values[name] = float(v)
    return training_pb2.AdamParams(
        learning_rate=values["learning_rate"],
        beta1=values["beta1"],
        beta2=values["beta2"],
        eps=values["eps"],
        weight_decay=values["weight_decay"],
        max_grad_norm=values["grad_clip_norm"],
    )
