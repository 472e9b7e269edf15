"""The release and fit pages in a real browser: headless Chromium against a live server on a loopback port.

Chromium is Debian's `chromium` package (CI's `.ci/run` installs it). Without it these tests skip,
unless KILN_REQUIRE_CHROMIUM=1 (set by CI) makes that a failure. Screenshots go to tmp_path, and those
worth looking at also to KILN_SCREENSHOT_DIR when it is set (docs/img/fit-explorer.png is
`test_fit_explorer_figure`'s, made with KILN_SCREENSHOT_DIR=docs/img).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from kiln.registry.web.bars import COLOURS
from tests.registry.helpers import serve_in_thread
from tests.registry.pages import FLEET_MODEL, parse, seed, seed_fleet

WIDTH, HEIGHT = 2000, 900  # wide enough to show the failed llama.cpp cells, past vLLM's group
# One browser test is enough per deployment shape; the pages' HTML is tested on both databases in test_web.py.
pytestmark = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


@pytest.fixture
def chromium() -> str:
    path = shutil.which("chromium") or "/usr/bin/chromium"
    if not os.access(path, os.X_OK):
        message = "chromium is not installed (apt-get install -y chromium)"
        if os.environ.get("KILN_REQUIRE_CHROMIUM") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture
def live(app: FastAPI, client: TestClient) -> Iterator[str]:
    """The seeded app served by uvicorn on a free loopback port."""
    seed(client)
    with serve_in_thread(app) as port:
        yield f"http://127.0.0.1:{port}"


def run_chromium(chromium: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Headless Chromium with its own profile directory (runs beside other browsers on this machine)."""
    command = [
        chromium,
        "--headless=new",
        "--no-sandbox",  # root in a container: the sandbox cannot start
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        *args,
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def greenish(rgb: tuple[int, int, int]) -> bool:
    r, g, b = rgb
    return g - r >= 25 and g - b >= 15


def reddish(rgb: tuple[int, int, int]) -> bool:
    r, g, b = rgb
    return r - g >= 40 and r - b >= 40


def test_release_page_screenshot(live: str, chromium: str, tmp_path: Path) -> None:
    from PIL import Image

    shot = tmp_path / "release.png"
    url = f"{live}/ui/models/tiny/releases/2.0"
    run_chromium(chromium, tmp_path / "profile", f"--screenshot={shot}", f"--window-size={WIDTH},{HEIGHT}", url)
    assert shot.is_file() and shot.stat().st_size > 0
    with Image.open(shot) as image:
        assert image.format == "PNG" and image.size == (WIDTH, HEIGHT)
        counted = image.convert("RGB").getcolors(maxcolors=WIDTH * HEIGHT)
    assert counted is not None
    colours: dict[tuple[int, int, int], int] = {colour: n for n, colour in counted}  # type: ignore[misc]  # RGB: 3-tuples
    pixels = WIDTH * HEIGHT
    # Not blank: text, tables and coloured cells, not one flat colour (an error page or an empty render).
    assert len(colours) > 50, f"only {len(colours)} distinct colours"
    non_white = sum(n for c, n in colours.items() if min(c) < 245)
    assert non_white > 0.05 * pixels, f"{non_white} non-white pixels of {pixels}"
    # Passed cells are green and failed ones red, each a sizeable area (not just anti-aliased text).
    green = sum(n for c, n in colours.items() if greenish(c))
    red = sum(n for c, n in colours.items() if reddish(c))
    assert green > 5_000, f"{green} greenish pixels"
    assert red > 5_000, f"{red} reddish pixels"


def test_release_page_dom(live: str, chromium: str, tmp_path: Path) -> None:
    url = f"{live}/ui/models/tiny/releases/2.0"
    dom = parse(run_chromium(chromium, tmp_path / "profile", "--dump-dom", url).stdout)
    matrix = dom.find("table", id="matrix")
    rows = {tr.attrs["data-artifact"]: tr for tr in matrix.find("tbody").find_all("tr")}
    assert {name: tr.attrs["data-status"] for name, tr in rows.items()} == {
        "gguf-q4_0": "failed",
        "gguf-q8_0": "passed",
        "hf-bundle-bf16": "passed",
        "trtllm-fp8": "not_evaluated",
    }
    states = {
        name: [
            (td.attrs["data-runtime"], td.attrs["data-state"]) for td in tr.find_all("td") if "data-state" in td.attrs
        ]
        for name, tr in rows.items()
    }
    gated = ["pass", "pass", "pass", "ungated"]
    assert states == {
        "gguf-q4_0": [("llama.cpp", s) for s in ("fail", "fail", "pass", "ungated")],
        "gguf-q8_0": [("llama.cpp", s) for s in gated],
        "hf-bundle-bf16": [("transformers", s) for s in gated] + [("vllm", s) for s in gated],
        "trtllm-fp8": [],
    }
    # Every row has a cell in every runtime's group: the browser kept the table rectangular.
    assert {len(tr.find_all("td", data_runtime="vllm")) for tr in rows.values()} >= {1}
    assert "not evaluated here: needs a runner with tensorrt_llm" in rows["trtllm-fp8"].text
    # The browser parsed the escaped reason as text: no script element made it into the document.
    assert dom.find_all("script") == []
    assert len(matrix.find_all("a", class_="download")) == 6  # 2.0 is sealed and served
    # The inline SVG reached the document as SVG: one mark per eval with metrics.
    assert len(dom.find("svg", class_="quality-plot").find_all("g", class_="mark")) == 4


def test_release_page_full_length(live: str, chromium: str, tmp_path: Path) -> None:
    """The whole page (matrix, plot, lineage, provenance) renders at a laptop's width without widening it:
    the matrix scrolls inside its wrapper. Saved under KILN_SCREENSHOT_DIR when set, to look at."""
    from PIL import Image

    shot = tmp_path / "release-full.png"
    url = f"{live}/ui/models/tiny/releases/2.0"
    run_chromium(chromium, tmp_path / "profile", f"--screenshot={shot}", f"--window-size={WIDTH},2200", url)
    with Image.open(shot) as image:
        assert image.size == (WIDTH, 2200)
        rgb = image.convert("RGB")
        # The plot's marks are drawn in its palette's blue and orange somewhere below the matrix.
        counted = rgb.getcolors(maxcolors=WIDTH * 2200)
    assert counted is not None
    colours = {colour for _, colour in counted}  # type: ignore[misc]  # RGB: 3-tuples
    assert (0x00, 0x72, 0xB2) in colours and (0xE6, 0x9F, 0x00) in colours
    if where := os.environ.get("KILN_SCREENSHOT_DIR"):
        shutil.copyfile(shot, Path(where) / "release-page-full.png")


@pytest.fixture
def live_fleet(app: FastAPI, client: TestClient) -> Iterator[str]:
    """The fleet release (pages.seed_fleet) served by uvicorn on a free loopback port."""
    seed_fleet(app, client)
    with serve_in_thread(app) as port:
        yield f"http://127.0.0.1:{port}"


def rgb(colour: str) -> tuple[int, int, int]:
    return int(colour[1:3], 16), int(colour[3:5], 16), int(colour[5:7], 16)


def bar_rows(image: Any, colour: tuple[int, int, int], run: int) -> list[int]:
    """The rows of `image` holding `run` or more pixels of `colour` side by side: where a bar of it is drawn."""
    width, height = image.size
    pixels = image.load()
    rows = []
    for y in range(height):
        longest = current = 0
        for x in range(width):
            current = current + 1 if pixels[x, y] == colour else 0
            longest = max(longest, current)
        if longest >= run:
            rows.append(y)
    return rows


def bands(rows: list[int]) -> int:
    """How many separate horizontal bands (runs of consecutive rows) `rows` make."""
    return sum(1 for i, y in enumerate(rows) if i == 0 or rows[i - 1] != y - 1)


FIT_WIDTH, FIT_HEIGHT = 1600, 1100


def test_fit_explorer_draws_memory_bars(live_fleet: str, chromium: str, tmp_path: Path) -> None:
    """Two pools: every candidate's bar is drawn, its weights in blue and its KV cache in orange, and the
    one that does not fit (Q8_0 on the CPU) past its usable line in red."""
    from PIL import Image

    shot = tmp_path / "fit.png"
    url = f"{live_fleet}/ui/models/{FLEET_MODEL}/releases/1.0/fit?pool=h100:8&pool=cpu&context=8192&concurrency=4"
    run_chromium(chromium, tmp_path / "profile", f"--screenshot={shot}", f"--window-size={FIT_WIDTH},{FIT_HEIGHT}", url)
    if where := os.environ.get("KILN_SCREENSHOT_DIR"):
        shutil.copyfile(shot, Path(where) / "fit-two-pools.png")
    with Image.open(shot) as image:
        assert image.format == "PNG" and image.size == (FIT_WIDTH, FIT_HEIGHT)
        pixels = image.convert("RGB")
    # Five candidates (three bundles on h100, two GGUFs on the CPU): five bars, each a band of rows with a long
    # run of the weights colour; the legend's swatch (12 px) is too short to count.
    weights = bar_rows(pixels, rgb(COLOURS["weights"]), run=40)
    assert bands(weights) == 5, weights
    assert len(weights) >= 5 * 14  # each bar is 18 px high
    # KV cache sits beside the weights in each bar (8K × 4 of Llama-3-70B: 10 GiB per replica), plainly in the
    # four that fit; the fifth's is past its usable line, under the red.
    assert bands(bar_rows(pixels, rgb(COLOURS["kv"]), run=16)) == 4  # the legend swatch is 12 px wide
    # The one that does not fit is outlined in red past its usable line: the outline's top and bottom edges.
    assert bands(bar_rows(pixels, rgb(COLOURS["over"]), run=10)) == 2


def test_fit_explorer_figure(live_fleet: str, chromium: str, tmp_path: Path) -> None:
    """The page for the README (docs/img/fit-explorer.png): four pools (h200's bounds on its measured shares),
    cropped to the answer and the candidates and kept small (a 256-colour palette); written to KILN_SCREENSHOT_DIR
    when set."""
    from PIL import Image

    shot = tmp_path / "fit-full.png"
    query = "pool=h200:8&pool=h100:8&pool=mi300x:8&pool=cpu&context=8192&concurrency=4"
    url = f"{live_fleet}/ui/models/{FLEET_MODEL}/releases/1.0/fit?{query}"
    height = 1900  # ten candidates
    run_chromium(chromium, tmp_path / "profile", f"--screenshot={shot}", f"--window-size={FIT_WIDTH},{height}", url)
    figure = tmp_path / "fit-explorer.png"
    with Image.open(shot) as image:
        full = image.convert("RGB")
    rows = bar_rows(full, rgb(COLOURS["weights"]), run=40)
    assert bands(rows) == 10, rows  # h200, h100: three bundles each; mi300x: two; cpu: two GGUFs (Q2_K failed)
    cropped = full.crop((0, 0, FIT_WIDTH, min(max(rows) + 100, height)))  # the last row's text below its bar
    # A 256-colour palette keeps the bars' colours exact and the file small.
    cropped.quantize(colors=256, method=Image.Quantize.FASTOCTREE).save(figure, optimize=True)
    assert figure.stat().st_size < 300_000
    with Image.open(figure) as saved:
        counted = saved.convert("RGB").getcolors(maxcolors=FIT_WIDTH * height)
    assert counted is not None
    colours = {c for _, c in counted}  # type: ignore[misc]  # RGB: 3-tuples
    assert {rgb(COLOURS["weights"]), rgb(COLOURS["kv"])} <= colours
    if where := os.environ.get("KILN_SCREENSHOT_DIR"):
        shutil.copyfile(figure, Path(where) / "fit-explorer.png")
