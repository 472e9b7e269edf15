"""Terminal output for the CLI: progress bars and stage lines on stderr, so stdout stays clean for --json.

Everything the CLI prints goes through the two consoles here (`err`, `stdout`). Text that comes from
data (tensor names, metadata, config values, error messages that quote input, registry answers)
goes through `safe_text` first: rich would otherwise read `[/red]` in it as markup (or fail on it),
and a file's metadata could send escape sequences to the terminal.
"""

from __future__ import annotations

import os
import re
import sys
from typing import TYPE_CHECKING, TextIO

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)

if TYPE_CHECKING:
    from kiln.pipeline.executors.node import NodeOutcome
    from kiln.pipeline.stage import Node

# Not a terminal (a CI log, a file): wide enough for `kiln plan`'s table to keep each row on one line.
err = Console(stderr=True, width=None if sys.stderr.isatty() else 160, emoji=False)
# stdout: what scripts read (secrets, resolve answers, inspect metadata): no wrapping, no highlighting.
stdout = Console(soft_wrap=True, highlight=False, emoji=False)

# C0 and C1 control characters (escape sequences, bell, carriage return, newline), Unicode line
# separators and the bidirectional overrides that can make printed text read differently than it is.
_UNSAFE_CHARS = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def safe_text(value: object) -> str:
    """Data as text to print through a rich console: unsafe characters shown escaped, markup escaped.

    `"\\x1b[2J"` comes out as the six characters `\\x1b[2J`, `"[/red]"` as `[/red]`; use the result
    inside markup strings (`err.print(f"[red]error[/red] {safe_text(message)}")`) and table cells.
    """
    text = value if isinstance(value, str) else str(value)
    text = _UNSAFE_CHARS.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)
    return escape(text)


def _terminal(console: Console) -> tuple[Console, TextIO | None]:
    """A console writing where `console` writes now, through its own copy of the file descriptor.

    While a stage runs, the executor points descriptors 1 and 2 at the stage's log; the progress bar
    must keep drawing on the terminal. Where the stream has no descriptor (a test's capture), the
    console itself is used.
    """
    try:
        fd = console.file.fileno()
    except (AttributeError, OSError, ValueError):
        return console, None
    stream = os.fdopen(os.dup(fd), "w", buffering=1, encoding="utf-8", errors="replace")
    return Console(file=stream, width=console.width, force_terminal=console.is_terminal, emoji=False), stream


class ProgressReporter:
    """Shows one progress bar per running stage and one line per finished stage."""

    def __init__(self, console: Console = err, quiet: bool = False):
        self.console = console
        self.quiet = quiet
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._stream: TextIO | None = None

    def start(self, node: Node, key: str) -> None:
        if self.quiet or not self.console.is_terminal:  # a bar redrawn in a log file or a pipe is noise
            return
        terminal, self._stream = _terminal(self.console)
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeElapsedColumn(),
            console=terminal,
            transient=True,
        )
        self._progress.start()
        self._task = self._progress.add_task(node.id, total=None)

    def progress(self, advance: int, total: int | None) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, advance=advance, total=total)

    def finish(self, outcome: NodeOutcome) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        if self.quiet:
            return
        key = safe_text((outcome.key or "")[:12])
        node = safe_text(f"{outcome.node.id:<28}")
        if outcome.status == "cached":
            self.console.print(f"[dim]= {node} cached  {key}[/dim]")
        elif outcome.status in ("built", "ran"):
            self.console.print(f"[green]+ {node} {outcome.status:<7} {key} in {outcome.seconds:.1f}s[/green]")
        elif outcome.status == "failed":
            self.console.print(f"[red]x {node} failed: {safe_text(outcome.reason)}[/red]")
        elif outcome.status == "cancelled":
            self.console.print(f"[red]- {node} cancelled: {safe_text(outcome.reason)}[/red]")
        else:
            self.console.print(f"[yellow]~ {node} deferred: {safe_text(outcome.reason)}[/yellow]")
