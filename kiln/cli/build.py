"""`kiln build`, `kiln plan`, `kiln publish`, `kiln inspect`: the stage graph, run and shown.

The build's modules are imported when a command runs, so `kiln --help` and the registry commands start
without loading them."""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from kiln.cli.common import (
    DEFAULT_REGISTRY,
    DEFAULT_WORK,
    EXIT_GATE_FAILED,
    AllowOutsideOpt,
    ExecutorOpt,
    JsonOpt,
    RayAddressOpt,
    RegistryOpt,
    RetriesOpt,
    StoreOpt,
    WorkDirOpt,
    allowed_roots,
    answer,
    app,
    emit,
    fmt_size,
)
from kiln.console import ProgressReporter, err, safe_text, stdout
from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput

if TYPE_CHECKING:
    from kiln.pipeline.report import BuiltArtifact
    from kiln.pipeline.requirements import Requirements

DeviceOpt = Annotated[
    str,
    typer.Option(
        "--device",
        envvar="KILN_DEVICE",
        help="Where the compute stages (reference, calibration, transformers and JAX evals) run: auto (a GPU when "
        "one is visible, else the CPU), cpu, cuda or cuda:N. With --executor ray: a GPU Ray grants (cuda), or auto.",
    ),
]


ForceOpt = Annotated[
    bool,
    typer.Option(
        "--force",
        help="Start even when the stages to build would write more than the work dir's disk has free "
        "(otherwise refused: BUILD_DISK_INSUFFICIENT).",
    ),
]


def _device(spec: str, executor: Any = None) -> Any:
    """`--device`, parsed once (INVALID_DEVICE); checked against this machine for a local build
    (DEVICE_UNAVAILABLE), left to the cluster for Ray (`pipeline.executors.ray.RayExecutor.placement`)."""
    from kiln.core.device import parse_device, resolve_device

    if executor is not None and executor.name == "ray":
        return parse_device(spec) or "auto"
    return resolve_device(spec)


def _peak_rss_mib() -> float:
    # ru_maxrss is KiB on Linux; include finished children (llama.cpp's quantizer runs in-process).
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, kids) / 1024


def _artifact_table(rows: list[BuiltArtifact]) -> Table:
    """One line per artifact and runtime that evaluated it (an artifact's name on its first line only)."""
    table = Table(title="artifacts")
    for col in ("artifact", "size", "runtime", "eval", "ppl", "ppl Δ", "KL", "top-1", "greedy"):
        table.add_column(col, justify="left" if col in ("artifact", "runtime", "eval") else "right", no_wrap=True)
    for r in rows:
        lines = [(e.runtime, e.status, e.metrics) for e in r.evals] or [(r.runtime or "-", r.eval, r.metrics)]
        for i, (runtime, status, m) in enumerate(lines):
            colour = {"passed": "green", "failed": "red"}.get(status, "yellow")
            table.add_row(
                safe_text(r.artifact) if i == 0 else "",
                fmt_size(r.size) if i == 0 else "",
                safe_text(runtime),
                f"[{colour}]{safe_text(status)}[/{colour}]",
                f"{m.ppl:.3f}" if m is not None else "-",
                f"{m.ppl_change:+.2%}" if m is not None else "-",
                f"{m.kl:.2e}" if m is not None else "-",
                f"{m.top1:.4f}" if m is not None else "-",
                f"{m.greedy_match:.3f}" if m is not None and m.greedy_match is not None else "-",
            )
    return table


def _prepare_stages() -> None:
    """Before a stage runs here: cap oneDNN below the AMX some CPUs advertise but fault on, and show our progress
    bars and lines, not each library's (transformers draws one per model load, compressed-tensors one per
    decompression, both through tqdm, which honours TQDM_DISABLE). Set in the environment, which the libraries
    read when a stage first imports them: a build whose stages are all cached imports none of them."""
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _run_build(
    recipe_path: Path,
    work_dir: Path,
    store_url: str | None,
    registry: str | None,
    as_json: bool,
    allow_outside: list[Path] | None,
    executor: Any = None,
    device: Any = "cpu",
    force: bool = False,
) -> None:
    from kiln.pipeline import build
    from kiln.pipeline.recipe import load_recipe
    from kiln.pipeline.store import open_store

    started = time.time()
    _prepare_stages()
    recipe = load_recipe(recipe_path, allowed_roots=allowed_roots(allow_outside))
    store = open_store(store_url, work_dir)
    result = build.run(
        recipe,
        store,
        registry=registry,
        reporter=ProgressReporter(quiet=as_json),
        executor=executor,
        device=device,
        force=force,
    )
    summary = result.summary().model_copy(
        update={"seconds": round(time.time() - started, 2), "peak_rss_mib": round(_peak_rss_mib(), 1)}
    )
    report = work_dir.parent / "reports" / f"{recipe.model}-{recipe.version}.json"
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(json.dumps(summary.as_json(), indent=2, sort_keys=True))
    if as_json:
        emit(summary.as_json())
    else:
        err.print(_artifact_table(summary.artifacts))
        err.print(
            safe_text(
                f"{recipe.model}@{recipe.version}: {summary.stages} in {summary.seconds:.1f}s, "
                f"peak RSS {summary.peak_rss_mib:.0f} MiB; report: {report}"
            )
        )
        for item in summary.ignored:  # files in the source kiln left alone (pickle checkpoints, ...)
            err.print(f"[yellow]ignored[/yellow] {safe_text(item.path)} in the source: {safe_text(item.reason)}")
        for r in summary.artifacts:
            for failure in r.failures:
                err.print(f"[red]gate failed[/red] {safe_text(r.artifact)}: {safe_text(failure)}")
            for e in r.evals:
                if e.status == "not_evaluated" and e.reason:
                    where = f"{r.artifact} in {e.runtime}"
                    err.print(f"[yellow]not evaluated[/yellow] {safe_text(where)}: {safe_text(e.reason)}")
        # Deferred is not a failure: the work waits for a runner that has what this machine lacks.
        for d in summary.deferred:
            if d.runner is not None:
                command = "; ".join(" ".join(argv) for argv in d.command)
                err.print(
                    f"[yellow]deferred[/yellow] {safe_text(d.node)} to a runner with {safe_text(d.runner)}"
                    + (f": {safe_text(command)}" if command else "")
                )
    if result.failed_gates:
        raise typer.Exit(EXIT_GATE_FAILED)


@app.command()
def build(
    recipe: Path,
    work_dir: WorkDirOpt = DEFAULT_WORK,
    store: StoreOpt = None,
    executor: ExecutorOpt = "local",
    ray_address: RayAddressOpt = None,
    retries: RetriesOpt = 3,
    as_json: JsonOpt = False,
    allow_outside: AllowOutsideOpt = None,
    device: DeviceOpt = "cpu",
    force: ForceOpt = False,
) -> None:
    """Build and evaluate every artifact of RECIPE, reusing finished stages."""
    choice = _executor(executor, store, ray_address, retries)
    _run_build(recipe, work_dir, store, None, as_json, allow_outside, choice, _device(device, choice), force)


@app.command()
def publish(
    recipe: Path,
    registry: RegistryOpt = DEFAULT_REGISTRY,
    work_dir: WorkDirOpt = DEFAULT_WORK,
    store: StoreOpt = None,
    executor: ExecutorOpt = "local",
    ray_address: RayAddressOpt = None,
    retries: RetriesOpt = 3,
    as_json: JsonOpt = False,
    allow_outside: AllowOutsideOpt = None,
    signing_key: Annotated[
        Path | None,
        typer.Option(
            "--signing-key",
            envvar="KILN_SIGNING_KEY",
            help="PEM EC private key: sign each artifact (OpenSSF model signature) and its SLSA provenance "
            "($KILN_SIGNING_KEY_PASSWORD if encrypted).",
            show_default=False,
        ),
    ] = None,
    device: DeviceOpt = "cpu",
    force: ForceOpt = False,
) -> None:
    """Build (reusing finished stages) and publish every artifact of RECIPE with its eval results."""
    choice = _executor(executor, store, ray_address, retries)
    placed = _device(device, choice)
    if signing_key is not None:
        # The publish stages read it from the environment, as `kiln run-stage` on a CI runner does.
        os.environ["KILN_SIGNING_KEY"] = str(signing_key.resolve())
    _run_build(recipe, work_dir, store, registry, as_json, allow_outside, choice, placed, force)


def _executor(name: str, store: str | None, ray_address: str | None, retries: int) -> Any:
    from kiln.pipeline.build import ExecutorChoice

    if name not in ("local", "ray"):
        raise InvalidInput(f"--executor {name!r}: known executors are local and ray", code=Codes.UNKNOWN_EXECUTOR)
    if ray_address is not None and name != "ray":
        raise InvalidInput("--ray-address is for --executor ray")
    return ExecutorChoice(name=name, store_url=store, ray_address=ray_address, max_retries=retries)  # type: ignore[arg-type]


@app.command("run-stage")
def run_stage(
    recipe: Path,
    stage: Annotated[str, typer.Argument(help="the stage's id, as `kiln plan` lists it, e.g. export/gguf-q4_0")],
    work_dir: WorkDirOpt = DEFAULT_WORK,
    store: StoreOpt = None,
    registry: Annotated[
        str | None,
        typer.Option("--registry", envvar="KILN_REGISTRY", help="For publish/* and seal/* stages.", show_default=False),
    ] = None,
    as_json: JsonOpt = False,
    allow_outside: AllowOutsideOpt = None,
    device: DeviceOpt = "cpu",
) -> None:
    """Run one stage of RECIPE from the store (its inputs must be there): the unit a CI job runs."""
    placed = _device(device)
    from kiln.pipeline import build
    from kiln.pipeline.recipe import load_recipe
    from kiln.pipeline.store import open_store

    _prepare_stages()
    loaded = load_recipe(recipe, allowed_roots=allowed_roots(allow_outside))
    outcome = build.run_one(
        loaded,
        open_store(store, work_dir),
        stage,
        registry=registry,
        reporter=ProgressReporter(quiet=as_json),
        device=placed,
    )
    out = {
        "stage": stage,
        "status": outcome.status,
        "key": outcome.key,
        "digest": outcome.output.digest if outcome.output is not None else None,
        "seconds": round(outcome.seconds, 2),
        "reason": outcome.reason or None,
        **({"runner": outcome.details.get("runner")} if outcome.status == "deferred" else {}),
    }
    answer(out, as_json, f"{stage}: {outcome.status}" + (f" ({outcome.reason})" if outcome.reason else ""))


@app.command()
def plan(
    recipe: Path,
    work_dir: WorkDirOpt = DEFAULT_WORK,
    store: StoreOpt = None,
    as_matrix: Annotated[
        bool,
        typer.Option(
            "--matrix", help="Print the graph as JSON for a CI workflow: stages by level, with their runner labels."
        ),
    ] = False,
    github_output: Annotated[
        Path | None,
        typer.Option(
            "--github-output",
            metavar="FILE",
            help="With --matrix: also append level0=..., levelN=..., model=, version= to FILE ($GITHUB_OUTPUT).",
            show_default=False,
        ),
    ] = None,
    levels: Annotated[
        int | None,
        typer.Option(
            "--levels", min=1, help="With --matrix: the level jobs the workflow has; a deeper graph is an error."
        ),
    ] = None,
    as_json: JsonOpt = False,
    allow_outside: AllowOutsideOpt = None,
    device: Annotated[
        str,
        typer.Option(
            "--device",
            envvar="KILN_DEVICE",
            help="Where the compute stages are planned to run: cpu, cuda or cuda:N (sized for this machine's GPU, "
            "or for --gpu), or auto (a GPU when one is named or visible, else the CPU).",
        ),
    ] = "cpu",
    gpu: Annotated[
        str | None,
        typer.Option(
            "--gpu",
            metavar="SKU",
            help="With --device cuda: size the GPU stages for this GPU of the hardware catalog (h100, h200, ...), "
            "not for this machine's.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Show the stage graph of RECIPE: each stage, its device (kind, count, memory per device), host memory, the
    disk it writes and reads, its estimated time, cores, its cache key and whether it is built; totals; and every
    stage this machine's memory or disk cannot hold, with what would."""
    from kiln.pipeline import build
    from kiln.pipeline.recipe import load_recipe
    from kiln.pipeline.requirements import planning_device
    from kiln.pipeline.store import open_store

    placed = planning_device(device, gpu)
    loaded = load_recipe(recipe, allowed_roots=allowed_roots(allow_outside))
    if as_matrix:
        graph = build.matrix(loaded, open_store(store, work_dir), device=placed, gpu=gpu)
        if levels is not None and len(graph.levels) > levels:
            raise InvalidInput(
                f"the graph has {len(graph.levels)} levels and the workflow runs {levels}: add level jobs",
                code=Codes.WORKFLOW_TOO_SHALLOW,
            )
        if github_output is not None:
            with open(github_output, "a", encoding="utf-8") as out:
                for i, level in enumerate(graph.levels):
                    out.write(f"level{i}={json.dumps(level.model_dump(mode='json'), separators=(',', ':'))}\n")
                out.write(f"model={graph.model}\nversion={graph.version}\n")
        emit(graph)
        return
    rows = build.status(loaded, open_store(store, work_dir), device=placed, gpu=gpu)
    if as_json:
        emit(rows)
        return
    title = str(recipe) + (
        " (shape-only source: config.json alone; sized, not buildable)" if loaded.is_shape_only else ""
    )
    table = Table(title=safe_text(title))
    for col in ("stage", "device", "host", "writes", "reads", "time", "needs", "key", "state"):
        right = col in ("writes", "reads", "time")
        table.add_column(col, no_wrap=col not in ("needs", "state"), justify="right" if right else "left")
    for r in rows:
        req, disk = r.requires, r.disk
        host = fmt_size(req.memory_bytes) + (" !" if r.misfits.memory is not None else "")
        writes = fmt_size(disk.written_bytes) + (" !" if r.misfits.disk is not None else "")
        cells = (
            r.node,
            _device_cell(req),
            host,
            writes,
            fmt_size(disk.read_bytes),
            _duration(r.seconds, r.timed),
        )
        table.add_row(*(safe_text(c) for c in (*cells, _needs(req), (r.key or "-")[:12], r.state)))
    pending = [r for r in rows if r.state in ("to build", "shape only")]
    total_s = sum(r.seconds or 0 for r in pending)
    table.add_row(
        "total (to build)",
        "",
        fmt_size(max((r.requires.memory_bytes for r in pending), default=0)),
        fmt_size(sum(r.disk.written_bytes for r in pending)),
        fmt_size(sum(r.disk.read_bytes for r in pending)),
        _duration(total_s, all(r.timed for r in pending)),
        "",
        "",
        "",
    )
    err.print(table)
    # What this machine cannot hold, with the numbers and what would.
    for r in rows:
        for what, m in r.misfits.found().items():
            have = m.have_bytes
            where = {"memory": "memory here", "disk": "disk free", "device": "the GPU"}[what]
            numbers = f"needs {fmt_size(m.needed_bytes)}" + (f", {fmt_size(have)} {where}" if have else "")
            err.print(safe_text(f"[does not fit] {r.node}: {what} {numbers}; {m.fix}"), soft_wrap=True)
    # Deferred stages on lines of their own, the runner each waits for whole (a cell would wrap it).
    for r in rows:
        if r.state == "deferred" and r.runner is not None:
            err.print(safe_text(f"{r.node}: deferred to {r.runner}"), soft_wrap=True)
        elif r.state == "to build" and r.reason:  # an ingest whose source no build has hashed yet
            err.print(safe_text(f"{r.node}: {r.reason}"), soft_wrap=True)


def _duration(seconds: float | None, timed: bool = True) -> str:
    """An estimate's seconds as `42 s`, `3.5 min` or `4.2 h`, a floor (not `timed` on its device) as `≥ 42 s`;
    `-` where there is none."""
    if seconds is None:
        return "-"
    if not timed:
        return "≥ " + _duration(seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def _device_cell(req: Requirements) -> str:
    """`cpu`, or `cuda x 2: 66.0 GiB each` (`does not fit` where the share exceeds the GPU's memory)."""
    if not req.gpus:
        return "cpu"
    count = f" x {req.gpus}" if req.gpus > 1 else ""
    fits = "" if req.fits else ", does not fit"
    return f"cuda{count}: {fmt_size(req.device_memory_bytes)}{' each' if count else ''}{fits}"


def _needs(req: Requirements) -> str:
    """`2 cpu, nvidia:h100, tensorrt_llm==0.21.0`: a node's cores, accelerator and runtime, in a table cell."""
    return ", ".join([f"{req.cpus} cpu", *(v for v in (req.accelerator, req.runtime_env) if v)])


@app.command()
def inspect(file: Path, as_json: JsonOpt = False) -> None:
    """Show the header of a SafeTensors or GGUF file (tensors, dtypes, shapes, metadata)."""
    from kiln.inspect import inspect_file

    info = inspect_file(file)
    if as_json:
        emit(info)
        return
    err.print(safe_text(f"{file}: {info.format}, {len(info.tensors)} tensors"))
    for k, v in info.metadata.items():
        text = str(v)
        stdout.print(f"  {safe_text(k)} = {safe_text(text[:100] + '...' if len(text) > 100 else text)}")
    table = Table()
    for col in ("tensor", "dtype", "shape", "bytes"):
        table.add_column(col)
    for t in info.tensors:
        table.add_row(*(safe_text(c) for c in (t.name, t.dtype, t.shape, t.nbytes)))
    err.print(table)
