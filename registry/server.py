"""Run the registry as a server, configured for throughput (what `kiln serve` should call).

    python -m kiln.registry.server --host 0.0.0.0 --port 8000 --workers 2

uvloop + httptools: plain asyncio does not set TCP_NODELAY and adds a ~40 ms floor per request.
After startup the heap is frozen out of the garbage collector's reach (`gc.freeze`) and young
collections are made rarer, so the collector does not pause every few hundred resolves to walk
the ~100k long-lived objects of the framework; and a thread holds the interpreter lock for 1 ms at a
time, not 5, so the event loop is not starved while a large request body is parsed beside it.
Settings come from `KILN_REGISTRY_*`.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile

import uvicorn
from fastapi import FastAPI

from kiln.registry.app import create_app
from kiln.registry.ops.logs import log_config


def create_server_app() -> FastAPI:
    """`create_app()` from the environment, with the garbage collector tuned for a long-running server."""
    app = create_app()
    app.openapi()  # build the schema now: it is long-lived too
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)
    # A thread parsing a large request body hands the interpreter back to the event loop within 1 ms
    # (not 5): a request needs it several times, so /healthz and the rest stay prompt meanwhile.
    sys.setswitchinterval(0.001)
    return app


def serve(host: str = "127.0.0.1", port: int = 8000, workers: int = 1, log_level: str = "info") -> None:
    """Serve until interrupted; each worker process builds its app from the environment.

    Logs are JSON lines on stderr (one access line per request, with its request id). With several
    workers, Prometheus values go to a shared directory so `/metrics` reports all of them.
    """
    if workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="kiln-metrics-")
    uvicorn.run(
        "kiln.registry.server:create_server_app",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        loop="uvloop",
        http="httptools",
        log_level=log_level,
        log_config=log_config(log_level),
        access_log=False,  # the registry writes its own, structured, access line
    )


def _main() -> None:
    parser = argparse.ArgumentParser(prog="python -m kiln.registry.server", description="Serve the kiln registry.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args()
    serve(args.host, args.port, args.workers, args.log_level)


if __name__ == "__main__":
    _main()
