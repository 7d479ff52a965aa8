"""Curves drawn on the server as inline SVG: a polyline per series, axes with labels, a legend."""

from __future__ import annotations

from html import escape
from typing import Mapping, Sequence

WIDTH, HEIGHT = 640, 260
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 28, 40  # room for the y labels, the title and the x labels
MAX_POINTS = 600  # more than the plot is wide in pixels: a longer series is thinned, its ends kept
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")

Series = Sequence[tuple[float, float]]


def thin(points: Series, most: int = MAX_POINTS) -> list[tuple[float, float]]:
    """At most `most` points of `points`, evenly spaced, the first and the last always among them."""
    if len(points) <= most:
        return list(points)
    stride = (len(points) - 1) / (most - 1)
    return [points[round(i * stride)] for i in range(most)]


def label(value: float) -> str:
    """A tick label: short, enough digits to tell neighbours apart."""
    return f"{value:.4g}"


def chart(title: str, series: Mapping[str, Series], x_label: str = "step") -> str:
    """An <svg> of every series against a shared x axis; a note instead of a plot when there is no point."""
    drawn = {name: thin(points) for name, points in series.items() if points}
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
            f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(title)}" class="chart">'
            f'<text x="{LEFT}" y="18" class="title">{escape(title)}</text>')
    if not drawn:
        return head + f'<text x="{LEFT}" y="{HEIGHT // 2}">no points yet</text></svg>'
    xs = [x for points in drawn.values() for x, _ in points]
    ys = [y for points in drawn.values() for _, y in points]
    box = (min(xs), max(xs), min(ys), max(ys))
    parts = [head, _axes(box, x_label)]
    for i, (name, points) in enumerate(sorted(drawn.items())):
        color = COLORS[i % len(COLORS)]
        coords = " ".join(f"{px:.1f},{py:.1f}" for px, py in (_place(box, x, y) for x, y in points))
        parts.append(f'<polyline class="series" data-name="{escape(name)}" data-points="{len(points)}" '
                     f'fill="none" stroke="{color}" stroke-width="1.5" points="{coords}"/>')
        parts.append(f'<text x="{WIDTH - RIGHT}" y="{18 + 13 * i}" text-anchor="end" fill="{color}">'
                     f'{escape(name)}</text>')  # the legend, above the plot's top right corner
    return "".join(parts) + "</svg>"


def _place(box: tuple[float, float, float, float], x: float, y: float) -> tuple[float, float]:
    """Data coordinates to pixels (y grows upwards); a flat range is drawn mid-height."""
    x0, x1, y0, y1 = box
    fx = (x - x0) / (x1 - x0) if x1 > x0 else 0.5
    fy = (y - y0) / (y1 - y0) if y1 > y0 else 0.5
    return LEFT + fx * (WIDTH - LEFT - RIGHT), HEIGHT - BOTTOM - fy * (HEIGHT - TOP - BOTTOM)


def _axes(box: tuple[float, float, float, float], x_label: str) -> str:
    """The two axes, three ticks on each with their labels, and the x axis's name."""
    x0, x1, y0, y1 = box
    bottom, right = HEIGHT - BOTTOM, WIDTH - RIGHT
    parts = [f'<line x1="{LEFT}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="#444"/>',
             f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{bottom}" stroke="#444"/>']
    for f in (0.0, 0.5, 1.0):
        px, _ = _place(box, x0 + f * (x1 - x0), y0)
        _, py = _place(box, x0, y0 + f * (y1 - y0))
        parts.append(f'<text x="{px:.1f}" y="{bottom + 16}" text-anchor="middle" class="tick">'
                     f'{label(x0 + f * (x1 - x0))}</text>')
        parts.append(f'<text x="{LEFT - 6}" y="{py + 4:.1f}" text-anchor="end" class="tick">'
                     f'{label(y0 + f * (y1 - y0))}</text>')
    parts.append(f'<text x="{(LEFT + right) / 2:.1f}" y="{HEIGHT - 6}" text-anchor="middle">{escape(x_label)}</text>')
    return "".join(parts)
