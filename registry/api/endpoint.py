"""Routes whose plain `def` endpoints end their read transactions as they return (`SessionRoute`).

FastAPI runs a plain `def` endpoint in a thread of its pool, then checks its answer against the response model in
a second thread hop. A read session still in its transaction would keep its pooled connection while that hop waits
for a thread; under load every thread could then be waiting for a connection that a request waiting for a thread
holds (64 concurrent reads of one SKU with 8 threads a process: 23 of them answered 500 after the pool's 30 s
timeout, `tests/registry/test_write_transactions.py`). So a `SessionRoute` commits its endpoint's read sessions in
the endpoint's own thread, as it returns: a read has nothing to write, and its rows stay loaded
(`expire_on_commit=False`). A write session's transaction is the route's own; one left open (the route raised)
is rolled back as before (`registry.deps`). Every API, OCI and web route of the registry is a `SessionRoute`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from fastapi.routing import APIRoute
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from kiln.registry.db import WRITE_OPTION


class SessionRoute(APIRoute):
    """An API route whose plain `def` endpoint ends its read sessions' transactions in its own thread."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(path, ending_reads(endpoint), **kwargs)


def ending_reads(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    """`endpoint`, committing the read sessions among its arguments after it returns (an `async def` one as it
    is: its answer is checked on the event loop, no second hop)."""
    if inspect.iscoroutinefunction(endpoint) or getattr(endpoint, "ends_reads", False):
        return endpoint

    @functools.wraps(endpoint)
    def ended(*args: Any, **values: Any) -> Any:
        result = endpoint(*args, **values)
        for value in values.values():
            if isinstance(value, Session) and value.in_transaction() and not _writes(value):
                value.commit()
        return result

    ended.ends_reads = True  # type: ignore[attr-defined]
    return ended


def _writes(session: Session) -> bool:
    bind = session.get_bind()
    return isinstance(bind, Engine) and bool(bind.get_execution_options().get(WRITE_OPTION))
