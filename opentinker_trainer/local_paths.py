"""Defense in depth on the trainer node: a task spec may not name files of the node's own work folder.

The node's work folder (``--work-dir``) holds every task's checkpoints (``<work_dir>/<task_id>/
checkpoints/step_<n>``, full weights included), the assignment files (with client-hosted env
tokens) and the dataset cache (``<work_dir>/datasets/<sha256>.jsonl``, other owners' uploads).
The sanctioned ways to use a task's weights are ``init_from`` and adapters, and uploaded data
is named by ``dataset_id``; all three check ownership at the scheduler. So before the workload
runs, the worker refuses a ``spec.model`` or ``env_config.path`` that resolves (symlinks
followed, relative names taken against the worker's current folder as ``from_pretrained``
would) into the work folder or the dataset cache, with a :class:`~opentinker_trainer.context.UserError`
naming the field and the sanctioned alternative. The scheduler's ``paths:`` policy
(:mod:`opentinker_scheduler.admission.paths`) is the first line; this one holds when the policy is loose
(auth off, or a ``model_dirs`` entry that contains or links to the work folder).

The agent hands each worker its absolute work folder as ``OPENTINKER_WORK_DIR`` and the caches as
``OPENTINKER_DATASET_CACHE`` and ``OPENTINKER_ARTIFACT_CACHE`` (downloaded checkpoints and, with
the ``s3`` store, datasets; under the work folder unless the operator moved it); a worker started
without them falls back to the agent's layout (``--checkpoint-dir`` = ``<work_dir>/<task_id>/checkpoints``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from opentinker_trainer.context import UserError

__all__ = ["WORK_DIR_ENV", "check_model_not_local", "check_spec_paths", "private_dirs"]

#: Environment variable with the node's absolute work folder (set by the agent for each worker).
WORK_DIR_ENV = "OPENTINKER_WORK_DIR"
_CACHE_ENV = "OPENTINKER_DATASET_CACHE"
_ARTIFACT_CACHE_ENV = "OPENTINKER_ARTIFACT_CACHE"


def private_dirs(checkpoint_dir: Path, env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The node's folders no spec may name, as real paths (symlinks resolved).

    Args:
        checkpoint_dir: this attempt's ``--checkpoint-dir``.
        env: where to read ``OPENTINKER_WORK_DIR`` / ``OPENTINKER_DATASET_CACHE`` /
            ``OPENTINKER_ARTIFACT_CACHE`` (default ``os.environ``).

    Returns:
        The work folder (from the variable, else ``checkpoint_dir/../..`` when ``checkpoint_dir``
        is named ``checkpoints`` as the agent lays it out), the dataset cache and the artifact
        cache, when known.
    """
    env = os.environ if env is None else env
    out: list[str] = []
    work = env.get(WORK_DIR_ENV, "")
    if not work and Path(checkpoint_dir).name == "checkpoints":
        work = str(Path(checkpoint_dir).parent.parent)
    for folder in (work, env.get(_CACHE_ENV, ""), env.get(_ARTIFACT_CACHE_ENV, "")):
        if folder:
            real = os.path.realpath(folder)
            if real not in out:
                out.append(real)
    return tuple(out)


def _inside(path: str, folders: tuple[str, ...]) -> bool:
    for folder in folders:
        if folder == "/" or path == folder or path.startswith(folder.rstrip("/") + "/"):
            return True
    return False


def _resolves_inside(name: str, folders: tuple[str, ...], cwd: str) -> bool:
    """Whether ``name`` (absolute, or relative to ``cwd``) lies in ``folders``, as written
    (normalized) or after following symlinks."""
    full = os.path.join(cwd, name)
    return _inside(os.path.normpath(full), folders) or _inside(os.path.realpath(full), folders)


def check_spec_paths(spec: Any, folders: tuple[str, ...], *, cwd: str | None = None) -> None:
    """Refuse a spec whose ``model`` or ``env_config.path`` resolves into ``folders``.

    Args:
        spec: the validated :class:`~opentinker_common.spec.TaskSpecModel`.
        folders: :func:`private_dirs`.
        cwd: folder relative names are taken against (default: the current one).

    A relative ``spec.model`` is refused only when it exists there (otherwise ``from_pretrained``
    treats it as a hub id); an absolute one whether or not it exists, so the answer does not tell
    what the folder holds.

    Raises:
        UserError: naming the field, saying the path cannot be used by this task, and the
            sanctioned alternative (``init_from``; ``dataset_id``).
    """
    if not folders:
        return
    cwd = os.getcwd() if cwd is None else cwd
    model = getattr(spec, "model", "") or ""
    if model:
        name = os.path.expanduser(model)
        if (os.path.isabs(name) or os.path.lexists(os.path.join(cwd, name))) and _resolves_inside(name, folders, cwd):
            raise UserError(
                f"spec.model: {model!r} cannot be used by this task: it is inside this trainer node's work folder "
                "(other tasks' checkpoints); to start from a task's weights name that task in init_from"
            )
    data = getattr(getattr(spec, "env", None), "path", None)
    if isinstance(data, str) and data and _resolves_inside(os.path.expanduser(data), folders, cwd):
        raise UserError(
            f"env_config.path: {data!r} cannot be used by this task: it is inside this trainer node's work folder "
            "(other tasks' files and the dataset cache); upload the file (upload_dataset) and name its dataset_id"
        )


def check_model_not_local(model: str, *, cwd: str | None = None) -> None:
    """Refuse a non-absolute ``spec.model`` that names something on this node's disk.

    Called when the scheduler's ``paths.model_dirs`` policy restricts the task
    (``AssignTask.local_paths_restricted``). The scheduler lets a hub-id-shaped name
    (``private-model``, ``org/name``) through as a hub id, but ``from_pretrained`` loads a folder of
    that name from the worker's current folder (the trainer's launch folder) when one exists, which
    would bypass ``model_dirs``. Names starting with ``~`` (a home folder) are refused outright.
    Absolute names were checked against ``model_dirs`` by the scheduler and pass here.

    Args:
        model: ``spec.model`` as submitted ("" = no model: nothing to check).
        cwd: folder relative names are taken against (default: the current one).

    Raises:
        UserError: naming ``spec.model``, why, and the sanctioned alternative (an absolute path
            under ``paths.model_dirs``).
    """
    if not model or os.path.isabs(model):
        return
    cwd = os.getcwd() if cwd is None else cwd
    if model.startswith("~"):
        raise UserError(
            f"spec.model {model!r} names a home folder on this node; "
            "name local models by an absolute path under paths.model_dirs"
        )
    if os.path.lexists(os.path.join(cwd, model)):
        raise UserError(
            f"spec.model {model!r} is a hub id, but a local folder of that name exists on this node; "
            "name local models by an absolute path under paths.model_dirs"
        )
