"""Which local paths a task spec may name on a trainer node (the ``paths:`` config section).

.. code-block:: yaml

    paths:
      model_dirs: [/models]   # spec.model may name a local folder only under these
      data_dirs: [/data]      # env_config.path (chat_jsonl) may name a file only under these
      tracking_dirs: [/runs]  # spec.tracking may write (TensorBoard, MLflow file store, W&B) only under these

A spec names local paths in two places: ``spec.model`` (a model folder instead of a hub id) and
``spec.env_config.path`` (an ``sft`` dataset file instead of an uploaded ``dataset_id``). On a
shared cluster either could read another owner's files on the node (their full-weights
checkpoints, their cached datasets), so the scheduler checks them at ``SubmitTask``:

* a list that is set restricts its field to folders under it (``[]`` = no local paths at all);
* a list that is unset means no restriction while ``auth.enabled`` is false (single-user
  development, ``make demo``, tests) and no local paths at all while it is true (hub ids,
  uploaded ``dataset_id`` s and ``init_from`` only).

A **hub id** is ``name`` or ``org/name``, each part ``[A-Za-z0-9][A-Za-z0-9._-]*``; anything else
is a path and must be absolute and normalized (``os.path.normpath(p) == p``: no ``..`` or ``.``
parts, no repeated or trailing ``/``) and lie under (or be) one of the listed folders. The check
is on the text only: the scheduler cannot see the trainer's file system, so an operator must not
put symlinks to private places under these folders (the trainer refuses paths that resolve into
its own work folder anyway, see :mod:`opentinker_trainer.local_paths`). The scheduler's own
``default_model`` is the operator's choice and is exempt.
"""

from __future__ import annotations

import re
from typing import Any

from opentinker_scheduler.config.paths import PathsConfig, is_clean_abs

__all__ = ["PathsConfig", "check_local_paths", "is_hub_id", "is_under"]

_HUB_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_HUB_ID = re.compile(rf"^{_HUB_PART}(?:/{_HUB_PART})?$")


def is_hub_id(name: str) -> bool:
    """True for ``name`` or ``org/name`` with ``[A-Za-z0-9][A-Za-z0-9._-]*`` parts (so never ``.``
    or ``..``); such a name is looked up on the model hub, not on the node's disk."""
    return bool(_HUB_ID.match(name)) and not any(part in (".", "..") for part in name.split("/"))


def is_under(path: str, folders: tuple[str, ...]) -> bool:
    """True when ``path`` is absolute and normalized and is one of ``folders`` or lies below one
    (a text comparison: ``/models2`` is not under ``/models``)."""
    if not is_clean_abs(path):
        return False
    for folder in folders:
        if folder == "/" or path == folder or path.startswith(folder + "/"):
            return True
    return False


def _describe(dirs: tuple[str, ...], key: str) -> str:
    if dirs:
        return f"a {'file' if key == 'data_dirs' else 'folder'} under paths.{key} ({', '.join(dirs)})"
    return f"no local path (auth is on and paths.{key} lists no folder)"


def _why(path: str) -> str:
    if path.startswith("/") and not is_clean_abs(path):
        return " (an absolute, normalized path: no '..' or '.' parts, no repeated or trailing '/')"
    if not path.startswith("/"):
        return " (local paths must be absolute)"
    return ""


def check_local_paths(spec: Any, *, paths: PathsConfig, auth_enabled: bool, default_model: str = "") -> None:
    """Refuse a spec whose ``model`` or ``env_config.path`` names a local path the policy forbids.

    Args:
        spec: the submitted ``opentinker.common.v1.TaskSpec``.
        paths: the scheduler's ``paths:`` section.
        auth_enabled: ``auth.enabled`` of the scheduler (unset lists then allow nothing).
        default_model: the scheduler's ``default_model``; naming it (or nothing) is always allowed.

    Raises:
        opentinker_scheduler.errors.InvalidArgument: naming the field, what is allowed and the
            value given, e.g. ``spec.model: expected a hub id (org/name) or a folder under
            paths.model_dirs (/models), got '/srv/runs/t1/checkpoints/step_1'``.
    """
    from opentinker_common.spec import SpecError, check_text

    from opentinker_scheduler.errors import InvalidArgument

    model = spec.model
    try:  # the spec check's own words (as the client's), before a path is judged by its text
        check_text("spec.model", model)
        if (data := _env_path(spec)) is not None:
            check_text("spec.env_config.path", data)
    except SpecError as exc:
        raise InvalidArgument.from_spec(exc) from None
    allowed = paths.allowed("model_dirs", auth_enabled=auth_enabled)
    if (
        model
        and model != default_model
        and allowed is not None
        and not is_hub_id(model)
        and not is_under(model, allowed)
    ):
        raise InvalidArgument(
            f"spec.model: expected a hub id (org/name) or {_describe(allowed, 'model_dirs')}, "
            f"got {model!r}{_why(model)}"
        )
    data = _env_path(spec)
    allowed = paths.allowed("data_dirs", auth_enabled=auth_enabled)
    if data is not None and allowed is not None and not is_under(data, allowed):
        raise InvalidArgument(
            "spec.env_config.path: expected an uploaded dataset_id (upload_dataset) or "
            f"{_describe(allowed, 'data_dirs')}, "
            f"got {data!r}{_why(data)}"
        )
    allowed = paths.allowed("tracking_dirs", auth_enabled=auth_enabled)
    if allowed is not None:
        for where, folder in _tracking_paths(spec):
            if not is_under(folder, allowed):
                raise InvalidArgument(
                    f"{where}: expected {_describe(allowed, 'tracking_dirs')}, got {folder!r}{_why(folder)}"
                )


def _tracking_paths(spec: Any) -> list[tuple[str, str]]:
    """Folders ``spec.tracking`` writes to on the node (a malformed section is the spec check's to refuse)."""
    if not spec.HasField("tracking"):
        return []
    from opentinker_common.spec import SpecError
    from opentinker_common.spec.structs import struct_to_dict
    from opentinker_common.spec.tracking import parse_tracking

    try:
        return parse_tracking(struct_to_dict(spec.tracking, "spec.tracking")).local_paths()
    except SpecError:
        return []


def _env_path(spec: Any) -> str | None:
    """``env_config.path`` when it is a string (another type is the spec check's to refuse)."""
    if not spec.HasField("env_config"):
        return None
    value = spec.env_config.fields.get("path")
    if value is None or value.WhichOneof("kind") != "string_value":
        return None
    return value.string_value
