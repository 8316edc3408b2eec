"""Line charts of logged metrics as SVG: one small chart per metric, one line per rank.

Plain SVG inside an HTML widget renders in every widget frontend (JupyterLab, VS Code, Colab),
with no plotting library in the kernel; what a saved notebook keeps has each chart as an image
(``images=True``), which a notebook that is not trusted shows too.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Sequence

from nbaccel.ui.formats import format_si

# Distinguishable line colours, one per rank (cycled beyond eight ranks).
RANK_COLOURS = (
    "#0969da",
    "#d1242f",
    "#1a7f37",
    "#8250df",
    "#bc4c00",
    "#0a7ea4",
    "#bf3989",
    "#57606a",
)
MAX_POINTS = 300  # per line; longer histories are thinned evenly, keeping the latest point


def rank_colour(rank: int) -> str:
    return RANK_COLOURS[rank % len(RANK_COLOURS)]


def _thin(points: list[tuple[float, float]], limit: int = MAX_POINTS) -> list[tuple[float, float]]:
    if len(points) <= limit:
        return points
    stride = len(points) / (limit - 1)
    kept = [points[int(i * stride)] for i in range(limit - 1)]
    return [*kept, points[-1]]


def axis_labels(lo: float, hi: float) -> tuple[str, str]:
    """An axis's two end labels in one style, so they read as one scale: plain decimals with
    the digits that tell them apart, SI suffixes from 1000 up, exponents for tiny scales.

    >>> axis_labels(0.009, 0.011), axis_labels(0, 1840), axis_labels(0.000531, 0.5)
    (('0.009', '0.011'), ('0', '1.84k'), ('0.00053', '0.5'))
    >>> axis_labels(2e-05, 3.5e-05), axis_labels(2.0, 3.0)
    (('2e-5', '3.5e-5'), ('2', '3'))
    """
    big = max(abs(lo), abs(hi))
    if big >= 1000 or (float(lo).is_integer() and float(hi).is_integer()):
        return format_si(lo), format_si(hi)
    if big < 1e-3:
        return _exponent(lo), _exponent(hi)
    digits = 2 - math.floor(math.log10(big))  # three significant digits of the larger end
    small = min(abs(lo), abs(hi))
    if small:
        digits = max(digits, min(6, 1 - math.floor(math.log10(small))))
    return _decimal(lo, digits), _decimal(hi, digits)


def _decimal(value: float, digits: int) -> str:
    text = f"{value:.{max(digits, 0)}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _exponent(value: float) -> str:
    return f"{value:.2g}".replace("e-0", "e-").replace("e+0", "e")


def line_chart(
    title: str,
    series: dict[int, list[tuple[float, float]]],
    width: int = 320,
    height: int = 160,
) -> str:
    """One SVG chart: ``series`` maps a rank to its ``(step, value)`` points.

    >>> "<svg" in line_chart("loss", {0: [(0, 1.0), (1, 0.5)]})
    True
    """
    clean = {
        rank: _thin([(x, y) for x, y in pts if math.isfinite(x) and math.isfinite(y)])
        for rank, pts in series.items()
    }
    clean = {rank: pts for rank, pts in clean.items() if pts}
    left, right, top, bottom = 48, 8, 18, 20
    plot_w, plot_h = width - left - right, height - top - bottom
    parts = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
        f"viewBox='0 0 {width} {height}' class='nbaccel-chart' data-metric='{html.escape(title)}' "
        "style='font:10px sans-serif;background:transparent'>",
        f"<text x='{left}' y='12' font-weight='600' fill='currentColor'>{html.escape(title)}</text>",
    ]
    if not clean:
        parts.append("</svg>")
        return "".join(parts)
    xs = [x for pts in clean.values() for x, _ in pts]
    ys = [y for pts in clean.values() for _, y in pts]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y0, y1 = y0 - (abs(y0) * 0.1 or 1), y1 + (abs(y1) * 0.1 or 1)

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * plot_w

    def sy(y: float) -> float:
        return top + (1 - (y - y0) / (y1 - y0)) * plot_h

    axis = "stroke='#8c959f' stroke-width='1'"
    (x_lo, x_hi), (y_lo, y_hi) = axis_labels(x0, x1), axis_labels(y0, y1)
    parts += [
        f"<line x1='{left}' y1='{top + plot_h}' x2='{left + plot_w}' y2='{top + plot_h}' {axis}/>",
        f"<line x1='{left}' y1='{top}' x2='{left}' y2='{top + plot_h}' {axis}/>",
        f"<text x='{left - 4}' y='{top + 4}' text-anchor='end' fill='currentColor'>{y_hi}</text>",
        f"<text x='{left - 4}' y='{top + plot_h}' text-anchor='end' fill='currentColor'>{y_lo}</text>",
        f"<text x='{left}' y='{height - 6}' fill='currentColor'>{x_lo}</text>",
        f"<text x='{left + plot_w / 2:.0f}' y='{height - 6}' text-anchor='middle' "
        "fill='#57606a'>step</text>",
        f"<text x='{left + plot_w}' y='{height - 6}' text-anchor='end' fill='currentColor'>"
        f"{x_hi}</text>",
    ]
    legend_x = left + plot_w - 46 * (len(clean) - 1)  # left to right in rank order
    for i, (rank, pts) in enumerate(sorted(clean.items())):
        colour = rank_colour(rank)
        if len(pts) == 1:
            x, y = pts[0]
            parts.append(f"<circle cx='{sx(x):.1f}' cy='{sy(y):.1f}' r='2' fill='{colour}'/>")
        else:
            path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
            parts.append(
                f"<polyline fill='none' stroke='{colour}' stroke-width='1.5' points='{path}' "
                f"data-rank='{rank}'/>"
            )
        lx = legend_x + 46 * i
        parts.append(
            f"<text x='{lx}' y='12' text-anchor='end' fill='{colour}' class='nbaccel-legend'>"
            f"rank {rank}</text>"
        )
    parts.append("</svg>")
    return "".join(parts)


def metric_names(histories: dict[int, Sequence[tuple[int, dict[str, float]]]]) -> list[str]:
    """Metric names in first-logged order, ``loss`` first when present."""
    names: dict[str, None] = {}
    for history in histories.values():
        for _, values in history:
            for name in values:
                names.setdefault(name, None)
    return sorted(names, key=lambda n: n != "loss")  # stable: the rest keep their order


def as_image(svg: str, title: str) -> str:
    """``svg`` as an ``<img>`` of a ``data:`` URI: what a notebook that is not trusted still
    shows (JupyterLab and Notebook 7 strip inline ``<svg>`` from its HTML, leaving the
    labels as loose text, "loss10.0170step30rank 0rank 1"). In an image ``currentColor`` is
    black whatever the theme: its text takes a grey that reads on light and dark alike.

    >>> as_image(line_chart("loss", {0: [(0, 1.0), (1, 0.5)]}), "loss")[:60]
    "<img class='nbaccel-chart' alt='loss by step, per rank' src="
    """
    data = base64.b64encode(svg.replace("currentColor", "#6e7781").encode()).decode()
    return (
        f"<img class='nbaccel-chart' alt='{html.escape(title)} by step, per rank' "
        f"src='data:image/svg+xml;base64,{data}'/>"
    )


def metrics_charts(
    histories: dict[int, Sequence[tuple[int, dict[str, float]]]],
    limit: int = 3,
    images: bool = False,
) -> str:
    """Charts of up to ``limit`` metrics (``loss`` first), side by side; "" when nothing was
    logged. ``histories`` maps a rank to its ``(step, {name: value})`` entries; ``images``:
    each chart an ``<img>`` (:func:`as_image`), for what a saved notebook keeps."""
    charts = []
    for name in metric_names(histories)[:limit]:
        series = {
            rank: [(float(step), float(v[name])) for step, v in history if name in v]
            for rank, history in histories.items()
        }
        chart = line_chart(name, series)
        charts.append(as_image(chart, name) if images else chart)
    if not charts:
        return ""
    return f"<div style='display:flex;flex-wrap:wrap;gap:8px'>{''.join(charts)}</div>"
