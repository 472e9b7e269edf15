"""The `kiln` command line: build, plan, publish, promote, resolve, serve, db upgrade, gc, inspect.

Exit codes (stable, for CI): 0 ok; 1 a stage or the service failed; 2 bad input (recipe, source,
arguments); 3 an eval gate failed; 4 not found; 5 conflict with what is stored; 6 not allowed;
7 a backend is unavailable.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from kiln.console import ProgressReporter, err
from kiln.errors import (
    Conflict,
    Forbidden,
    GateFailed,
    InvalidInput,
    KilnError,
    NotFound,
    Unauthorized,
    Unavailable,
)

EXIT_CODES: list[tuple[type[KilnError], int]] = [
    (GateFailed, 3),
    (InvalidInput, 2),
    (NotFound, 4),
    (Conflict, 5),
    (Unauthorized, 6),
    (Forbidden, 6),
    (Unavailable, 7),
    (KilnError, 1),
]
EXIT_GATE_FAILED = 3

app = typer.Typer(
    name="kiln",
    help="Build verified, hardware-specific LLM artifacts from one SafeTensors release, and serve them.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
db_app = typer.Typer(help="Manage the registry database schema.", no_args_is_help=True)
app.add_typer(db_app, name="db")
token_app = typer.Typer(help="Manage registry API tokens (needs the admin scope).", no_args_is_help=True)
app.add_typer(token_app, name="token")

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout (for CI).")]
WorkDirOpt = Annotated[
    Path, typer.Option("--work-dir", envvar="KILN_WORK_DIR", help="Content-addressed stage outputs.")
]
RegistryOpt = Annotated[
    str,
    typer.Option(
        "--registry",
        envvar="KILN_REGISTRY",
        help="Registry URL (http://..., token from $KILN_TOKEN), embedded registry directory, or database URL.",
    ),
]
DEFAULT_WORK = Path(".kiln/work")
DEFAULT_REGISTRY = ".kiln/registry"


def _emit(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def _peak_rss_mib() -> float:
    # ru_maxrss is KiB on Linux; include finished children (llama.cpp's quantizer runs in-process).
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, kids) / 1024


def _fmt_size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _artifact_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="artifacts")
    for col in ("artifact", "size", "eval", "ppl", "ppl Δ", "KL", "top-1", "greedy"):
        table.add_column(col, justify="left" if col in ("artifact", "eval") else "right", no_wrap=True)
    for r in rows:
        m = r.get("metrics") or {}
        colour = {"passed": "green", "failed": "red"}.get(r["eval"], "yellow")
        table.add_row(
            r["artifact"],
            _fmt_size(r.get("size")),
            f"[{colour}]{r['eval']}[/{colour}]",
            f"{m['ppl']:.3f}" if "ppl" in m else "-",
            f"{m['ppl_change']:+.2%}" if "ppl_change" in m else "-",
            f"{m['kl']:.2e}" if "kl" in m else "-",
            f"{m['top1']:.4f}" if "top1" in m else "-",
            f"{m['greedy_match']:.3f}" if "greedy_match" in m else "-",
        )
    return table


def _quiet_libraries() -> None:
    """Our progress bars, not each library's: transformers draws one per model load, compressed-tensors
    one per decompression (both through tqdm, which honours TQDM_DISABLE)."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _run_build(recipe_path: Path, work_dir: Path, registry: str | None, as_json: bool) -> None:
    from pipeline import build
    from pipeline.recipe import load_recipe

    started = time.time()
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")  # some CPUs advertise AMX that faults
    _quiet_libraries()
    recipe = load_recipe(recipe_path)
    result = build.run(recipe, work_dir, registry=registry, reporter=ProgressReporter(quiet=as_json))
    summary = result.summary() | {"seconds": round(time.time() - started, 2), "peak_rss_mib": round(_peak_rss_mib(), 1)}
    report = work_dir.parent / "reports" / f"{recipe.model}-{recipe.version}.json"
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(json.dumps(summary, indent=2, sort_keys=True, default=str))
    if as_json:
        _emit(summary)
    else:
        err.print(_artifact_table(summary["artifacts"]))
        err.print(
            f"{recipe.model}@{recipe.version}: {summary['stages']} in {summary['seconds']:.1f}s, "
            f"peak RSS {summary['peak_rss_mib']:.0f} MiB; report: {report}"
        )
        for r in summary["artifacts"]:
            for failure in r["failures"]:
                err.print(f"[red]gate failed[/red] {r['artifact']}: {failure}")
        # Deferred is not a failure: the work waits for a runner that has what this machine lacks.
        for d in summary["deferred"]:
            if "runner" in d:
                command = " ".join(d["command"])
                err.print(f"[yellow]deferred[/yellow] {d['node']} to a runner with {d['runner']}: {command}")
    if result.failed_gates:
        raise typer.Exit(EXIT_GATE_FAILED)


@app.command()
def build(recipe: Path, work_dir: WorkDirOpt = DEFAULT_WORK, as_json: JsonOpt = False) -> None:
    """Build and evaluate every artifact of RECIPE, reusing finished stages."""
    _run_build(recipe, work_dir, None, as_json)


@app.command()
def publish(
    recipe: Path,
    registry: RegistryOpt = DEFAULT_REGISTRY,
    work_dir: WorkDirOpt = DEFAULT_WORK,
    as_json: JsonOpt = False,
) -> None:
    """Build (reusing finished stages) and publish every artifact of RECIPE with its eval results."""
    _run_build(recipe, work_dir, registry, as_json)


@app.command()
def plan(recipe: Path, work_dir: WorkDirOpt = DEFAULT_WORK, as_json: JsonOpt = False) -> None:
    """Show the stage graph of RECIPE: each stage, its cache key and whether it is already built."""
    from pipeline import build
    from pipeline.recipe import load_recipe

    rows = build.status(load_recipe(recipe), work_dir)
    if as_json:
        _emit(rows)
        return
    table = Table(title=str(recipe))
    for col in ("stage", "inputs", "key", "state"):
        table.add_column(col)
    for r in rows:
        state = f"deferred to {r['runner']}" if "runner" in r else r["state"]
        table.add_row(r["node"], ", ".join(r["inputs"]), (r["key"] or "-")[:12], state)
    err.print(table)


@app.command()
def promote(
    ref: Annotated[str, typer.Argument(metavar="MODEL@VERSION")],
    channel: Annotated[str, typer.Option(help="Channel to point at the release, e.g. prod.")],
    force: Annotated[bool, typer.Option(help="Promote although an eval gate failed (needs --reason).")] = False,
    reason: Annotated[str | None, typer.Option(help="Why; recorded in the audit log.")] = None,
    registry: RegistryOpt = DEFAULT_REGISTRY,
    as_json: JsonOpt = False,
) -> None:
    """Point CHANNEL of MODEL at VERSION (refused while an artifact failed its eval gate)."""
    from registry.client import RegistryClient

    model, version = _split_ref(ref)
    with RegistryClient.connect(registry) as client:
        out = client.promote(model, version, channel, force=force, reason=reason, actor=os.environ.get("USER"))
    if as_json:
        _emit(out)
    else:
        err.print(f"{model}: channel {channel} -> {version}" + (" (forced)" if force else ""))


@app.command()
def resolve(
    model: str,
    hardware: Annotated[str, typer.Option(help="Hardware profile of the serving pool, e.g. cpu, h100.")],
    channel: Annotated[str, typer.Option(help="Channel to resolve.")] = "prod",
    context: Annotated[int, typer.Option(help="Context length to size the KV cache for.")] = 4096,
    concurrency: Annotated[int, typer.Option(help="Concurrent sequences per node.")] = 1,
    registry: RegistryOpt = DEFAULT_REGISTRY,
    as_json: JsonOpt = False,
) -> None:
    """Which artifact a node of HARDWARE should load for MODEL on CHANNEL, and why."""
    from registry.client import RegistryClient

    with RegistryClient.connect(registry) as client:
        answer = client.resolve(model, hardware, channel, context=context, concurrency=concurrency)
    if as_json:
        _emit(answer)
        return
    a, why = answer["artifact"], answer["reason"]
    print(f"{answer['model']}@{answer['version']} ({answer['channel']}) on {answer['hardware']}: {a['name']}")
    print(f"  {why.get('explanation', '')}")
    for f in a["files"]:
        print(f"  {f['path']}  sha256:{f['sha256']}  {f['size']} bytes\n    {f['url']}")
    if answer.get("fallbacks"):
        print("  fallbacks: " + ", ".join(fb["artifact"]["name"] for fb in answer["fallbacks"]))
    if not registry.startswith(("http://", "https://")):
        err.print(f"[dim]embedded registry: `kiln serve --data-dir {registry}` serves these URLs[/dim]")


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.")] = 8000,
    workers: Annotated[int, typer.Option(help="uvicorn worker processes.")] = 1,
    data_dir: Annotated[
        str | None, typer.Option(envvar="KILN_REGISTRY_DATA_DIR", help="Embedded registry directory.")
    ] = None,
) -> None:
    """Run the registry server (uvicorn with uvloop and httptools)."""
    from registry.server import serve as run_server

    if data_dir:
        os.environ["KILN_REGISTRY_DATA_DIR"] = data_dir
    run_server(host=host, port=port, workers=workers)


@db_app.command("upgrade")
def db_upgrade(
    database_url: Annotated[
        str | None, typer.Option(envvar="KILN_REGISTRY_DATABASE_URL", help="SQLAlchemy URL; default: embedded SQLite.")
    ] = None,
    revision: Annotated[str, typer.Option(help="Alembic revision.")] = "head",
) -> None:
    """Apply the registry's database migrations."""
    from registry.migrate import upgrade
    from registry.settings import RegistrySettings

    settings = RegistrySettings() if database_url is None else RegistrySettings(database_url=database_url)
    upgrade(settings.effective_database_url(), revision)
    err.print(f"database at revision {revision}")


@app.command()
def gc(
    registry: Annotated[
        str,
        typer.Option(
            "--registry",
            envvar="KILN_REGISTRY",
            help="Embedded registry directory, or the registry's database URL (blob store: KILN_REGISTRY_BLOB_URL).",
        ),
    ] = DEFAULT_REGISTRY,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List what would be deleted; delete nothing.")] = False,
    grace_hours: Annotated[
        float | None,
        typer.Option(
            min=0, help="Spare blobs uploaded within this many hours (default KILN_REGISTRY_BLOB_GC_GRACE_HOURS)."
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Delete blobs that no artifact references and that were not uploaded within the grace period.

    Runs next to the registry's database and blob store (not over HTTP); safe while publishes run.
    """
    from datetime import timedelta

    from registry.app import create_app
    from registry.blobs.gc import collect_garbage
    from registry.settings import RegistrySettings

    if registry.startswith(("http://", "https://")):
        raise InvalidInput(
            "kiln gc works on the registry's database and blob store directly: "
            "give --registry a directory or a database URL, not a server URL"
        )
    if registry.startswith(("postgresql", "sqlite:")):
        settings = RegistrySettings(database_url=registry)
    else:
        if not (Path(registry) / "registry.db").is_file():  # never create a registry just to collect it
            raise NotFound(f"no embedded registry in {registry!r}", details={"registry": registry})
        settings = RegistrySettings(data_dir=Path(registry))
    hours = settings.blob_gc_grace_hours if grace_hours is None else grace_hours
    grace = timedelta(hours=hours)
    registry_app = create_app(settings)  # the same schema check and blob store as the server
    try:
        report = collect_garbage(
            registry_app.state.session_factory, registry_app.state.blob_store, grace, dry_run=dry_run
        )
    finally:
        registry_app.state.engine.dispose()
    if as_json:
        _emit(report.to_dict())
        return
    verb = "would delete" if dry_run else "deleted"
    for blob in report.deleted:
        print(f"{verb} {blob.sha256}  {_fmt_size(blob.size)}  uploaded {blob.uploaded_at:%Y-%m-%d %H:%M:%S}Z")
    err.print(
        f"{verb} {len(report.deleted)} unreferenced blobs ({_fmt_size(report.deleted_bytes)}); "
        f"spared {report.spared_recent} uploaded within {hours:g} h"
        + (f", {report.spared_raced} referenced or re-uploaded meanwhile" if report.spared_raced else "")
    )


@app.command()
def inspect(file: Path, as_json: JsonOpt = False) -> None:
    """Show the header of a SafeTensors or GGUF file (tensors, dtypes, shapes, metadata)."""
    from kiln.inspect import inspect_file

    info = inspect_file(file)
    if as_json:
        _emit(info)
        return
    err.print(f"{file}: {info['format']}, {len(info['tensors'])} tensors")
    for k, v in info["metadata"].items():
        text = str(v)
        print(f"  {k} = {text[:100] + '...' if len(text) > 100 else text}")
    table = Table()
    for col in ("tensor", "dtype", "shape", "bytes"):
        table.add_column(col)
    for t in info["tensors"]:
        table.add_row(t["name"], t["dtype"], str(t["shape"]), str(t["nbytes"]))
    err.print(table)


def _split_ref(ref: str) -> tuple[str, str]:
    model, sep, version = ref.partition("@")
    if not sep or not model or not version:
        raise InvalidInput(f"expected MODEL@VERSION, got {ref!r}")
    return model, version


@token_app.command("create")
def token_create(
    name: str,
    scopes: Annotated[str, typer.Option(help="Comma-separated: read, publish, promote, admin.")],
    models: Annotated[str, typer.Option(help="Comma-separated model name patterns (default: all).")] = "",
    registry: RegistryOpt = DEFAULT_REGISTRY,
    as_json: JsonOpt = False,
) -> None:
    """Create an API token; its secret is printed once, on stdout."""
    from registry.client import RegistryClient

    with RegistryClient.connect(registry) as client:
        out = client.create_token(name, [s for s in scopes.split(",") if s], [m for m in models.split(",") if m])
    if as_json:
        _emit(out)
        return
    err.print(f"token {out['id']} {out['name']!r}: scopes {', '.join(out['scopes'])}; store the secret now")
    print(out["token"])


@token_app.command("list")
def token_list(registry: RegistryOpt = DEFAULT_REGISTRY, as_json: JsonOpt = False) -> None:
    """API tokens (never their secrets)."""
    from registry.client import RegistryClient

    with RegistryClient.connect(registry) as client:
        tokens = client.list_tokens()
    if as_json:
        _emit(tokens)
        return
    for t in tokens:
        state = f"revoked {t['revoked_at']}" if t["revoked_at"] else "active"
        models = ", ".join(t["models"]) or "all models"
        print(f"{t['id']:>4}  {t['name']:<24} {t['prefix']}…  {','.join(t['scopes']):<22} {models:<20} {state}")


@token_app.command("revoke")
def token_revoke(
    token_id: int,
    reason: Annotated[str | None, typer.Option(help="Why; recorded in the audit log.")] = None,
    registry: RegistryOpt = DEFAULT_REGISTRY,
    as_json: JsonOpt = False,
) -> None:
    """Revoke an API token (audited)."""
    from registry.client import RegistryClient

    with RegistryClient.connect(registry) as client:
        out = client.revoke_token(token_id, reason)
    if as_json:
        _emit(out)
    else:
        err.print(f"token {out['id']} {out['name']!r} revoked")


@app.command()
def yank(
    ref: Annotated[str, typer.Argument(metavar="MODEL@VERSION")],
    reason: Annotated[str, typer.Option(help="Why; recorded in the audit log.")],
    registry: RegistryOpt = DEFAULT_REGISTRY,
    as_json: JsonOpt = False,
) -> None:
    """Yank a release: it stays stored, but resolve and downloads by channel never return it again."""
    from registry.client import RegistryClient

    model, version = _split_ref(ref)
    with RegistryClient.connect(registry) as client:
        out = client.yank(model, version, reason)
    if as_json:
        _emit(out)
    else:
        err.print(f"{model}@{version} yanked: {reason}")


@app.command()
def audit(
    model: Annotated[str | None, typer.Option(help="Only events about this model.")] = None,
    limit: Annotated[int, typer.Option(help="How many events, newest first.")] = 50,
    registry: RegistryOpt = DEFAULT_REGISTRY,
    as_json: JsonOpt = False,
) -> None:
    """The audit log: promotions, forced promotions, yanks and token changes (who, what, when, why)."""
    from registry.client import RegistryClient

    with RegistryClient.connect(registry) as client:
        events = client.audit(model, limit)
    if as_json:
        _emit(events)
        return
    for e in events:
        why = f"  reason: {e['reason']}" if e.get("reason") else ""
        change = e.get("details", {})
        before_after = f"  {change.get('before')} -> {change.get('after')}" if "after" in change else ""
        print(f"{e['at']}  {e['actor']:<28} {e['action']:<24} {e['target']}{before_after}{why}")


def main() -> None:
    try:
        # Without standalone mode click returns (not raises) the code of a typer.Exit.
        code = app(standalone_mode=False)
        sys.exit(code if isinstance(code, int) else 0)
    except KilnError as e:
        err.print(f"[red]error[/red] [{e.code}] {e.message}")
        if "--json" in sys.argv:
            _emit({"error": e.to_dict()})
        sys.exit(next(code for cls, code in EXIT_CODES if isinstance(e, cls)))
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
