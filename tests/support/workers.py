"""Running a trainer in this process: a worker context on the CPU, and the reports it wrote."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from opentinker_common.spec import TaskSpecModel
from opentinker_trainer.context import WorkerContext


def worker_ctx(
    tmp_path: Path,
    name: str,
    *,
    workload_type: str,
    model: str | Path,
    env_config: dict[str, Any],
    hyperparameters: dict[str, Any],
    task_id: str | None = None,
    resume_from: Path | None = None,
    init: tuple[Path, str] | None = None,
    cls: type[WorkerContext] = WorkerContext,
) -> WorkerContext:
    """Attempt 1 of a task on the CPU, its reports written to ``ctx.out`` (a ``StringIO``).

    Args:
        tmp_path, name: checkpoints go to ``tmp_path / name``; the task is ``t-<name>`` unless
            ``task_id`` names it.
        workload_type, model, env_config, hyperparameters: the task spec
            (:meth:`TaskSpecModel.from_parts`, which raises ``SpecError`` on a bad one).
        resume_from: a checkpoint folder to resume from.
        init: ``(checkpoint folder, format)`` of an ``init_from`` checkpoint (the spec names task
            ``task-sft``), or None.
        cls: the context class (a subclass that stops itself, for instance).
    """
    spec = TaskSpecModel.from_parts(
        workload_type=workload_type,
        model=str(model),
        env_config=env_config,
        hyperparameters=hyperparameters,
        init_from="task-sft" if init else "",
    )
    return cls(
        task_id=task_id or f"t-{name}",
        attempt=1,
        spec=spec,
        device="cpu",
        checkpoint_dir=tmp_path / name,
        resume_from=resume_from,
        out=io.StringIO(),
        init_checkpoint=Path(init[0]) if init else None,
        init_format=init[1] if init else "",
    )


def reports(ctx: WorkerContext, kind: str) -> list[dict]:
    """The reports of type ``kind`` (``metric``, ``checkpoint`` ...) the context wrote to its
    ``StringIO`` ``out``, in order, as parsed JSON lines (blank lines skipped)."""
    lines = [json.loads(line) for line in ctx.out.getvalue().splitlines() if line.strip()]
    return [r for r in lines if r["type"] == kind]
