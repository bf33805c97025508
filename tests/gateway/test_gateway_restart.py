"""A gateway killed (``kill -9``) after it took requests and before the session worker got them,
then restarted on its port: the unmodified SDK's futures of those requests fail with a clear
error once the worker has waited the gap timeout for them, the model goes on with the next
requests, and ``retrieve_future`` long-polls meanwhile instead of answering ``try_again`` at once."""

from __future__ import annotations

import psutil
import pytest
import tinker
from tinker import types

from tests.support.gateway import MODEL_NAME
from tests.support.waiting import wait_for

GAP_TIMEOUT_S = 3
#: Seconds a future may take to answer; far below an SDK that spins forever.
ANSWERED_S = 120


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def _session_worker(trainer_pid: int) -> psutil.Process:
    workers = [
        p for p in psutil.Process(trainer_pid).children() if "opentinker_trainer.worker" in " ".join(p.cmdline())
    ]
    assert len(workers) == 1, workers
    return workers[0]


def _events(gateway, event: str) -> list[dict]:
    return [e for e in gateway.proc.log_events() if e.get("event") == event]


def test_requests_lost_with_a_killed_gateway_fail_clearly_and_the_model_goes_on(
    cluster, gateway_factory, sdk_env, monkeypatch
) -> None:
    monkeypatch.setenv("OPENTINKER_LOG_LEVEL", "debug")  # the gateways log each request and try_again
    gateway = gateway_factory("--gap-timeout-s", str(GAP_TIMEOUT_S))
    sdk_env(gateway)
    trainer = next(p for p in cluster.procs if p is not cluster.scheduler)
    batch = [_datum([1, 2, 3, 4, 5, 6])]
    with tinker.ServiceClient() as service:
        training = service.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
        training.forward_backward(batch, "cross_entropy").result(timeout=ANSWERED_S)
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=ANSWERED_S)

        # The worker stopped: the gateway takes a forward_backward and the optim_step behind it,
        # and holds the optim_step until the forward_backward is answered. It dies meanwhile.
        worker = _session_worker(trainer.pid)
        worker.suspend()
        try:
            fb = training.forward_backward(batch, "cross_entropy")
            step = training.optim_step(types.AdamParams(learning_rate=1e-3))
            wait_for(lambda: len(_events(gateway, "request accepted")) >= 4, what="the gateway took both requests")
            gateway.proc.kill9()
        finally:
            worker.resume()
        restarted = gateway_factory("--gap-timeout-s", str(GAP_TIMEOUT_S), port=gateway.port)

        # The forward_backward reached the worker's socket and may have run; the optim_step never
        # left the gateway: it fails, naming why.
        try:
            fb.result(timeout=ANSWERED_S)
        except tinker.RequestFailedError as exc:
            assert "never reached its session worker" in str(exc)
        with pytest.raises(tinker.RequestFailedError, match="never reached its session worker"):
            step.result(timeout=ANSWERED_S)
        # The model goes on.
        training.forward_backward(batch, "cross_entropy").result(timeout=ANSWERED_S)
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=ANSWERED_S)

    # No spin: every try_again of the restarted gateway waited out its long-poll or an answer.
    assert len(_events(restarted, "future not answered yet")) < 10
    assert _events(restarted, "request lost")
