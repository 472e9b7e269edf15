"""Terminal output for the CLI: progress bars and stage lines on stderr, so stdout stays clean for --json."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from rich.console import Console
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
    from pipeline.executors.local import NodeOutcome
    from pipeline.stage import Node

err = Console(stderr=True, width=None if sys.stderr.isatty() else 120)


class ProgressReporter:
    """Shows one progress bar per running stage and one line per finished stage."""

    def __init__(self, console: Console = err, quiet: bool = False):
        self.console = console
        self.quiet = quiet
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def start(self, node: Node, key: str) -> None:
        if self.quiet:
            return
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeElapsedColumn(),
            console=self.console,
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
        if self.quiet:
            return
        key = (outcome.key or "")[:12]
        if outcome.status == "cached":
            self.console.print(f"[dim]= {outcome.node.id:<28} cached  {key}[/dim]")
        elif outcome.status in ("built", "ran"):
            self.console.print(
                f"[green]+ {outcome.node.id:<28} {outcome.status:<7} {key} in {outcome.seconds:.1f}s[/green]"
            )
        else:
            self.console.print(f"[yellow]~ {outcome.node.id:<28} deferred: {outcome.reason}[/yellow]")
