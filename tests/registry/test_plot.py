"""The quality-against-size plot as a pure function: placement, the Pareto front, escaping, edge cases."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import pytest

from kiln.registry.web.plot import (
    BOTTOM,
    KL_FLOOR,
    LEFT,
    MAX_TICKS,
    RIGHT,
    TOP,
    WIDTH,
    PlotLayout,
    PlotPoint,
    pareto_front,
    plot_layout,
    quality_plot,
)

SVG = "{http://www.w3.org/2000/svg}"
GiB, MiB = 1024**3, 1024**2


def point(artifact: str, size: int, kl: float | None, runtime: str = "llama.cpp", status: str = "passed") -> PlotPoint:
    return PlotPoint(artifact, runtime, size, kl, status)


def layout_of(points: list[PlotPoint]) -> PlotLayout:
    layout = plot_layout(points)
    assert layout is not None
    return layout


def svg_of(points: list[PlotPoint]) -> ET.Element:
    """The SVG parsed as XML: whatever went in, what comes out is well-formed."""
    plot = quality_plot(points)
    assert plot.svg is not None
    return ET.fromstring(plot.svg)


def test_coordinates_are_monotone_in_size_and_kl() -> None:
    sizes = [300 * MiB, 900 * MiB, 2 * GiB, 4 * GiB, 15 * GiB]
    kls = [0.4, 0.08, 0.01, 3e-4, 2e-6]
    layout = layout_of([point(f"a{i}", s, kl) for i, (s, kl) in enumerate(zip(sizes, kls, strict=True))])
    xs = [m.x for m in layout.marks]
    ys = [m.y for m in layout.marks]
    assert xs == sorted(xs) and len(set(xs)) == len(xs)  # larger: further right
    assert ys == sorted(ys) and len(set(ys)) == len(ys)  # lower KL: lower on the page (SVG y grows down)
    for m in layout.marks:
        assert LEFT <= m.x <= WIDTH - RIGHT and TOP <= m.y <= layout.height - BOTTOM
    # Log scales: equal ratios are equal distances.
    even = layout_of([point("a", 1 * MiB, 1e-4), point("b", 10 * MiB, 1e-3), point("c", 100 * MiB, 1e-2)])
    (a, b, c) = even.marks
    assert math.isclose(b.x - a.x, c.x - b.x) and math.isclose(a.y - b.y, b.y - c.y)


def test_pareto_front_on_a_hand_made_set() -> None:
    tiny = point("tiny", 50, 0.5)
    q4 = point("q4", 100, 0.1)
    q5 = point("q5", 200, 0.05)
    q5_again = point("q5", 200, 0.05, runtime="vllm")  # equal to q5: neither beats the other
    worse = point("worse", 300, 0.2)  # q5 is smaller and closer
    q8 = point("q8", 400, 0.01)
    q8_vllm = point("q8", 400, 0.02, runtime="vllm")  # same size as q8, further away
    points = [worse, q8_vllm, q8, q5, q4, tiny, q5_again]
    assert pareto_front(points) == (tiny, q4, q5, q5_again, q8)
    layout = layout_of(points)
    assert [m.point for m in layout.front] == [tiny, q4, q5, q5_again, q8]
    assert {m.point for m in layout.marks if m.on_front} == {tiny, q4, q5, q5_again, q8}
    svg = svg_of(points)
    line = svg.find(f"{SVG}polyline[@class='front']")
    assert line is not None and len(line.attrib["points"].split()) == 5  # joined smallest to largest
    fronts = [g.attrib["data-artifact"] for g in svg.iter(f"{SVG}g") if g.attrib.get("class") == "mark front"]
    assert sorted(fronts) == ["q4", "q5", "q5", "q8", "tiny"]
    labels = sorted(t.text or "" for t in svg.iter(f"{SVG}text") if t.attrib.get("class") == "front-label")
    assert labels == ["q4", "q5", "q8", "tiny"]  # q5's two runtimes share one spot and one label


def test_failed_evals_are_marked_and_runtimes_have_their_own_marker() -> None:
    svg = svg_of(
        [
            point("a", 1 * GiB, 0.01),
            point("a", 1 * GiB, 0.3, runtime="vllm", status="failed"),
            point("b", 2 * GiB, 0.02, runtime="transformers"),
        ]
    )
    marks = {
        (g.attrib["data-artifact"], g.attrib["data-runtime"]): g
        for g in svg.iter(f"{SVG}g")
        if "mark" in g.attrib.get("class", "").split()
    }
    failed = marks["a", "vllm"]
    assert "failed" in failed.attrib["class"].split()
    shape = next(c for c in failed if c.tag != f"{SVG}title")
    assert shape.attrib["stroke"] == "#c00000"
    assert all(
        next(c for c in g if c.tag != f"{SVG}title").attrib["stroke"] != "#c00000"
        for k, g in marks.items()
        if k != ("a", "vllm")
    )
    # The legend: runtimes in the order they first appear, each its own shape and colour.
    legend = [g for g in svg.iter(f"{SVG}g") if "data-runtime" in g.attrib and g.attrib.get("class") == "legend-entry"]
    assert [g.attrib["data-runtime"] for g in legend] == ["llama.cpp", "vllm", "transformers"]
    markers = {(c.tag, c.attrib["fill"]) for g in legend for c in g if c.tag not in (f"{SVG}title", f"{SVG}text")}
    assert len(markers) == 3
    title = failed.find(f"{SVG}title")
    assert title is not None and title.text == "a · vllm · 1.0 GiB (1073741824 bytes) · KL 0.3 · failed"


def test_hostile_names_are_escaped() -> None:
    hostile = "<script>alert('x')</script>&amp;\"\x01"
    runtime = 'vllm"><svg onload=alert(1)>'
    plot = quality_plot([point(hostile, 1 * GiB, 0.01, runtime=runtime), point("b", 2 * GiB, 0.001)])
    assert plot.svg is not None
    assert "<script" not in plot.svg and "<svg onload" not in plot.svg and "\x01" not in plot.svg
    svg = ET.fromstring(plot.svg)  # well-formed XML: every text was escaped
    mark = next(g for g in svg.iter(f"{SVG}g") if g.attrib.get("data-artifact", "").startswith("<script>"))
    assert mark.attrib["data-artifact"] == hostile.replace("\x01", "\ufffd")
    assert mark.attrib["data-runtime"] == runtime
    title = mark.find(f"{SVG}title")
    assert title is not None and (title.text or "").startswith(hostile.replace("\x01", "\ufffd") + " · " + runtime)


def test_nothing_to_plot() -> None:
    assert quality_plot([]) == quality_plot([])
    empty = quality_plot([])
    assert empty.svg is None and empty.not_plotted == ()
    broken = quality_plot([point("a", 100, math.nan), point("b", 100, None), point("c", 0, 0.1)])
    assert broken.svg is None
    assert broken.not_plotted == (
        "a (llama.cpp): KL divergence is NaN",
        "b (llama.cpp): no KL divergence reported",
        "c (llama.cpp): size is 0 B",
    )


def test_one_mark_sits_inside_a_decade_each_way() -> None:
    layout = layout_of([point("only", 1 * MiB, 1e-3)])
    (mark,) = layout.marks
    assert mark.on_front and [m.point.artifact for m in layout.front] == ["only"]
    assert [t.label for t in layout.x_ticks] == ["100 KiB", "1 MiB", "10 MiB"]
    assert [t.label for t in layout.y_ticks] == ["1e-4", "0.001", "0.01"]
    assert math.isclose(mark.x, layout.x_ticks[1].at) and math.isclose(mark.y, layout.y_ticks[1].at)
    svg = svg_of([point("only", 1 * MiB, 1e-3)])
    assert svg.find(f"{SVG}polyline") is None  # a front of one point is no line


def test_identical_sizes_and_non_finite_metrics() -> None:
    points = [
        point("q4", 4 * GiB, 0.02, runtime="llama.cpp"),
        point("q4", 4 * GiB, 0.01, runtime="vllm"),
        point("q4", 4 * GiB, math.inf, runtime="jax"),
        point("q8", 8 * GiB, -math.inf, runtime="jax"),
    ]
    plot = quality_plot(points)
    assert plot.svg is not None
    assert plot.not_plotted == ("q4 (jax): KL divergence is +inf", "q8 (jax): KL divergence is -inf")
    layout = layout_of(points)
    assert len({m.x for m in layout.marks}) == 1  # one size: one column of marks, not a division by zero
    assert [(m.point.runtime, m.on_front) for m in layout.marks] == [("llama.cpp", False), ("vllm", True)]


def test_kl_below_the_floor_is_drawn_at_it_and_said_so() -> None:
    points = [point("bf16", 16 * GiB, 0.0), point("fp8", 8 * GiB, 1e-9), point("q4", 4 * GiB, -1e-12)]
    layout = layout_of(points)
    assert all(m.clamped for m in layout.marks) and len({m.y for m in layout.marks}) == 1
    assert layout.y_ticks[0].label == "1e-7" and math.isclose(layout.marks[0].y, layout.y_ticks[0].at)
    assert pareto_front(points) == (points[2],)  # the truth decides the front, not the clamped drawing
    svg = quality_plot(points).svg
    assert svg is not None and f"below {KL_FLOOR:g} drawn at {KL_FLOOR:g}" in svg
    assert "KL 0 (drawn at 1e-07)" in svg


@pytest.mark.parametrize(
    ("low", "high", "labels"),
    [
        (600, 800, ["100 B", "1 KiB"]),
        (300 * MiB, 15 * GiB, ["100 MiB", "1 GiB", "10 GiB", "100 GiB"]),
        (10, 400 * GiB, ["1 B", "1 KiB", "1 MiB", "1 GiB", "1 TiB"]),  # many decades: whole units only
    ],
)
def test_size_ticks_are_round_binary_sizes(low: int, high: int, labels: list[str]) -> None:
    layout = layout_of([point("small", low, 0.1), point("large", high, 0.01)])
    assert [t.label for t in layout.x_ticks] == labels
    assert len(layout.x_ticks) <= MAX_TICKS
    ats = [t.at for t in layout.x_ticks]
    assert ats == sorted(ats) and ats[0] >= LEFT - 1e-6 and ats[-1] <= WIDTH - RIGHT + 1e-6
