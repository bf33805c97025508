"""Live experiment tracking: the loggers of ``spec.tracking`` (TensorBoard, MLflow, W&B), written
by the worker as each step's metrics are reported (:meth:`WorkerContext.emit_metric` calls
:meth:`Trackers.log`), with the resolved spec as the run's config and each checkpoint recorded.

Which node has which logger: each node tells the scheduler at register which loggers its Python
can write (:func:`writable_loggers`, ``Register.tracking_loggers``), so a task naming one that no
connected node can write is refused at submit, and a task is placed only on nodes that can write
its loggers. The worker still checks at start (:func:`open_trackers`; an agent too old to say): it
fails the attempt with a :class:`~opentinker_trainer.context.UserError` (not retried) that names
the extra to install, ``pip install 'opentinker[mlflow]'``, before any training. A logger that fails while the task
runs (a full disk, a tracking server gone) is logged and dropped; training goes on.

* **TensorBoard** (``tensorboard: DIR``, tensorboardX): event files in ``DIR/<task_id>``; every
  metric key is a scalar tag (``loss/policy`` groups under ``loss``) against the step; the spec
  is a text summary ``spec`` and each checkpoint a text summary ``checkpoint``. Flushed every step.
* **MLflow** (``mlflow: {uri, experiment}``): one run per task, named and tagged with the task id
  (a resumed attempt continues the same run); metrics per step (``log_batch``; ``/`` in a key
  becomes ``.``, ``loss/policy`` -> ``loss.policy``, see :func:`mlflow_key`), the resolved
  hyper-parameters as params, the whole spec as the artifact ``spec.json`` and the checkpoint
  paths as ``checkpoints.json``. A ``file:///...`` URI is MLflow's local file store, which MLflow 3
  keeps in maintenance mode behind ``MLFLOW_ALLOW_FILE_STORE`` (set here for ``file:`` URIs).
* **W&B** (``wandb: {project, mode}``): ``wandb.init(id=task_id, resume="allow", config=spec)``,
  ``wandb.log(values, step=step)``; offline runs go under ``dir`` (default: the attempt's folder),
  in ``<dir>/wandb/offline-run-<time>-<task_id>/run-<task_id>.wandb`` (``wandb sync`` uploads it).
  Tested in offline mode: the run file read back holds every step's metrics and the spec.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Any, Mapping

import structlog

from opentinker_common.spec.tracking import EXTRAS, TrackingConfig
from opentinker_trainer.context import UserError

__all__ = ["Trackers", "open_trackers", "writable_loggers"]

log = structlog.get_logger("opentinker.worker")


def writable_loggers() -> list[str]:
    """The ``spec.tracking`` loggers whose package this Python has (``"tensorboard"``, ``"mlflow"``,
    ``"wandb"``, in that order), found without importing them (:func:`importlib.util.find_spec`)."""
    out = []
    for logger, (module, _) in EXTRAS.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a broken or half-removed install: as missing
            found = False
        if found:
            out.append(logger)
    return out


def _need(logger: str):
    module, extra = EXTRAS[logger]
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(
            f"spec.tracking.{logger}: this node ({os.environ.get('OPENTINKER_NODE_ID') or 'trainer'}) cannot write "
            f"{logger} runs: the {module} package is not installed; install it on the trainer nodes with "
            f"pip install 'opentinker[{extra}]', or drop tracking.{logger} from the spec"
        ) from None


def _flat(data: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flat(value, name + "."))
        else:
            out[name] = json.dumps(value, default=str) if not isinstance(value, str) else value
    return out


class _TensorBoard:
    def __init__(self, folder: str, task_id: str, spec: dict) -> None:
        tbx = _need("tensorboard")
        self.path = Path(folder) / task_id
        self.path.mkdir(parents=True, exist_ok=True)
        self.writer = tbx.SummaryWriter(logdir=str(self.path), flush_secs=3600)
        self.writer.add_text("spec", "```json\n" + json.dumps(spec, indent=2, sort_keys=True) + "\n```", 0)
        self.writer.flush()

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for key, value in sorted(values.items()):
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def checkpoint(self, step: int, path: str, final: bool) -> None:
        self.writer.add_text("checkpoint", f"{'final ' if final else ''}checkpoint: {path}", step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def mlflow_key(key: str) -> str:
    """A metric key as an MLflow metric name: ``/`` becomes ``.`` (``loss/policy`` ->
    ``loss.policy``), since MLflow's file store keeps each metric in a file named by its key and
    cannot hold both ``loss`` and ``loss/policy``."""
    return key.replace("/", ".")


class _Mlflow:
    def __init__(self, uri: str, experiment: str, task_id: str, attempt: int, spec: dict) -> None:
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        _need("mlflow")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(experiment)
        eid = found.experiment_id if found is not None else self.client.create_experiment(experiment)
        runs = self.client.search_runs([eid], filter_string=f"tags.opentinker_task_id = '{task_id}'", max_results=1)
        if runs:
            self.run_id = runs[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            run = self.client.create_run(eid, run_name=task_id, tags={"opentinker_task_id": task_id})
            self.run_id = run.info.run_id
            hp = _flat(spec.get("hyperparameters") or {})
            params = [Param(k[:250], v[:6000]) for k, v in sorted(hp.items())]
            for i in range(0, len(params), 100):
                self.client.log_batch(self.run_id, params=params[i : i + 100])
            self.client.log_dict(self.run_id, spec, "spec.json")
        self.client.set_tag(self.run_id, "opentinker_attempt", str(attempt))
        self.checkpoints: list[dict] = []

    def log(self, step: int, values: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [self._metric(mlflow_key(k), v, now, step) for k, v in sorted(values.items())]
        self.client.log_batch(self.run_id, metrics=metrics)

    def checkpoint(self, step: int, path: str, final: bool) -> None:
        self.checkpoints.append({"step": step, "path": path, "final": final})
        self.client.log_dict(self.run_id, {"checkpoints": self.checkpoints}, "checkpoints.json")

    def close(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)


class _Wandb:
    def __init__(self, project: str, mode: str, folder: str, task_id: str, spec: dict) -> None:
        wandb = _need("wandb")
        self.run = wandb.init(
            project=project, mode=mode, id=task_id, name=task_id, resume="allow", config=spec, dir=folder or None
        )

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def checkpoint(self, step: int, path: str, final: bool) -> None:
        self.run.summary["checkpoint"] = path
        self.run.summary["checkpoint_step"] = step

    def close(self, status: str = "FINISHED") -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


class Trackers:
    """The open loggers of one attempt. A logger that raises is dropped (logged once)."""

    def __init__(self, loggers: dict[str, Any]) -> None:
        self.loggers = loggers

    def _each(self, what: str, *args) -> None:
        for name, logger in list(self.loggers.items()):
            try:
                getattr(logger, what)(*args)
            except Exception as exc:  # noqa: BLE001 - tracking never stops training
                log.warning("tracking logger failed; dropped for this attempt", logger=name, error=repr(exc))
                self.loggers.pop(name, None)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self._each("log", int(step), dict(values))

    def checkpoint(self, step: int, path: str, final: bool) -> None:
        self._each("checkpoint", int(step), str(path), bool(final))

    def close(self, *, ok: bool = True) -> None:
        for name, logger in list(self.loggers.items()):
            try:
                if isinstance(logger, (_Mlflow, _Wandb)):
                    logger.close("FINISHED" if ok else "FAILED")
                else:
                    logger.close()
            except Exception as exc:  # noqa: BLE001
                log.warning("tracking logger did not close cleanly", logger=name, error=repr(exc))
        self.loggers = {}


def open_trackers(
    tracking: TrackingConfig, *, task_id: str, attempt: int, spec: dict, work_dir: Path
) -> Trackers | None:
    """Open every logger ``tracking`` names (None when it names none).

    Raises:
        UserError: a logger's package is missing on this node (names the extra), or its folder
            or server cannot be used at start (the message says which logger).
    """
    if not tracking.enabled:
        return None
    loggers: dict[str, Any] = {}
    try:
        for name in tracking.enabled:
            try:
                if name == "tensorboard":
                    loggers[name] = _TensorBoard(tracking.tensorboard, task_id, spec)
                elif name == "mlflow":
                    m = tracking.mlflow
                    loggers[name] = _Mlflow(m.uri, m.experiment, task_id, attempt, spec)
                else:
                    w = tracking.wandb
                    loggers[name] = _Wandb(w.project, w.mode, w.dir or str(work_dir), task_id, spec)
            except UserError:
                raise
            except Exception as exc:  # noqa: BLE001 - a folder or server that does not work
                raise UserError(f"spec.tracking.{name}: cannot start the {name} run: {exc}") from None
    except BaseException:
        Trackers(loggers).close(ok=False)
        raise
    log.info("tracking", loggers=sorted(loggers))
    return Trackers(loggers)
