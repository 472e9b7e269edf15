"""Running the registry: `kiln serve`, `kiln db upgrade`, `kiln gc`.

The server and the app are imported when a command runs: the other commands start without them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from kiln.cli.common import DEFAULT_REGISTRY, JsonOpt, app, db_app, emit, fmt_size
from kiln.console import err, safe_text, stdout
from kiln.core.errors import InvalidInput, NotFound


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.")] = 8000,
    workers: Annotated[int, typer.Option(help="uvicorn worker processes.")] = 1,
    data_dir: Annotated[
        str | None, typer.Option(envvar="KILN_REGISTRY_DATA_DIR", help="Embedded registry directory.")
    ] = None,
    modelcar_base: Annotated[
        str | None,
        typer.Option(
            envvar="KILN_REGISTRY_MODELCAR_BASE",
            help="OCI image layout of the base image model cars are built on (offers modelcar/<model>).",
        ),
    ] = None,
) -> None:
    """Run the registry server (uvicorn with uvloop and httptools)."""
    from kiln.registry.server import serve as run_server

    if data_dir:
        os.environ["KILN_REGISTRY_DATA_DIR"] = data_dir
    if modelcar_base:
        os.environ["KILN_REGISTRY_MODELCAR_BASE"] = modelcar_base
    run_server(host=host, port=port, workers=workers)


@app.command("modelcar-base")
def modelcar_base(
    layout: Annotated[Path, typer.Argument(help="Directory to write the OCI image layout to.")],
    busybox: Annotated[Path, typer.Option(help="A statically linked busybox (Debian: busybox-static).")] = Path(
        "/bin/busybox"
    ),
) -> None:
    """Write a model-car base image (a static busybox: sh, ln, sleep) as an OCI image layout."""
    from kiln.registry.oci.base_image import write_busybox_base

    try:
        layout.mkdir(parents=True, exist_ok=True)
        digest = write_busybox_base(busybox, layout)
    except OSError as e:
        raise InvalidInput(f"cannot write a base image from {str(busybox)!r} to {str(layout)!r}: {e}") from None
    stdout.print(f"base image {digest} written to {safe_text(str(layout))}")


@db_app.command("upgrade")
def db_upgrade(
    database_url: Annotated[
        str | None, typer.Option(envvar="KILN_REGISTRY_DATABASE_URL", help="SQLAlchemy URL; default: embedded SQLite.")
    ] = None,
    revision: Annotated[str, typer.Option(help="Alembic revision.")] = "head",
) -> None:
    """Apply the registry's database migrations."""
    from kiln.registry.migrate import upgrade
    from kiln.registry.settings import RegistrySettings

    settings = RegistrySettings() if database_url is None else RegistrySettings(database_url=database_url)
    upgrade(settings.effective_database_url(), revision)
    err.print(f"database at revision {safe_text(revision)}")


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

    from kiln.registry.app import open_storage
    from kiln.registry.blobs.gc import collect_garbage
    from kiln.registry.settings import RegistrySettings

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
    storage = open_storage(settings)  # the same schema check and blob store as the server
    try:
        report = collect_garbage(
            storage.sessions(), storage.blob_store, storage.blob_references, grace, dry_run=dry_run
        )
    finally:
        storage.engine.dispose()
    if as_json:
        emit(report.to_dict())
        return
    verb = "would delete" if dry_run else "deleted"
    for blob in report.deleted:
        stdout.print(
            safe_text(f"{verb} {blob.sha256}  {fmt_size(blob.size)}  uploaded {blob.uploaded_at:%Y-%m-%d %H:%M:%S}Z")
        )
    err.print(
        f"{verb} {len(report.deleted)} unreferenced blobs ({fmt_size(report.deleted_bytes)}); "
        f"spared {report.spared_recent} uploaded within {hours:g} h"
        + (f", {report.spared_raced} referenced or re-uploaded meanwhile" if report.spared_raced else "")
    )
