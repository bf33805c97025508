"""The ``model_names:`` section: Tinker model names and the local model folders they train, one
table for every Tinker API gateway of the scheduler (``ListModelNames``).

.. code-block:: yaml

    model_names:
      - name: HuggingFaceTB/SmolLM2-135M-Instruct   # what a Tinker client asks for
        folder: /models/SmolLM2-135M-Instruct       # a folder with config.json; relative: to this file
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ModelName", "parse_model_names"]


@dataclass(frozen=True)
class ModelName:
    """Tinker model ``name`` trains the model in local ``folder`` (absolute)."""

    name: str
    folder: str


def parse_model_names(r, node, base_dir: Path | None) -> tuple[ModelName, ...]:
    """Parse the ``model_names:`` list with the config reader ``r`` (file:line:key errors).

    Raises:
        ConfigError: not a list of ``{name, folder}``, an empty or repeated name, or a folder
            without ``config.json`` (via ``r``).
    """
    out: list[ModelName] = []
    for i, item in enumerate(r.sequence(node, "model_names")):
        key = f"model_names[{i}]"
        m = r.mapping(item, key, {"name": "", "folder": ""})
        for field in ("name", "folder"):
            if field not in m:
                raise r.fail(item, f"{key}.{field}", "a value; missing")
        name = r.scalar(m["name"][1], f"{key}.name", str)
        if not name or len(name) > 200:
            raise r.fail(m["name"][1], f"{key}.name", "a model name of 1 to 200 characters")
        if any(n.name == name for n in out):
            raise r.fail(m["name"][1], f"{key}.name", f"each name once; {name!r} is listed already")
        text = r.scalar(m["folder"][1], f"{key}.folder", str)
        folder = Path(text) if Path(text).is_absolute() or base_dir is None else base_dir / text
        if not (folder / "config.json").is_file():
            raise r.fail(
                m["folder"][1],
                f"{key}.folder",
                f"a model folder holding config.json, got {text!r} (no {folder}/config.json)",
            )
        out.append(ModelName(name, os.path.normpath(os.path.abspath(folder))))
    return tuple(out)
