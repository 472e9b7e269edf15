"""The schema comes only from Alembic migrations, and they match the ORM models exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect
from starlette.testclient import TestClient

from kiln.core.errors import Unavailable
from kiln.registry import migrate
from kiln.registry.app import create_app
from kiln.registry.db import create_db_engine
from kiln.registry.schema import registry_metadata
from kiln.registry.settings import RegistrySettings


def schema_differences(url: str) -> list[object]:
    engine = create_db_engine(url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            return list(compare_metadata(context, registry_metadata()))
    finally:
        engine.dispose()


def test_upgrade_head_leaves_nothing_for_autogenerate(db_url: str) -> None:
    # db_url was migrated with registry.migrate.upgrade (alembic upgrade head).
    assert schema_differences(db_url) == []
    engine = create_db_engine(db_url)
    try:
        assert migrate.current_revision(engine) == migrate.head_revision()
    finally:
        engine.dispose()
    assert migrate._main(["check", "--url", db_url]) == 0


def test_downgrade_and_upgrade_again(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'r.db'}"
    migrate.upgrade(url)
    migrate.upgrade(url)  # already at head: a no-op
    command.downgrade(migrate.alembic_config(url), "base")
    engine = create_db_engine(url)
    try:
        assert set(inspect(engine).get_table_names()) == {"alembic_version"}
    finally:
        engine.dispose()
    migrate.upgrade(url)
    assert schema_differences(url) == []


def test_unmigrated_database_is_refused(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    settings = RegistrySettings(database_url=url, data_dir=tmp_path, blob_url=(tmp_path / "b").as_uri())
    with pytest.raises(Unavailable) as info:
        create_app(settings)
    assert info.value.code == "DB_NOT_MIGRATED"
    assert "kiln db upgrade" in info.value.message
    assert migrate._main(["check", "--url", url]) == 1
    migrate.upgrade(url)
    create_app(settings).state.engine.dispose()


def test_unreachable_database_is_unavailable(tmp_path: Path) -> None:
    settings = RegistrySettings(
        database_url="postgresql://postgres@127.0.0.1:1/none", data_dir=tmp_path, blob_url=(tmp_path / "b").as_uri()
    )
    with pytest.raises(Unavailable) as info:
        create_app(settings)
    assert info.value.code == "UNAVAILABLE"


def test_embedded_registry_migrates_itself(tmp_path: Path) -> None:
    data_dir = tmp_path / "registry"
    with TestClient(create_app(RegistrySettings(data_dir=data_dir, auth_required=False))) as client:
        assert client.post("/v1/models", json={"name": "m"}).status_code == 201
    assert (data_dir / "registry.db").is_file()
    assert (data_dir / "blobs").is_dir()
    assert schema_differences(f"sqlite:///{data_dir / 'registry.db'}") == []
    with TestClient(create_app(RegistrySettings(data_dir=data_dir))) as client:  # reopening keeps the data
        assert client.get("/v1/models/m").status_code == 200


def test_sqlite_has_foreign_keys_and_wal(tmp_path: Path) -> None:
    engine = create_db_engine(f"sqlite:///{tmp_path / 'x.db'}")
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    finally:
        engine.dispose()


def test_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KILN_REGISTRY_DATA_DIR", str(tmp_path / "reg"))
    monkeypatch.setenv("KILN_REGISTRY_MAX_UPLOAD_BYTES", "1234")
    settings = RegistrySettings()
    assert settings.is_embedded and settings.max_upload_bytes == 1234
    assert settings.effective_database_url() == f"sqlite:///{tmp_path / 'reg' / 'registry.db'}"
    assert settings.effective_blob_url() == (tmp_path / "reg" / "blobs").as_uri()
    monkeypatch.setenv("KILN_REGISTRY_DATABASE_URL", "postgresql://db/kiln")
    assert not RegistrySettings().is_embedded


def test_releases_from_before_sealing_stay_served(tmp_path: Path) -> None:
    """0005: a release published before releases were sealed was served; it becomes sealed, planning
    the artifacts it has, and a channel keeps judging it by the evals it had."""
    url = f"sqlite:///{tmp_path / 'old.db'}"
    migrate.upgrade(url, "0004")
    engine = create_db_engine(url)
    now = "2026-11-01 00:00:00"
    try:
        with engine.begin() as conn:
            run = conn.exec_driver_sql
            run(f"INSERT INTO models (id, name, description, created_at) VALUES (1, 'tiny', '', '{now}')")
            run(
                "INSERT INTO releases (id, model_id, version, source_digest, lineage, model_config, created_at) "
                f"VALUES (1, 1, '1.0', '{'a' * 64}', '{{}}', '{{}}', '{now}')"
            )
            run(f"INSERT INTO blobs (sha256, size, created_at, uploaded_at) VALUES ('{'b' * 64}', 1, '{now}', '{now}')")
            for artifact_id, name in ((1, "gguf-q8"), (2, "gguf-q4")):
                run(
                    "INSERT INTO artifacts (id, release_id, name, target, format, quant, hardware, unsupported, "
                    f"runtime, provenance, manifest_digest, total_size, created_at) VALUES ({artifact_id}, 1, "
                    f"'{name}', 'gguf', 'gguf-v3', 'q8_0', '[\"cpu\"]', '{{}}', '{{}}', '{{}}', "
                    f"'{'c' * 64}', 1, '{now}')"
                )
                run(
                    "INSERT INTO eval_results (id, artifact_id, runtime, status, metrics, gates, created_at) "
                    f"VALUES ({artifact_id + 10}, {artifact_id}, 'llama.cpp', 'passed', '{{}}', '{{}}', '{now}')"
                )
            run(f"INSERT INTO channels (id, model_id, name, release_id, updated_at) VALUES (1, 1, 'prod', 1, '{now}')")
    finally:
        engine.dispose()
    migrate.upgrade(url)
    assert schema_differences(url) == []
    engine = create_db_engine(url)
    try:
        with engine.connect() as conn:
            release = conn.exec_driver_sql("SELECT status, planned_artifacts, sealed_at FROM releases").one()
            assert release[0] == "sealed" and json.loads(release[1]) == ["gguf-q4", "gguf-q8"] and release[2]
            assert conn.exec_driver_sql("SELECT evals_through FROM channels").scalar() == 12
    finally:
        engine.dispose()
