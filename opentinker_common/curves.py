"""Learning curves from metric points: the x axis (step, env steps, tokens, wall time), smoothing,
and which keys a chart of reward, loss, KL or throughput reads. Shared by the CLI's plots
(``opentinker plot``, ``opentinker compare``) and the scheduler's dashboard, so both draw the same
curve from the same points.

A point is ``(step, time, values)``: the training step (from 1), its wall-clock time in seconds
since the epoch (0 when unknown) and the metric values of that step.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

__all__ = [
    "X_AXES",
    "PANELS",
    "Point",
    "default_x_axis",
    "panel_key",
    "series",
    "smooth",
    "value_range",
]

Point = tuple[int, float, Mapping[str, float]]

#: The x axes a curve can be drawn against, and their labels.
X_AXES = {"step": "step", "env_steps": "env steps", "tokens": "tokens", "time": "wall time (s)"}

#: Chart panels: name -> metric keys, the first a task reports is drawn. SFT has no reward: its
#: ``reward`` is its token accuracy, drawn under that name.
PANELS: dict[str, tuple[str, ...]] = {
    "reward": ("train/token_accuracy", "reward"),
    "loss": ("loss",),
    "kl": ("kl", "grpo/kl_ref", "ppo/approx_kl", "grpo/approx_kl", "loss/kl"),
    "throughput": (
        "perf/tokens_per_s",
        "perf/env_steps_per_s",
        "perf/examples_per_s",
        "tokens_per_s",
        "steps_per_s",
    ),
}

#: Keys whose value is already a running total of tokens (else tokens are summed from throughput).
_TOKEN_TOTALS = ("tokens", "train/tokens")


def default_x_axis(workload_type: str, env_kind: str = "") -> str:
    """``env_steps`` for PPO on gymnasium/PettingZoo environments (``full_rl`` on a non-text
    env: sample efficiency is measured in environment steps), else ``step``."""
    return "env_steps" if workload_type == "full_rl" and env_kind in ("gym", "multiagent") else "step"


def panel_key(points: Sequence[Point], panel: str) -> str | None:
    """The metric key drawn for ``panel`` (a :data:`PANELS` name or any metric key): the first of
    its keys some point carries, else None."""
    keys = PANELS.get(panel, (panel,))
    for key in keys:
        if any(key in values for _, _, values in points):
            return key
    return None


def _finite(v) -> bool:
    return v is not None and isinstance(v, (int, float)) and math.isfinite(v)


def series(points: Sequence[Point], key: str, x: str = "step") -> tuple[list[float], list[float]]:
    """``(xs, ys)`` of metric ``key`` against axis ``x`` (a :data:`X_AXES` name), oldest first.

    ``step``: the step; ``env_steps``: the ``env_steps`` value (a running total); ``tokens``: a
    running total of ``tokens``/``train/tokens`` when reported, else the sum of
    ``perf/tokens_per_s`` x ``perf/step_s`` over the steps so far; ``time``: seconds since the
    first point. A point without a finite value or x is skipped.

    Raises:
        ValueError: ``x`` is not one of :data:`X_AXES`.
    """
    if x not in X_AXES:
        raise ValueError(f"x: expected one of {', '.join(X_AXES)}, got {x!r}")
    ordered = sorted(points, key=lambda p: p[0])
    t0 = next((t for _, t, _ in ordered if t), 0.0)
    tokens = 0.0
    xs: list[float] = []
    ys: list[float] = []
    for step, t, values in ordered:
        xv: float | None
        if x == "step":
            xv = float(step)
        elif x == "env_steps":
            xv = values.get("env_steps")
        elif x == "tokens":
            total = next((values[k] for k in _TOKEN_TOTALS if _finite(values.get(k))), None)
            if total is not None:
                xv = float(total)
            else:
                rate, took = values.get("perf/tokens_per_s"), values.get("perf/step_s")
                if _finite(rate) and _finite(took):
                    tokens += rate * took
                    xv = tokens
                else:
                    xv = None
        else:
            xv = (t - t0) if t else None
        y = values.get(key)
        if _finite(xv) and _finite(y):
            xs.append(float(xv))
            ys.append(float(y))
    return xs, ys


def smooth(ys: Sequence[float], weight: float) -> list[float]:
    """Exponential moving average as TensorBoard smooths (debiased, so the first value is not
    pulled towards 0): ``weight`` in [0, 1), 0 = unchanged.

    Raises:
        ValueError: ``weight`` outside [0, 1).
    """
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smooth: expected a weight in [0, 1), got {weight}")
    out: list[float] = []
    last, num = 0.0, 0
    for y in ys:
        num += 1
        last = last * weight + (1 - weight) * y
        out.append(last / (1 - weight**num))
    return out


def value_range(key: str) -> tuple[float | None, float | None]:
    """Bounds a metric cannot leave (a ±std band is clipped to them): fractions and accuracies
    in [0, 1], rates, times, counts and KL at least 0; None where unbounded (reward, loss)."""
    name = key.rsplit("/", 1)[-1]
    if name.endswith(("frac", "accuracy", "clipfrac")) or name in ("success", "success_rate"):
        return 0.0, 1.0
    if name.endswith(("_per_s", "_s", "tokens", "steps", "kl", "kl_ref", "norm", "entropy")) or name == "samples":
        return 0.0, None
    return None, None
