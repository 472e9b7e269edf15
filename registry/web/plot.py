"""Quality against size, drawn on the server as inline SVG: one mark per (artifact, runtime) eval.

Pure functions, no JavaScript and no plotting library: `plot_layout` places the marks, the ticks and
the Pareto front (numbers a test can check), `render_svg` writes them as SVG markup, escaping every
text it writes itself, so the template inserts the result as it is.

Scales: x is the artifact's total bytes and y its KL divergence from the reference, both logarithmic
(quantized artifacts of one model span orders of magnitude in both). KL can be exactly 0 (a lossless
artifact) or below what float32 resolves, so a value under `KL_FLOOR` is drawn at the floor, and the
axis label says so. A mark whose KL is missing, NaN or infinite, or whose size is 0, has no place on
those scales: it is left out and listed in `not_plotted`, never drawn at a made-up position.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kiln.registry.web.units import human_size

KL_FLOOR = 1e-7

# The drawing area in SVG user units; the legend sits to the right of the plot.
WIDTH, HEIGHT = 780, 400
LEFT, RIGHT, TOP, BOTTOM = 64, 210, 16, 58
MAX_TICKS = 9
LEGEND_ROW = 18
LEGEND_NAME_CHARS = 26

Shape = Literal["circle", "square", "triangle", "diamond", "triangle-down"]
SHAPES: tuple[Shape, ...] = ("circle", "square", "triangle", "diamond", "triangle-down")
# Okabe-Ito's colour-blind-safe palette without its red (red marks a failed eval) and yellow (unreadable on white).
COLOURS = ("#0072b2", "#e69f00", "#009e73", "#cc79a7", "#56b4e9", "#6b6b6b", "#8c564b", "#1d2330")
FAILED_STROKE = "#c00000"
FRONT_STROKE = "#1d2330"

# Tick candidates on the size axis: 1, 10 and 100 of each binary unit, so labels stay round ("10 MiB")
# and neighbours are about a decade apart (100 KiB to 1 MiB is ×10.24).
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
SIZE_TICKS: tuple[tuple[int, str], ...] = tuple(
    (m * 1024**k, f"{m} {unit}") for k, unit in enumerate(_UNITS) for m in (1, 10, 100)
)
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


@dataclass(frozen=True)
class PlotPoint:
    """One eval with metrics: which artifact, which runtime, its size and its KL (None: not reported)."""

    artifact: str
    runtime: str
    size: int  # the artifact's total bytes
    kl: float | None
    status: str  # passed | failed


@dataclass(frozen=True)
class Mark:
    """A point placed on the plot: SVG coordinates, its marker, and whether it is on the Pareto front."""

    point: PlotPoint
    x: float
    y: float
    shape: Shape
    colour: str
    on_front: bool
    clamped: bool  # KL below the floor, drawn at it


@dataclass(frozen=True)
class Tick:
    at: float  # SVG coordinate along its axis
    label: str


@dataclass(frozen=True)
class LegendEntry:
    runtime: str
    shape: Shape
    colour: str


@dataclass(frozen=True)
class PlotLayout:
    """Everything the SVG shows, as numbers; `front` runs from the smallest artifact to the largest."""

    marks: tuple[Mark, ...]
    front: tuple[Mark, ...]
    x_ticks: tuple[Tick, ...]
    y_ticks: tuple[Tick, ...]
    legend: tuple[LegendEntry, ...]
    height: int
    not_plotted: tuple[str, ...]


@dataclass(frozen=True)
class QualityPlot:
    """The SVG markup (None when there was nothing to plot) and the evals left out, each with why."""

    svg: str | None
    not_plotted: tuple[str, ...]


def _unplottable(point: PlotPoint) -> str | None:
    """Why `point` has no place on log scales, or None when it has one."""
    if point.kl is None:
        return "no KL divergence reported"
    if math.isnan(point.kl):
        return "KL divergence is NaN"
    if math.isinf(point.kl):
        return f"KL divergence is {'+' if point.kl > 0 else '-'}inf"
    if point.size <= 0:
        return "size is 0 B"
    return None


def _kl(point: PlotPoint) -> float:
    assert point.kl is not None  # only plottable points get here
    return point.kl


def pareto_front(points: Sequence[PlotPoint]) -> tuple[PlotPoint, ...]:
    """The points no other point dominates (as small or smaller and as low or lower in KL, and strictly
    better in one), smallest first. Equal points are all on the front: neither is better."""

    def dominated(p: PlotPoint) -> bool:
        return any(q.size <= p.size and _kl(q) <= _kl(p) and (q.size < p.size or _kl(q) < _kl(p)) for q in points)

    return tuple(sorted((p for p in points if not dominated(p)), key=lambda p: (p.size, _kl(p), p.artifact)))


def _snap(low: int, high: int, candidates: Sequence[int]) -> tuple[int, int]:
    """The neighbouring candidates around [low, high]; a single value gets one step each side."""
    lo = max((t for t in candidates if t <= low), default=candidates[0])
    hi = min((t for t in candidates if t >= high), default=candidates[-1])
    if lo == hi:
        i = candidates.index(lo)
        lo, hi = candidates[max(i - 1, 0)], candidates[min(i + 1, len(candidates) - 1)]
    return lo, hi


def _size_axis(low: int, high: int) -> tuple[int, int, list[tuple[int, str]]]:
    """The size axis around [low, high]: its ends and its ticks, both on round binary sizes.

    Too many ticks for the axis: whole units only (1 KiB, 1 MiB, ...), the ends snapped to them so
    the axis starts and ends on a label, then every other one.
    """
    lo, hi = _snap(low, high, [t for t, _ in SIZE_TICKS])
    ticks = [(t, label) for t, label in SIZE_TICKS if lo <= t <= hi]
    if len(ticks) > MAX_TICKS:
        whole = [(t, label) for t, label in SIZE_TICKS if label.startswith("1 ")]
        lo, hi = _snap(low, high, [t for t, _ in whole])
        ticks = [(t, label) for t, label in whole if lo <= t <= hi]
    while len(ticks) > MAX_TICKS:
        ticks = ticks[::2]
    return lo, hi, ticks


def _kl_domain(low: float, high: float) -> tuple[int, int]:
    """Decade exponents around [low, high] (both ≥ KL_FLOOR); a single decade gets one step each side."""
    floor = round(math.log10(KL_FLOOR))
    lo, hi = math.floor(math.log10(low) + 1e-9), math.ceil(math.log10(high) - 1e-9)
    if lo == hi:
        lo, hi = lo - 1, hi + 1
    return max(lo, floor), max(hi, floor + 1)


def _kl_label(exponent: int) -> str:
    return f"{10.0**exponent:g}" if -3 <= exponent <= 3 else f"1e{exponent}"


def _scale(value: float, lo: float, hi: float, start: float, end: float) -> float:
    """`value` on a log scale from `lo` (at `start`) to `hi` (at `end`)."""
    return start + (math.log10(value) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)) * (end - start)


def plot_layout(points: Sequence[PlotPoint]) -> PlotLayout | None:
    """Place `points` (legend in their runtimes' order of first appearance); None when none can be placed."""
    not_plotted = tuple(f"{p.artifact} ({p.runtime}): {why}" for p in points if (why := _unplottable(p)) is not None)
    placed = [p for p in points if _unplottable(p) is None]
    if not placed:
        return None
    runtimes = list(dict.fromkeys(p.runtime for p in placed))
    legend = tuple(LegendEntry(r, SHAPES[i % len(SHAPES)], COLOURS[i % len(COLOURS)]) for i, r in enumerate(runtimes))
    style = {e.runtime: e for e in legend}
    height = max(HEIGHT, TOP + LEGEND_ROW * (len(legend) + 3) + 8)
    x_lo, x_hi, x_ticks = _size_axis(min(p.size for p in placed), max(p.size for p in placed))
    y_lo, y_hi = _kl_domain(max(min(_kl(p) for p in placed), KL_FLOOR), max(max(_kl(p) for p in placed), KL_FLOOR))
    x_start, x_end = LEFT, WIDTH - RIGHT
    y_start, y_end = height - BOTTOM, TOP  # SVG's y grows downwards: a higher KL is drawn higher

    def x_of(size: int) -> float:
        return _scale(size, x_lo, x_hi, x_start, x_end)

    def y_of(kl: float) -> float:
        return _scale(max(kl, KL_FLOOR), 10.0**y_lo, 10.0**y_hi, y_start, y_end)

    front = set(pareto_front(placed))
    marks = tuple(
        Mark(
            point=p,
            x=x_of(p.size),
            y=y_of(_kl(p)),
            shape=style[p.runtime].shape,
            colour=style[p.runtime].colour,
            on_front=p in front,
            clamped=_kl(p) < KL_FLOOR,
        )
        for p in placed
    )
    by_point = {m.point: m for m in marks}
    y_step = max(1, math.ceil((y_hi - y_lo + 1) / MAX_TICKS))
    return PlotLayout(
        marks=marks,
        front=tuple(by_point[p] for p in pareto_front(placed)),
        x_ticks=tuple(Tick(x_of(t), label) for t, label in x_ticks),
        y_ticks=tuple(Tick(y_of(10.0**e), _kl_label(e)) for e in range(y_lo, y_hi + 1, y_step)),
        legend=legend,
        height=height,
        not_plotted=not_plotted,
    )


def _text(value: str) -> str:
    """Text or an attribute value, escaped for HTML and XML alike (control characters replaced)."""
    return html.escape(_CONTROL.sub("\ufffd", value), quote=True)


def _num(value: float) -> str:
    return f"{value:.1f}"


def _marker(shape: Shape, x: float, y: float, r: float, attrs: str) -> str:
    """One marker of `shape` centred on (x, y) with half-size `r`; `attrs` are its fill and stroke."""
    if shape == "circle":
        return f'<circle cx="{_num(x)}" cy="{_num(y)}" r="{_num(r)}" {attrs}/>'
    if shape == "square":
        s = r * 0.9
        return f'<rect x="{_num(x - s)}" y="{_num(y - s)}" width="{_num(2 * s)}" height="{_num(2 * s)}" {attrs}/>'
    corners = {
        "triangle": ((0, -1.2), (1.1, 0.8), (-1.1, 0.8)),
        "triangle-down": ((0, 1.2), (1.1, -0.8), (-1.1, -0.8)),
        "diamond": ((0, -1.25), (1.1, 0), (0, 1.25), (-1.1, 0)),
    }[shape]
    points = " ".join(f"{_num(x + dx * r)},{_num(y + dy * r)}" for dx, dy in corners)
    return f'<polygon points="{points}" {attrs}/>'


def _tooltip(mark: Mark) -> str:
    p = mark.point
    kl = f"{_kl(p):.3g}" + (f" (drawn at {KL_FLOOR:g})" if mark.clamped else "")
    front = ", on the Pareto front" if mark.on_front else ""
    return f"{p.artifact} · {p.runtime} · {human_size(p.size)} ({p.size} bytes) · KL {kl} · {p.status}{front}"


def _short(name: str) -> str:
    return name if len(name) <= LEGEND_NAME_CHARS else name[: LEGEND_NAME_CHARS - 1] + "…"


def render_svg(layout: PlotLayout) -> str:
    """The layout as one `<svg>` element (marks, ticks, axis labels, legend, front), all text escaped."""
    h = layout.height
    x0, x1, y0, y1 = LEFT, WIDTH - RIGHT, h - BOTTOM, TOP
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="quality-plot" viewBox="0 0 {WIDTH} {h}" '
        f'width="{WIDTH}" height="{h}" role="img" aria-labelledby="quality-plot-title">',
        '<title id="quality-plot-title">KL divergence against artifact size, one mark per artifact and runtime</title>',
        f'<rect class="frame" x="{x0}" y="{y1}" width="{x1 - x0}" height="{y0 - y1}" fill="#fff" stroke="#d8dde6"/>',
    ]
    for tick in layout.x_ticks:
        out.append(
            f'<g class="tick x"><line x1="{_num(tick.at)}" y1="{y1}" x2="{_num(tick.at)}" y2="{y0 + 4}" '
            f'stroke="#eceff3"/><text x="{_num(tick.at)}" y="{y0 + 17}" text-anchor="middle">'
            f"{_text(tick.label)}</text></g>"
        )
    for tick in layout.y_ticks:
        out.append(
            f'<g class="tick y"><line x1="{x0 - 4}" y1="{_num(tick.at)}" x2="{x1}" y2="{_num(tick.at)}" '
            f'stroke="#eceff3"/><text x="{x0 - 7}" y="{_num(tick.at + 4)}" text-anchor="end">'
            f"{_text(tick.label)}</text></g>"
        )
    out.append(
        f'<text class="axis-label" x="{_num((x0 + x1) / 2)}" y="{h - 14}" text-anchor="middle">'
        "Artifact size (total bytes, log scale)</text>"
    )
    out.append(
        f'<text class="axis-label" transform="translate(15 {_num((y0 + y1) / 2)}) rotate(-90)" '
        f'text-anchor="middle">KL divergence (log; below {KL_FLOOR:g} drawn at {KL_FLOOR:g})</text>'
    )
    if len(layout.front) > 1:
        points = " ".join(f"{_num(m.x)},{_num(m.y)}" for m in layout.front)
        out.append(
            f'<polyline class="front" points="{points}" fill="none" stroke="{FRONT_STROKE}" '
            'stroke-width="1.5" stroke-dasharray="5 3"/>'
        )
    # Front marks last, so they are drawn over the others.
    for mark in sorted(layout.marks, key=lambda m: m.on_front):
        p = mark.point
        failed = p.status == "failed"
        stroke = FAILED_STROKE if failed else (FRONT_STROKE if mark.on_front else "#fff")
        width = 2.5 if failed else (1.5 if mark.on_front else 1)
        attrs = f'fill="{mark.colour}" stroke="{stroke}" stroke-width="{width}"'
        classes = "mark" + (" front" if mark.on_front else "") + (" failed" if failed else "")
        out.append(
            f'<g class="{classes}" data-artifact="{_text(p.artifact)}" data-runtime="{_text(p.runtime)}" '
            f'data-status="{_text(p.status)}"><title>{_text(_tooltip(mark))}</title>'
            f"{_marker(mark.shape, mark.x, mark.y, 6.5 if mark.on_front else 5, attrs)}</g>"
        )
    labelled: set[tuple[str, str, str]] = set()
    for mark in layout.front:
        key = (mark.point.artifact, _num(mark.x), _num(mark.y))
        if key not in labelled:
            labelled.add(key)
            out.append(
                f'<text class="front-label" x="{_num(mark.x + 9)}" y="{_num(mark.y - 8)}">'
                f"{_text(mark.point.artifact)}</text>"
            )
    out.append(_legend(layout, x1 + 18))
    out.append("</svg>")
    return "".join(out)


def _legend(layout: PlotLayout, x: float) -> str:
    parts = ['<g class="legend">']
    y = TOP + 12
    for entry in layout.legend:
        attrs = f'fill="{entry.colour}" stroke="#fff" stroke-width="1"'
        parts.append(
            f'<g class="legend-entry" data-runtime="{_text(entry.runtime)}"><title>{_text(entry.runtime)}</title>'
            f"{_marker(entry.shape, x, y, 5, attrs)}"
            f'<text x="{_num(x + 12)}" y="{_num(y + 4)}">{_text(_short(entry.runtime))}</text></g>'
        )
        y += LEGEND_ROW
    failed = f'fill="#fff" stroke="{FAILED_STROKE}" stroke-width="2.5"'
    parts.append(
        f'<g class="legend-entry failed">{_marker("circle", x, y, 5, failed)}'
        f'<text x="{_num(x + 12)}" y="{_num(y + 4)}">failed eval (red outline)</text></g>'
    )
    y += LEGEND_ROW
    parts.append(
        f'<g class="legend-entry front"><line x1="{_num(x - 7)}" y1="{_num(y)}" x2="{_num(x + 7)}" y2="{_num(y)}" '
        f'stroke="{FRONT_STROKE}" stroke-width="1.5" stroke-dasharray="5 3"/>'
        f'<text x="{_num(x + 12)}" y="{_num(y + 4)}">Pareto front (smaller and closer)</text></g>'
    )
    parts.append("</g>")
    return "".join(parts)


def quality_plot(points: Sequence[PlotPoint]) -> QualityPlot:
    """The SVG of `points` and the ones left out; no SVG at all when none can be placed."""
    layout = plot_layout(points)
    if layout is None:
        return QualityPlot(None, tuple(f"{p.artifact} ({p.runtime}): {_unplottable(p)}" for p in points))
    return QualityPlot(render_svg(layout), layout.not_plotted)
