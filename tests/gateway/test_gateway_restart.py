"""A gateway killed (``kill -9``) while a request is in flight, then restarted on its port: the
unmodified SDK sends the request again, the session worker answers it once, and the run goes on
as if nothing happened."""

from __future__ import annotations

import pytest
import tinker

from tests.support.gateway import ANSWERED_S, MODEL_NAME, STILL, sdk_datum, session_worker
from tests.support.waiting import wait_for


def _accepted(gateway) -> int:
    return sum(e.get("event") == "request accepted" for e in gateway.proc.log_events())


def test_a_request_in_flight_when_its_gateway_is_killed_is_answered_once(
    cluster, gateway_factory, sdk_env, monkeypatch
) -> None:
    monkeypatch.setenv("OPENTINKER_LOG_LEVEL", "debug")  # the gateway logs each request it takes
    # A short gap timeout: a request the worker never gets fails fast instead of being waited for.
    gateway = gateway_factory("--gap-timeout-s", "3")
    sdk_env(gateway)
    trainer = next(p for p in cluster.procs if p is not cluster.scheduler)
    batch = [sdk_datum([1, 2, 3, 4, 5, 6])]
    with tinker.ServiceClient() as service:
        training = service.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
        reference = training.forward_backward(batch, "cross_entropy").result(timeout=ANSWERED_S)
        first = training.optim_step(STILL).result(timeout=ANSWERED_S)
        assert first.metrics["step:max"] == 1.0

        # The worker stopped: the gateway takes a forward_backward and dies before it is answered.
        worker = session_worker(trainer.pid)
        taken = _accepted(gateway)
        worker.suspend()
        try:
            fb = training.forward_backward(batch, "cross_entropy")
            wait_for(lambda: _accepted(gateway) > taken, what="the gateway took the forward_backward")
            gateway.proc.kill9()
        finally:
            worker.resume()
        gateway_factory("--gap-timeout-s", "3", port=gateway.port)

        # The SDK sent it again to the restarted gateway: answered, and applied once.
        out = fb.result(timeout=ANSWERED_S)
        assert out.metrics["loss:sum"] == pytest.approx(reference.metrics["loss:sum"], rel=1e-4)
        step = training.optim_step(STILL).result(timeout=ANSWERED_S)
        assert step.metrics["step:max"] == 2.0
        assert step.metrics["grad_norm:mean"] == pytest.approx(first.metrics["grad_norm:mean"], rel=1e-3)
