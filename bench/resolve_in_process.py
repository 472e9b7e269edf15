"""Benchmark: what one warm `GET /v1/resolve` costs the registry app itself, with no server around it.

    python bench/resolve_in_process.py [--calls 5000] [--repeats 5]

Seeds the same registry as `registry_resolve.py` (two sealed releases of a Llama-3-8B config, prod split
95/5), builds the app as `kiln serve` does (`registry.server.create_server_app`: its logging with the
access line to /dev/null, multiprocess Prometheus values, the collector frozen) and calls it on uvloop
with that benchmark's question and a read token, `--calls` times per repeat, after 2,000 warm-up calls.
Prints the CPU time per call (`time.process_time`) of each repeat and the best. No target: it tells
where a worker's time goes apart from uvicorn, httptools and the kernel, which `registry_resolve.py`
measures whole; run it at two commits, alternating, to compare them.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging.config
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from record import add_record_argument, run_record, save_record  # bench/record.py, beside this script
from registry_resolve import PATH, seed  # the same registry and question

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


async def measure(app: Any, token: str, calls: int, repeats: int) -> list[float]:
    path, _, query = PATH.partition("?")
    headers = [
        (b"host", b"127.0.0.1:8000"),
        (b"authorization", f"Bearer {token}".encode()),
        (b"user-agent", b"wrk"),
        (b"accept", b"*/*"),
    ]
    statuses: list[int] = []

    def scope() -> dict[str, Any]:
        return {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 40000), "scheme": "http", "method": "GET",
            "root_path": "", "path": path, "raw_path": path.encode(), "query_string": query.encode(),
            "headers": list(headers), "state": {},
        }  # fmt: skip

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    started: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    incoming: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    await incoming.put({"type": "lifespan.startup"})
    lifespan = asyncio.create_task(
        app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, incoming.get, started.put)
    )
    await started.get()
    for _ in range(2000):
        await app(scope(), receive, send)
    if set(statuses) != {200}:
        raise SystemExit(f"resolve answered {sorted(set(statuses))}, not 200")
    per_call = []
    for _ in range(repeats):
        began = time.process_time()
        for _ in range(calls):
            await app(scope(), receive, send)
        per_call.append((time.process_time() - began) / calls * 1e6)
    await incoming.put({"type": "lifespan.shutdown"})
    await lifespan
    return per_call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--repeats", type=int, default=5)
    add_record_argument(ap, "resolve_in_process")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "registry"
        token = seed(data)
        os.environ.update(
            KILN_REGISTRY_DATA_DIR=str(data),
            KILN_REGISTRY_ANONYMOUS_READ="false",
            PROMETHEUS_MULTIPROC_DIR=str(Path(tmp) / "metrics"),
        )
        (Path(tmp) / "metrics").mkdir()
        import uvloop

        from kiln.registry.ops.logs import log_config
        from kiln.registry.server import create_server_app

        with open(os.devnull, "w") as devnull:
            saved, sys.stderr = sys.stderr, devnull  # the access lines are written, to nowhere
            try:
                logging.config.dictConfig(log_config("info"))
                app = create_server_app()
                per_call = uvloop.run(measure(app, token, args.calls, args.repeats))
            finally:
                sys.stderr = saved
                gc.unfreeze()
    print(f"GET {PATH}: in process, CPU per call, {args.calls:,} calls x {args.repeats}")
    print("  " + "  ".join(f"{x:.1f}" for x in per_call) + f" us; best {min(per_call):.1f} us")
    save_record(run_record(path=PATH, calls=args.calls, per_call_us=per_call, best_us=min(per_call)), args.record)


if __name__ == "__main__":
    main()
