"""Distributed runs for tests: a real worker process with several CPU ranks, and functions run on
W gloo ranks (``torch.multiprocessing`` spawn) for the data-parallel equivalence tests."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from google.protobuf import json_format

from opentinker.common.v1 import common_pb2
from opentinker.node.v1 import node_pb2

REPO = Path(__file__).resolve().parents[2]


def task_spec(
    *, workload_type: str, model: str | Path, env_config: dict, hyperparameters: dict, gpu_count: int = 0
) -> common_pb2.TaskSpec:
    """A ``TaskSpec`` message as a client sends it."""
    spec = common_pb2.TaskSpec(
        workload_type=workload_type, model=str(model), resources=common_pb2.Resources(gpu_count=gpu_count)
    )
    json_format.ParseDict(env_config, spec.env_config)
    json_format.ParseDict(hyperparameters, spec.hyperparameters)
    return spec


@dataclass
class WorkerRun:
    """A finished worker process: exit code, its JSON-line reports, its stderr (logs)."""

    returncode: int
    reports: list[dict]
    stderr: str

    def of(self, kind: str) -> list[dict]:
        return [r for r in self.reports if r["type"] == kind]


def worker_env() -> dict[str, str]:
    """The environment of a CPU worker in tests: one intra-op thread, no GPU, the repo importable."""
    env = {k: v for k, v in os.environ.items() if k != "OPENTINKER_AGENT_PID"}
    env.update(
        {
            "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'protos'}",
            "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    return env


def run_worker(
    tmp_path: Path,
    name: str,
    spec: common_pb2.TaskSpec,
    *,
    devices: int,
    attempt: int = 1,
    resume_from: Path | None = None,
    timeout_s: float = 900,
) -> WorkerRun:
    """Run ``python -m opentinker_trainer.worker`` on an ``AssignTask`` with ``devices`` (simulated)
    device indices, on the CPU, as the node agent of a ``--simulate-gpus`` node does; checkpoints
    under ``tmp_path / "node" / name / checkpoints`` (the work folder is ``tmp_path / "node"``:
    a spec may name files elsewhere under ``tmp_path``). Waits for it to end."""
    folder = _assignment(tmp_path, name, spec, devices=devices, attempt=attempt, resume_from=resume_from)
    proc = subprocess.run(
        _worker_argv(folder), capture_output=True, text=True, env=worker_env(), cwd=folder, timeout=timeout_s
    )
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.strip().startswith("{")]
    return WorkerRun(proc.returncode, reports, proc.stderr)


def start_worker(tmp_path: Path, name: str, spec: common_pb2.TaskSpec, *, devices: int, stderr) -> subprocess.Popen:
    """:func:`run_worker` without waiting: the worker in its own session (process group, as the
    agent starts it), its report lines on ``stdout`` (text), its stderr to file ``stderr``;
    checkpoints under ``tmp_path / "node" / name / checkpoints``. The caller ends and reaps it."""
    folder = _assignment(tmp_path, name, spec, devices=devices)
    return subprocess.Popen(
        _worker_argv(folder),
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=worker_env(),
        cwd=folder,
        start_new_session=True,
    )


def _assignment(
    tmp_path: Path, name: str, spec: common_pb2.TaskSpec, *, devices: int, attempt: int = 1, resume_from=None
) -> Path:
    """Folder ``tmp_path / "node" / name`` holding ``assignment.pb`` (task ``t-<name>``)."""
    folder = tmp_path / "node" / name
    folder.mkdir(parents=True, exist_ok=True)
    assign = node_pb2.AssignTask(task_id=f"t-{name}", attempt=attempt, spec=spec, device_indices=list(range(devices)))
    if resume_from is not None:
        assign.resume_from.path = str(resume_from)
    (folder / "assignment.pb").write_bytes(assign.SerializeToString())
    return folder


def _worker_argv(folder: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "opentinker_trainer.worker",
        str(folder / "assignment.pb"),
        "--checkpoint-dir",
        str(folder / "checkpoints"),
        "--device",
        "cpu",
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank: int, fn: Callable, world_size: int, port: int, out: Path, args: tuple) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from opentinker_trainer.distributed import DataParallel

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=300),
    )
    try:
        result = fn(DataParallel(rank, world_size), *args)
        torch.save(result, out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, out: Path, *args: Any) -> list[Any]:
    """``fn(dp, *args)`` on ``world_size`` gloo ranks (spawned processes; ``dp`` a
    :class:`~opentinker_trainer.distributed.DataParallel`); returns each rank's result (saved with
    ``torch.save``), in rank order. ``fn`` must be a module-level function (spawn imports it)."""
    import torch
    import torch.multiprocessing as mp

    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank_entry, args=(fn, world_size, free_port(), out, args), nprocs=world_size, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
