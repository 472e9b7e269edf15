"""What the HTTP benchmarks share: `kiln serve` on a free loopback port, and the best time of a command."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def best_seconds(command: list[str], repeat: int, before: Callable[[], object] | None = None) -> float:
    """The fastest of `repeat` runs of `command` (calling `before()` first, untimed, each time)."""
    best = float("inf")
    for _ in range(repeat):
        if before is not None:
            before()
        t0 = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        best = min(best, time.perf_counter() - t0)
    return best


@contextlib.contextmanager
def kiln_serve(data: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """`kiln serve` of the embedded registry in `data` (with `env` added), until it answers /healthz;
    yields its base URL and stops it after."""
    sys.path.insert(0, str(ROOT))
    from tests.registry.s3_server import free_port

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "kiln", "serve", "--port", str(port)],
        env={**os.environ, "KILN_REGISTRY_DATA_DIR": str(data), **(env or {})},
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    host = f"http://127.0.0.1:{port}"
    try:
        for _ in range(150):
            if subprocess.run(["curl", "-sf", f"{host}/healthz"], capture_output=True).returncode == 0:
                break
            time.sleep(0.2)
        yield host
    finally:
        server.terminate()
        server.wait(timeout=30)
