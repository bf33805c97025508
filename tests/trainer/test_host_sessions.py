"""A training session (``lora_session``) as a tenant of a model host, in this process: it trains its
own adapter on the host's one copy of the base model, every call in its turn, so its losses,
samples and saved state are those of the same session alone in a worker, and a GRPO neighbour's
curve is the one it has alone."""

from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from opentinker.common.v1 import common_pb2
from opentinker.node.v1 import node_pb2
from opentinker.training.v1 import training_pb2, training_pb2_grpc
from opentinker_client.training import Datum, TrainingSession
from opentinker_trainer.host import ModelHost, shareable
from opentinker_trainer.workloads import grpo_text, lora_session

from tests.support.waiting import wait_for
from tests.support.workers import reports, worker_ctx
from tests.trainer.test_model_host import HP, _assign, _curve, _lines, reply_rewards  # noqa: F401 - a fixture

SESSION_HP = {"lora_rank": 4, "lora_dropout": 0.1, "seed": 3, "idle_timeout_s": 600}


def _session_assign(task_id: str, model: Path) -> node_pb2.AssignTask:
    spec = common_pb2.TaskSpec(workload_type="lora_session", model=str(model))
    spec.hyperparameters.update(SESSION_HP)
    return node_pb2.AssignTask(task_id=task_id, attempt=1, spec=spec, device_indices=[0])


def _drive(endpoint: str) -> dict:
    """The same calls on any session: two SFT steps with a seeded sample between, then a saved
    state. LoRA dropout is on, so training draws from the global RNG: the tenant's own stream."""
    datums = [
        Datum.from_sequence([5, 9, 14, 3, 7, 11], prompt_length=2),
        Datum.from_sequence([8, 2, 6, 13, 4], prompt_length=3),
    ]
    with TrainingSession(endpoint, timeout=120) as s:
        first = s.forward_backward(datums)  # queued before waiting, as a user would
        step = s.optim_step(5e-2)
        losses = [first.result(120).losses, step.result(120).step]
        sample = s.sample([5, 9, 14], n=2, max_tokens=4, seed=7).result(120)
        second = s.forward_backward(datums).result(120)
        s.optim_step(5e-2).result(120)
        s.save_state("s1").result(120)
        # A sampler save, sampled after a later step with SampleSnapshot, and the base model.
        s.save_weights_for_sampler("v").result(120)
        s.forward_backward(datums).result(120)
        s.optim_step(5e-2).result(120)
        stub = training_pb2_grpc.TrainingServiceStub(s._channel)
        prompts = [
            training_pb2.SnapshotPrompt(tokens=training_pb2.TokenPrompt(tokens=[5, 9, 14]), num_samples=2, seed=7),
            training_pb2.SnapshotPrompt(tokens=training_pb2.TokenPrompt(tokens=[8, 2]), num_samples=1, seed=3),
        ]
        params = training_pb2.SamplingParams(max_tokens=4, return_logprobs=True)
        snapshots = [
            stub.SampleSnapshot(
                training_pb2.SampleSnapshotRequest(prompts=prompts, params=params, **weights), timeout=120
            )
            for weights in ({"sampler": "v"}, {"base_model": True})
        ]
    return {
        "losses": [*losses, second.losses],
        "sample": [x.tokens for x in sample.samples],
        "logprobs": [x.logprobs for x in sample.samples],
        "snapshots": [[[list(x.tokens) for x in r.samples] for r in out.results] for out in snapshots],
        "snapshot_logprobs": [v for out in snapshots for r in out.results for x in r.samples for v in x.logprobs],
    }


def _endpoint(read, task_id: str) -> str:
    """The endpoint the session task reported (waits for it)."""
    found: list[str] = []

    def reported() -> bool:
        found[:] = [r["address"] for r in read() if r["type"] == "endpoint" and r.get("task_id", task_id) == task_id]
        return bool(found)

    wait_for(reported, what=f"session {task_id} reported its endpoint", timeout=120)
    return found[0]


def test_a_training_session_is_shareable_on_one_device(tiny_model_dir: Path) -> None:
    assert shareable(_session_assign("s", tiny_model_dir)) == (str(tiny_model_dir), (0,), "auto")
    two = _session_assign("s", tiny_model_dir)
    two.device_indices[:] = [0, 1]
    assert shareable(two) is None
    full = _session_assign("s", tiny_model_dir)
    full.spec.hyperparameters.update({"lora": False})
    assert shareable(full) is None  # full weights: weights of its own, a worker of its own


@pytest.mark.usefixtures("reply_rewards")
def test_a_session_tenant_trains_as_it_would_alone_beside_a_grpo_tenant(tiny_model_dir: Path, tmp_path: Path) -> None:
    # Alone: the session in a worker of its own, and the GRPO task in another.
    alone = worker_ctx(
        tmp_path, "alone", workload_type="lora_session", model=tiny_model_dir,
        env_config={}, hyperparameters=SESSION_HP, task_id="s",
    )  # fmt: skip
    served = threading.Thread(target=lora_session.run, args=(alone,), daemon=True)
    served.start()
    want = _drive(_endpoint(lambda: reports(alone, "endpoint"), "s"))
    alone.request_stop()
    served.join(60)
    hp = {**HP, "checkpoint_every": 0}
    grpo_alone = worker_ctx(
        tmp_path, "grpo-alone", workload_type="lora_finetune", model=tiny_model_dir,
        env_config={"env_id": "arithmetic"}, hyperparameters=hp, task_id="g",
    )  # fmt: skip
    grpo_text.run(grpo_alone)
    curve = _curve(reports(grpo_alone, "metric"))

    # On one host: the GRPO task trains while the session's calls come in.
    out = io.StringIO()
    host = ModelHost(str(tiny_model_dir), "cpu", "auto", out)
    for task_id, assign in (("g", _assign("g", tiny_model_dir, hp)), ("s", _session_assign("s", tiny_model_dir))):
        path = tmp_path / f"{task_id}.pb"
        path.write_bytes(assign.SerializeToString())
        host.add(path, tmp_path / "host" / task_id)

    def lines() -> list[dict]:
        return [json.loads(x) for x in out.getvalue().splitlines() if x.strip()]

    endpoint = _endpoint(lines, "s")
    turns_before = host.turns.turns
    got = _drive(endpoint)
    assert host.turns.turns >= turns_before + 6  # each call that used the model took a turn
    assert set(host.model.peft_config) >= {"ts-a1"}  # its adapter is one of the host's
    while ("g", 1) in host.tenants:
        time.sleep(0.05)
    host.stop("s", 1)
    host.join()

    assert got["sample"] == want["sample"]
    assert got["snapshots"] == want["snapshots"]
    assert got["snapshot_logprobs"] == pytest.approx(want["snapshot_logprobs"], abs=1e-5)
    assert got["losses"][1] == want["losses"][1]  # the optimizer step number
    for ours, theirs in ((got["losses"][0], want["losses"][0]), (got["losses"][2], want["losses"][2])):
        assert ours == pytest.approx(theirs, abs=1e-5)
    assert [v for lp in got["logprobs"] for v in lp] == pytest.approx(
        [v for lp in want["logprobs"] for v in lp], abs=1e-5
    )
    ours = load_file(tmp_path / "host" / "s" / "state_s1" / "adapter_model.safetensors")
    theirs = load_file(tmp_path / "alone" / "state_s1" / "adapter_model.safetensors")
    assert sorted(ours) == sorted(theirs)  # the PEFT keys of an adapter alone: no tenant name in them
    assert all(torch.allclose(ours[k], theirs[k], atol=1e-6) for k in ours)
    config = json.loads((tmp_path / "host" / "s" / "state_s1" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == str(tiny_model_dir)
    grpo = _curve(_lines(out, "g", "metric"))
    assert [v for c in grpo for v in c[1:]] == pytest.approx([v for c in curve for v in c[1:]], abs=1e-6)
    assert [r["task_id"] for r in lines() if r["type"] == "released"] == ["g", "s"]
    assert list(host.model.peft_config) == []  # both adapters left the model with their tenants
