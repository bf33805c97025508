"""The worker's experiment-tracking loggers (opentinker_trainer/tracking.py), in process: a
missing package is a clear non-retryable error naming the extra; a short task's W&B offline run
holds every step's metrics and the resolved spec, read back from its ``.wandb`` file. (TensorBoard
and MLflow are read back by their own readers in tests/integration/test_dashboard_in_browser.py.)"""

from __future__ import annotations

import io
import json
import sys

import pytest
import structlog

from opentinker_common.spec.tracking import parse_tracking
from opentinker_trainer.context import UserError
from opentinker_trainer.tracking import open_trackers


def test_a_logger_whose_package_is_missing_fails_naming_the_extra(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError, as on a node without it
    cfg = parse_tracking({"wandb": {"project": "p"}})
    with pytest.raises(UserError, match=r"spec.tracking.wandb: .* pip install 'opentinker\[wandb\]'"):
        open_trackers(cfg, task_id="t1", attempt=1, spec={}, work_dir=tmp_path)


def test_a_logger_that_cannot_start_is_a_user_error(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    cfg = parse_tracking({"tensorboard": str(blocker / "tb")})
    with pytest.raises(UserError, match="spec.tracking.tensorboard: cannot start the tensorboard run"):
        open_trackers(cfg, task_id="t1", attempt=1, spec={}, work_dir=tmp_path)


def test_no_tracking_opens_nothing(tmp_path) -> None:
    assert open_trackers(parse_tracking({}), task_id="t1", attempt=1, spec={}, work_dir=tmp_path) is None


def test_a_short_task_writes_a_wandb_offline_run_of_its_steps_and_spec(tmp_path, monkeypatch) -> None:
    pytest.importorskip("wandb", reason="the dev extra installs wandb")
    from google.protobuf import struct_pb2

    from opentinker.common.v1 import common_pb2
    from opentinker.node.v1 import node_pb2
    from opentinker_trainer.worker import execute, prepare

    from tests.support import wandb_log

    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DIR": tmp_path / "wandb-dir",
        "WANDB_CONFIG_DIR": tmp_path / "wandb-config",
        "WANDB_CACHE_DIR": tmp_path / "wandb-cache",
        "WANDB_DATA_DIR": tmp_path / "wandb-data",
        "WANDB_DISABLE_GIT": "true",
    }.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.delenv("OPENTINKER_SCHEDULER_URL", raising=False)  # checkpoints by path, no artifact store
    runs = tmp_path / "runs"
    spec = common_pb2.TaskSpec(workload_type="full_rl", model="mlp", name="ppo-wandb")
    spec.env_config.update({"env_id": "CartPole-v1"})
    hp = {"total_timesteps": 64 * 3, "num_envs": 2, "num_steps": 32, "hidden_sizes": [8], "checkpoint_every": 0}
    spec.hyperparameters.update(hp)
    tracking = struct_pb2.Struct()
    tracking.update({"wandb": {"project": "opentinker-tests", "mode": "offline", "dir": str(runs)}})
    spec.tracking.CopyFrom(tracking)
    assign = node_pb2.AssignTask(task_id="task-wandb-offline", attempt=1, spec=spec)
    out = io.StringIO()
    log = structlog.get_logger("test")
    ctx = prepare(assign, tmp_path / "work" / "task-wandb-offline" / "checkpoints", "cpu", out, log)
    assert ctx is not None, out.getvalue()
    assert execute(ctx, assign, "cpu", log) == 0, out.getvalue()
    import wandb

    wandb.teardown()  # the wandb-core service this process started

    (run_file,) = runs.glob("wandb/offline-run-*-task-wandb-offline/run-task-wandb-offline.wandb")
    reported = [r for r in map(json.loads, out.getvalue().splitlines()) if r["type"] == "metric"]
    rows = wandb_log.history(run_file)
    assert [r["_step"] for r in rows] == [r["step"] for r in reported] == [1, 2, 3]
    for row, metric in zip(rows, reported):
        assert row["reward"] == pytest.approx(metric["values"]["reward"])
        assert row["loss/entropy"] == pytest.approx(metric["values"]["loss/entropy"])
    config = wandb_log.config(run_file)
    assert config["workload_type"] == "full_rl" and config["env"]["env_id"] == "CartPole-v1"
    assert config["hyperparameters"]["num_envs"] == 2
    assert "learning_rate" in config["hyperparameters"]  # resolved: the defaults are there too
    assert config["tracking"]["wandb"]["mode"] == "offline"


def test_the_node_reports_the_loggers_its_python_has(monkeypatch) -> None:
    import importlib.util

    from opentinker_trainer.tracking import writable_loggers

    if importlib.util.find_spec("mlflow") is None or importlib.util.find_spec("tensorboardX") is None:
        pytest.skip("the dev extra installs mlflow-skinny and tensorboardX")
    assert {"tensorboard", "mlflow"} <= set(writable_loggers())  # found without importing them
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as on a node without it
    assert "mlflow" not in writable_loggers() and "tensorboard" in writable_loggers()
