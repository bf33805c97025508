"""Several gateways serve one model, and a gateway restart loses nothing: a future is answered by
another instance and by a restarted one (the session's kept answer), a request retried on another
instance gets the first answer without applying twice, and an SDK client goes on training
through the restarted gateway."""

from __future__ import annotations

import httpx
import tinker
from tinker import types

from tests.support.gateway import MODEL_NAME, PROTO, create_model, fb_body, post, result

KEY = "tml-anything"


def test_futures_and_retries_across_instances_and_a_restart(cluster, gateway_factory, sdk_env) -> None:
    a, b = gateway_factory(), gateway_factory()
    with httpx.Client(base_url=a.url, timeout=120) as via_a, httpx.Client(base_url=b.url, timeout=120) as via_b:
        model = create_model(via_a, KEY)
        first = post(via_a, "forward_backward", KEY, content=fb_body(model, 1), headers=PROTO).json()["request_id"]
        answer = result(via_a, KEY, first)
        assert isinstance(answer, bytes)
        # Another instance answers the same future, from the session's kept answer.
        assert result(via_b, KEY, first) == answer
        # A retry of request 1 on the other instance, even with other data, gets the first answer.
        retried = post(via_b, "forward_backward", KEY, content=fb_body(model, 1, tokens=(9, 8, 7, 6, 5)), headers=PROTO)
        assert retried.json()["request_id"] == first and result(via_b, KEY, first) == answer
        # Request 2 on B, the optimizer step, runs once: one forward_backward was accumulated.
        step = post(
            via_b, "optim_step", KEY, json={"model_id": model, "seq_id": 2, "adam_params": {"learning_rate": 0.01}}
        )
        assert result(via_a, KEY, step.json()["request_id"])["metrics"]["step:max"] == 1.0

        # Gateway A dies and comes back on its port: the future it answered is answered again.
        port = a.port
        a.close()
        restarted = gateway_factory(port=port)
        assert result(via_a, KEY, first) == answer

    # The unmodified SDK trains through the restarted gateway and the second instance alike.
    sdk_env(restarted)
    with tinker.ServiceClient() as service:
        training = service.create_lora_training_client(base_model=MODEL_NAME, rank=2).result()
        batch = [
            types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3, 4]})
        ]
        training.forward_backward(batch, "cross_entropy").result()
        restarted.close()
        again = gateway_factory(port=port)
        assert again.port == port
        assert training.optim_step(types.AdamParams(learning_rate=0.01)).result().metrics["step:max"] == 1.0
