"""`kiln runtime install|list`: the environments of runtimes that cannot share kiln's own (vLLM)."""

from __future__ import annotations

from typing import Annotated

import typer
from pydantic import BaseModel, Field

from kiln.cli.common import JsonOpt, answer, emit, runtime_app
from kiln.console import err, safe_text, stdout


@runtime_app.command("install")
def runtime_install(
    name: Annotated[str, typer.Argument(help="The runtime, e.g. vllm.")],
    variant: Annotated[
        str, typer.Option(help="auto (CUDA where a GPU is visible, else the CPU build), cpu or cuda.")
    ] = "auto",
    as_json: JsonOpt = False,
) -> None:
    """Install a runtime's pinned environment (once; later calls find it), under KILN_RUNTIMES."""
    from kiln.eval.runtimes import environments

    env = environments.for_install(name, variant)
    installed = environments.install(env.name, say=lambda line: err.print(safe_text(line)))
    answer(
        {"name": name, "path": str(installed.path), **installed.record.model_dump(mode="json")},
        as_json,
        f"{installed.env.label}: {installed.python}",
    )


@runtime_app.command("list")
def runtime_list(as_json: JsonOpt = False) -> None:
    """Every runtime environment kiln knows, and whether (and where) it is installed."""
    from kiln.eval.runtimes import environments

    rows = [
        RuntimeRow(
            name=name,
            label=env.label,
            runtime=env.serves,
            accelerator=env.accelerator,
            installed=found is not None,
            path=str(found.path if found else environments.environment_dir(env)),
            bytes=found.record.bytes if found else None,
        )
        for name, env in environments.ENVIRONMENTS.items()
        for found in [environments.find(name)]
    ]
    if as_json:
        emit(rows)
        return
    for r in rows:
        state = f"installed, {r.bytes / 2**30:.1f} GiB" if r.bytes is not None else "not installed"
        stdout.print(safe_text(f"{r.name:<10} {r.label}: {state} ({r.path})"))


class RuntimeRow(BaseModel):
    """A runtime environment kiln knows, as `kiln runtime list` shows it."""

    name: str
    label: str
    runtime: str
    accelerator: str
    installed: bool
    path: str
    bytes: int | None = Field(description="its size on disk, where installed")
