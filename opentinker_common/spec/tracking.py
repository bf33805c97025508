"""``spec.tracking``: live experiment tracking a task's worker writes as steps happen.

.. code-block:: yaml

    tracking:
      tensorboard: /runs/tb                   # event files under /runs/tb/<task_id>
      mlflow: {uri: file:///runs/mlruns, experiment: grpo-arithmetic}
      wandb: {project: opentinker, mode: offline}

Each logger is optional and needs its package on the trainer node (``pip install
'opentinker[tensorboard]'``, ``[mlflow]``, ``[wandb]``). The scheduler cannot see a node's
packages, so the check is the worker's: a node without the package fails the task at start, not
retried, with a message naming the extra (see :mod:`opentinker_trainer.tracking`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from opentinker_common.spec._parse import SpecError, did_you_mean

__all__ = ["TrackingConfig", "MlflowTracking", "WandbTracking", "parse_tracking", "EXTRAS"]

#: logger -> (module imported on the node, the pip extra that installs it)
EXTRAS = {"tensorboard": ("tensorboardX", "tensorboard"), "mlflow": ("mlflow", "mlflow"), "wandb": ("wandb", "wandb")}
_WANDB_MODES = ("offline", "online")
_MAX = 1024


@dataclass(frozen=True)
class MlflowTracking:
    #: Tracking URI: ``file:///abs/folder`` (a local file store on the node), or ``http(s)://`` a server.
    uri: str
    #: Experiment name (made when missing).
    experiment: str = "opentinker"


@dataclass(frozen=True)
class WandbTracking:
    project: str
    #: ``offline`` (files under the node's ``wandb/`` folder, synced later) or ``online``.
    mode: str = "offline"
    #: Folder the offline run is written under ("" = the worker's attempt folder).
    dir: str = ""


@dataclass(frozen=True)
class TrackingConfig:
    """Which loggers a task writes to; all None = none."""

    #: Absolute folder on the node; the run is ``<folder>/<task_id>``.
    tensorboard: str | None = None
    mlflow: MlflowTracking | None = None
    wandb: WandbTracking | None = None

    @property
    def enabled(self) -> tuple[str, ...]:
        return tuple(k for k in ("tensorboard", "mlflow", "wandb") if getattr(self, k) is not None)

    def local_paths(self) -> list[tuple[str, str]]:
        """``(field path, folder)`` of every folder on the node this config writes to."""
        out = []
        if self.tensorboard is not None:
            out.append(("spec.tracking.tensorboard", self.tensorboard))
        if self.mlflow is not None and self.mlflow.uri.startswith("file:"):
            out.append(("spec.tracking.mlflow.uri", urlparse(self.mlflow.uri).path))
        if self.wandb is not None and self.wandb.dir:
            out.append(("spec.tracking.wandb.dir", self.wandb.dir))
        return out


def _str(value: Any, path: str, expected: str) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > _MAX:
        raise SpecError(path, expected, value)
    return value


def _abs(value: Any, path: str, example: str) -> str:
    value = _str(value, path, f"an absolute folder on the trainer node, such as {example}")
    if not value.startswith("/"):
        raise SpecError(path, f"an absolute folder on the trainer node, such as {example}", value)
    return value


def _mapping(value: Any, path: str, keys: tuple[str, ...]) -> dict:
    if not isinstance(value, dict):
        raise SpecError(path, f"a mapping with {', '.join(keys)}", value)
    for key in value:
        if key not in keys:
            raise SpecError(
                f"{path}.{key}", f"one of the known keys ({', '.join(keys)})", key, hint=did_you_mean(key, keys)
            )
    return value


def parse_tracking(data: Any, path: str = "spec.tracking") -> TrackingConfig:
    """Validate ``spec.tracking`` (a mapping, possibly empty).

    Raises:
        SpecError: an unknown logger or key, a relative folder, an MLflow URI that is neither
            ``file:///...`` nor ``http(s)://...``, a W&B mode other than offline/online.
    """
    if data is None or data == {}:
        return TrackingConfig()
    data = _mapping(data, path, ("tensorboard", "mlflow", "wandb"))
    tb = mlflow = wandb = None
    if "tensorboard" in data:
        tb = _abs(data["tensorboard"], f"{path}.tensorboard", "/runs/tb")
    if "mlflow" in data:
        m = _mapping(data["mlflow"], f"{path}.mlflow", ("uri", "experiment"))
        if "uri" not in m:
            raise SpecError(f"{path}.mlflow.uri", "a tracking URI such as file:///runs/mlruns or http://mlflow:5000")
        uri = _str(m["uri"], f"{path}.mlflow.uri", "a tracking URI such as file:///runs/mlruns")
        parsed = urlparse(uri)
        if parsed.scheme == "file":
            if parsed.netloc or not parsed.path.startswith("/"):
                raise SpecError(f"{path}.mlflow.uri", "file:///absolute/folder (three slashes)", uri)
        elif parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise SpecError(f"{path}.mlflow.uri", "file:///absolute/folder or http(s)://host:port", uri)
        experiment = _str(m.get("experiment", "opentinker"), f"{path}.mlflow.experiment", "an experiment name")
        mlflow = MlflowTracking(uri=uri, experiment=experiment)
    if "wandb" in data:
        w = _mapping(data["wandb"], f"{path}.wandb", ("project", "mode", "dir"))
        if "project" not in w:
            raise SpecError(f"{path}.wandb.project", "a W&B project name")
        project = _str(w["project"], f"{path}.wandb.project", "a W&B project name")
        mode = w.get("mode", "offline")
        if mode not in _WANDB_MODES:
            raise SpecError(f"{path}.wandb.mode", " or ".join(_WANDB_MODES), mode)
        folder = _abs(w["dir"], f"{path}.wandb.dir", "/runs/wandb") if w.get("dir") else ""
        wandb = WandbTracking(project=project, mode=mode, dir=folder)
    return TrackingConfig(tensorboard=tb, mlflow=mlflow, wandb=wandb)
