"""Resolve's one question per request on SQLite: every commit by another connection or process is seen by
the next lookup, and the WAL-index header it watches is read only when SQLite's own readers would trust it."""

from __future__ import annotations

import mmap
import sqlite3
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from kiln.registry.app import create_app
from kiln.registry.resolve.cache import ChannelFingerprints, WalIndexHeader
from kiln.registry.settings import RegistrySettings
from tests.registry.conftest import make_token
from tests.registry.test_api_resolve import seed

# Another process's writes, one commit each, with nothing in between to let time pass.
WRITER = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=10)
for _ in range(int(sys.argv[2])):
    db.execute("UPDATE channels SET evals_through = evals_through + 1")
"""


@pytest.fixture
def sqlite_settings(settings: RegistrySettings) -> RegistrySettings:
    if not settings.effective_database_url().startswith("sqlite"):
        pytest.skip("the WAL-index header is SQLite's")
    return settings


def _database(settings: RegistrySettings) -> str:
    return settings.effective_database_url().removeprefix("sqlite:///")


def test_each_commit_of_another_process_is_seen_by_the_next_lookup(sqlite_settings: RegistrySettings) -> None:
    app = create_app(sqlite_settings)
    with TestClient(app, headers={"Authorization": f"Bearer {make_token(app, ['admin'])}"}) as client:
        seed(client)
        fingerprints: ChannelFingerprints = app.state.resolve_cache.fingerprints
        row = fingerprints.lookup("tiny", "prod")
        assert row is not None
        assert fingerprints._wal_index is not None  # the header is watched, not the pragma asked
        through = row[2]
        for step in (1, 1, 3, 17):  # single commits, and bursts within the same millisecond
            subprocess.run([sys.executable, "-c", WRITER, _database(sqlite_settings), str(step)], check=True)
            through += step
            again = fingerprints.lookup("tiny", "prod")
            assert again is not None and again[2] == through
            assert fingerprints.lookup("tiny", "prod") == again  # unchanged: answered from the kept row
        writer = sqlite3.connect(_database(sqlite_settings), isolation_level=None)
        writer.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the log restarts: new salts, frame 0
        writer.execute("UPDATE channels SET evals_through = evals_through + 1")
        writer.close()
        latest = fingerprints.lookup("tiny", "prod")
        assert latest is not None and latest[2] == through + 1


def _header(i_change: int, is_init: int = 1) -> bytes:
    # iVersion, unused, iChange, isInit, bigEndCksum, szPage, mxFrame, nPage, aFrameCksum[2], aSalt[2], aCksum[2]
    return struct.pack("=IIIBBHIIIIIIII", 3007000, 0, i_change, is_init, 0, 4096, i_change, 2, 1, 2, 3, 4, 5, 6)


@pytest.mark.parametrize(
    ("copies", "trusted"),
    [
        ((_header(7), _header(7)), True),
        ((_header(8), _header(7)), False),  # a writer between its two copies
        ((_header(7, is_init=0), _header(7, is_init=0)), False),  # no index built yet
    ],
)
def test_the_header_is_trusted_only_when_its_copies_agree(
    tmp_path: Path, copies: tuple[bytes, bytes], trusted: bool
) -> None:
    shm = tmp_path / "registry.db-shm"
    shm.write_bytes(copies[0] + copies[1] + bytes(32768 - 96))
    file = open(shm, "rb")  # noqa: SIM115 - closed by the header
    header = WalIndexHeader(file, mmap.mmap(file.fileno(), 96, access=mmap.ACCESS_READ))
    try:
        assert header.read() == (copies[0] if trusted else None)
    finally:
        header.close()


def test_a_database_not_in_wal_mode_has_no_header_to_watch(tmp_path: Path) -> None:
    rollback = sqlite3.connect(tmp_path / "rollback.db", isolation_level=None)
    rollback.execute("CREATE TABLE t (x)")
    assert WalIndexHeader.open(rollback) is None
    memory = sqlite3.connect(":memory:", isolation_level=None)
    memory.execute("PRAGMA journal_mode=WAL")
    assert WalIndexHeader.open(memory) is None
