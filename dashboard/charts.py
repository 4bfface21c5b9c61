"""Server-rendered SVG charts over a tenant's intervals: stacked bars, lines, and a dashed target line."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from markupsafe import Markup, escape

WIDTH, HEIGHT = 560, 190
LEFT, RIGHT, TOP, BOTTOM = 64, 12, 12, 36
PALETTE = ("#2f6fb0", "#d9822b", "#7a9e3a", "#a14da0", "#c23b3b", "#3a9e9e", "#6b6b6b")


@dataclass(frozen=True)
class Series:
    """One named row of values, one per interval (``None``: no value there)."""

    name: str
    values: Sequence[float | None]
    color: str


def _scale_top(values: list[float], target: float | None) -> float:
    top = max([*values, target or 0.0, 0.0])
    return top * 1.1 if top > 0 else 1.0


def _frame(starts: Sequence[datetime], top: float, unit: Callable[[float], str]) -> list[str]:
    """The chart's box, its y labels (0 and the top) and x labels (first and last interval)."""
    bottom_y = HEIGHT - BOTTOM
    first = starts[0].strftime("%m-%d %H:%M") if starts else ""
    last = starts[-1].strftime("%m-%d %H:%M") if starts else ""
    return [
        f'<rect x="{LEFT}" y="{TOP}" width="{WIDTH - LEFT - RIGHT}" height="{bottom_y - TOP}" class="plot"/>',
        f'<text x="{LEFT - 6}" y="{TOP + 10}" class="axis" text-anchor="end">{escape(unit(top))}</text>',
        f'<text x="{LEFT - 6}" y="{bottom_y}" class="axis" text-anchor="end">0</text>',
        f'<text x="{LEFT}" y="{HEIGHT - 20}" class="axis">{escape(first)}</text>',
        f'<text x="{WIDTH - RIGHT}" y="{HEIGHT - 20}" class="axis" text-anchor="end">{escape(last)}</text>',
    ]


def _legend(series: Sequence[Series], target: float | None) -> list[str]:
    parts, x = [], LEFT
    for s in series:
        parts.append(f'<rect x="{x}" y="{HEIGHT - 12}" width="10" height="10" fill="{s.color}"/>')
        parts.append(f'<text x="{x + 14}" y="{HEIGHT - 3}" class="legend">{escape(s.name)}</text>')
        x += 24 + 7 * len(s.name)
    if target is not None:
        parts.append(f'<line x1="{x}" y1="{HEIGHT - 7}" x2="{x + 14}" y2="{HEIGHT - 7}" class="target"/>')
        parts.append(f'<text x="{x + 18}" y="{HEIGHT - 3}" class="legend">target</text>')
    return parts


class _Plot:
    """Coordinates: interval ``i`` of ``n`` across, a value from 0 to ``top`` up."""

    def __init__(self, n: int, top: float) -> None:
        self.slot = (WIDTH - LEFT - RIGHT) / max(n, 1)
        self.height = HEIGHT - BOTTOM - TOP
        self.top = top

    def y(self, value: float) -> float:
        return TOP + self.height - self.height * value / self.top

    def x(self, i: int) -> float:
        return LEFT + (i + 0.5) * self.slot


def _stacked_bars(plot: _Plot, n: int, series: Sequence[Series], unit: Callable[[float], str]) -> list[str]:
    parts = []
    width = max(plot.slot * 0.8, 1)
    for i in range(n):
        base = 0.0
        for s in series:
            value = s.values[i] or 0.0
            if value > 0:
                top_y, base_y = plot.y(base + value), plot.y(base)
                tip = f"{escape(s.name)}: {escape(unit(value))}"
                parts.append(
                    f'<rect x="{plot.x(i) - width / 2:.1f}" y="{top_y:.1f}" width="{width:.1f}" '
                    f'height="{base_y - top_y:.1f}" fill="{s.color}"><title>{tip}</title></rect>'
                )
            base += value
    return parts


def _lines(plot: _Plot, series: Sequence[Series]) -> list[str]:
    """A polyline per unbroken run of values (a lone value is a dot)."""
    parts = []
    for s in series:
        runs: list[list[tuple[float, float]]] = [[]]
        for i, value in enumerate(s.values):
            if value is None:
                runs.append([])
            else:
                runs[-1].append((plot.x(i), plot.y(value)))
        for run in runs:
            if len(run) == 1:
                parts.append(f'<circle cx="{run[0][0]:.1f}" cy="{run[0][1]:.1f}" r="2.5" fill="{s.color}"/>')
            elif run:
                points = " ".join(f"{x:.1f},{y:.1f}" for x, y in run)
                parts.append(f'<polyline points="{points}" fill="none" stroke="{s.color}" stroke-width="2"/>')
    return parts


def chart(
    title: str,
    starts: Sequence[datetime],
    series: Sequence[Series],
    *,
    bars: bool,
    unit: Callable[[float], str],
    target: float | None = None,
) -> Markup:
    """An SVG chart of ``series`` over the intervals starting at ``starts``: stacked bars (``bars``) or
    lines, with an optional dashed target line."""
    n = len(starts)
    if bars:
        heights = [sum(s.values[i] or 0.0 for s in series) for i in range(n)]
    else:
        heights = [v for s in series for v in s.values if v is not None]
    plot = _Plot(n, _scale_top(heights, target))
    parts = _frame(starts, plot.top, unit)
    parts += _stacked_bars(plot, n, series, unit) if bars else _lines(plot, series)
    if target is not None:
        y = plot.y(target)
        parts.append(
            f'<line x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" class="target" '
            f'data-target="{target}"/>'
        )
    parts.extend(_legend(series, target))
    return Markup(
        f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img" '
        f'aria-label="{escape(title)}" class="chart" data-intervals="{n}">{"".join(parts)}</svg>'
    )
