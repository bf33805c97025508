"""A session worker killed mid-session (``kill -9``) under a cookbook-like SDK loop: the scheduler
requeues its task, whose next attempt resumes from the newest ``save_state`` at a new endpoint.
The gateway follows the task to that endpoint, and the SDK's next request, whose predecessors
the resumed worker lost, fails at once as a Tinker ``user`` error naming the gap and the save the
task resumed from, instead of waiting out the gap timeout."""

from __future__ import annotations

import re
import time

import pytest
import tinker
from tinker import types

from opentinker.common.v1 import common_pb2
from tests.support.gateway import MODEL_NAME, sdk_datum, session_worker
from tests.support.waiting import wait_for


def _step(training, batch) -> float:
    fb = training.forward_backward(batch, "cross_entropy")
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    return fb.result().metrics["loss:sum"]


def test_worker_killed_mid_session(cluster, gateway_factory, sdk_env) -> None:
    # A gap timeout far beyond the test's own waits: the error must come from knowing the worker
    # resumed, not from waiting out the timeout.
    gateway = gateway_factory("--gap-timeout-s", "3600")
    sdk_env(gateway)
    trainer = next(p for p in cluster.procs if p is not cluster.scheduler)
    with tinker.ServiceClient() as service:
        training = service.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
        tokens = training.get_tokenizer().encode("The cat sat on the mat. The cat sat on the mat.")
        batch = [sdk_datum(tokens)]
        for _ in range(2):
            _step(training, batch)
        training.save_state("step-2").result()
        _step(training, batch)  # a step after the save: the resumed worker loses it

        before = cluster.get(training.model_id)
        session_worker(trainer.pid).kill()
        resumed = wait_for(
            lambda: (
                (t := cluster.get(training.model_id)).attempt > before.attempt
                and t.state == common_pb2.TASK_STATE_RUNNING
                and t.endpoint
                and t
            ),
            what="the session task requeued and serving again",
        )
        assert resumed.endpoint != before.endpoint

        started = time.monotonic()
        with pytest.raises(tinker.RequestFailedError) as failed:
            _step(training, batch)
        assert time.monotonic() - started < 600
        message = str(failed.value)
        assert "resumed from its newest save_state step-2" in message, message
        lost = re.search(r"requests (\d+) to (\d+) ran on the lost worker", message)
        assert lost and int(lost[2]) - int(lost[1]) == 1, message  # the step after the save: fb and optim
