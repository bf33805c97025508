"""Forks beside a live client, as a training script or a hosted environment makes them: run as
``python -m tests.support.fork_beside_client SCHEDULER ITERATIONS``.

The process imports the client first (as a user's script does), submits a task, keeps a watch of
it open in a thread and hosts an environment; then each iteration starts a gymnasium
``AsyncVectorEnv`` and a torch ``DataLoader`` with ``num_workers=2``, both with the ``fork``
context, uses them, and makes one client call. It prints ``ok N`` per iteration that worked and
exits 0 once all did; an iteration that failed prints its error and the exit status is 1.
"""

from __future__ import annotations

import sys
import threading
import traceback

from opentinker_client import RLClient  # first: before anything imports grpc
from opentinker_client.hosting.server import EnvironmentServer

import gymnasium
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from tests.support.environments import Corridor


class _Numbers(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)])


def _one_iteration(client: RLClient, task_id: str, seed: int) -> None:
    envs = gymnasium.vector.AsyncVectorEnv([lambda: gymnasium.make("CartPole-v1")] * 2, context="fork")
    try:
        envs.reset(seed=seed)
        for _ in range(5):
            envs.step(np.array([0, 1]))
    finally:
        envs.close()
    loader = DataLoader(_Numbers(), batch_size=4, num_workers=2, multiprocessing_context="fork")
    total = sum(float(batch.sum()) for batch in loader)
    if total != sum(range(16)):
        raise AssertionError(f"the DataLoader's workers gave a sum of {total}, expected {sum(range(16))}")
    client.get_task(task_id)


def main() -> int:
    target, iterations = sys.argv[1], int(sys.argv[2])
    failed = 0
    with RLClient(target) as client, EnvironmentServer(Corridor(), require_token=False):
        task_id = client.submit_task(workload_type="lora_finetune", model="/models/m")
        watching = threading.Event()

        def watch() -> None:
            for _ in client.watch(task_id, reconnect_timeout=None):
                watching.set()

        threading.Thread(target=watch, daemon=True).start()
        watching.wait(60)
        for i in range(iterations):
            try:
                _one_iteration(client, task_id, seed=i)
                print(f"ok {i}", flush=True)
            except Exception:  # noqa: BLE001 - counted and shown; the next iteration goes on
                failed += 1
                print(f"iteration {i} failed:\n{traceback.format_exc()}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
