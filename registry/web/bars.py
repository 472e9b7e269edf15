"""A replica's memory per device as a horizontal bar, drawn on the server as inline SVG.

Pure functions, like `plot`: `memory_bar` places the segments (numbers a test can check) and
`render_bar` writes them as SVG. One bar is one device of the replica: its share of the weights,
its share of the KV cache, the room left of what a server may use (`usable`: the plan's
MEMORY_UTILIZATION of the device) and the rest of the device, which is kept for activations and
the allocator. Every bar of a page shares one scale (`bar_domain`), so a 192 GiB device is drawn
wider than an 80 GiB one; a replica that needs more than it has is drawn past its usable line, in
red, up to OVERFLOW times its memory and cut there (marked).
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from kiln.placement.fit import ReplicaPlan
from kiln.registry.web.units import human_size

WIDTH, HEIGHT = 380, 22
BAR_TOP, BAR_HEIGHT = 2, 18
OVERFLOW = 1.5  # how far past its own memory a bar that does not fit is drawn before it is cut

SegmentKind = Literal["weights", "kv", "free", "reserved", "over"]
# Okabe-Ito's blue and orange, as the quality plot: weights and KV cache; a light grey for the room left, a
# darker one for the share no server uses, and the failed-gate red for what does not fit.
COLOURS: dict[SegmentKind, str] = {
    "weights": "#0072b2",
    "kv": "#e69f00",
    "free": "#e3f1e6",
    "reserved": "#c9ced6",
    "over": "#c00000",
}


@dataclass(frozen=True)
class Segment:
    kind: SegmentKind
    start: int  # bytes from the bar's left end
    size: int  # bytes
    x: float  # SVG units
    width: float


@dataclass(frozen=True)
class MemoryBar:
    """One device of a replica: the segments drawn and the facts they are drawn from (bytes per device)."""

    weights: int
    kv: int
    usable: int
    memory: int
    required: int
    fits: bool  # weights + KV ≤ usable (the plan's own verdict)
    segments: tuple[Segment, ...]
    usable_x: float
    memory_x: float
    cut: bool  # the bar reaches past OVERFLOW × memory (or the page's scale) and is cut at the right edge


def bar_domain(plans: Iterable[ReplicaPlan]) -> int:
    """The bytes one page's full bar width stands for: the largest device memory, or the most a bar that does not
    fit is drawn to (OVERFLOW × its memory) where that is more; 1 for no plans."""
    return max(
        (max(p.memory_per_device_bytes, min(p.required_per_device_bytes, int(OVERFLOW * p.memory_per_device_bytes)))
         for p in plans),
        default=1,
    )  # fmt: skip


def memory_bar(plan: ReplicaPlan, domain: int) -> MemoryBar:
    """The bar of one device of `plan`'s replica on a scale where `domain` bytes fill WIDTH."""
    scale = WIDTH / max(domain, 1)
    limit = min(domain, int(OVERFLOW * plan.memory_per_device_bytes))

    def segment(kind: SegmentKind, start: int, end: int) -> Segment | None:
        end = min(end, limit)
        if end <= start:
            return None
        return Segment(kind, start, end - start, round(start * scale, 1), round((end - start) * scale, 1))

    w, kv = plan.weights_per_device_bytes, plan.kv_per_device_bytes
    usable, memory, required = plan.usable_per_device_bytes, plan.memory_per_device_bytes, w + kv
    drawn = [
        segment("free", required, usable),
        segment("reserved", max(required, usable), memory),
        segment("weights", 0, w),
        segment("kv", w, required),
        segment("over", usable, required),  # over the weights and KV past the usable line
    ]
    return MemoryBar(
        weights=w,
        kv=kv,
        usable=usable,
        memory=memory,
        required=required,
        fits=plan.fits,
        segments=tuple(s for s in drawn if s is not None),
        usable_x=round(min(usable, limit) * scale, 1),
        memory_x=round(min(memory, limit) * scale, 1),
        cut=required > limit,
    )


def _text(value: str) -> str:
    return html.escape(value, quote=True)


def bar_title(bar: MemoryBar) -> str:
    """The bar in words (its tooltip): what it holds against what the device gives."""
    verdict = "fits" if bar.fits else "does not fit"
    return (
        f"per device: weights {human_size(bar.weights)} + KV cache {human_size(bar.kv)} = "
        f"{human_size(bar.required)} of {human_size(bar.usable)} usable ({human_size(bar.memory)} in all): {verdict}"
    )


def render_bar(bar: MemoryBar) -> str:
    """The bar as one `<svg>` element: segments, the usable and memory lines, and a cut mark where it is cut."""
    y, h = BAR_TOP, BAR_HEIGHT
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="membar{"" if bar.fits else " over"}" '
        f'viewBox="0 0 {WIDTH + 8} {HEIGHT}" width="{WIDTH + 8}" height="{HEIGHT}" role="img" '
        f'data-weights-bytes="{bar.weights}" data-kv-bytes="{bar.kv}" data-usable-bytes="{bar.usable}" '
        f'data-memory-bytes="{bar.memory}"><title>{_text(bar_title(bar))}</title>'
    ]
    for s in bar.segments:
        if s.kind == "over":
            attrs = f'fill="{COLOURS["over"]}" fill-opacity="0.55" stroke="{COLOURS["over"]}" stroke-width="2"'
        else:
            attrs = f'fill="{COLOURS[s.kind]}"'
        out.append(
            f'<rect class="segment {s.kind}" data-kind="{s.kind}" data-bytes="{s.size}" x="{s.x:.1f}" y="{y}" '
            f'width="{s.width:.1f}" height="{h}" {attrs}/>'
        )
    out.append(
        f'<line class="memory-line" x1="{bar.memory_x:.1f}" y1="{y - 2}" x2="{bar.memory_x:.1f}" y2="{y + h + 2}" '
        'stroke="#1d2330" stroke-width="1"/>'
    )
    out.append(
        f'<line class="usable-line" x1="{bar.usable_x:.1f}" y1="{y - 2}" x2="{bar.usable_x:.1f}" y2="{y + h + 2}" '
        'stroke="#1d2330" stroke-width="1.5" stroke-dasharray="3 2"/>'
    )
    if bar.cut:
        x = WIDTH
        out.append(
            f'<polygon class="cut" points="{x},{y} {x + 7},{y + h / 2:.1f} {x},{y + h}" fill="{COLOURS["over"]}"/>'
        )
    out.append("</svg>")
    return "".join(out)
