"""A task stopped in the middle of a step keeps its last completed step: a real scheduler and
trainer, SmolLM2-135M with a LoRA adapter on CPU, GRPO on prompts scored by a reward served from
this test. The reward of step 2 is never answered, so step 2 is in progress for as long as the
test likes; then the task is cancelled, preempted, drained or runs out of its max_runtime. The
worker abandons step 2 and stores step 1 at once, well inside a --kill-grace that no step of
this task could finish in, and the stored step 1 is downloaded and served. On two ranks each
rank's step 2 is held; both abandon it and rank 0 stores step 1 with both ranks' RNGs."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import pytest
import torch

from opentinker.common.v1 import common_pb2 as C
from opentinker_client import InferenceClient, RLClient

from tests.integration.test_checkpoints_leave import cli
from tests.support.procs import Cluster

HP = {"steps": 50, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4, "lora_rank": 4}
# The worker's grace after SIGTERM: room for a save on a loaded machine, none for step 2.
GRACE = ("--kill-grace", "30")


class Gate:
    """A reward function that scores its first ``scored`` calls (step 1: one call per rank) and
    holds every later one until :meth:`open`; :attr:`held` is set once a call is held (step 2 is
    in progress)."""

    def __init__(self, scored: int = 1) -> None:
        self._gates: list[threading.Event] = []
        self.scored = scored
        self.reset()

    def reset(self) -> None:
        """Start over for the next task: its first call is scored, its later ones held."""
        self.calls = 0
        self.held = threading.Event()
        self._gates.append(threading.Event())

    def __call__(self, prompts, completions, metadata):
        self.calls += 1
        if self.calls > self.scored:
            gate = self._gates[-1]
            self.held.set()
            gate.wait()
        return [float(len(c) % 2) for c in completions]

    def open(self) -> None:
        for gate in self._gates:
            gate.set()


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": i + 1}) + "\n" for i in range(8)))
    return path


def _submit(client: RLClient, model: Path, dataset: Path, server, **kw) -> str:
    info = client.upload_dataset(dataset, format="prompts")
    return client.submit_task(
        workload_type="lora_finetune",
        model=str(model),
        env_config={
            "env_id": "prompts",
            "dataset_id": info.dataset_id,
            "reward": server.reward_config,
            "eval_fraction": 0,  # every reward call is a training step's
        },
        hyperparameters=HP,
        priority=0,
        **kw,
    )


def _kept_step_one(cluster: Cluster, task_id: str, state: int) -> C.Task:
    """The task once in ``state`` with its checkpoint; it holds step 1, the last completed."""
    task = cluster.wait_state(task_id, state, what=lambda t: t.HasField("latest_checkpoint"))
    assert (task.latest_checkpoint.step, task.latest_checkpoint.attempt, task.latest_step) == (1, 1, 1)
    assert task.latest_checkpoint.artifact.key and not task.latest_checkpoint.final
    return task


def _downloaded_step(cluster: Cluster, task_id: str, folder: Path) -> int:
    cli(cluster, "download", task_id, "-o", str(folder))
    assert (folder / "adapter_model.safetensors").exists()
    return torch.load(folder / "trainer_state.pt", weights_only=False)["step"]


@pytest.fixture
def held(tmp_path: Path, real_model_dir: Path, dataset: Path):
    """``(cluster, client, start)``: ``start(*trainer_args)`` starts a trainer and returns
    ``(trainer, task_id)`` with the task's step 2 in progress."""
    cluster = Cluster(tmp_path)
    gate = Gate()
    try:
        cluster.start_scheduler()
        with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
            with client.serve_reward(gate, timeout_s=600) as server:

                def start(*trainer_args: str):
                    trainer = cluster.start_trainer("node-a", *GRACE, *trainer_args)
                    cluster.wait_nodes(1)
                    task_id = _submit(client, real_model_dir, dataset, server)
                    cluster.wait_state(task_id, C.TASK_STATE_RUNNING, what=lambda t: gate.held.is_set())
                    return trainer, task_id

                start.gate, start.server = gate, server  # type: ignore[attr-defined]
                yield cluster, client, start
                gate.open()
    finally:
        gate.open()
        cluster.close()


def test_a_cancelled_task_keeps_its_last_completed_step_and_serves_it(held, tmp_path: Path) -> None:
    cluster, client, start = held
    _, task_id = start()
    client.cancel(task_id, reason="enough")
    _kept_step_one(cluster, task_id, C.TASK_STATE_CANCELLED)
    assert _downloaded_step(cluster, task_id, tmp_path / "ck") == 1
    note = "last complete checkpoint, step 1 (the task ended CANCELLED)"
    out = cli(cluster, "serve", task_id, "--ttl", "300").stdout
    assert f"adapter {task_id} ({note}) served by inference task" in out, out
    endpoint = out.splitlines()[0].rsplit(" at ", 1)[1]  # the next line says how to try it
    with InferenceClient(endpoint, adapter=task_id) as llm:
        reply = llm.generate("What is 2 + 3?", temperature=0, max_tokens=4)
    assert reply.adapter == task_id and reply.samples[0].token_ids


def test_a_task_past_its_max_runtime_keeps_its_last_completed_step(
    held, tmp_path: Path, real_model_dir: Path, dataset: Path
) -> None:
    cluster, client, start = held
    cluster.start_trainer("node-a", *GRACE)
    cluster.wait_nodes(1)
    # The limit must leave room to load the model and run step 1; step 2 is held until the
    # limit ends the task. On a loaded machine, where step 2 was not reached, it is doubled.
    for max_runtime in (20, 40, 80, 160):
        start.gate.reset()
        task_id = _submit(client, real_model_dir, dataset, start.server, max_runtime=max_runtime)
        cluster.wait_state(task_id, C.TASK_STATE_FAILED)
        if start.gate.held.is_set():
            break
    else:
        pytest.fail(f"no task reached step 2 within its max_runtime, the last {max_runtime} s")
    _kept_step_one(cluster, task_id, C.TASK_STATE_FAILED)
    events = list(client.watch(task_id, follow=False))
    assert [e.reason for e in events if e.kind == "state"][-1] == "TIMEOUT"
    assert _downloaded_step(cluster, task_id, tmp_path / "ck") == 1


def test_a_preempted_task_keeps_its_last_completed_step(held, tmp_path: Path, real_model_dir: Path) -> None:
    cluster, client, start = held
    _, low = start("--max-tasks", "1")
    high = client.submit_task(
        workload_type="lora_finetune", model=str(real_model_dir), hyperparameters={**HP, "steps": 1}, priority=50
    )
    task = _kept_step_one(cluster, low, C.TASK_STATE_PENDING)
    assert task.attempt == 2
    assert _downloaded_step(cluster, low, tmp_path / "ck") == 1
    client.cancel(high)
    client.cancel(low)


def test_a_drained_task_keeps_its_last_completed_step(held, tmp_path: Path) -> None:
    cluster, client, start = held
    trainer, task_id = start()
    trainer.popen.send_signal(signal.SIGTERM)
    assert trainer.wait_exit(what="node-a drains and exits") == 0, trainer.log_text()[-2000:]
    task = _kept_step_one(cluster, task_id, C.TASK_STATE_PENDING)
    assert task.attempt == 2
    assert _downloaded_step(cluster, task_id, tmp_path / "ck") == 1


def test_two_ranks_stopped_mid_step_keep_the_same_last_completed_step(
    tmp_path: Path, tiny_model_dir: Path, dataset: Path
) -> None:
    cluster = Cluster(tmp_path)
    gate = Gate(scored=2)
    try:
        cluster.start_scheduler()
        cluster.start_trainer("node-a", "--simulate-gpus", "2", *GRACE)
        cluster.wait_nodes(1)
        with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
            with client.serve_reward(gate, timeout_s=600) as server:
                task_id = _submit(client, tiny_model_dir, dataset, server, gpu_count=2)
                cluster.wait_state(task_id, C.TASK_STATE_RUNNING, what=lambda t: gate.held.is_set())
                client.cancel(task_id, reason="enough")
                _kept_step_one(cluster, task_id, C.TASK_STATE_CANCELLED)
                gate.open()
        assert _downloaded_step(cluster, task_id, tmp_path / "ck") == 1
        state = torch.load(tmp_path / "ck" / "trainer_state.pt", weights_only=False)
        assert state["world_size"] == 2 and len(state["rng_ranks"]) == 2
    finally:
        gate.open()
        cluster.close()


def test_a_model_host_tenant_stopped_mid_step_keeps_its_last_completed_step(
    tmp_path: Path, tiny_model_dir: Path, dataset: Path
) -> None:
    cluster = Cluster(tmp_path)
    gate = Gate()
    try:
        cluster.start_scheduler()
        trainer = cluster.start_trainer("node-a", "--simulate-gpus", "1", "--tenants-per-host", "2", *GRACE)
        cluster.wait_nodes(1)
        with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
            with client.serve_reward(gate, timeout_s=600) as server:
                task_id = _submit(client, tiny_model_dir, dataset, server, gpu_count=1)
                cluster.wait_state(task_id, C.TASK_STATE_RUNNING, what=lambda t: gate.held.is_set())
                client.cancel(task_id, reason="enough")
                _kept_step_one(cluster, task_id, C.TASK_STATE_CANCELLED)
                gate.open()
        assert "tenant joined" in trainer.log_text()  # the task ran on a model host
        assert _downloaded_step(cluster, task_id, tmp_path / "ck") == 1
    finally:
        gate.open()
        cluster.close()
