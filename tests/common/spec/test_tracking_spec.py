"""``spec.tracking``: which loggers a task writes to, validated with field paths."""

from __future__ import annotations

import pytest

from opentinker_common.spec import SpecError, TaskSpecModel
from opentinker_common.spec.tracking import MlflowTracking, WandbTracking, parse_tracking


def test_all_three_loggers_parse_with_defaults() -> None:
    cfg = parse_tracking({"tensorboard": "/runs/tb", "mlflow": {"uri": "file:///runs/ml"}, "wandb": {"project": "p"}})
    assert cfg.tensorboard == "/runs/tb"
    assert cfg.mlflow == MlflowTracking(uri="file:///runs/ml", experiment="opentinker")
    assert cfg.wandb == WandbTracking(project="p", mode="offline")
    assert cfg.enabled == ("tensorboard", "mlflow", "wandb")
    assert cfg.local_paths() == [("spec.tracking.tensorboard", "/runs/tb"), ("spec.tracking.mlflow.uri", "/runs/ml")]
    assert parse_tracking({}).enabled == ()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"comet": "x"}, "spec.tracking.comet: expected one of the known keys (tensorboard, mlflow, wandb)"),
        ({"tensorboard": "runs/tb"}, "spec.tracking.tensorboard: expected an absolute folder on the trainer node"),
        ({"mlflow": {"experiment": "e"}}, "spec.tracking.mlflow.uri: expected a tracking URI"),
        ({"mlflow": {"uri": "file://runs"}}, "spec.tracking.mlflow.uri: expected file:///absolute/folder"),
        ({"mlflow": {"uri": "s3://b/x"}}, "spec.tracking.mlflow.uri: expected file:///absolute/folder or http(s)"),
        ({"wandb": {"project": "p", "mode": "cloud"}}, "spec.tracking.wandb.mode: expected offline or online, got"),
        ({"wandb": {"project": "p", "entity": "e"}}, "spec.tracking.wandb.entity: expected one of the known keys"),
        ("tb", "spec.tracking: expected a mapping with tensorboard, mlflow, wandb"),
    ],
)
def test_bad_tracking_is_refused_naming_the_field(data, message) -> None:
    with pytest.raises(SpecError) as err:
        parse_tracking(data)
    assert str(err.value).startswith(message), str(err.value)


def test_task_spec_carries_tracking_through_validation() -> None:
    spec = TaskSpecModel.from_parts(
        workload_type="full_rl",
        model="mlp",
        env_config={"env_id": "CartPole-v1"},
        hyperparameters={},
        tracking={"tensorboard": "/runs/tb"},
    )
    assert spec.tracking.tensorboard == "/runs/tb"
    assert spec.to_dict()["tracking"]["tensorboard"] == "/runs/tb"
