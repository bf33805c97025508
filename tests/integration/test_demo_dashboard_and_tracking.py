"""``make demo`` (``scripts/demo.py``, here on the tiny model) prints the dashboard's URL; its task
is on that dashboard while it runs, its reward curve gaining a point per step; the task's
TensorBoard and MLflow runs, written by the worker as steps happen, read back while it trains
with those tools' own readers (TensorBoard's ``EventAccumulator``, ``MlflowClient`` on the file
store); and SIGTERM in the middle of training stops the demo's scheduler, trainer and worker.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.support.demo import Demo, assert_nothing_left

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as resp:
        assert resp.status == 200, url
        return resp.read().decode()


def _reward_points(page: str) -> int:
    match = re.search(r'id="chart-reward".*?<path class="curve"[^>]*data-points="(\d+)"', page, re.S)
    return int(match.group(1)) if match else 0


def test_demo_shows_its_task_live_on_the_dashboard_and_in_tensorboard_and_mlflow(tiny_model_dir, tmp_path) -> None:
    pytest.importorskip("tensorboard", reason="the dev extra installs tensorboard")
    pytest.importorskip("mlflow", reason="the dev extra installs mlflow-skinny")
    work_dir = tmp_path / "demo"
    demo = Demo(tiny_model_dir, work_dir)  # 50 steps: still training when the test stops it
    try:
        dashboard = demo.wait_for_line("dashboard ").split()[1]
        assert re.fullmatch(r"http://localhost:\d+/", dashboard), dashboard
        live = demo.wait_for_line("live ").split()[1]
        task_id = live.rsplit("/", 1)[1]
        assert live == f"{dashboard}ui/task/{task_id}"
        tensorboard = Path(demo.wait_for_line("tensorboard: ").split("--logdir ", 1)[1].strip())
        mlflow_uri = demo.wait_for_line("mlflow: ").split("--backend-store-uri ", 1)[1].strip()

        demo.wait_for_line("   1 ")  # the first step's row: the dashboard has that point too
        page = _get(live)
        assert task_id in page and 'id="state">running' in page and _reward_points(page) >= 1
        assert task_id in _get(f"{dashboard}ui/tasks") and 'data-node="demo-node"' in _get(f"{dashboard}ui/cluster")
        demo.wait_for_line("   3 ")  # live: the fragment the page fetches has the new points
        assert _reward_points(_get(f"{live}/charts")) >= 3

        # The worker logs a step to its trackers right after reporting it, before the next step:
        # with step 3 reported, steps 1 and 2 are in both runs.
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(tensorboard / task_id))
        acc.Reload()
        assert [e.step for e in acc.Scalars("reward")][:2] == [1, 2]
        assert "loss" in acc.Tags()["scalars"]

        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store behind this
        from mlflow.tracking import MlflowClient

        ml = MlflowClient(tracking_uri=mlflow_uri)
        (run,) = ml.search_runs([ml.get_experiment_by_name("demo").experiment_id])
        assert run.info.run_name == task_id and run.info.status == "RUNNING"  # written live, not exported at the end
        assert [m.step for m in ml.get_metric_history(run.info.run_id, "reward")][:2] == [1, 2]
        assert "spec.json" in {a.path for a in ml.list_artifacts(run.info.run_id)}

        # SIGTERM while training stops the scheduler, the trainer and its worker.
        demo.proc.send_signal(signal.SIGTERM)
        rc = demo.finish()
        out = "".join(demo.output)
        assert rc == 128 + signal.SIGTERM, out
        assert "Traceback" not in out
        assert_nothing_left(work_dir)
    finally:
        demo.kill_leftovers()
