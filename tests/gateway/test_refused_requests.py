"""A request refused by the session worker or by the gateway uses up its ``seq_id``, as on
Tinker: its error is its answer, and the unmodified SDK's next requests run. The gap timeout is
an hour, so a request left waiting for a refused one fails the test by its own timeout."""

from __future__ import annotations

import pytest
import tinker
from tinker import types

from tests.support.gateway import MODEL_NAME

#: Seconds a good request may take to answer; far below the gap timeout.
ANSWERED_S = 120


def _datum(tokens: list[int], weights=None) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "weights": weights if weights is not None else [1.0] * (len(tokens) - 1),
        },
    )


def test_a_refused_request_uses_up_its_seq_id_and_the_next_ones_run(cluster, gateway_factory, sdk_env) -> None:
    sdk_env(gateway_factory("--gap-timeout-s", "3600"))
    with tinker.ServiceClient() as service:
        training = service.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
        good = [_datum([1, 2, 3, 4, 5, 6])]

        def trains() -> None:
            training.forward_backward(good, "cross_entropy").result(timeout=ANSWERED_S)
            training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=ANSWERED_S)

        trains()
        # Refused by the session worker: a failed future.
        with pytest.raises(tinker.RequestFailedError, match=r"expected a token id in \[0, "):
            training.forward_backward([_datum([1, 2, 10**6, 4, 5])], "cross_entropy").result(timeout=ANSWERED_S)
        trains()
        # Refused by the gateway: an HTTP 400 at once.
        int_weights = types.TensorData(data=[1] * 5, dtype="int64", shape=[5])
        with pytest.raises(tinker.BadRequestError, match="weights: expected dtype float32"):
            training.forward_backward([_datum([1, 2, 3, 4, 5, 6], int_weights)], "cross_entropy").result(
                timeout=ANSWERED_S
            )
        trains()
        model = training.model_id
        for path in (
            f"tinker://{model}/weights/",
            f"tinker://{model}/weights/{'x' * 100_000}",
            f"tinker://{model}/weights/a\0b",
        ):
            with pytest.raises(tinker.BadRequestError, match="path: expected tinker://"):
                training.load_state(path).result(timeout=ANSWERED_S)
        trains()
