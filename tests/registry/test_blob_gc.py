"""Garbage collection of unreferenced blobs, and its races with publishes and uploads.

Runs on both deployments (SQLite + local disk, PostgreSQL + S3). The interleaving tests stop one
side at the point where it holds its lock (GC: row deleted, bytes not yet; publish: rows
flushed, not committed), check that the other side waits, then let the first one finish.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from sqlalchemy import event, select, update
from sqlalchemy.orm import Session
from starlette.testclient import TestClient

from kiln.core.errors import InvalidInput
from kiln.core.manifest import ArtifactManifest
from kiln.registry.app import create_app
from kiln.registry.artifacts.models import Artifact
from kiln.registry.blobs import service as blobs
from kiln.registry.blobs.gc import GcReport, collect_garbage
from kiln.registry.blobs.models import Blob
from kiln.registry.db import utcnow
from kiln.registry.releases import contents
from kiln.registry.settings import RegistrySettings
from kiln.storage.store import BlobStore
from tests.registry.helpers import make_release, manifest, publish, sha, upload

KEPT = b"referenced by an artifact"
ORPHAN = b"uploaded, never published"
FRESH = b"uploaded a minute ago, publish still to come"
GRACE = timedelta(hours=24)
BLOCKED_FOR = 0.5  # how long the waiting side is watched to be still waiting


def backdate(app: FastAPI, digest: str, days: float = 2) -> None:
    """Pretend `digest` was last uploaded `days` ago (older than the grace period)."""
    with app.state.session_factory() as session:
        session.execute(update(Blob).where(Blob.sha256 == digest).values(uploaded_at=utcnow() - timedelta(days=days)))
        session.commit()


def gc(app: FastAPI, *, dry_run: bool = False, store: BlobStore | None = None) -> GcReport:
    return collect_garbage(
        app.state.session_factory, store or app.state.blob_store, app.state.blob_references, GRACE, dry_run=dry_run
    )


def blob_row(app: FastAPI, digest: str) -> Blob | None:
    with app.state.session_factory() as session:
        return session.get(Blob, digest)


def test_collects_only_old_unreferenced_blobs(app: FastAPI, client: TestClient) -> None:
    make_release(client)
    publish(client, "gguf-q8", {"model.gguf": KEPT}, ["cpu"])
    orphan, fresh = upload(client, ORPHAN), upload(client, FRESH)
    backdate(app, sha(KEPT))
    backdate(app, orphan)

    planned = gc(app, dry_run=True)
    assert [b.sha256 for b in planned.deleted] == [orphan] and planned.spared_recent == 1
    assert client.head(f"/v1/blobs/{orphan}").status_code == 200  # a dry run deletes nothing

    report = gc(app)
    assert [(b.sha256, b.size) for b in report.deleted] == [(orphan, len(ORPHAN))]
    assert report.deleted_bytes == len(ORPHAN) and report.spared_raced == 0
    assert client.head(f"/v1/blobs/{orphan}").status_code == 404
    assert blob_row(app, orphan) is None and not app.state.blob_store.exists(orphan)
    assert client.get(f"/v1/blobs/{fresh}").content == FRESH
    assert client.get(f"/v1/blobs/{sha(KEPT)}").content == KEPT
    assert gc(app).deleted == []  # nothing left to collect


def test_uploading_again_restarts_the_grace_period(app: FastAPI, client: TestClient) -> None:
    orphan = upload(client, ORPHAN)
    backdate(app, orphan)
    # The publisher uploads it again for a new artifact: already stored (200), and now spared.
    assert client.put(f"/v1/blobs/{orphan}", content=ORPHAN).status_code == 200
    report = gc(app)
    assert report.deleted == [] and report.spared_recent == 1
    assert client.get(f"/v1/blobs/{orphan}").content == ORPHAN


class PausingStore:
    """The app's real store, except that `delete` stops (after announcing itself) until released.

    GC deletes bytes while it holds the blob's row lock, so this holds GC at its critical point.
    """

    def __init__(self, inner: BlobStore):
        self.inner = inner
        self.deleting = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def delete(self, sha256: str) -> None:
        self.deleting.set()
        assert self.release.wait(30), "the test never released the collection"
        self.inner.delete(sha256)


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run `fn` in a thread; the list gets its result or the exception it raised."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(fn())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def publish_in_session(app: FastAPI, name: str, files: dict[str, bytes], session: Session | None = None) -> Any:
    """What the publish route does: the service flushes, the caller commits."""
    spec = ArtifactManifest.model_validate(manifest(name, files, ["cpu"]))
    with session or app.state.write_session_factory() as s:
        row = contents.publish_artifact(s, "tiny", "1.0", spec)
        s.commit()
        return row


def test_publish_during_collection_gets_blob_missing(app: FastAPI, client: TestClient) -> None:
    make_release(client, planned=["late"])
    orphan = upload(client, ORPHAN)
    backdate(app, orphan)
    store = PausingStore(app.state.blob_store)
    collector, collected = in_thread(lambda: gc(app, store=store))
    assert store.deleting.wait(30)  # GC deleted the row, holds its lock, bytes still there

    publisher, published = in_thread(lambda: publish_in_session(app, "late", {"model.gguf": ORPHAN}))
    publisher.join(BLOCKED_FOR)
    assert publisher.is_alive(), f"the publish did not wait for the collection: {published}"
    store.release.set()
    collector.join(30)
    publisher.join(30)

    assert [b.sha256 for b in collected[0].deleted] == [orphan]
    error = published[0]
    assert isinstance(error, InvalidInput) and error.code == "BLOB_MISSING", error
    with app.state.session_factory() as session:
        assert session.scalars(select(Artifact)).all() == []  # nothing references the collected blob
    # The client uploads again and publishes: everything is consistent.
    upload(client, ORPHAN)
    publish(client, "late", {"model.gguf": ORPHAN}, ["cpu"])
    assert client.get(f"/v1/blobs/{orphan}").content == ORPHAN


@pytest.fixture
def paused_publish(app: FastAPI) -> Iterator[tuple[threading.Event, threading.Event]]:
    """A session whose next flush stops, its rows written and locked but not committed, until released."""
    flushed, release = threading.Event(), threading.Event()
    session: Session = app.state.write_session_factory()

    def hold(_session: Session, _context: Any) -> None:
        flushed.set()
        assert release.wait(30), "the test never released the publish"

    event.listen(session, "after_flush", hold, once=True)
    app.state.paused_session = session
    yield flushed, release
    release.set()
    session.close()


def test_collection_during_publish_spares_the_blob(
    app: FastAPI, client: TestClient, paused_publish: tuple[threading.Event, threading.Event]
) -> None:
    flushed, release = paused_publish
    make_release(client, planned=["now"])
    orphan = upload(client, ORPHAN)
    backdate(app, orphan)
    publisher, published = in_thread(
        lambda: publish_in_session(app, "now", {"model.gguf": ORPHAN}, app.state.paused_session)
    )
    assert flushed.wait(30)  # the artifact's rows are written, not committed

    collector, collected = in_thread(lambda: gc(app))
    collector.join(BLOCKED_FOR)
    assert collector.is_alive(), f"the collection did not wait for the publish: {collected}"
    release.set()
    publisher.join(30)
    collector.join(30)

    assert not isinstance(published[0], BaseException), published[0]
    report = collected[0]
    assert report.deleted == [] and report.spared_raced == 1, report
    assert blob_row(app, orphan) is not None and app.state.blob_store.exists(orphan)
    assert client.get(f"/v1/blobs/{orphan}").content == ORPHAN


def test_upload_during_collection_stores_the_bytes_afresh(app: FastAPI, client: TestClient) -> None:
    orphan = upload(client, ORPHAN)
    backdate(app, orphan)
    store = PausingStore(app.state.blob_store)
    collector, collected = in_thread(lambda: gc(app, store=store))
    assert store.deleting.wait(30)

    def upload_again() -> tuple[Blob, bool]:
        with app.state.write_session_factory() as session:  # as the upload route does
            stored = blobs.put_blob(session, app.state.blob_store, orphan, [ORPHAN])
            session.commit()
            return stored

    uploader, uploaded = in_thread(upload_again)
    uploader.join(BLOCKED_FOR)
    assert uploader.is_alive(), f"the upload did not wait for the collection: {uploaded}"
    store.release.set()
    collector.join(30)
    uploader.join(30)

    assert [b.sha256 for b in collected[0].deleted] == [orphan]
    assert not isinstance(uploaded[0], BaseException), uploaded[0]
    # The collection deleted the old bytes before the upload wrote its own: the blob is whole.
    assert blob_row(app, orphan) is not None
    assert client.get(f"/v1/blobs/{orphan}").content == ORPHAN


# -- the command line --------------------------------------------------------------------------------


def kiln(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kiln", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_kiln_gc_dry_run_then_delete(tmp_path: Path) -> None:
    registry = tmp_path / "registry"
    app = create_app(RegistrySettings(data_dir=registry))
    try:
        with app.state.write_session_factory() as session:
            for data in (ORPHAN, FRESH):
                blobs.put_blob(session, app.state.blob_store, sha(data), [data])
            session.commit()
        backdate(app, sha(ORPHAN))
    finally:
        app.state.engine.dispose()

    planned = kiln("gc", "--registry", str(registry), "--dry-run", "--json")
    assert planned.returncode == 0, planned.stderr
    out = json.loads(planned.stdout)
    assert out["dry_run"] and [b["sha256"] for b in out["deleted"]] == [sha(ORPHAN)]
    assert out["deleted_bytes"] == len(ORPHAN) and out["spared_recent"] == 1

    done = kiln("gc", "--registry", str(registry))
    assert done.returncode == 0, done.stderr
    assert f"deleted {sha(ORPHAN)}" in done.stdout and "deleted 1 unreferenced blobs" in done.stderr
    assert not (registry / "blobs" / sha(ORPHAN)[:2] / sha(ORPHAN)[2:4] / sha(ORPHAN)).exists()

    everything = json.loads(kiln("gc", "--registry", str(registry), "--grace-hours", "0", "--json").stdout)
    assert [b["sha256"] for b in everything["deleted"]] == [sha(FRESH)]


def test_kiln_gc_on_a_database_url(app: FastAPI, client: TestClient, settings: RegistrySettings) -> None:
    """The production form: database URL as --registry, blob store (S3 on PostgreSQL) from the environment."""
    orphan = upload(client, ORPHAN)
    backdate(app, orphan)
    env = {"KILN_REGISTRY_BLOB_URL": settings.effective_blob_url()}
    if settings.s3_endpoint_url is not None:
        env |= {"KILN_REGISTRY_S3_ENDPOINT_URL": settings.s3_endpoint_url}
    assert settings.database_url is not None
    out = kiln("gc", "--registry", settings.database_url, "--json", env=env)
    assert out.returncode == 0, out.stderr
    assert [b["sha256"] for b in json.loads(out.stdout)["deleted"]] == [orphan]
    assert client.head(f"/v1/blobs/{orphan}").status_code == 404
    assert not app.state.blob_store.exists(orphan)


def test_kiln_gc_refuses_what_it_cannot_collect(tmp_path: Path) -> None:
    server = kiln("gc", "--registry", "http://registry:8000", "--json")
    assert server.returncode == 2 and json.loads(server.stdout)["error"]["code"] == "INVALID_INPUT"
    missing = kiln("gc", "--registry", str(tmp_path / "nowhere"))
    assert missing.returncode == 4 and "no embedded registry" in missing.stderr
    assert not (tmp_path / "nowhere").exists()
    negative = kiln("gc", "--registry", str(tmp_path), "--grace-hours", "-1")
    assert negative.returncode == 2


def test_client_uploads_again_when_a_blob_it_skipped_was_collected(tmp_path: Path) -> None:
    from kiln.client import RegistryClient

    files = tmp_path / "artifact"
    files.mkdir()
    (files / "model.gguf").write_bytes(ORPHAN)
    with RegistryClient.connect(tmp_path / "registry") as client:
        client.ensure_model("tiny")
        client.create_release("tiny", "1.0", "a" * 64, ["gguf-q8"])
        client.upload_blob(files / "model.gguf")  # uploaded long ago for a publish that never came
        app: FastAPI = client._http.app  # type: ignore[attr-defined]
        backdate(app, sha(ORPHAN))
        collections: list[GcReport] = []

        def collect_before_first_publish(request: Any) -> None:
            # Between the client's "the registry has it" and its publish, the old orphan is collected.
            if request.method == "POST" and request.url.path.endswith("/artifacts") and not collections:
                collections.append(gc(app))

        client._http.event_hooks["request"].append(collect_before_first_publish)
        spec = ArtifactManifest.model_validate(manifest("gguf-q8", {"model.gguf": ORPHAN}, ["cpu"]))
        published = client.publish_artifact("tiny", "1.0", spec, files_root=files)
        assert [b.sha256 for b in collections[0].deleted] == [sha(ORPHAN)]
        assert published.name == "gguf-q8"
        assert app.state.blob_store.exists(sha(ORPHAN))
