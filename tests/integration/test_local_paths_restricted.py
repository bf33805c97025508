"""``paths.model_dirs`` cannot be bypassed by a hub-id-shaped name of a folder in the trainer's
launch folder.

The scheduler lets ``model: private-model`` through as a hub id, but the worker runs in the
trainer's launch folder and ``from_pretrained("private-model")`` would load ``./private-model``.
So the scheduler marks the assignment ``local_paths_restricted`` when its ``paths:`` policy is in
force, and the worker then refuses a relative name that exists on its disk (or a ``~`` name).

Pure checks, the flag as the scheduler core sets it, a real worker process, and real scheduler
(auth on, ``model_dirs`` set) and trainer processes on loopback.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from opentinker.common.v1 import common_pb2 as C
from opentinker.node.v1 import node_pb2 as N
from opentinker_client import InvalidArgumentError, RLClient, TaskFailedError
from opentinker_scheduler.security.auth import AuthConfig
from opentinker_scheduler.config import PoolNode, SchedulerConfig
from opentinker_scheduler.state.core import SchedulerCore
from opentinker_scheduler.admission.paths import PathsConfig
from opentinker_scheduler.state.store import SqliteStore
from opentinker_trainer.context import UserError
from opentinker_trainer.local_paths import check_model_not_local

from tests.support.procs import Cluster, run_worker

REPO = Path(__file__).resolve().parents[2]
HINT = "name local models by an absolute path under paths.model_dirs"


# ----------------------------------------------------------------------------------- pure check


def test_relative_names_that_exist_here_are_refused(tmp_path: Path) -> None:
    (tmp_path / "private-model").mkdir()
    (tmp_path / "org" / "name").mkdir(parents=True)
    (tmp_path / "weights.safetensors").write_bytes(b"x")
    os.symlink("/nonexistent", tmp_path / "dangling")
    for name in ("private-model", "org/name", "weights.safetensors", "dangling"):
        with pytest.raises(UserError) as err:
            check_model_not_local(name, cwd=str(tmp_path))
        assert (
            str(err.value)
            == f"spec.model {name!r} is a hub id, but a local folder of that name exists on this node; {HINT}"
        )
    for name in ("~", "~/m", "~alice/m"):
        with pytest.raises(UserError, match=rf"spec.model '{name}' names a home folder on this node; {HINT}"):
            check_model_not_local(name, cwd=str(tmp_path))
    # Fine: hub ids with nothing of that name here, absolute paths (the scheduler checked those), no model.
    for name in ("HuggingFaceTB/SmolLM2-135M-Instruct", "org/other", "gpt2", str(tmp_path / "private-model"), ""):
        check_model_not_local(name, cwd=str(tmp_path))


# ----------------------------------------------------------------- the flag the scheduler sets


def _assignment(tmp: Path, *, model: str, **config) -> N.AssignTask:
    cfg = SchedulerConfig(resource_pool=(PoolNode("node-a", 0, 8),), state_dir=tmp, **config)
    core = SchedulerCore(cfg, SqliteStore(tmp))
    node, _ = core.node_register(N.Register(node_id="node-a", devices=[], max_tasks=8))
    core.api.submit(C.TaskSpec(workload_type="lora_finetune", model=model), owner="alice")
    core.schedule()
    pushed = []
    while not node.outbox.empty():
        msg = node.outbox.get_nowait()
        if msg.HasField("assign_task"):
            pushed.append(msg.assign_task)
    assert len(pushed) == 1
    return pushed[0]


@pytest.mark.parametrize(
    ("config", "model", "restricted"),
    [
        ({}, "private-model", False),  # auth off, no paths: one trusted user, anything goes
        ({"auth": AuthConfig(enabled=True)}, "private-model", True),  # auth on: no local paths at all
        ({"paths": PathsConfig(model_dirs=("/models",))}, "private-model", True),  # model_dirs set
        ({"paths": PathsConfig(model_dirs=("/models",))}, "/models/m", True),
        (
            {"auth": AuthConfig(enabled=True), "default_model": "local-default"},
            "",
            False,
        ),  # the operator's default is exempt
        ({"auth": AuthConfig(enabled=True), "default_model": "local-default"}, "local-default", False),
    ],
)
def test_the_scheduler_marks_assignments_under_the_paths_policy(
    tmp_path: Path, config: dict, model: str, restricted: bool
) -> None:
    assert _assignment(tmp_path, model=model, **config).local_paths_restricted is restricted


# -------------------------------------------------------------------------------- real worker


def test_a_restricted_worker_refuses_a_folder_in_its_launch_folder(tmp_path: Path, tiny_model_dir: Path) -> None:
    launch = tmp_path / "launch"
    launch.mkdir()
    os.symlink(tiny_model_dir, launch / "private-model")
    spec = C.TaskSpec(workload_type="lora_finetune", model="private-model")
    assign = N.AssignTask(task_id="t1", attempt=1, spec=spec, local_paths_restricted=True)
    rc, reports = run_worker(assign, tmp_path, tmp_path / "runs" / "t1" / "checkpoints", cwd=launch)
    assert rc == 1 and reports[-1]["type"] == "failed" and reports[-1]["retryable"] is False, reports
    assert (
        reports[-1]["error"]
        == f"spec.model 'private-model' is a hub id, but a local folder of that name exists on this node; {HINT}"
    )


# ---------------------------------------------------- real scheduler and trainer processes


def test_end_to_end_with_auth_on_and_model_dirs(tmp_path: Path, tiny_model_dir: Path, monkeypatch) -> None:
    config = (
        "heartbeat_interval: 0.5\nlease: 3\nauth: {enabled: true}\n"
        f"paths: {{model_dirs: [{tiny_model_dir.parent}]}}\n"
    )
    cluster = Cluster(tmp_path, config)
    try:
        cluster.start_scheduler()
        admin = (cluster.state_dir / "admin.key").read_text().strip()
        with RLClient(cluster.url, api_key=admin) as root:
            _, node_key = root.keys.create("rack-1", "node")
            _, alice_key = root.keys.create("alice", "user")
        # The trainer is launched from a folder holding a model under a hub-id-shaped name.
        launch = tmp_path / "launch"
        launch.mkdir()
        os.symlink(tiny_model_dir, launch / "private-model")
        monkeypatch.chdir(launch)
        cluster.start_trainer("node-a", "--api-key", node_key)
        monkeypatch.undo()
        with RLClient(cluster.url, api_key=alice_key, min_poll_interval=0) as alice:
            _wait_connected(cluster)
            stolen = alice.submit_task(
                workload_type="lora_finetune", model="private-model", hyperparameters={"steps": 1, "lora_rank": 2}
            )
            with pytest.raises(TaskFailedError) as err:
                cluster.wait_done(alice, stolen)
            task = err.value.task
            assert task.attempt == 1  # not retried: a user error
            assert (
                task.error
                == "spec.model 'private-model' is a hub id, but a local folder of that name exists on this node; "
                + HINT
            )
            # The scheduler itself refuses home-folder and relative paths.
            with pytest.raises(InvalidArgumentError, match="spec.model"):
                alice.submit_task(workload_type="lora_finetune", model="~/private-model")
            # The sanctioned way: the absolute path under paths.model_dirs trains on the same node.
            ok = alice.submit_task(
                workload_type="lora_finetune",
                model=str(tiny_model_dir),
                hyperparameters={
                    "steps": 1,
                    "prompts_per_step": 2,
                    "group_size": 2,
                    "max_new_tokens": 4,
                    "lora_rank": 2,
                },
            )
            assert cluster.wait_done(alice, ok).state == "succeeded"
    finally:
        cluster.close()


def _wait_connected(cluster: Cluster, timeout: float = 60) -> None:
    """Wait for one connected node, asking with the admin key (auth is on)."""
    admin = (cluster.state_dir / "admin.key").read_text().strip()
    deadline = time.monotonic() + timeout
    with RLClient(cluster.url, api_key=admin) as root:
        while time.monotonic() < deadline:
            if any(n.connected for n in root.list_nodes()):
                return
            time.sleep(0.2)
    raise TimeoutError("the trainer did not connect")
