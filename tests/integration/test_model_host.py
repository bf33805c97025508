"""LoRA tasks of several owners as tenants of one model host: a real scheduler (API keys on), a
``--simulate-gpus 1`` trainer with ``--tenants-per-host``, eight identical LoRA GRPO tasks from three
owners. They share one host process (the process table shows one host and no worker), run in
turns with identical curves, all requeue and resume when the host is killed with ``kill -9``, and
cancelling one leaves the others running to the end."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from opentinker.common.v1 import common_pb2
from opentinker_client import RLClient

from tests.support.procs import Cluster, task_fields
from tests.support.waiting import wait_for, wait_progress

#: Every task the same, seed included: with neighbours that leave no trace, their curves agree.
HP = {
    "steps": 4,
    "prompts_per_step": 2,
    "group_size": 2,
    "max_new_tokens": 4,
    "lora_rank": 4,
    "checkpoint_every": 2,
    "seed": 5,
}
OWNERS = ("alice", "bob", "carol")
RUNNING, PENDING = common_pb2.TASK_STATE_RUNNING, common_pb2.TASK_STATE_PENDING


def _children(pid: int) -> dict[int, str]:
    """pid -> command line of every process whose parent is ``pid``."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                out[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
    return out


def _hosts(trainer_pid: int) -> list[int]:
    kids = _children(trainer_pid)
    assert not any("opentinker_trainer.worker" in c for c in kids.values()), kids  # no worker process
    return [p for p, c in kids.items() if "opentinker_trainer.host" in c]


def one_gpu_host_node(tmp_path: Path) -> tuple[Cluster, object, RLClient]:
    """``(cluster, trainer, client)``: a real scheduler and one connected ``--simulate-gpus 1``
    trainer with model hosts on (4 tenants, 1 s idle exit), no API keys. The caller closes the
    cluster."""
    cluster = Cluster(tmp_path, "heartbeat_interval: 0.5\nlease: 3\n")
    try:
        cluster.start_scheduler()
        trainer = cluster.start_trainer(
            "node-a", "--simulate-gpus", "1", "--max-tasks", "4", "--tenants-per-host", "4", "--host-idle", "1"
        )
        client = RLClient(cluster.url, min_poll_interval=0)
        wait_for(lambda: [n for n in client.list_nodes() if n.connected], what="the node connected")
    except BaseException:
        cluster.close()
        raise
    return cluster, trainer, client


def _wait(cluster: Cluster, client, task_id: str, state: int, what=None) -> common_pb2.Task:
    """The task (as ``client``, its owner, sees it) once in ``state`` and ``what(task)``; waits
    while it moves or the cluster logs about it."""
    seen: list = [None]

    def arrived():
        seen[0] = task = client.get_task(task_id).proto
        return task if task.state == state and (what is None or what(task)) else None

    return wait_progress(
        arrived,
        lambda: (task_fields(seen[0]), cluster.said_about(task_id)),
        what=f"task {task_id} in {common_pb2.TaskState.Name(state)}",
    )


def _curve(client, task_id: str) -> dict[int, tuple[float, float]]:
    """step -> (reward, mean completion tokens), the newest attempt's value of each step."""
    return {
        e.step: (e.metrics["reward"], e.metrics["completion/mean_tokens"])
        for e in client.watch(task_id)
        if e.kind == "metric"
    }


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
def test_owners_tasks_share_one_host_survive_its_kill9_and_cancel_alone(tmp_path: Path, tiny_model_dir: Path):
    cluster = Cluster(
        tmp_path,
        # No max_tasks_per_gpu: the node's --tenants-per-host lets its 8 tenants share the GPU.
        "heartbeat_interval: 0.5\nlease: 3\nauth: {enabled: true}\n"
        f"paths: {{model_dirs: [{tiny_model_dir.parent}]}}\n",
    )
    try:
        cluster.start_scheduler()
        with RLClient(cluster.url, api_key=cluster.admin_key()) as root:
            _, node_key = root.keys.create("rack-1", "node")
            keys = {o: root.keys.create(o, "user")[1] for o in OWNERS}
        trainer = cluster.start_trainer(
            "node-a",
            "--simulate-gpus",
            "1",
            "--max-tasks",
            "8",
            "--tenants-per-host",
            "8",
            "--host-idle",
            "1",
            "--api-key",
            node_key,
        )
        clients = {o: RLClient(cluster.url, api_key=k, min_poll_interval=0) for o, k in keys.items()}
        admin = RLClient(cluster.url, api_key=cluster.admin_key(), min_poll_interval=0)  # ListNodes is for admins
        wait_for(lambda: [n for n in admin.list_nodes() if n.connected], what="the node connected")
        tasks: dict[str, str] = {}  # task id -> owner
        for owner, n in zip(OWNERS, (3, 3, 2)):  # eight tenants: the host's --tenants-per-host
            for _ in range(n):
                tid = clients[owner].submit_task(
                    workload_type="lora_finetune",
                    model=str(tiny_model_dir),
                    gpu_count=1,
                    hyperparameters=HP,
                    max_attempts=3,
                )
                tasks[tid] = owner
        for tid in tasks:
            _wait(cluster, clients[tasks[tid]], tid, RUNNING, lambda t: t.latest_checkpoint.step >= 2)
        # One host process holds every tenant: no worker, one copy of the base model.
        (host,) = _hosts(trainer.pid)
        # ListNodes (and `opentinker nodes`) show the host, its base model and tenants.
        shown = wait_for(
            lambda: [h for n in admin.list_nodes() for h in n.model_hosts if len(h.task_ids) == len(tasks)],
            what="the model host in ListNodes",
        )
        assert shown[0].pid == host and shown[0].model == str(tiny_model_dir) and set(shown[0].task_ids) == set(tasks)
        assert shown[0].device_indices == (0,) and shown[0].max_tenants == 8
        started = [e for e in trainer.log_events() if e.get("event") == "Task started"]
        assert {e["task_id"] for e in started} == set(tasks) and {e["pid"] for e in started} == {host}
        for tid, owner in tasks.items():
            task = clients[owner].get_task(tid).proto
            assert task.node_id == "node-a" and list(task.device_indices) == [0] and task.owner == owner

        os.kill(host, 9)  # the host dies: every tenant's attempt ends, and each resumes from its checkpoint
        for tid in tasks:
            _wait(
                cluster,
                clients[tasks[tid]],
                tid,
                RUNNING,
                lambda t: t.attempt == 2 and t.latest_step > t.latest_checkpoint.step,
            )
        (second,) = _hosts(trainer.pid)
        assert second != host
        victim = next(iter(tasks))
        clients[tasks[victim]].cancel(victim)
        for tid in tasks:
            if tid == victim:
                assert _wait(cluster, clients[tasks[tid]], tid, common_pb2.TASK_STATE_CANCELLED).attempt == 2
                continue
            task = _wait(cluster, clients[tasks[tid]], tid, common_pb2.TASK_STATE_SUCCEEDED)
            assert task.attempt == 2 and task.latest_step == HP["steps"]
        finished = [t for t in tasks if t != victim]
        curves = {t: _curve(clients[tasks[t]], t) for t in finished}
        first = curves[finished[0]]
        assert sorted(first) == list(range(1, HP["steps"] + 1))
        assert all(c == first for c in curves.values()), curves
        # The final adapters agree as well, each in the PEFT format a worker writes.
        adapters = []
        for t in finished:
            got = clients[tasks[t]].download_checkpoint(t, tmp_path / "download" / t)
            assert (got / "adapter_config.json").exists()
            adapters.append(load_file(got / "adapter_model.safetensors"))
        assert all(sorted(a) == sorted(adapters[0]) for a in adapters)
        for a in adapters[1:]:
            assert all(torch.allclose(a[k], adapters[0][k], atol=1e-6) for k in a)
        resumed = [e for e in trainer.log_events() if e.get("event") == "resumed"]
        assert {e["task_id"] for e in resumed} == set(tasks)
        # No tenant left: the host exits after --host-idle, freeing its memory.
        wait_for(lambda: not _hosts(trainer.pid), what="the idle model host exits")
        for c in [*clients.values(), admin]:
            c.close()
    finally:
        cluster.close()
