"""SVG charts drawn on the server for the dashboard: line charts (several curves on shared axes,
nice ticks, integer ticks for steps) and sparklines. Plain strings, every label escaped; no
JavaScript, no external file, so a page works offline and in any browser."""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape
from typing import Sequence

__all__ = ["Curve", "line_chart", "nice_ticks", "sparkline", "PALETTE"]

#: Curve colours (colour-blind safe: Okabe-Ito), in the order curves are given.
PALETTE = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#F0E442", "#000000")


@dataclass(frozen=True)
class Curve:
    """One line: ``label``, points ``xs``/``ys`` (same length), and an optional shaded band
    ``(lows, highs)`` around it (already clipped to the metric's range)."""

    label: str
    xs: Sequence[float]
    ys: Sequence[float]
    band: tuple[Sequence[float], Sequence[float]] | None = None


def nice_ticks(lo: float, hi: float, n: int = 5, *, integer: bool = False) -> list[float]:
    """About ``n`` round tick values covering ``[lo, hi]`` (steps of 1, 2 or 5 x 10^k);
    ``integer``: whole numbers only (step counts), never a tick at 2.5."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    if integer:
        step = max(1.0, round(step))
    start = math.ceil(lo / step - 1e-9) * step
    ticks = []
    v = start
    while v <= hi + step * 1e-9 and len(ticks) < 50:
        ticks.append(round(v, 10))
        v += step
    return ticks


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e6 or a < 1e-3:
        return f"{v:.2g}"
    if a >= 1000:
        return f"{v / 1000:g}k" if v % 1000 == 0 else f"{v:,.0f}"
    return f"{v:.4g}"


def line_chart(
    curves: Sequence[Curve],
    *,
    title: str = "",
    x_label: str = "step",
    width: int = 520,
    height: int = 220,
    integer_x: bool = True,
    chart_id: str = "",
) -> str:
    """An ``<svg>`` line chart of ``curves`` on shared axes, a legend when more than one.

    Every curve is a ``<path class="curve" data-label=... data-points=N>`` (tests and scripts read
    the number of points drawn from it). ``integer_x``: x ticks are whole numbers (steps, env steps).
    """
    left, right, top, bottom = 56, 12, 22 if title else 8, 34
    pw, ph = width - left - right, height - top - bottom
    xs_all = [x for c in curves for x in c.xs]
    ys_all = [y for c in curves for y in c.ys]
    for c in curves:
        if c.band is not None:
            ys_all += [*c.band[0], *c.band[1]]
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" role="img" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}"' + (f' id="{escape(chart_id)}"' if chart_id else "") + ">",
        f"<title>{escape(title or 'chart')}</title>",
    ]
    if title:
        out.append(
            f'<text x="{left}" y="15" class="chart-title" font-size="13" font-weight="600">{escape(title)}</text>'
        )
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#bbb" stroke-width="1"/>')
    if not xs_all:
        out.append(
            f'<text x="{left + pw / 2}" y="{top + ph / 2}" text-anchor="middle" fill="#777" font-size="12">'
            "no points yet</text></svg>"
        )
        return "".join(out)
    x0, x1 = min(xs_all), max(xs_all)
    y0, y1 = min(ys_all), max(ys_all)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        pad = abs(y0) * 0.1 or 1.0
        y0, y1 = y0 - pad, y1 + pad
    else:
        pad = (y1 - y0) * 0.05
        y0, y1 = y0 - pad, y1 + pad

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return top + ph - (y - y0) / (y1 - y0) * ph

    for t in nice_ticks(x0, x1, 6, integer=integer_x):
        X = sx(t)
        out.append(f'<line x1="{X:.1f}" y1="{top}" x2="{X:.1f}" y2="{top + ph}" stroke="#eee"/>')
        out.append(
            f'<text x="{X:.1f}" y="{top + ph + 14}" text-anchor="middle" font-size="10" fill="#444">{_fmt(t)}</text>'
        )
    for t in nice_ticks(y0, y1, 4):
        Y = sy(t)
        out.append(f'<line x1="{left}" y1="{Y:.1f}" x2="{left + pw}" y2="{Y:.1f}" stroke="#eee"/>')
        out.append(
            f'<text x="{left - 4}" y="{Y + 3:.1f}" text-anchor="end" font-size="10" fill="#444">{_fmt(t)}</text>'
        )
    out.append(
        f'<text x="{left + pw / 2}" y="{height - 4}" text-anchor="middle" font-size="11" fill="#333">'
        f"{escape(x_label)}</text>"
    )
    for i, c in enumerate(curves):
        colour = PALETTE[i % len(PALETTE)]
        if c.band is not None and c.xs:
            lows, highs = c.band
            upper = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(c.xs, highs))
            lower = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in reversed(list(zip(c.xs, lows))))
            out.append(f'<polygon class="band" points="{upper} {lower}" fill="{colour}" fill-opacity="0.15"/>')
        if not c.xs:
            continue
        d = " ".join(f"{'M' if j == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}" for j, (x, y) in enumerate(zip(c.xs, c.ys)))
        out.append(
            f'<path class="curve" data-label="{escape(c.label)}" data-points="{len(c.xs)}" d="{d}" '
            f'fill="none" stroke="{colour}" stroke-width="1.8"/>'
        )
        if len(c.xs) < 40:
            out.extend(
                f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.2" fill="{colour}"/>' for x, y in zip(c.xs, c.ys)
            )
    if len(curves) > 1:
        for i, c in enumerate(curves):
            colour = PALETTE[i % len(PALETTE)]
            ly = top + 12 + i * 14
            out.append(f'<rect x="{left + 8}" y="{ly - 8}" width="10" height="10" fill="{colour}"/>')
            out.append(f'<text x="{left + 22}" y="{ly + 1}" font-size="11" fill="#222">{escape(c.label)}</text>')
    out.append("</svg>")
    return "".join(out)


def sparkline(
    values: Sequence[float],
    *,
    width: int = 120,
    height: int = 24,
    lo: float | None = None,
    hi: float | None = None,
    label: str = "",
) -> str:
    """A tiny ``<svg>`` line of ``values`` (oldest first) between ``lo`` and ``hi`` (default: their
    own range), for telemetry columns."""
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="spark" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}"><title>{escape(label)}</title>'
        f'<rect width="{width}" height="{height}" fill="#f6f8fa"/>'
    ]
    vals = [v for v in values if math.isfinite(v)]
    if len(vals) >= 1:
        a = min(vals) if lo is None else lo
        b = max(vals) if hi is None else hi
        if b <= a:
            b = a + 1
        n = len(vals)
        xs = [(i / max(1, n - 1)) * (width - 2) + 1 for i in range(n)]
        ys = [height - 1 - (min(max(v, a), b) - a) / (b - a) * (height - 2) for v in vals]
        pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in zip(xs, ys))
        out.append(f'<polyline points="{pts}" fill="none" stroke="#0072B2" stroke-width="1.3"/>')
    out.append("</svg>")
    return "".join(out)
