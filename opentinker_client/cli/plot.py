"""Learning curves of a task as an image: reward and loss against step (matplotlib, Agg).

matplotlib is an optional extra (``pip install 'opentinker[plot]'``); without it
:func:`plot_history` raises :class:`MissingExtraError` saying so. The figure is drawn with the
non-interactive Agg canvas (no display, no global backend switch) and written to a temporary
file beside the target that is renamed into place, so a failed plot leaves nothing half-written.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Mapping, Sequence

__all__ = ["MissingExtraError", "plot_history", "curve"]


class MissingExtraError(RuntimeError):
    """An optional dependency is not installed; the message names the extra to install."""


def curve(history: Sequence[tuple[int, Mapping[str, float]]], key: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of ``key`` over ``history``, skipping steps without it or with NaN/inf."""
    steps, values = [], []
    for step, point in history:
        v = point.get(key)
        if v is None or not math.isfinite(v):
            continue
        steps.append(int(step))
        values.append(float(v))
    return steps, values


def plot_history(
    history: Sequence[tuple[int, Mapping[str, float]]],
    path: str | os.PathLike[str],
    *,
    title: str = "",
    keys: Sequence[str] = ("reward", "loss"),
    dpi: int = 100,
) -> dict[str, int]:
    """Draw one panel per metric key (default ``reward`` above ``loss``) against step; save to ``path``.

    A ``<key>_std`` value (``reward_std``) is drawn as a ±1 std band around its curve. The
    format follows the file suffix (``.png``, ``.svg``, ``.pdf``).

    Args:
        history: ``[(step, {key: value})]`` oldest first, as ``RLClient.get_metric_history`` returns.
        path: where to write the image.
        title: figure title (the task id, say).
        keys: metric keys to draw, one panel each.

    Returns:
        Points drawn per key (``{"reward": 15, "loss": 15}``).

    Raises:
        MissingExtraError: matplotlib is not installed.
        ValueError: no point of any key to draw, or a file suffix matplotlib cannot write.
        OSError: the file cannot be written.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise MissingExtraError("plotting needs matplotlib: pip install 'opentinker[plot]'") from None
    curves = {k: curve(history, k) for k in keys}
    counts = {k: len(s) for k, (s, _) in curves.items()}
    if not any(counts.values()):
        raise ValueError(f"nothing to plot: no finite {', '.join(keys)} value in {len(history)} metric point(s)")
    out = Path(path)
    fmt = out.suffix.lstrip(".").lower() or "png"

    fig = Figure(figsize=(8, 2.6 * len(keys)), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(keys), 1, sharex=True, squeeze=False)[:, 0]
    for ax, key in zip(axes, keys):
        steps, values = curves[key]
        ax.plot(
            steps,
            values,
            marker="o" if len(steps) < 40 else None,
            markersize=3,
            linewidth=1.5,
            label=key,
            gid=f"curve-{key}",
        )
        std_steps, stds = curve(history, f"{key}_std")
        if std_steps and std_steps == steps:
            ax.fill_between(
                steps,
                [v - s for v, s in zip(values, stds)],
                [v + s for v, s in zip(values, stds)],
                alpha=0.2,
                label=f"±1 {key}_std",
            )
        ax.set_ylabel(key)
        ax.grid(True, alpha=0.3)
        if not steps:
            ax.text(0.5, 0.5, f"no {key} reported", transform=ax.transAxes, ha="center", va="center")
        elif std_steps:
            ax.legend(loc="best", fontsize="small")
    axes[-1].set_xlabel("step")
    if title:
        fig.suptitle(title)

    if not out.parent.is_dir():
        raise FileNotFoundError(f"{out.parent}: no such folder (create it first)")
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=out.suffix, dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fig.savefig(fh, format=fmt)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a plot is an ordinary file
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return counts
