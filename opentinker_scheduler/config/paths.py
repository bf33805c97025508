"""The ``paths:`` section: which local paths a task spec may name on a trainer node (what that
means, and the check at submit: :mod:`opentinker_scheduler.admission.paths`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

_EXAMPLE = {"model_dirs": "/models", "data_dirs": "/data", "tracking_dirs": "/runs"}


@dataclass(frozen=True)
class PathsConfig:
    """The ``paths:`` section. None = unset (see the module docstring for what that means)."""

    #: Folders ``spec.model`` may name a local model folder under.
    model_dirs: tuple[str, ...] | None = None
    #: Folders ``env_config.path`` may name a dataset file under.
    data_dirs: tuple[str, ...] | None = None
    #: Folders ``spec.tracking`` may write under (TensorBoard logdir, MLflow ``file:`` store, W&B dir).
    tracking_dirs: tuple[str, ...] | None = None

    def allowed(self, field: str, *, auth_enabled: bool) -> tuple[str, ...] | None:
        """Folders allowed for ``field`` (``model_dirs``, ``data_dirs`` or ``tracking_dirs``); None = unrestricted."""
        dirs = getattr(self, field)
        if dirs is None:
            return () if auth_enabled else None
        return dirs


def is_clean_abs(path: str) -> bool:
    """Absolute, normalized (``normpath(p) == p``), without NUL bytes or ``..`` parts."""
    return (
        path.startswith("/")
        and not path.startswith("//")
        and "\x00" not in path
        and os.path.normpath(path) == path
        and ".." not in path.split("/")
    )


def parse_paths(r, node) -> PathsConfig:
    """Parse ``paths:`` with the config reader ``r`` (``file:line: key: expected ...`` errors).

    Each list holds absolute, normalized folders (``/models``, not ``models`` or ``/models/``).
    """
    m = r.mapping(node, "paths", {"model_dirs": "", "data_dirs": "", "tracking_dirs": ""})
    kw: dict[str, tuple[str, ...]] = {}
    for key in ("model_dirs", "data_dirs", "tracking_dirs"):
        if key not in m:
            continue
        dirs: list[str] = []
        for i, item in enumerate(r.sequence(m[key][1], f"paths.{key}")):
            where = f"paths.{key}[{i}]"
            value = r.scalar(item, where, str)
            if not is_clean_abs(value) or (value != "/" and value.endswith("/")):
                raise r.fail(item, where, f"an absolute, normalized folder such as {_EXAMPLE[key]}, got {value!r}")
            if value not in dirs:
                dirs.append(value)
        kw[key] = tuple(dirs)
    return PathsConfig(**kw)
