"""Export a task's metrics as TensorBoard event files (tensorboardX writer).

tensorboardX is an optional extra (``pip install 'opentinker[tensorboard]'``); it writes the
ordinary ``events.out.tfevents.*`` files that ``tensorboard --logdir DIR`` reads, without
TensorFlow. Each metric key becomes a scalar tag as it is named (``loss``, ``reward``,
``loss/policy``, ``perf/tokens_per_s`` ...: TensorBoard groups tags by the part before ``/``),
with the training step as the x axis. Each task is one run: a sub-folder named after its id.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from opentinker_client.cli.plot import MissingExtraError

__all__ = ["export_tensorboard", "MissingExtraError"]


def export_tensorboard(
    history: Sequence[tuple[int, Mapping[str, float]]],
    log_dir: str | os.PathLike[str],
    *,
    run: str,
    description: Mapping[str, Any] | None = None,
) -> tuple[Path, int]:
    """Write every finite value of ``history`` as a TensorBoard scalar under ``log_dir/run``.

    Args:
        history: ``[(step, {key: value})]`` as ``RLClient.get_metric_history`` returns.
        log_dir: TensorBoard log folder (created if missing).
        run: run name, the sub-folder (the task id).
        description: written once as a text summary ``task`` (JSON): spec, state ...

    Returns:
        ``(run folder, scalars written)``. NaN and infinite values are skipped (TensorBoard
        cannot draw them).

    Raises:
        MissingExtraError: tensorboardX is not installed.
        ValueError: ``run`` is empty or not a plain folder name.
        OSError: the folder cannot be written.
    """
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise MissingExtraError(
            "TensorBoard export needs tensorboardX: pip install 'opentinker[tensorboard]'"
        ) from None
    if not run or run in (".", "..") or "/" in run or os.sep in run:
        raise ValueError(f"run: expected a plain folder name, got {run!r}")
    folder = Path(log_dir) / run
    folder.mkdir(parents=True, exist_ok=True)
    written = 0
    writer = SummaryWriter(logdir=str(folder), flush_secs=3600)
    try:
        if description:
            writer.add_text(
                "task",
                "```json\n" + json.dumps(dict(description), indent=2, sort_keys=True, default=str) + "\n```",
                global_step=0,
            )
        for step, values in history:
            for key, value in sorted(values.items()):
                if value is None or not math.isfinite(value):
                    continue
                writer.add_scalar(key, float(value), global_step=int(step))
                written += 1
    finally:
        writer.close()
    return folder, written
