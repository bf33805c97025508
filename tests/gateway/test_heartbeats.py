"""Heartbeats keep a Tinker session's models alive: a model whose session heartbeats (the SDK's,
every 10 s) outlives one with no requests and no heartbeats, which ends after the gateway's
--heartbeat-timeout-s (its session task SUCCEEDED, as an idle lora_session ends)."""

from __future__ import annotations

import httpx
import tinker
from tinker import types

from opentinker.common.v1 import common_pb2
from tests.support.gateway import MODEL_NAME, create_model


def test_heartbeats_keep_a_model_alive_and_silence_ends_it(cluster, gateway_factory, sdk_env) -> None:
    gateway = gateway_factory("--heartbeat-timeout-s", "30")
    sdk_env(gateway)
    with tinker.ServiceClient() as service:
        alive = service.create_lora_training_client(base_model=MODEL_NAME, rank=2).result()
        with httpx.Client(base_url=gateway.url, timeout=120) as http:
            silent = create_model(http, "tml-anything")  # its session never heartbeats
        # The silent model's last request came after the SDK model's: without heartbeats the SDK
        # model would have ended first.
        cluster.wait_state(silent, common_pb2.TASK_STATE_SUCCEEDED)
        assert cluster.get(alive.model_id).state == common_pb2.TASK_STATE_RUNNING
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3, 4]}
        )
        assert len(alive.forward([datum], "cross_entropy").result().loss_fn_outputs) == 1
