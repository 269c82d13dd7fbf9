"""Inline SVG charts, drawn on the server: a line per metric over steps, bars per day.

A chart never draws more than `MAX_POINTS` points: the console asks the API for at most that
many (consecutive steps averaged by the scheduler) and longer series are cut the same way here;
the chart says how many steps a point is, so a page with 10,000 steps stays small.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_POINTS = 500
WIDTH, HEIGHT = 640, 200
LEFT, RIGHT, TOP, BOTTOM = 64, 12, 12, 28  # margins for the axes' labels


@dataclass(frozen=True)
class Tick:
    at: float  # pixels along its axis
    label: str


@dataclass(frozen=True)
class LineChart:
    title: str
    path: str  # SVG path data
    x_ticks: list[Tick]
    y_ticks: list[Tick]
    points: int
    per_point: int  # steps averaged into one point
    last: float  # the newest value (what the chart ends at)
    width: int = WIDTH
    height: int = HEIGHT
    left: int = LEFT
    bottom: int = HEIGHT - BOTTOM


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    label: str  # what the bar is (its day and value), for its <title>


@dataclass(frozen=True)
class BarChart:
    title: str
    bars: list[Bar]
    x_ticks: list[Tick]
    y_ticks: list[Tick]
    width: int = WIDTH
    height: int = HEIGHT
    left: int = LEFT
    bottom: int = HEIGHT - BOTTOM


def fmt(value: float) -> str:
    """A number as a chart labels it: 4 significant digits, plain or scientific."""
    if value == 0 or 1e-3 <= abs(value) < 1e6:
        return f"{value:.4g}"
    return f"{value:.2e}"


def _buckets(xs: list[float], ys: list[float], most: int) -> tuple[list[tuple[float, float]], int]:
    size = max(1, math.ceil(len(xs) / most))
    out = []
    for i in range(0, len(xs), size):
        bx, by = xs[i : i + size], ys[i : i + size]
        out.append((sum(bx) / len(bx), sum(by) / len(by)))
    return out, size


def _ticks(low: float, high: float, pixels_low: float, pixels_high: float) -> list[Tick]:
    if high == low:
        return [Tick(pixels_low, fmt(low))]
    return [
        Tick(pixels_low + (pixels_high - pixels_low) * i / 4, fmt(low + (high - low) * i / 4))
        for i in range(5)
    ]


def line_chart(title: str, xs: list[float], ys: list[float], per_step: int = 1) -> LineChart:
    """`ys` over `xs` (non-finite values are left out); `per_step`: steps each value already
    is the mean of (the API's `points`)."""
    pairs = [(x, y) for x, y in zip(xs, ys, strict=True) if math.isfinite(y)]
    points, per_point = _buckets([p[0] for p in pairs], [p[1] for p in pairs], MAX_POINTS)
    per_point *= per_step
    if not points:
        return LineChart(title, "", [], [], 0, 1, float("nan"))
    x0, x1 = points[0][0], points[-1][0]
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + (plot_w * (x - x0) / (x1 - x0) if x1 > x0 else plot_w / 2)

    def py(y: float) -> float:
        return TOP + (plot_h * (1 - (y - y0) / (y1 - y0)) if y1 > y0 else plot_h / 2)

    path = " ".join(
        f"{'M' if i == 0 else 'L'}{px(x):.1f},{py(y):.1f}" for i, (x, y) in enumerate(points)
    )
    steps = sorted({round(x0 + (x1 - x0) * i / 4) for i in range(5)})  # whole steps, once each
    x_ticks = [Tick(px(x), f"{x:.0f}") for x in steps]
    y_ticks = _ticks(y0, y1, py(y0), py(y1))
    return LineChart(title, path, x_ticks, y_ticks, len(points), per_point, pairs[-1][1])


def bar_chart(title: str, labels: list[str], values: list[float]) -> BarChart:
    """One bar per label (days), from zero up."""
    top = max(values, default=0.0) or 1.0
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    slot = plot_w / max(len(values), 1)
    bars = []
    for i, (label, value) in enumerate(zip(labels, values, strict=True)):
        h = plot_h * value / top
        bars.append(
            Bar(
                LEFT + i * slot + slot * 0.15,
                TOP + plot_h - h,
                slot * 0.7,
                h,
                f"{label}: {fmt(value)}",
            )
        )
    every = max(1, math.ceil(len(labels) / 7))
    x_ticks = [Tick(LEFT + (i + 0.5) * slot, labels[i]) for i in range(0, len(labels), every)]
    return BarChart(title, bars, x_ticks, _ticks(0.0, top, TOP + plot_h, TOP))
