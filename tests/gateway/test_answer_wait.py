"""A training request the session worker does not answer within the gateway's ``answer_wait_s``
gets 408 with ``retry-after-ms``: the unmodified SDK sends it again with the same ``seq_id``,
gets the one answer once the worker answers, and the step applies once."""

from __future__ import annotations

import httpx
import pytest
import tinker

from tests.support.gateway import ANSWERED_S, MODEL_NAME, PROTO, STILL, fb_body, post, sdk_datum, session_worker
from tests.support.waiting import wait_for


KEY = "tml-anything"


def _events(gateway, name: str) -> list[dict]:
    return [e for e in gateway.proc.log_events() if e.get("event") == name]


def test_a_request_slower_than_the_answer_wait_gets_408_and_the_sdk_sends_it_again(
    cluster, gateway_factory, sdk_env, monkeypatch
) -> None:
    monkeypatch.setenv("OPENTINKER_LOG_LEVEL", "debug")  # the gateway logs each request it takes
    gateway = gateway_factory("--answer-wait-s", "0.5")
    sdk_env(gateway)
    trainer = next(p for p in cluster.procs if p is not cluster.scheduler)
    batch = [sdk_datum([1, 2, 3, 4, 5, 6])]
    with tinker.ServiceClient() as service:
        training = service.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
        reference = training.forward_backward(batch, "cross_entropy").result(timeout=ANSWERED_S)
        first = training.optim_step(STILL).result(timeout=ANSWERED_S)
        assert first.metrics["step:max"] == 1.0

        # The worker stopped: the forward_backward is not answered in time, and is sent again.
        worker = session_worker(trainer.pid)
        accepted, timed_out = len(_events(gateway, "request accepted")), len(_events(gateway, "request refused"))
        worker.suspend()
        try:
            fb = training.forward_backward(batch, "cross_entropy")
            wait_for(
                lambda: len(_events(gateway, "request accepted")) >= accepted + 3,
                what="the SDK sent the forward_backward again after 408s",
            )
        finally:
            worker.resume()
        resent = _events(gateway, "request accepted")[accepted:]
        assert len({(e["model_id"], e["seq_id"]) for e in resent}) == 1, resent  # one request, one seq_id
        refusals = _events(gateway, "request refused")[timed_out:]
        assert refusals and all(e["status"] == 408 for e in refusals), refusals

        # The one answer, and the batch applied once: the same gradient as the first step's.
        out = fb.result(timeout=ANSWERED_S)
        assert out.metrics["loss:sum"] == pytest.approx(reference.metrics["loss:sum"], rel=1e-4)
        step = training.optim_step(STILL).result(timeout=ANSWERED_S)
        assert step.metrics["step:max"] == 2.0
        assert step.metrics["grad_norm:mean"] == pytest.approx(first.metrics["grad_norm:mean"], rel=1e-3)

        # What the SDK saw: 408 and how long to wait before sending again (SDK internals: a
        # sequence number of its own, so that the request is its next).
        seq_id = training._reserve_request_ids(1).start + 1
        worker.suspend()
        try:
            with httpx.Client(base_url=gateway.url, timeout=ANSWERED_S) as http:
                late = post(http, "forward_backward", KEY, content=fb_body(training.model_id, seq_id), headers=PROTO)
        finally:
            worker.resume()
        assert late.status_code == 408, late.text
        assert late.headers["retry-after-ms"] == "100"
        assert f"request {seq_id} of model {training.model_id} is not answered yet" in late.json()["error"]
