"""A task across two trainer nodes (a gang) on loopback: two trainer processes with
``--simulate-gpus 2`` each, 4 gloo ranks of PPO on CartPole in one process group.

It finishes, across a ``kill -9`` of the scheduler (the same attempt); and after ``kill -9`` of
one member node mid-task, the other member's ranks end on
their own (their collective breaks), the attempt ends everywhere, and once the node is back the
task runs again as one gang, attempt 2, from its newest checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from google.protobuf import json_format

from opentinker.common.v1 import common_pb2 as C
from opentinker.scheduler.v1 import scheduler_pb2
from opentinker_client import RLClient

from tests.support.procs import Cluster, free_port
from tests.support.waiting import wait_for


def gang_spec(updates: int, checkpoint_every: int) -> C.TaskSpec:
    spec = C.TaskSpec(workload_type="full_rl", model="mlp", resources=C.Resources(gpu_count=2, nodes=2))
    json_format.ParseDict({"env_id": "CartPole-v1"}, spec.env_config)
    hp = {
        "total_timesteps": 64 * updates,  # 4 envs (one per rank) x 16 steps per update
        "num_envs": 4,
        "num_steps": 16,
        "num_minibatches": 2,
        "update_epochs": 1,
        "hidden_sizes": [16],
        "checkpoint_every": checkpoint_every,
    }
    json_format.ParseDict(hp, spec.hyperparameters)
    return spec


def start(tmp_path: Path, *, lease_s: float = 3) -> Cluster:
    port = free_port()  # the rendezvous: one port, free now (other tests may use 29500)
    cluster = Cluster(tmp_path, f"heartbeat_interval: 0.5\nlease: {lease_s}\ngang_rendezvous_ports: [{port}, {port}]\n")
    cluster.start_scheduler()
    for node_id in ("node-a", "node-b"):
        cluster.start_trainer(node_id, "--simulate-gpus", "2")
    cluster.wait_nodes(2)
    return cluster


def submit(cluster: Cluster, spec: C.TaskSpec) -> str:
    return cluster.stub.SubmitTask(scheduler_pb2.SubmitTaskRequest(spec=spec)).task.task_id


def started(trainer, task_id: str) -> list[dict]:
    return [e for e in trainer.log_events() if e.get("event") == "Task started" and e.get("task_id") == task_id]


def test_a_two_node_gang_finishes_across_a_kill_9_of_the_scheduler(tmp_path) -> None:
    """The gang attempt is in the store: a scheduler killed mid-task and restarted knows both
    members, each node re-announces its worker and carries on (nobody is told its attempt is
    stale, no NODE_LOST), and the same attempt finishes with one checkpoint of all 4 ranks.

    The lease is long enough that a trainer starved of CPU on a loaded machine is not declared
    lost: a node loss is the other test's subject, not this one's."""
    cluster = start(tmp_path, lease_s=15)
    try:
        task_id = submit(cluster, gang_spec(updates=120, checkpoint_every=60))
        cluster.wait_state(task_id, C.TASK_STATE_RUNNING, what=lambda t: t.latest_step >= 2)
        cluster.scheduler.kill9()
        restarted = cluster.start_scheduler()  # same port, same state directory, same log file
        task = cluster.wait_state(task_id, {C.TASK_STATE_SUCCEEDED, C.TASK_STATE_FAILED, C.TASK_STATE_PENDING})
        with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
            changes = [(e.reason, e.message) for e in client.watch(task_id, follow=False) if e.kind == "state"]
        assert task.state == C.TASK_STATE_SUCCEEDED and task.attempt == 1, (task.error, changes)
        a, b = cluster.procs[1], cluster.procs[2]
        assert len(started(a, task_id)) == len(started(b, task_id)) == 1  # one member on each node, once
        for trainer in (a, b):  # registered again after the restart, told nothing is stale
            regs = [e for e in trainer.log_events() if e.get("event") == "registered with scheduler"]
            assert len(regs) >= 2 and all(e["stale"] == 0 for e in regs), regs
            assert not trainer.mentions("scheduler no longer runs this attempt here")
        reasons = [reason for reason, _ in changes]
        assert "NODE_LOST" not in reasons and "ATTEMPT_FAILED" not in reasons, reasons
        # Both members were still running when they re-registered with the new scheduler (each
        # node's last registration is that one).
        last = {e["node_id"]: e for e in restarted.log_events() if e.get("event") == "node registered"}
        assert {n: (e["running"], e["stale"]) for n, e in last.items()} == {"node-a": (1, 0), "node-b": (1, 0)}, last
        state = torch.load(Path(task.latest_checkpoint.path) / "trainer_state.pt", weights_only=True)
        assert state["world_size"] == 4 and len(state["rng_ranks"]) == 4 and state["env_steps"] == 64 * 120
        assert task.latest_checkpoint.step == 120 and task.latest_checkpoint.final
    finally:
        cluster.close()


def test_kill_9_of_a_member_node_ends_the_attempt_and_the_gang_resumes(tmp_path) -> None:
    cluster = start(tmp_path)
    try:
        task_id = submit(cluster, gang_spec(updates=40, checkpoint_every=4))
        running = cluster.wait_state(task_id, C.TASK_STATE_RUNNING, what=lambda t: t.latest_checkpoint.step >= 4)
        primary = running.node_id
        trainers = {"node-a": cluster.procs[1], "node-b": cluster.procs[2]}
        other = "node-b" if primary == "node-a" else "node-a"
        trainers[other].kill9()  # the member node and its ranks, without a word
        # Member 0's ranks end on their own: their collective with the lost ranks breaks.
        ended = wait_for(
            lambda: [
                e
                for e in trainers[primary].log_events()
                if e.get("event") == "Task ended" and e.get("task_id") == task_id and e.get("attempt") == 1
            ],
            timeout=300,
            what="member 0's worker of attempt 1 ended",
        )
        assert ended[0]["state"] == "TASK_STATE_FAILED", ended[0]
        task = cluster.wait_state(task_id, {C.TASK_STATE_PENDING}, what=lambda t: t.attempt == 2)
        resume_step = task.latest_checkpoint.step
        assert resume_step >= 4
        # The node comes back (same id); the gang is placed again, whole, and resumes.
        back = cluster.start_trainer(other, "--simulate-gpus", "2")  # logs to the same file as before
        task = cluster.wait_state(task_id, {C.TASK_STATE_SUCCEEDED, C.TASK_STATE_FAILED})
        assert task.state == C.TASK_STATE_SUCCEEDED and task.attempt == 2, task.error
        assert [e["attempt"] for e in started(trainers[primary], task_id)] == [1, 2]
        assert [e["attempt"] for e in started(back, task_id)] == [1, 2]  # before the kill, and after
        # Each member's worker of attempt 2 was handed the checkpoint, and its ranks loaded it.
        for trainer in (trainers[primary], back):
            second = [e for e in started(trainer, task_id) if e["attempt"] == 2]
            assert second[0]["resume_from"], second
        resumed = [
            e
            for trainer in (trainers[primary], back)
            for e in trainer.log_events()
            if e.get("event") == "resumed" and e.get("task_id") == task_id and e.get("attempt") == 2
        ]
        tail = [e for t in (trainers[primary], back) for e in t.log_events() if e.get("task_id") == task_id][-20:]
        assert resumed and {e["step"] for e in resumed} == {resume_step}, tail
    finally:
        cluster.close()


def test_a_two_gpu_task_on_a_simulated_node_runs_two_ranks_and_matches_one(tmp_path, tiny_model_dir) -> None:
    """Through the scheduler: the same SFT task with ``gpu_count`` 1 and 2 on a ``--simulate-gpus 2``
    node; the 2-GPU one runs 2 gloo ranks, and its metrics and PEFT checkpoint equal the 1-GPU one's."""
    from safetensors.torch import load_file

    from tests.support.datasets import arithmetic_chat_jsonl

    data = arithmetic_chat_jsonl(tmp_path / "d.jsonl", n=12)
    cluster = Cluster(tmp_path)
    try:
        cluster.start_scheduler()
        trainer = cluster.start_trainer("node-a", "--simulate-gpus", "2")
        cluster.wait_nodes(1)
        done = {}
        for gpus in (1, 2):
            spec = C.TaskSpec(workload_type="sft", model=str(tiny_model_dir), resources=C.Resources(gpu_count=gpus))
            json_format.ParseDict({"env_id": "chat_jsonl", "path": str(data), "eval_fraction": 0.25}, spec.env_config)
            json_format.ParseDict(
                {"steps": 2, "batch_size": 5, "learning_rate": 1e-2, "lora_rank": 4}, spec.hyperparameters
            )
            task_id = submit(cluster, spec)
            task = cluster.wait_state(task_id, {C.TASK_STATE_SUCCEEDED, C.TASK_STATE_FAILED})
            assert task.state == C.TASK_STATE_SUCCEEDED, task.error
            metrics = cluster.stub.GetMetrics(scheduler_pb2.GetMetricsRequest(task_id=task_id, include_history=True))
            done[gpus] = (task, metrics)
        ranks = [e for e in trainer.log_events() if e.get("event") == "starting ranks"]
        assert [(e["world_size"], e["backend"]) for e in ranks] == [(2, "gloo")]  # the 2-GPU task only
        (t1, m1), (t2, m2) = done[1], done[2]
        a = load_file(str(Path(t1.latest_checkpoint.path) / "adapter_model.safetensors"))
        b = load_file(str(Path(t2.latest_checkpoint.path) / "adapter_model.safetensors"))
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], atol=2e-5, rtol=1e-4)  # two AdamW steps: float order
        assert [p.step for p in m1.points] == [p.step for p in m2.points] == [1, 2]
        for p1, p2 in zip(m1.points, m2.points):
            for key in ("loss", "reward", "train/tokens", "loss/eval"):
                if key in p1.values:
                    assert p2.values[key] == pytest.approx(p1.values[key], rel=1e-5), key
    finally:
        cluster.close()
