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

WIDTH, HEIGHT = 1280, 900
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
    groups = {g.attrs["data-artifact"]: g for g in matrix.find_all("tbody", class_="artifact")}
    assert {name: g.attrs["data-status"] for name, g in groups.items()} == {
        "gguf-q4_0": "failed",
        "gguf-q8_0": "passed",
        "hf-bundle-bf16": "not_evaluated",
        "trtllm-fp8": "not_evaluated",
    }
    states = {
        name: [td.attrs["data-state"] for td in g.find_all("td", class_="metric") if "data-state" in td.attrs]
        for name, g in groups.items()
    }
    assert states == {
        "gguf-q4_0": ["fail", "fail", "pass", "ungated"],
        "gguf-q8_0": ["pass", "pass", "pass", "ungated"],
        "hf-bundle-bf16": [],
        "trtllm-fp8": [],
    }
    assert "not evaluated here: needs a runner with tensorrt_llm" in groups["trtllm-fp8"].text
    # The browser parsed the escaped reason as text: no script element made it into the document.
    assert dom.find_all("script") == []
    assert len(matrix.find_all("a", class_="download")) == 6  # 2.0 is sealed and served
