"""The release page in a real browser: headless Chromium against a live server on a loopback port.

Chromium is Debian's `chromium` package (CI's `.ci/run` installs it). Without it these tests skip,
unless KILN_REQUIRE_CHROMIUM=1 (set by CI) makes that a failure. Screenshots go to tmp_path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from tests.registry.helpers import serve_in_thread
from tests.registry.pages import parse, seed

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
