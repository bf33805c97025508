"""A forward_backward the SDK splits into chunks survives its gateway killed mid-step: the SDK
sends the first chunk after the others got their futures, so those chunks wait for it at the
session worker. The worker holds them; a gateway killed (``kill -9``) after giving out all the
futures, before the first chunk ran, loses nothing, and a new gateway at the same URL answers
them with the step of an uninterrupted run."""

from __future__ import annotations

import httpx
import pytest
import tinker
from tinker.proto import tinker_public_pb2 as tpb

from tests.support.gateway import ANSWERED_S, MODEL_NAME, PROTO, STILL, fb_body, post, result, sdk_datum
from tests.support.waiting import wait_for


KEY = "tml-anything"


def test_the_chunks_of_a_step_survive_a_gateway_killed_before_the_first_chunk_ran(
    cluster, gateway_factory, sdk_env
) -> None:
    gateway = gateway_factory()
    sdk_env(gateway)
    # The SDK sends at most 1024 datums in one request: 1025 make two chunks.
    batch = [sdk_datum([1 + i % 97, 2 + i % 89, 3]) for i in range(1025)]
    with tinker.ServiceClient() as service:
        training = service.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
        reference = training.forward_backward(batch, "cross_entropy").result(timeout=ANSWERED_S)
        first = training.optim_step(STILL).result(timeout=ANSWERED_S)
        assert first.metrics["step:max"] == 1.0

        # A request the SDK numbers and skips (SDK internals: its numbering and its turns), so
        # that the session worker waits for it: both chunks, the first one too, are then ahead.
        hole = training._reserve_request_ids(1).start

        async def skip() -> None:
            async with training._take_turn(hole):
                pass

        training.holder.run_coroutine_threadsafe(skip()).result()
        fb = training.forward_backward(batch, "cross_entropy")
        # The SDK's turn moves on once a request got its future: both chunks got theirs.
        wait_for(lambda: training._turn_counter == hole + 3, what="the futures of both chunks given out")
        gateway.proc.kill9()
        restarted = gateway_factory(port=gateway.port)

        # The missing request, sent now through the new gateway: a forward, which changes nothing.
        forward = tpb.ForwardBackwardRequest.FromString(fb_body(training.model_id, hole + 1))
        forward.forward_only = True
        with httpx.Client(base_url=restarted.url, timeout=ANSWERED_S) as http:
            sent = post(http, "forward_backward", KEY, content=forward.SerializeToString(), headers=PROTO)
            assert sent.status_code == 200, sent.text
            assert isinstance(result(http, KEY, sent.json()["request_id"]), bytes)

        # The chunks ran after it, once each: the same loss and, at the next step, the same gradient.
        out = fb.result(timeout=ANSWERED_S)
        assert out.metrics["loss:sum"] == pytest.approx(reference.metrics["loss:sum"], rel=1e-4)
        step = training.optim_step(STILL).result(timeout=ANSWERED_S)
        assert step.metrics["step:max"] == 2.0
        assert step.metrics["grad_norm:mean"] == pytest.approx(first.metrics["grad_norm:mean"], rel=1e-3)
