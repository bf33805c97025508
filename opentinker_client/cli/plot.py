"""Learning curves of one or more tasks as an image: reward and loss against step, env steps,
tokens or wall time, overlaid and optionally smoothed (matplotlib, Agg).

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

from opentinker_common import curves

__all__ = ["MissingExtraError", "plot_history", "plot_runs", "curve"]


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

    One task's curves: :func:`plot_runs` with a single run (see there for bands, formats, errors).

    Args:
        history: ``[(step, {key: value})]`` oldest first, as ``RLClient.get_metric_history`` returns.
        path: where to write the image.
        title: figure title (the task id, say).
        keys: metric keys to draw, one panel each.

    Returns:
        Points drawn per key (``{"reward": 15, "loss": 15}``).
    """
    return plot_runs([("", [(s, 0.0, v) for s, v in history])], path, title=title, keys=keys, dpi=dpi)


def plot_runs(
    runs: Sequence[tuple[str, Sequence[curves.Point]]],
    path: str | os.PathLike[str],
    *,
    title: str = "",
    keys: Sequence[str] = ("reward", "loss"),
    x: str = "step",
    smooth: float = 0.0,
    dpi: int = 100,
) -> dict[str, int]:
    """Overlay several tasks' curves, one panel per metric key, against axis ``x``; save to ``path``.

    ``x`` is ``step``, ``env_steps``, ``tokens`` or ``time`` (:func:`opentinker_common.curves.series`);
    ``smooth`` a TensorBoard-style EMA weight in [0, 1) (the raw curve stays, faint, beneath). A
    ``<key>_std`` value (``reward_std``) is a ±1 std band around its curve, clipped to the
    metric's range (:func:`opentinker_common.curves.value_range`: a fraction stays in [0, 1]). Step
    and env-step axes get whole-number ticks. The format follows the file suffix (``.png``,
    ``.svg``, ``.pdf``).

    Args:
        runs: ``[(label, [(step, unix time, {key: value})])]``, a label per task ("" for one task).

    Returns:
        Points drawn per key over all runs.

    Raises:
        MissingExtraError: matplotlib is not installed.
        ValueError: no point of any key to draw, an unknown ``x``, a bad ``smooth``, or a file
            suffix matplotlib cannot write.
        OSError: the file cannot be written.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise MissingExtraError("plotting needs matplotlib: pip install 'opentinker[plot]'") from None
    curves.smooth([], smooth)  # ValueError for a bad weight, before any drawing
    drawn = {key: [(label, *curves.series(points, key, x)) for label, points in runs] for key in keys}
    counts = {k: sum(len(xs) for _, xs, _ in lines) for k, lines in drawn.items()}
    if not any(counts.values()):
        raise ValueError(
            f"nothing to plot: no finite {', '.join(keys)} value against {x} in "
            f"{sum(len(p) for _, p in runs)} metric point(s)"
        )
    out = Path(path)
    fmt = out.suffix.lstrip(".").lower() or "png"

    fig = Figure(figsize=(8, 2.6 * len(keys)), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(keys), 1, sharex=True, squeeze=False)[:, 0]
    single = len(runs) == 1
    for ax, key in zip(axes, keys):
        lo, hi = curves.value_range(key)
        for i, (label, points) in enumerate(runs):
            _, xs, ys = drawn[key][i]
            if not xs:
                continue
            colour = f"C{i % 10}"
            shown = curves.smooth(ys, smooth) if smooth else ys
            if smooth:
                ax.plot(xs, ys, color=colour, alpha=0.25, linewidth=1)
            ax.plot(
                xs,
                shown,
                color=colour,
                marker="o" if len(xs) < 40 and not smooth else None,
                markersize=3,
                linewidth=1.5,
                label=label or key,
                gid=f"curve-{key}" if single else f"curve-{key}-{i}",
            )
            std_xs, stds = curves.series(points, f"{key}_std", x)
            if std_xs and std_xs == xs:
                low = [v - s if lo is None else max(lo, v - s) for v, s in zip(shown, stds)]
                high = [v + s if hi is None else min(hi, v + s) for v, s in zip(shown, stds)]
                ax.fill_between(xs, low, high, color=colour, alpha=0.2, label=f"±1 {key}_std" if single else None)
        ax.set_ylabel(key)
        ax.grid(True, alpha=0.3)
        if x != "time":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if not counts[key]:
            ax.text(0.5, 0.5, f"no {key} reported", transform=ax.transAxes, ha="center", va="center")
        elif not single or any(curves.series(p, f"{key}_std", x)[0] for _, p in runs):
            ax.legend(loc="best", fontsize="small")
    axes[-1].set_xlabel(curves.X_AXES[x] + (f" (smoothing {smooth:g})" if smooth else ""))
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
