"""A write transaction never waits for a thread while it is open, and never takes the write lock for nothing.

On SQLite a write request's transaction (BEGIN IMMEDIATE) holds the database's one write lock from its first
statement to its end. Under the soak's load every thread of the default pool was at times waiting for that
lock in SQLite's busy handler, while the request holding it waited for one of those threads to end its
transaction (a rollback in the session's teardown, or the commit of an `async def` route in a second thread
hop): the lock was held until the waiters' 10 s busy timeout, and they answered 503. And a route that read
what it answers after its commit took the write lock a second time, only to roll it back.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import anyio.to_thread
import pytest
from fastapi import FastAPI
from sqlalchemy import event, select, text
from sqlalchemy.engine import Connection
from starlette.testclient import TestClient

from kiln.core.errors import Conflict, Unavailable
from kiln.registry.db import WRITE_OPTION, WriteTurns, create_db_engine, create_session_factory
from tests.registry.helpers import make_release, post_eval, promote, publish, seal, upload


class Transactions:
    """Every transaction's end on `app`'s engine, as (write session?, "commit" | "rollback")."""

    def __init__(self, app: FastAPI) -> None:
        self.ended: list[tuple[bool, str]] = []
        engine = app.state.engine
        for kind in ("commit", "rollback"):
            event.listen(engine, kind, self._listener(kind))

    def _listener(self, kind: str) -> Any:
        def ended(conn: Connection) -> None:
            self.ended.append((bool(conn.get_execution_options().get(WRITE_OPTION)), kind))

        return ended

    def take(self) -> list[tuple[bool, str]]:
        ended, self.ended = self.ended, []
        return ended


def test_successful_writes_roll_no_write_transaction_back(app: FastAPI, client: TestClient) -> None:
    """Each step of a release's life answers 2xx, and no write transaction of it ends in a ROLLBACK: none
    read after its commit (taking the lock again), none was left open for the teardown."""
    seen = Transactions(app)
    entry = {k: v for k, v in client.get("/v1/hardware/h100").json().items() if k not in ("name", "source")}
    split = {"weights": [{"version": "1.0", "weight": 100}]}
    steps: list[tuple[str, Any]] = [
        ("open", lambda: make_release(client)),
        ("publish", lambda: publish(client, "gguf-q8", {"model.gguf": b"8" * 300}, ["cpu", "h100"], quant="q8_0")),
        ("upload again", lambda: upload(client, b"8" * 300)),  # bytes stored, from the caller who stored them
        ("eval", lambda: post_eval(client, "gguf-q8", "passed", metrics={"kl": 0.01})),
        ("seal", lambda: seal(client)),
        ("promote", lambda: promote(client, "1.0")),
        ("promote again", lambda: promote(client, "1.0")),  # nothing to change
        ("split", lambda: client.put("/v1/models/tiny/channels/canary/split", json=split)),
        ("hardware", lambda: client.put("/v1/hardware/node-1", json={**entry, "memory_gib": 96})),
        ("token", lambda: client.post("/v1/tokens", json={"name": "ci", "scopes": ["publish"]})),
    ]
    seen.take()
    wasted = {}
    for label, step in steps:
        answer = step()
        assert getattr(answer, "status_code", 200) in (200, 201), (label, answer.text)
        ended = seen.take()
        assert (True, "commit") in ended, label
        if (True, "rollback") in ended:
            wasted[label] = ended
    assert not wasted, wasted


def test_a_failed_write_is_rolled_back_without_waiting_for_a_pool_thread(
    app: FastAPI, client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A promotion that takes the write lock and then fails, while the one pool thread there is goes to a
    hardware write waiting for that lock: the failed transaction is rolled back on a thread of its own,
    and the hardware write answers at once (before: it waited out SQLite's 10 s busy timeout, then 503)."""
    entry = {k: v for k, v in client.get("/v1/hardware/h100").json().items() if k not in ("name", "source")}

    def failing_promote(session: Any, *args: Any, **kwargs: Any) -> None:
        session.execute(select(1))  # the transaction begins: on SQLite, the write lock is taken
        time.sleep(0.6)  # meanwhile the hardware write queues for the pool's one thread
        raise Conflict("refused on purpose")

    monkeypatch.setattr("kiln.registry.channels.service.promote", failing_promote)

    async def one_thread() -> None:
        anyio.to_thread.current_default_thread_limiter().total_tokens = 1

    assert client.portal is not None
    client.portal.call(one_thread)
    answers: dict[str, tuple[int, float]] = {}

    def send(name: str, call: Any) -> None:
        started = time.monotonic()
        answers[name] = (call().status_code, time.monotonic() - started)

    promoting = threading.Thread(target=send, args=("promote", lambda: promote(client, "1.0")))
    writing = threading.Thread(
        target=send, args=("hardware", lambda: client.put("/v1/hardware/node-2", json={**entry, "memory_gib": 64}))
    )
    promoting.start()
    time.sleep(0.2)
    writing.start()
    promoting.join(30)
    writing.join(30)
    assert answers["promote"][0] == 409
    status, seconds = answers["hardware"]
    assert status == 200 and seconds < 5, answers


def test_requests_run_on_as_many_threads_as_the_settings_say(app: FastAPI, client: TestClient) -> None:
    """Each server process runs requests' blocking work on `request_threads` threads (8): more only contend
    with the event loop for the interpreter (bench/soak.py)."""

    async def tokens() -> float:
        return anyio.to_thread.current_default_thread_limiter().total_tokens

    assert client.portal is not None
    assert client.portal.call(tokens) == app.state.settings.request_threads == 8


def test_reads_hold_no_pooled_connection_while_their_answer_waits_for_a_thread(
    app: FastAPI, client: TestClient
) -> None:
    """A plain `def` route's answer is checked in a second thread hop: its read session ends first, in the
    endpoint's thread (`registry.api.endpoint.SessionRoute`). Before, 24 concurrent reads on 2 threads held the
    pool's 15 connections while waiting for a thread, and the threads waited for a connection: 500s after the
    pool's 30 s timeout."""

    async def two_threads() -> None:
        anyio.to_thread.current_default_thread_limiter().total_tokens = 2

    assert client.portal is not None
    client.portal.call(two_threads)
    answers: list[tuple[int, float]] = []

    def read() -> None:
        started = time.monotonic()
        answers.append((client.get("/v1/hardware/h100").status_code, time.monotonic() - started))

    readers = [threading.Thread(target=read) for _ in range(24)]
    for r in readers:
        r.start()
    for r in readers:
        r.join(60)
    assert len(answers) == 24 and {status for status, _ in answers} == {200}, answers
    assert max(seconds for _, seconds in answers) < 10, answers


def test_writers_take_the_write_lock_in_the_order_they_asked(tmp_path: Path) -> None:
    """Five writers queued behind a sixth get SQLite's write lock first come, first served, not as SQLite's
    busy handler happens to wake them."""
    engine = create_db_engine(f"sqlite:///{tmp_path / 'turns.db'}")
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (writer INTEGER)")
    writes = create_session_factory(engine, write=True)
    order: list[int] = []

    def write(n: int) -> None:
        with writes() as session:
            session.execute(text("INSERT INTO t VALUES (:n)"), {"n": n})
            order.append(n)
            session.commit()

    first = writes()
    first.execute(text("INSERT INTO t VALUES (0)"))  # holds the lock while the others queue
    writers = [threading.Thread(target=write, args=(n,)) for n in range(1, 6)]
    for w in writers:
        w.start()
        time.sleep(0.1)
    first.commit()
    first.close()
    for w in writers:
        w.join(10)
    assert order == [1, 2, 3, 4, 5]
    engine.dispose()


def test_a_writer_whose_turn_does_not_come_is_refused_and_leaves_the_queue() -> None:
    turns = WriteTurns(timeout_s=0.2)
    turns.acquire()
    with pytest.raises(Unavailable) as refused:
        turns.acquire()
    assert refused.value.code == "UNAVAILABLE"
    turns.release()
    started = time.monotonic()
    turns.acquire()  # free at once: the refused writer is no longer queued ahead
    assert time.monotonic() - started < 0.1
    turns.release()
