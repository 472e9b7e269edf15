"""Registry test fixtures: a migrated database per backend, a clean state per test, an app client.

`db_url` runs each test on SQLite (a copy of a migrated template file) and on PostgreSQL (one
fresh database per session, migrated once, truncated before each test). PostgreSQL tests are
skipped when the server is unreachable, unless KILN_REQUIRE_POSTGRES=1 makes that a failure.
`settings` pairs them with the blob stores of the two deployments: SQLite with local disk,
PostgreSQL with S3 (moto's server process, see s3_server.py).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.pool import NullPool
from starlette.testclient import TestClient

from kiln.registry.app import create_app
from kiln.registry.migrate import upgrade
from kiln.registry.schema import registry_metadata
from kiln.registry.settings import RegistrySettings
from tests.registry.s3_server import S3Server

POSTGRES_ADMIN_URL = os.environ.get("KILN_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sqlite-template") / "registry.db"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A fresh, migrated PostgreSQL database for this test session, dropped at the end."""
    admin = create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        with admin.connect() as conn:
            conn.execute(text("SELECT 1"))
    except OperationalError as exc:
        admin.dispose()
        message = f"PostgreSQL unreachable at {make_url(POSTGRES_ADMIN_URL).render_as_string()}: {exc.orig}"
        if os.environ.get("KILN_REQUIRE_POSTGRES") == "1":
            pytest.fail(message)
        pytest.skip(message)
    name = f"kiln_test_{uuid.uuid4().hex[:12]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(POSTGRES_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    try:
        upgrade(url)
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="session")
def postgres_engine(postgres_url: str) -> Iterator[Engine]:
    engine = create_engine(postgres_url, poolclass=NullPool)
    yield engine
    engine.dispose()


def _truncate(engine: Engine) -> None:
    tables = ", ".join(t.name for t in registry_metadata().sorted_tables)
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A migrated, empty registry database, on each backend."""
    if request.param == "sqlite":
        path = tmp_path / "registry.db"
        shutil.copyfile(request.getfixturevalue("sqlite_template"), path)
        return f"sqlite:///{path}"
    url: str = request.getfixturevalue("postgres_url")
    _truncate(request.getfixturevalue("postgres_engine"))
    return url


@pytest.fixture
def settings(request: pytest.FixtureRequest, db_url: str, tmp_path: Path) -> RegistrySettings:
    """The two deployments: SQLite with blobs on local disk, PostgreSQL with blobs in S3 (moto's server)."""
    if db_url.startswith("sqlite"):
        return RegistrySettings(
            database_url=db_url, data_dir=tmp_path / "data", blob_url=(tmp_path / "blobs").as_uri(), public_url=None
        )
    s3: S3Server = request.getfixturevalue("s3_server")
    return RegistrySettings(
        database_url=db_url, data_dir=tmp_path / "data", blob_url=s3.new_url(), public_url=None, **s3.settings()
    )


@pytest.fixture
def app(settings: RegistrySettings) -> FastAPI:
    return create_app(settings)


def make_token(app: FastAPI, scopes: list[str], models: list[str] | None = None, name: str = "test") -> str:
    """A token created straight in the app's database (how an operator bootstraps the first admin)."""
    from kiln.registry.auth.principal import LOCAL
    from kiln.registry.auth.service import create_token

    with app.state.session_factory() as session:
        _, secret = create_token(session, name, scopes, models or [], LOCAL)
        session.commit()
    return secret


@pytest.fixture
def admin_token(app: FastAPI) -> str:
    return make_token(app, ["admin"], name="test-admin")


@pytest.fixture
def client(app: FastAPI, admin_token: str) -> Iterator[TestClient]:
    """A client of the app acting with an admin token (auth is on, as in production)."""
    with TestClient(app, headers={"Authorization": f"Bearer {admin_token}"}) as c:
        yield c
