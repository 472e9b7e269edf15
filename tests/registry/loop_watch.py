"""Serve the registry as `registry.server` builds it, watching its event loop for blocking work.

    python -m tests.registry.loop_watch PORT [THRESHOLD_S]

Settings come from `KILN_REGISTRY_*`. Two reports, one line each on stdout, so the test reading them
knows when and where:

- `BLOCKING <unix time> <call> <where>`: the loop's thread called into the database (a statement, a
  commit or rollback, a pool checkout, the resolve cache's own cursor) or opened a file. Exact, whatever
  the machine's load: the registry's rule is that none of these run on the loop.
- `SLOW <unix time> <seconds held> <callback>`: a callback (a task's step, a protocol's data callback:
  each is an `asyncio.Handle`) held the loop over the threshold, as asyncio's debug mode reports them
  (`slow_callback_duration`), less the time the thread was runnable but not running (the kernel's
  `/proc/thread-self/schedstat`), so another process taking the CPU does not count. The interpreter
  lock still does: where the machine is oversubscribed a thread holding it may be descheduled.

Plain asyncio, not uvloop: its callbacks are Python objects that can be timed.
"""

from __future__ import annotations

import asyncio
import builtins
import os
import sqlite3
import sys
import time
import traceback
from types import CodeType, FrameType
from typing import Any

import psycopg
import uvicorn
from sqlalchemy.engine.base import Connection
from sqlalchemy.pool.base import _ConnectionFairy

from kiln.registry.ops.logs import log_config
from kiln.registry.server import create_server_app

# Python entry points of database work: every SQLAlchemy statement, commit, rollback and pool checkout,
# and psycopg's own (the resolve cache's cursor is a bare DBAPI one).
_BLOCKING_CODE: dict[CodeType, str] = {
    Connection._execute_context.__code__: "sqlalchemy statement",
    Connection._commit_impl.__code__: "sqlalchemy commit",
    Connection._rollback_impl.__code__: "sqlalchemy rollback",
    _ConnectionFairy._checkout.__func__.__code__: "connection pool checkout",  # type: ignore[attr-defined]
    psycopg.Cursor.execute.__code__: "psycopg execute",
    psycopg.Connection.commit.__code__: "psycopg commit",
    psycopg.Connection.rollback.__code__: "psycopg rollback",
}
_OPEN = builtins.open
_SQLITE = (sqlite3.Cursor, sqlite3.Connection)
_SQLITE_CALLS = {"execute", "executemany", "executescript", "commit", "rollback"}


def _where(frame: FrameType | None) -> str:
    """Where the blocking call was made, innermost first: its caller, then the registry's own frames."""
    stack = [f for f in traceback.extract_stack(frame, limit=40) if "loop_watch" not in f.filename]
    shown = stack[-2:] + [f for f in stack[:-2] if "/registry/" in f.filename][-3:]
    return " < ".join(f"{'/'.join(f.filename.split('/')[-2:])}:{f.lineno} {f.name}" for f in reversed(shown))


def watch_blocking_calls() -> None:
    """Report every database call or file opened on this thread (the loop's) from now on."""

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        what = None
        if event == "call":
            what = _BLOCKING_CODE.get(frame.f_code)
        elif event == "c_call":
            if arg is _OPEN:
                what = "open"
            elif isinstance(getattr(arg, "__self__", None), _SQLITE) and arg.__name__ in _SQLITE_CALLS:
                what = f"sqlite3 {arg.__name__}"
        if what is not None:
            print(f"BLOCKING {time.time():.3f} {what} {_where(frame)}", flush=True)

    sys.setprofile(profile)


def _runnable_waiting_s(schedstat: int) -> float:
    """Seconds this thread has spent runnable but waiting for a CPU (schedstat's second field)."""
    return int(os.pread(schedstat, 128, 0).split()[1]) / 1e9


def watch_callbacks(threshold_s: float) -> None:
    """Time every asyncio callback run on this thread from now on; a SLOW line for each held over `threshold_s`."""
    schedstat = os.open("/proc/thread-self/schedstat", os.O_RDONLY)  # this thread's: the loop's
    run = asyncio.events.Handle._run

    def timed_run(handle: Any) -> None:
        started, waited = time.perf_counter(), _runnable_waiting_s(schedstat)
        try:
            run(handle)
        finally:
            held = time.perf_counter() - started - (_runnable_waiting_s(schedstat) - waited)
            if held > threshold_s:
                print(f"SLOW {time.time():.3f} {held:.3f} {handle!r}", flush=True)

    asyncio.events.Handle._run = timed_run  # type: ignore[method-assign,assignment]


def main(port: int, threshold_s: float) -> None:
    app = create_server_app()
    watch_callbacks(threshold_s)
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        loop="asyncio",
        http="httptools",
        log_level="warning",
        log_config=log_config("warning"),  # errors as `kiln serve` logs them, on stderr
        access_log=False,
    )
    server = uvicorn.Server(config)
    watch_blocking_calls()  # after the app is built: startup connects and migrates, before any request
    server.run()


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 0.05)
