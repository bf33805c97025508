"""The SDK's wire format to the session's: Tinker's AdamParams defaults, the ppo clip thresholds,
the per-datum checks and the protobuf answers the SDK decodes with its own code."""

from __future__ import annotations

import pytest
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

from opentinker.training.v1 import training_pb2
from opentinker_gateway import wire
from opentinker_gateway.errors import ApiError
from opentinker_gateway.sampling import sample_response


def request(loss_fn: str = "ppo", config: dict | None = None, **inputs) -> object:
    tokens = [5, 6, 7]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": types.TensorData(data=[6, 7, 8], dtype="int64", shape=[3]), **inputs},
    )
    fb = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn=loss_fn, loss_fn_config=config),
        model_id="m",
        seq_id=1,
    )
    return forward_backward_request_to_proto(fb)


def test_adam_params_take_tinkers_defaults() -> None:
    adam = wire.adam_params(types.AdamParams(learning_rate=1e-3).model_dump())
    assert (adam.learning_rate, adam.beta1, adam.beta2, adam.eps, adam.weight_decay, adam.max_grad_norm) == (
        pytest.approx(1e-3),
        pytest.approx(0.9),
        pytest.approx(0.95),
        pytest.approx(1e-12),
        0.0,
        0.0,
    )
    assert wire.adam_params({}).beta2 == pytest.approx(0.95)
    with pytest.raises(ApiError, match=r"^adam_params.eps: expected a finite number"):
        wire.adam_params({"eps": float("nan")})


def test_loss_fn_config_keys_map_by_name_and_an_unknown_one_is_named() -> None:
    config = wire.loss_config(request(config={"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}))
    assert (config.clip_low_threshold, config.clip_high_threshold, config.HasField("beta")) == (
        pytest.approx(0.8),
        pytest.approx(1.28),
        False,
    )
    with pytest.raises(ApiError, match=r"^loss_fn_config.clip_epsilon: expected one of clip_low_threshold") as err:
        wire.loss_config(request(config={"clip_epsilon": 0.2}))
    assert err.value.category == "user" and err.value.status == 400
    assert set(wire.LOSSES) >= {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo"}


def test_datums_carry_each_input_and_name_a_bad_one() -> None:
    rl = request(
        "importance_sampling",
        advantages=types.TensorData(data=[0.0, 1.0, -1.0], dtype="float32", shape=[3]),
        logprobs=types.TensorData(data=[-1.0, -2.0, -3.0], dtype="float32", shape=[3]),
    )
    (d,) = wire.datums_from_proto(rl)
    assert (list(d.input_tokens), list(d.target_tokens), list(d.advantages), list(d.sampling_logprobs)) == (
        [5, 6, 7],
        [6, 7, 8],
        [0.0, 1.0, -1.0],
        [-1.0, -2.0, -3.0],
    )
    bad = request(mask=types.TensorData(data=[1.0, 1.0, 1.0], dtype="float32", shape=[3]))
    with pytest.raises(ApiError, match=r"^data\[0\].loss_fn_inputs.mask: expected one of advantages, logprobs"):
        wire.datums_from_proto(bad)


def test_answers_decode_with_the_sdks_own_code() -> None:
    outputs = [training_pb2.DatumOutput(logprobs=[-1.0, -2.0]), training_pb2.DatumOutput(logprobs=[-0.5])]
    metrics = {"loss:sum": 3.5, "tokens:sum": 3.0, "importance_ratio:mean": 1.25, "clip_fraction:mean": 0.5}
    fb = deserialize_forward_backward_output(wire.forward_backward_output(outputs, metrics))
    assert fb.metrics == metrics
    assert deserialize_forward_backward_output(wire.forward_backward_output(outputs, {})).metrics == {"loss:sum": 0.0}
    # The metrics go out sorted by name, not in the process's hash order: an instance answering
    # from the session's kept answer sends the bytes the instance that sent the request sent.
    encoded = wire.forward_backward_output(outputs, dict(reversed(list(metrics.items()))))
    assert [encoded.index(name.encode()) for name in sorted(metrics)] == sorted(
        encoded.index(name.encode()) for name in metrics
    )
    assert [o["logprobs"].tolist() for o in fb.loss_fn_outputs] == [[-1.0, -2.0], [-0.5]]
    sample = training_pb2.SnapshotSamples(
        samples=[training_pb2.SampledSequence(tokens=[3, 4], logprobs=[-0.25, -0.5], stop_reason=2)]
    )
    (seq,) = deserialize_sample_response(sample_response(sample)).sequences
    assert (seq.tokens, seq.logprobs, seq.stop_reason) == ([3, 4], [-0.25, -0.5], "length")
