"""The trainer's side of owner isolation: a spec may not name the node's own work folder, dataset
files are regular files within the upload limit, and what the processes write is theirs only.

Pure checks of :mod:`opentinker_trainer.local_paths` and ``read_chat_jsonl``; a real worker process
refusing a model path in its node's work folder; and real scheduler and trainer processes on
loopback for the file modes and the end-to-end refusals.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from opentinker.common.v1 import common_pb2 as C
from opentinker.node.v1 import node_pb2 as N
from opentinker_client import RLClient, TaskFailedError
from opentinker_trainer.context import UserError
from opentinker_trainer.local_paths import check_spec_paths, private_dirs
from opentinker_trainer.workloads.sft_data import MAX_DATASET_BYTES, read_chat_jsonl
from opentinker_common.datasets import DEFAULT_MAX_DATASET_BYTES

from tests.support.procs import Cluster, run_worker

REPO = Path(__file__).resolve().parents[2]
LINE = json.dumps({"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}) + "\n"


def _spec(model: str = "", path: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(model=model, env=SimpleNamespace(path=path))


# ----------------------------------------------------------------------------- local_paths


def test_private_dirs_from_the_agents_variables_or_the_checkpoint_layout(tmp_path) -> None:
    work = tmp_path / "runs"
    env = {"OPENTINKER_WORK_DIR": str(work), "OPENTINKER_DATASET_CACHE": str(tmp_path / "cache")}
    assert private_dirs(tmp_path / "x", env) == (str(work), str(tmp_path / "cache"))
    # an artifact cache the operator moved out of the work folder (other tasks' checkpoints, datasets)
    moved = {**env, "OPENTINKER_ARTIFACT_CACHE": str(tmp_path / "artifacts")}
    assert private_dirs(tmp_path / "x", moved) == (str(work), str(tmp_path / "cache"), str(tmp_path / "artifacts"))
    assert private_dirs(work / "t1" / "checkpoints", {}) == (str(work),)  # the agent's layout
    assert private_dirs(tmp_path / "ck", {}) == ()  # unknown: nothing to protect


def test_model_and_data_paths_in_the_work_folder_are_refused_with_the_alternative(tmp_path) -> None:
    work = tmp_path / "runs"
    (work / "t1" / "checkpoints" / "step_1").mkdir(parents=True)
    folders = (os.path.realpath(work),)
    other = str(work / "t1" / "checkpoints" / "step_1")
    for model in (
        other,
        str(work / "t9" / "checkpoints" / "step_3"),
        str(work / "x" / ".." / "t1" / "checkpoints" / "step_1"),
    ):
        with pytest.raises(
            UserError,
            match=r"spec.model: .* cannot be used by this task: "
            r"it is inside this trainer node's work folder .* init_from",
        ):
            check_spec_paths(_spec(model), folders, cwd=str(tmp_path))
    # Relative to the worker's folder, as from_pretrained would read it.
    with pytest.raises(UserError, match="spec.model: 'runs/t1/checkpoints/step_1' cannot be used"):
        check_spec_paths(_spec("runs/t1/checkpoints/step_1"), folders, cwd=str(tmp_path))
    # A symlink from an allowed folder into the work folder.
    (tmp_path / "models").mkdir()
    os.symlink(other, tmp_path / "models" / "m")
    with pytest.raises(UserError, match="spec.model"):
        check_spec_paths(_spec(str(tmp_path / "models" / "m")), folders, cwd="/")
    with pytest.raises(UserError, match=r"env_config.path: .* cannot be used by this task: .* dataset_id"):
        check_spec_paths(_spec("org/m", str(work / "datasets" / ("a" * 64 + ".jsonl"))), folders, cwd="/")
    # Fine: hub ids (also when no such local folder exists), folders and files elsewhere.
    check_spec_paths(_spec("HuggingFaceTB/SmolLM2-135M-Instruct", str(tmp_path / "data.jsonl")), folders, cwd=str(work))
    check_spec_paths(_spec(str(tmp_path / "models")), folders, cwd="/")
    check_spec_paths(_spec(other), (), cwd="/")  # nothing known to protect


# -------------------------------------------------------------------------- dataset files


def test_the_read_limit_is_the_upload_limit() -> None:
    assert MAX_DATASET_BYTES == DEFAULT_MAX_DATASET_BYTES == 256 * 1024 * 1024


def test_dev_zero_a_folder_and_a_fifo_are_refused_without_reading(tmp_path) -> None:
    # /dev/zero read without bound took a worker to 23 GB and the OOM killer; a FIFO with no
    # writer would block the open forever.
    with pytest.raises(
        UserError,
        match="dataset /dev/zero cannot be used by this task: expected a regular file, got a character device",
    ):
        read_chat_jsonl(Path("/dev/zero"))
    with pytest.raises(
        UserError, match=f"dataset {tmp_path} cannot be used by this task: expected a regular file, got a folder"
    ):
        read_chat_jsonl(tmp_path)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(UserError, match="expected a regular file, got a FIFO"):
        read_chat_jsonl(fifo)


def test_a_file_over_the_limit_is_refused_before_it_is_read(tmp_path) -> None:
    big = tmp_path / "big.jsonl"
    with open(big, "wb") as fh:  # sparse: costs no disk; zeros that would fail line 1 if parsed
        fh.truncate(MAX_DATASET_BYTES + 1)
    with pytest.raises(
        UserError,
        match=rf"dataset {big} cannot be used by this task: expected at most {MAX_DATASET_BYTES} bytes "
        rf"\(256 MiB, the upload limit\), got {MAX_DATASET_BYTES + 1} bytes",
    ):
        read_chat_jsonl(big)
    small = tmp_path / "small.jsonl"
    small.write_text(LINE * 3)
    assert len(read_chat_jsonl(small, max_bytes=len(LINE) * 3)) == 3
    with pytest.raises(UserError, match="expected at most"):
        read_chat_jsonl(small, max_bytes=len(LINE) * 3 - 1)
    with pytest.raises(UserError, match="cannot be used by this task: it cannot be read on this trainer node"):
        read_chat_jsonl(tmp_path / "missing.jsonl")


# ----------------------------------------------------------------------- a real worker


def _run_worker(tmp_path: Path, spec: C.TaskSpec, env: dict[str, str], checkpoint_dir: Path) -> tuple[int, list[dict]]:
    return run_worker(N.AssignTask(task_id="t2", attempt=1, spec=spec), tmp_path, checkpoint_dir, cwd=REPO, env=env)


def test_a_worker_refuses_a_model_in_its_nodes_work_folder(tmp_path) -> None:
    work = tmp_path / "runs"
    (work / "t1" / "checkpoints" / "step_1").mkdir(parents=True)
    spec = C.TaskSpec(workload_type="inference", model=str(work / "t1" / "checkpoints" / "step_1"))
    for env in ({"OPENTINKER_WORK_DIR": str(work)}, {}):  # from the agent, or from --checkpoint-dir's layout
        rc, reports = _run_worker(tmp_path, spec, env, work / "t2" / "checkpoints")
        assert rc == 1 and reports[-1]["type"] == "failed" and reports[-1]["retryable"] is False, reports
        assert (
            reports[-1]["error"].startswith(f"spec.model: '{spec.model}' cannot be used by this task")
            and "init_from" in reports[-1]["error"]
        )


# ------------------------------------------------- real scheduler and trainer processes


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.close()


def test_file_modes_and_work_folder_refusals_end_to_end(cluster: Cluster, tiny_model_dir: Path, tmp_path: Path) -> None:
    cluster.start_scheduler()
    cluster.start_trainer("node-a")
    cluster.wait_nodes(1)
    data = tmp_path / "train.jsonl"
    data.write_text(LINE * 4)
    with RLClient(scheduler_url=cluster.url, min_poll_interval=0) as client:
        info = client.upload_dataset(data)
        env = {"env_id": "chat_jsonl", "dataset_id": info.dataset_id, "eval_fraction": 0}
        task_id = client.submit_task(
            env,
            workload_type="sft",
            model=str(tiny_model_dir),
            hyperparameters={"steps": 1, "batch_size": 2, "lora_rank": 2},
        )
        task = cluster.wait_done(client, task_id)
        assert task.state == "succeeded", task.error

        # Scheduler: state_dir 0700; database, WAL and uploaded datasets 0600.
        state = cluster.state_dir
        assert _mode(state) == 0o700
        hex_ = info.dataset_id.removeprefix("sha256:")
        files = [state / "scheduler.db", *state.glob("scheduler.db-*"), state / "datasets" / f"{hex_}.jsonl"]
        assert {str(p): _mode(p) for p in files} == {str(p): 0o600 for p in files}
        assert _mode(state / "datasets") == 0o700
        # Trainer: the assignment (client-hosted env tokens), checkpoints and the dataset cache.
        work = tmp_path / "runs" / "node-a"
        attempt = work / task_id / "attempt-1"
        assert (_mode(work / task_id), _mode(attempt), _mode(attempt / "assignment.pb")) == (0o700, 0o700, 0o600)
        ckpt = Path(task.checkpoint_path)
        assert ckpt.is_relative_to(work) and _mode(ckpt) == 0o700
        inside = [p for p in ckpt.rglob("*")]
        assert inside and {str(p): _mode(p) for p in inside} == {str(p): 0o700 if p.is_dir() else 0o600 for p in inside}
        cached = work / "datasets" / f"{hex_}.jsonl"
        assert _mode(cached) == 0o600

        # Auth is off, so the scheduler lets any path through; the worker still refuses the
        # node's own files: another task's checkpoint as a model, the dataset cache as a path.
        stolen = client.submit_task(workload_type="inference", model=str(ckpt))
        with pytest.raises(TaskFailedError) as err:
            cluster.wait_done(client, stolen)
        assert (
            err.value.task.attempt == 1
            and "cannot be used by this task" in err.value.task.error
            and "init_from" in err.value.task.error
        )
        cache_read = client.submit_task(
            {"env_id": "chat_jsonl", "path": str(cached)}, workload_type="sft", model=str(tiny_model_dir)
        )
        with pytest.raises(TaskFailedError) as err:
            cluster.wait_done(client, cache_read)
        assert err.value.task.error.startswith("env_config.path:") and "dataset_id" in err.value.task.error
