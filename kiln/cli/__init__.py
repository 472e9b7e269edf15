"""The `kiln` command line, one module per command group, on top of every other layer.

build (build, plan, run-stage, publish, inspect) · lint (lint) · releases (seal, abandon, promote, split, yank, resolve,
audit) · hardware (hardware list/set/delete, performance) · routing (routing render) · tokens · signing (verify,
keys) · runtimes (runtime install, list) · server (serve, modelcar-base, db upgrade, gc).
`main` exits with the exit status of a kiln error's kind (`core.error_codes.Kind`).
"""

from __future__ import annotations

import sys

import typer

from kiln.cli.common import app, emit, json_requested
from kiln.console import err, safe_text
from kiln.core.errors import KilnError

__all__ = ["app", "main"]

# Loading the commands reads kiln's data files (the hardware catalog, extended by the file KILN_HARDWARE_CATALOG
# names): `main` reports a bad one as it reports any kiln error, not as a traceback from an import.
_load_error: KilnError | None = None
try:
    from kiln.cli import build, hardware, lint, releases, routing, runtimes, server, signing, tokens  # noqa: F401 - each registers its commands
except KilnError as e:
    _load_error = e


def main() -> None:
    try:
        if _load_error is not None:
            raise _load_error
        # Without standalone mode click returns (not raises) the code of a typer.Exit.
        code = app(standalone_mode=False)
        sys.exit(code if isinstance(code, int) else 0)
    except KilnError as e:
        err.print(f"[red]error[/red] {safe_text(f'[{e.code}]')} {safe_text(e.message)}")
        if "log" in e.details:  # a stage failed: where its log is (ending with the traceback), what it printed last
            err.print(f"[dim]its log, with the traceback: {safe_text(e.details['log'])}[/dim]")
            if e.details.get("log_tail"):
                err.print("[dim]what the stage printed last:[/dim]")
            for line in e.details.get("log_tail", []):
                err.print(f"[dim]  {safe_text(line)}[/dim]")
        if json_requested():
            emit({"error": e.to_dict()})
        sys.exit(e.kind.exit_status)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        sys.exit(130)
    except Exception as e:
        # Usage errors (typer's own copy of click's ClickException): print the usage line, exit 2.
        show, exit_code = getattr(e, "show", None), getattr(e, "exit_code", None)
        if callable(show) and isinstance(exit_code, int):
            show()
            sys.exit(exit_code)
        raise
