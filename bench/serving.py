"""What the HTTP benchmarks share: `kiln serve` on a free loopback port, the best time of a command, a random
input file, and the time to sha256 it (the ceiling of anything that must read and hash those bytes)."""

from __future__ import annotations

import contextlib
import hashlib
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


def random_file(path: Path, size_mib: int) -> str:
    """Write `size_mib` MiB of random bytes to `path`; their sha256."""
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for _ in range(size_mib):
            chunk = os.urandom(1 << 20)
            digest.update(chunk)
            f.write(chunk)
    return digest.hexdigest()


def sha256_seconds(path: Path, repeat: int) -> float:
    """The best time of sha256 over `path` with Python's hashlib (OpenSSL), in a fresh process."""
    hashing = f"import hashlib; h = hashlib.sha256(); f = open({str(path)!r}, 'rb')\n"
    hashing += "while b := f.read(8 << 20): h.update(b)"
    return best_seconds([sys.executable, "-c", hashing], repeat)
