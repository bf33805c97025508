"""``spec.tracking`` through a real scheduler and trainer: a running PPO task's metrics appear in
TensorBoard event files and an MLflow file store while it runs, read back with those tools' own
readers (tensorboard's EventAccumulator, MlflowClient); the resolved spec is the run's config."""

from __future__ import annotations

import json
import os

import pytest

from opentinker_client import RLClient
from tests.support.waiting import wait_progress

pytestmark = pytest.mark.e2e

HP = {"total_timesteps": 64 * 600, "num_envs": 2, "num_steps": 32, "checkpoint_every": 2, "hidden_sizes": [16]}


def _tensorboard_steps(folder) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [e.step for e in acc.Scalars("reward")] if "reward" in acc.Tags()["scalars"] else []


def test_running_task_writes_tensorboard_and_mlflow_as_steps_happen(cluster, tmp_path) -> None:
    pytest.importorskip("tensorboard", reason="the dev extra installs tensorboard")
    pytest.importorskip("mlflow", reason="the dev extra installs mlflow-skinny")
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store behind this
    from mlflow.tracking import MlflowClient

    tb, mlruns = tmp_path / "tb", tmp_path / "mlruns"
    cluster.start_scheduler()
    cluster.start_trainer("node-a")
    cluster.wait_nodes(1)
    with RLClient(cluster.url, min_poll_interval=0) as client:
        task_id = client.submit_task(
            workload_type="full_rl",
            model="mlp",
            env_config={"env_id": "CartPole-v1"},
            hyperparameters=HP,
            tracking={"tensorboard": str(tb), "mlflow": {"uri": f"file://{mlruns}", "experiment": "ppo-cartpole"}},
        )
        ml = MlflowClient(tracking_uri=f"file://{mlruns}")

        def run_and_history():
            exp = ml.get_experiment_by_name("ppo-cartpole")
            runs = ml.search_runs([exp.experiment_id]) if exp is not None else []
            if not runs:
                return None
            history = ml.get_metric_history(runs[0].info.run_id, "reward")
            return (runs[0], history) if len(history) >= 3 and len(_tensorboard_steps(tb / task_id)) >= 3 else None

        run, history = wait_progress(
            run_and_history, lambda: cluster.said_about(task_id), what="3 steps in TensorBoard and MLflow"
        )
        assert client.get_task(task_id).state == "running"  # written live, not exported at the end
        assert [m.step for m in history][:3] == [1, 2, 3]
        assert _tensorboard_steps(tb / task_id)[:3] == [1, 2, 3]
        assert run.info.run_name == task_id and run.data.tags["opentinker_task_id"] == task_id
        assert run.data.params["num_envs"] == "2" and run.data.params["learning_rate"]  # resolved: defaults too
        spec = json.loads((mlruns / run.info.experiment_id / run.info.run_id / "artifacts" / "spec.json").read_text())
        assert spec["tracking"]["mlflow"]["experiment"] == "ppo-cartpole" and spec["env"]["env_id"] == "CartPole-v1"
        wait_progress(
            lambda: ml.get_run(run.info.run_id).info.artifact_uri and _checkpoints(mlruns, run),
            lambda: cluster.said_about(task_id),
            what="a checkpoint recorded in MLflow",
        )
        assert "loss.entropy" in ml.get_run(run.info.run_id).data.metrics  # loss/entropy: "/" becomes "."
        client.cancel(task_id)
        cluster.wait_state(task_id, 6)  # CANCELLED


def _checkpoints(mlruns, run) -> list | None:
    path = mlruns / run.info.experiment_id / run.info.run_id / "artifacts" / "checkpoints.json"
    return json.loads(path.read_text())["checkpoints"] if path.exists() else None
