"""Serving from the model host a LoRA task trains on: a real scheduler and one ``--simulate-gpus 1``
trainer with model hosts on. A LoRA GRPO task and an inference task on the same tiny base share
one host process (one load of the base, no worker); the inference endpoint answers Generate for
the training task's adapter as of its newest step at each request's arrival (a later step is a
new version); ``kill -9`` of the host requeues both onto a new host; cancelling
the inference task leaves the training task running, and cancelling the training task leaves a
second inference task serving."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from opentinker.common.v1 import common_pb2
from opentinker_client import InferenceClient, RLClient

from tests.integration.test_model_host import _hosts, _wait, one_gpu_host_node
from tests.support.waiting import wait_for

#: Long enough to outlive the test (it is cancelled); a checkpoint after every step.
TRAIN_HP = {
    "steps": 10000,
    "prompts_per_step": 1,
    "group_size": 2,
    "max_new_tokens": 4,
    "lora_rank": 4,
    "checkpoint_every": 1,
    "seed": 5,
}
RUNNING, CANCELLED = common_pb2.TASK_STATE_RUNNING, common_pb2.TASK_STATE_CANCELLED


def _events(trainer, event: str, **fields) -> list[dict]:
    return [
        e for e in trainer.log_events() if e.get("event") == event and all(e.get(k) == v for k, v in fields.items())
    ]


def _serve(client: RLClient, model: Path) -> str:
    return client.submit_task(workload_type="inference", model=str(model), gpu_count=1, hyperparameters={"ttl_s": 600})


def _versions(llm: InferenceClient, task_id: str) -> set[int]:
    """Steps of ``task_id``'s adapter versions resident on the server (``<task id>@<step>``)."""
    return {int(a.name.split("@")[1]) for a in llm.list_adapters() if a.name.startswith(f"{task_id}@")}


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
def test_an_inference_task_serves_a_training_tasks_adapter_from_its_model_host(tmp_path: Path, tiny_model_dir: Path):
    cluster, trainer, client = one_gpu_host_node(tmp_path)
    try:
        trained = client.submit_task(
            workload_type="lora_finetune", model=str(tiny_model_dir), gpu_count=1, hyperparameters=TRAIN_HP
        )
        served = _serve(client, tiny_model_dir)
        server = _wait(cluster, client, served, RUNNING, lambda t: bool(t.endpoint))
        first = _wait(cluster, client, trained, RUNNING, lambda t: t.latest_checkpoint.step >= 1)

        # One host process holds both tenants on the one GPU: one load of the base, no worker.
        (host,) = _hosts(trainer.pid)
        assert len(_events(trainer, "model host ready")) == 1
        assert _events(trainer, "serving from the model host", task_id=served)
        assert not _events(trainer, "loading model", task_id=served)  # the workload's own load: not done
        started = {e["task_id"]: e for e in _events(trainer, "Task started")}
        assert started[served]["pid"] == started[trained]["pid"] == host
        assert list(client.get_task(served).proto.device_indices) == list(first.device_indices) == [0]
        (shown,) = [h for n in client.list_nodes() for h in n.model_hosts]
        assert shown.pid == host and set(shown.task_ids) == {trained, served}

        # The training task's adapter as it is when the request arrives (between two of its steps).
        llm = InferenceClient(server.endpoint, adapter=trained)
        out = llm.generate("What is 2 + 3?", temperature=0, max_tokens=4)
        assert out.adapter == trained and 1 <= len(out.samples[0].token_ids) <= 4
        (version,) = _versions(llm, trained)
        assert version >= first.latest_checkpoint.step
        # A later step is a new version for later requests.
        _wait(cluster, client, trained, RUNNING, lambda t: t.latest_checkpoint.step > version)
        llm.generate("What is 2 + 3?", temperature=0, max_tokens=4)
        assert max(_versions(llm, trained)) > version
        llm.close()

        # The host dies (kill -9): both tenants requeue and come back together on a new host.
        os.kill(host, 9)
        server = _wait(cluster, client, served, RUNNING, lambda t: t.attempt == 2 and bool(t.endpoint))
        (host,) = _hosts(trainer.pid)
        assert len(_events(trainer, "model host ready")) == 2
        with InferenceClient(server.endpoint, adapter=trained) as llm:
            assert llm.generate("What is 2 + 3?", temperature=0, max_tokens=4).samples[0].token_ids
        assert client.get_task(trained).proto.attempt == 2

        # Cancelling the inference task ends only it: the training task keeps stepping.
        client.cancel(served)
        _wait(cluster, client, served, CANCELLED)
        stepped = client.get_task(trained).proto.latest_step
        _wait(cluster, client, trained, RUNNING, lambda t: t.latest_step > stepped)

        # The other way round: a second inference task joins the warm host; cancelling the
        # training task leaves it serving that task's adapter (its newest checkpoint).
        again = _serve(client, tiny_model_dir)
        second = _wait(cluster, client, again, RUNNING, lambda t: bool(t.endpoint))
        assert {e["task_id"]: e["pid"] for e in _events(trainer, "Task started")}[again] == host
        client.cancel(trained)
        _wait(cluster, client, trained, CANCELLED)
        assert client.get_task(again).proto.state == RUNNING
        with InferenceClient(second.endpoint, adapter=trained) as llm2:
            assert llm2.generate("What is 2 + 3?", temperature=0, max_tokens=4).samples[0].token_ids
        assert _hosts(trainer.pid) == [host] and len(_events(trainer, "model host ready")) == 2
        client.cancel(again)
        _wait(cluster, client, again, CANCELLED)
        wait_for(lambda: not _hosts(trainer.pid), what="the idle model host exits")
        client.close()
    finally:
        cluster.close()
