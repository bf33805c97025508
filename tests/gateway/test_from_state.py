"""A training client created from another run's state (``create_training_client_from_state``,
the cookbook's resume) continues that run: with the optimizer state, one more step on it equals
one more step of the run that saved it; without, it starts from the saved weights with a fresh
AdamW. ``load_state`` takes another run's state into an existing model the same way."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from opentinker.common.v1 import common_pb2
from tests.support.gateway import MODEL_NAME, sdk_datum
from tests.support.waiting import wait_for

ADAM = types.AdamParams(learning_rate=5e-2)


def _step(training, batch) -> float:
    fb = training.forward_backward(batch, "cross_entropy")
    training.optim_step(ADAM).result()
    return fb.result().metrics["loss:sum"]


def _logprobs(training, batch) -> list[list[float]]:
    return [o["logprobs"].tolist() for o in training.forward(batch, "cross_entropy").result().loss_fn_outputs]


def test_a_new_or_existing_model_continues_another_runs_state(cluster, gateway_factory, sdk_env) -> None:
    gateway = gateway_factory()
    sdk_env(gateway)
    with tinker.ServiceClient() as service:
        run_a = service.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
        tokens = run_a.get_tokenizer().encode("The cat sat on the mat. The cat sat on the mat.")
        batch = [sdk_datum(tokens), sdk_datum(tokens[:8])]
        for _ in range(2):
            _step(run_a, batch)
        path = run_a.save_state("a-2").result().path
        assert path == f"tinker://{run_a.model_id}/weights/a-2"
        a_loss = _step(run_a, batch)  # the run continued: its third step
        a_after = _logprobs(run_a, batch)

    with tinker.ServiceClient() as service:
        resumed = service.create_training_client_from_state_with_optimizer(path).result()
        assert resumed.model_id != run_a.model_id
        np.testing.assert_allclose(_step(resumed, batch), a_loss, rtol=0, atol=1e-6)
        for got, want in zip(_logprobs(resumed, batch), a_after):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
        # Its own saves are paths of its own task, which a later run can start from in turn.
        again = resumed.save_state("b-3").result().path
        assert again.startswith("tinker://task-") and again.endswith("/weights/b-3")

        weights_only = service.create_training_client_from_state(path).result()
        # The saved weights: the same loss as the run's third step; then a fresh AdamW's first
        # step, which differs from the run's own.
        fresh_loss = _step(weights_only, batch)
        np.testing.assert_allclose(fresh_loss, a_loss, rtol=0, atol=1e-6)
        assert not np.allclose(np.concatenate(_logprobs(weights_only, batch)), np.concatenate(a_after), atol=1e-4)

        # load_state takes the run's state into this existing model, which trained on its own since:
        # with the optimizer, its next step is the run's third step again.
        rest = tinker.RestClient(base_url=gateway.url)  # RestClient() would reuse an earlier test's gateway
        wait_for(
            lambda: path in [c.tinker_path for c in rest.list_checkpoints(run_a.model_id).result().checkpoints],
            what=f"{path} listed",
        )
        weights_only.load_state_with_optimizer(path).result()
        np.testing.assert_allclose(_step(weights_only, batch), a_loss, rtol=0, atol=1e-6)
        for got, want in zip(_logprobs(weights_only, batch), a_after):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
        # Weights only: the saved weights' loss, then a fresh AdamW's step.
        weights_only.load_state(path).result()
        np.testing.assert_allclose(_step(weights_only, batch), a_loss, rtol=0, atol=1e-6)
        assert not np.allclose(np.concatenate(_logprobs(weights_only, batch)), np.concatenate(a_after), atol=1e-4)
        # A state of another LoRA rank is refused naming it; a path of no run is missing.
        rank_2 = service.create_lora_training_client(base_model=MODEL_NAME, rank=2).result()
        with pytest.raises(tinker.BadRequestError, match="LoRA rank 4, this model's is 2"):
            rank_2.load_state(path).result()
        with pytest.raises(tinker.NotFoundError, match="no state"):
            weights_only.load_state("tinker://task-00000000000000000000/weights/a-2").result()
    cluster.wait_state(run_a.model_id, common_pb2.TASK_STATE_CANCELLED)
