"""`kiln lint`: check artifact directories against what their runtimes load, without running a model.

Each artifact is checked by its target's lint (`targets.lint`): its scales, quantized head, expert layouts,
metadata and every tensor its config implies. Findings print one a line (code, tensor or key, what is
wrong); any error-level finding exits 2 (bad input, `kiln.cli.common`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from kiln.cli.common import EXIT_INVALID_INPUT, JsonOpt, app, emit
from kiln.console import err, safe_text, stdout

ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        help="config.json (or the directory holding it) of the model the artifacts were made from: their metadata "
        "and tensors are checked against it too (a GGUF file carries no config.json of its own).",
        show_default=False,
    ),
]
TargetOpt = Annotated[
    str | None,
    typer.Option("--target", help="Lint as this target's artifact (default: chosen by the files).", show_default=False),
]


def _source_shape(path: Path | None) -> Any:
    if path is None:
        return None
    from kiln.core.datafile import read_data_bytes
    from kiln.core.untrusted import loads_json
    from kiln.formats.architectures.shape import ModelShape

    file = path / "config.json" if path.is_dir() else path
    return ModelShape.from_config(loads_json(read_data_bytes(file, "--config (a model's config.json)"), what=str(file)))


@app.command()
def lint(
    artifacts: Annotated[list[Path], typer.Argument(help="artifact directories (or .gguf files)", show_default=False)],
    config: ConfigOpt = None,
    target: TargetOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Check artifacts against what their runtimes load: scales (zero, NaN, inf, missing), a quantized lm_head,
    per-expert vs stacked layouts, layer_types / sliding window / rope / experts metadata, every tensor's
    presence, dtype and shape. Exits 2 on any error-level finding."""
    from kiln.targets.lint import lint_artifact

    shape = _source_shape(config)
    reports = [lint_artifact(path, shape=shape, target=target) for path in artifacts]
    errors = sum(len(r.errors) for r in reports)
    if as_json:
        emit({"ok": errors == 0, "errors": errors, "artifacts": [r.to_json() for r in reports]})
    else:
        for r in reports:
            for f in r.findings:
                where = f" ({f.file})" if f.file else ""
                colour = "red" if f.severity == "error" else "yellow"
                stdout.print(
                    f"[{colour}]{f.severity:<7}[/{colour}] {safe_text(f.code):<22} {safe_text(f.subject)}: "
                    f"{safe_text(f.message)}{safe_text(where)}"
                )
            verdict = "[green]ok[/green]" if r.ok else "[red]refused[/red]"
            err.print(
                f"{safe_text(r.artifact)}: {r.format} {verdict}: {len(r.errors)} error(s), {len(r.warnings)} "
                f"warning(s); {r.tensors} tensors, {r.scales} scale tensors read ({r.scale_bytes} bytes)"
            )
    if errors:
        raise typer.Exit(EXIT_INVALID_INPUT)
