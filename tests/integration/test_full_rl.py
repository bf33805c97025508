"""full_rl PPO on CartPole through real scheduler and trainer processes on loopback, with RLClient."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
import torch
from google.protobuf import struct_pb2

from opentinker.common.v1 import common_pb2
from opentinker.scheduler.v1 import scheduler_pb2
from opentinker_client import Environment, InvalidArgumentError, RLClient

# 4 envs x 128 steps = 512 env steps per update, 8 updates (a few seconds of training).
HP = {"total_timesteps": 4096, "num_envs": 4, "num_steps": 128, "checkpoint_every": 4, "hidden_sizes": [32, 32]}


def test_cartpole_ppo_task_succeeds_with_metrics_and_checkpoints(cluster) -> None:
    cluster.start_scheduler()
    trainer = cluster.start_trainer("node-a")
    cluster.wait_nodes(1)
    with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
        env = Environment(env_id="CartPole-v1", action_space=2, observation_space=4)
        task_id = client.submit_task(
            env_config=env, workload_type="full_rl", gpu_count=0, model="mlp", hyperparameters=HP
        )
        events = list(client.watch(task_id))
        task = client.get_task(task_id)
        assert task.state == "succeeded", task.error
        assert [e.to_state for e in events if e.kind == "state"] == ["pending", "assigned", "running", "succeeded"]
        ms = [e for e in events if e.kind == "metric"]
        assert [e.step for e in ms] == list(range(1, 9))
        for e in ms:
            assert {
                "loss",
                "reward",
                "loss/policy",
                "loss/value",
                "loss/entropy",
                "ppo/approx_kl",
                "ppo/clipfrac",
                "perf/env_steps_per_s",
            } <= set(e.metrics)
        assert ms[-1].metrics["env_steps"] == 4096
        ckpts = [e for e in events if e.kind == "checkpoint"]
        assert [c.step for c in ckpts] == [4, 8] and ckpts[-1].final
        latest = client.get_metrics(task_id)
        assert latest["step"] == 8 and latest["reward"] > 0
    folder = Path(task.checkpoint_path)
    assert folder.name == "step_8"
    assert "actor.0.weight" in torch.load(folder / "policy.pt", weights_only=True)
    assert json.loads((folder / "policy.json").read_text())["format"] == "torch_ppo"
    started = [e for e in trainer.log_events() if e.get("event") == "Task started"]
    assert started and started[0]["task_id"] == task_id


def test_bad_ppo_spec_is_invalid_argument_with_field_path(cluster) -> None:
    cluster.start_scheduler()
    with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
        with pytest.raises(InvalidArgumentError) as err:
            client.submit_task(
                env_config={"env_id": "CartPole-v1"},
                workload_type="full_rl",
                model="mlp",
                hyperparameters={"clip_coef": 0},
            )
        assert err.value.field == "spec.hyperparameters.clip_coef"
    # the scheduler itself refuses it (not only the client's local check)
    hp = struct_pb2.Struct()
    hp.update({"parameter_sharing": "yes"})
    env = struct_pb2.Struct()
    env.update({"env_id": "mpe2/simple_spread_v3"})
    spec = common_pb2.TaskSpec(workload_type="full_rl", model="mlp", env_config=env, hyperparameters=hp)
    with pytest.raises(grpc.RpcError) as rpc:
        cluster.stub.SubmitTask(scheduler_pb2.SubmitTaskRequest(spec=spec))
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "spec.hyperparameters.parameter_sharing" in rpc.value.details()
    assert not cluster.stub.ListTasks(scheduler_pb2.ListTasksRequest()).tasks  # nothing half-written
