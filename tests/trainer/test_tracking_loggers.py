"""The worker's experiment-tracking loggers (opentinker_trainer/tracking.py), in process: a
missing package is a clear non-retryable error naming the extra; TensorBoard and MLflow write
runs their own readers read back."""

from __future__ import annotations

import importlib.util

import pytest

from opentinker_common.spec.tracking import parse_tracking
from opentinker_trainer.context import UserError
from opentinker_trainer.tracking import open_trackers


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_a_logger_whose_package_is_missing_fails_naming_the_extra(tmp_path) -> None:
    cfg = parse_tracking({"tensorboard": str(tmp_path / "tb"), "wandb": {"project": "p"}})
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
