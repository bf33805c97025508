"""A PPO task stopped in the middle of an update keeps its last completed update, on one rank and
on two: a real scheduler and trainer, PPO on a corridor that this test serves as a client-hosted
environment. The first environment step of update 2 is never answered, so update 2 is in
progress for as long as the test likes; then the task is cancelled. The worker abandons update 2
and stores update 1 at once; on two ranks, the rank that was not held waits in a collective of
update 2 and abandons it with the held one, and rank 0 stores update 1 with both ranks' RNGs."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from opentinker.common.v1 import common_pb2 as C
from opentinker_client import Environment, RLClient

from tests.integration.test_checkpoints_leave import cli
from tests.support.procs import Cluster

NUM_ENVS, NUM_STEPS = 2, 4
#: Updates for ever (the test stops the task); update 1 is NUM_ENVS * NUM_STEPS environment steps.
HP = {
    "total_timesteps": 1_000_000,
    "num_envs": NUM_ENVS,
    "num_steps": NUM_STEPS,
    "num_minibatches": 1,
    "update_epochs": 1,
    "hidden_sizes": [8],
}
# The worker's grace after SIGTERM: room for a save on a loaded machine, none for update 2.
GRACE = ("--kill-grace", "30")


class HeldCorridor(Environment):
    """Four squares, 'right' pays at the far end. Step call number ``NUM_ENVS * NUM_STEPS + 1``
    (the first of update 2, whichever rank makes it) is held until :attr:`gate` opens; the
    others are answered, so on two ranks the other rank goes on into update 2."""

    lock = threading.Lock()
    calls = 0
    held = threading.Event()
    gate = threading.Event()

    def __init__(self, **options):
        super().__init__(action_space=2, observation_space=4, timeout_s=600, **options)
        self.pos = 0

    @classmethod
    def start_over(cls) -> None:
        cls.calls, cls.held, cls.gate = 0, threading.Event(), threading.Event()

    def reset(self, seed=None):
        self.pos = 0
        return self.pos

    def step(self, action):
        cls = type(self)
        with cls.lock:
            cls.calls += 1
            hold = cls.calls == NUM_ENVS * NUM_STEPS + 1
        if hold:
            cls.held.set()
            cls.gate.wait()
        self.pos = max(0, min(3, self.pos + (1 if action == 1 else -1)))
        return self.pos, float(self.pos == 3), self.pos == 3, False, {}


@pytest.fixture
def corridor(tmp_path: Path):
    """``(cluster, client, server)``: a scheduler, an RLClient and the held corridor's server."""
    cluster = Cluster(tmp_path)
    HeldCorridor.start_over()
    try:
        cluster.start_scheduler()
        with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
            with client.serve_environment(HeldCorridor()) as server:
                yield cluster, client, server
                HeldCorridor.gate.set()
    finally:
        HeldCorridor.gate.set()
        cluster.close()


def _cancel_in_update_two(cluster: Cluster, client: RLClient, server, gpu_count: int) -> str:
    task_id = client.submit_task(
        workload_type="full_rl", model="mlp", env_config=server.env_config, hyperparameters=HP, gpu_count=gpu_count
    )
    cluster.wait_state(task_id, C.TASK_STATE_RUNNING, what=lambda t: HeldCorridor.held.is_set())
    client.cancel(task_id, reason="enough")
    task = cluster.wait_state(task_id, C.TASK_STATE_CANCELLED, what=lambda t: t.HasField("latest_checkpoint"))
    assert (task.latest_checkpoint.step, task.latest_checkpoint.attempt, task.latest_step) == (1, 1, 1)
    assert task.latest_checkpoint.artifact.key and not task.latest_checkpoint.final
    return task_id


def _downloaded_state(cluster: Cluster, task_id: str, folder: Path) -> dict:
    cli(cluster, "download", task_id, "-o", str(folder))
    assert (folder / "policy.pt").exists()
    return torch.load(folder / "trainer_state.pt", weights_only=False)


def test_a_cancelled_ppo_task_keeps_its_last_completed_update(corridor, tmp_path: Path) -> None:
    cluster, client, server = corridor
    cluster.start_trainer("node-a", *GRACE)
    cluster.wait_nodes(1)
    task_id = _cancel_in_update_two(cluster, client, server, gpu_count=0)
    state = _downloaded_state(cluster, task_id, tmp_path / "ck")
    assert (state["step"], state["env_steps"]) == (1, NUM_ENVS * NUM_STEPS)


def test_two_ranks_cancelled_mid_update_keep_the_same_last_completed_update(corridor, tmp_path: Path) -> None:
    cluster, client, server = corridor
    cluster.start_trainer("node-a", "--simulate-gpus", "2", *GRACE)
    cluster.wait_nodes(1)
    task_id = _cancel_in_update_two(cluster, client, server, gpu_count=2)
    state = _downloaded_state(cluster, task_id, tmp_path / "ck")
    assert (state["step"], state["env_steps"], state["world_size"]) == (1, NUM_ENVS * NUM_STEPS, 2)
    assert len(state["rng_ranks"]) == 2
