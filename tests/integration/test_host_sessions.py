"""Training sessions as tenants of a model host: a real scheduler and one ``--simulate-gpus 1``
trainer with model hosts on. Two ``lora_session`` tasks (one GPU each) and a LoRA GRPO task on
the same tiny base share one host process (no worker); both sessions train their own adapters;
``kill -9`` of the host requeues all three, and ``resume_training_session`` continues each
session from its own saved state on a new host; cancelling one session leaves the other serving."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from opentinker.common.v1 import common_pb2
from opentinker_client.training import Datum

from tests.integration.test_model_host import _hosts, _wait, one_gpu_host_node
from tests.support.waiting import wait_for

RUNNING, CANCELLED = common_pb2.TASK_STATE_RUNNING, common_pb2.TASK_STATE_CANCELLED
#: Long enough to outlive the test (it is cancelled).
TRAIN_HP = {"steps": 10000, "prompts_per_step": 1, "group_size": 2, "max_new_tokens": 4, "lora_rank": 4, "seed": 5}
DATUMS = [
    Datum.from_sequence([5, 9, 14, 3, 7, 11], prompt_length=2),
    Datum.from_sequence([8, 2, 6, 13], prompt_length=1),
]


def _sft_step(session) -> float:
    loss = session.forward_backward(DATUMS).result(timeout=120).loss
    session.optim_step(1e-2).result(timeout=120)
    return loss


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
def test_sessions_share_a_model_host_and_resume_after_it_is_killed(tmp_path: Path, tiny_model_dir: Path) -> None:
    cluster, trainer, client = one_gpu_host_node(tmp_path)
    try:
        model = str(tiny_model_dir)
        grpo = client.submit_task(
            workload_type="lora_finetune", model=model, gpu_count=1, env_config={"env_id": "arithmetic"},
            hyperparameters=TRAIN_HP, max_attempts=3,
        )  # fmt: skip
        sessions = [
            client.create_training_session(model, lora_rank=4, seed=seed, gpu_count=1, max_attempts=3, timeout=300)
            for seed in (1, 2)
        ]
        _wait(cluster, client, grpo, RUNNING)
        (host,) = _hosts(trainer.pid)  # one host process holds all three, and no worker runs
        ids = [s.task_id for s in sessions]
        assert {client.get_task(t).node_id for t in [grpo, *ids]} == {"node-a"}

        # Each session trains its own adapter: the loss falls; from the same base's loss at the start
        # (LoRA B starts at 0) the two part ways (their seeds give different A matrices).
        losses = {t: [_sft_step(s) for _ in range(3)] for t, s in zip(ids, sessions)}
        assert all(v[-1] < v[0] for v in losses.values()), losses
        assert losses[ids[0]][0] == losses[ids[1]][0] and losses[ids[0]][1:] != losses[ids[1]][1:]
        saved = {t: s.save_state("three").result(timeout=120) for t, s in zip(ids, sessions)}
        for t in ids:
            wait_for(
                lambda t=t: [c.step for c in client.list_checkpoints(t)][-1:] == [saved[t].step],
                what=f"session {t}'s state recorded as its newest checkpoint",
            )
        after = {t: s.forward([DATUMS[0]]).result(timeout=120)[0] for t, s in zip(ids, sessions)}
        for s in sessions:
            s.close()

        # kill -9 of the host: all three requeue and come back on a new host.
        os.kill(host, signal.SIGKILL)
        for t in [grpo, *ids]:
            _wait(cluster, client, t, RUNNING, lambda task: task.attempt == 2)
        resumed = {t: client.resume_training_session(t, timeout=300) for t in ids}
        (again,) = _hosts(trainer.pid)
        assert again != host
        for t, s in resumed.items():
            info = s.get_info()
            assert (info.attempt, info.step, info.resumed_from) == (2, 3, "three")
            # The weights it resumed with are its own saved ones (not the neighbour's).
            assert s.forward([DATUMS[0]]).result(timeout=120)[0] == pytest.approx(after[t], abs=1e-5)

        # Cancelling one session ends it alone: the other still trains on the same host.
        client.cancel(ids[0])
        _wait(cluster, client, ids[0], CANCELLED)
        assert _sft_step(resumed[ids[1]]) > 0 and resumed[ids[1]].get_info().step == 4
        assert client.get_task(grpo).state == "running" and _hosts(trainer.pid) == [again]
        for s in resumed.values():
            s.close()
        client.cancel(grpo)
        client.cancel(ids[1])
    finally:
        cluster.close()
