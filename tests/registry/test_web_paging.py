"""The web pages' listings a page at a time, on SQLite and PostgreSQL: at most the page size with a link to
the next page, and a number of SQL statements per page that does not grow with the rows listed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

from fastapi import FastAPI
from sqlalchemy import event, insert, select
from starlette.testclient import TestClient

from kiln.registry.audit.models import AuditEvent
from kiln.registry.models.models import Model
from kiln.registry.paging import PAGE_LIMIT
from kiln.registry.releases.models import Release
from tests.registry.conftest import make_token
from tests.registry.pages import Node, parse, seed

START = datetime(2026, 1, 1, tzinfo=UTC)


def add_models(app: FastAPI, count: int, releases: int = 1, first: int = 0) -> None:
    """`count` models named m-00000..., each with `releases` sealed releases, straight in the database."""
    with app.state.session_factory() as session:
        names = [f"m-{i:05d}" for i in range(first, first + count)]
        session.execute(insert(Model), [{"name": n, "description": f"model {n}", "created_at": START} for n in names])
        ids = {name: id_ for name, id_ in session.execute(select(Model.name, Model.id))}
        if not releases:
            session.commit()
            return
        session.execute(
            insert(Release),
            [
                {
                    "model_id": ids[n],
                    "version": f"{v}.0",
                    "source_digest": "d" * 64,
                    "lineage": {},
                    "model_config": {},
                    "planned_artifacts": [],
                    "status": "sealed",
                    "created_at": START + timedelta(seconds=v),
                }
                for n in names
                for v in range(1, releases + 1)
            ],
        )
        session.commit()


@contextmanager
def statements(app: FastAPI) -> Iterator[list[str]]:
    """The SQL statements the app's engine runs inside the block."""
    seen: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    event.listen(app.state.engine, "before_cursor_execute", count)
    try:
        yield seen
    finally:
        event.remove(app.state.engine, "before_cursor_execute", count)


def get(client: TestClient, url: str) -> Node:
    response = client.get(url)
    assert response.status_code == 200, response.text[:2000]
    return parse(response.text)


def next_link(doc: Node) -> str | None:
    links = doc.find_all("a", id="next-page")
    return links[0].attrs["href"] if links else None


def listed(doc: Node, table: str, attribute: str) -> list[str]:
    return [tr.attrs[attribute] for tr in doc.find("table", id=table).find_all("tr") if attribute in tr.attrs]


def walk(client: TestClient, url: str, table: str, attribute: str) -> list[list[str]]:
    """Every page of a listing, following the next links from `url`."""
    pages: list[list[str]] = []
    next_url: str | None = url
    while next_url is not None:
        doc = get(client, next_url)
        pages.append(listed(doc, table, attribute) if doc.find_all("table", id=table) else [])
        next_url = next_link(doc)
        assert len(pages) < 50
    return pages


def test_models_page_is_paged_in_a_fixed_number_of_queries(app: FastAPI, client: TestClient) -> None:
    seed(client)  # tiny: three releases, a channel
    add_models(app, 40)
    client.get("/ui/")  # warm whatever the app reads once (the token, the settings)
    with statements(app) as few:
        small = get(client, "/ui/")
    add_models(app, 310, releases=3, first=40)
    with statements(app) as many:
        large = get(client, "/ui/")
    assert len(listed(small, "models", "data-model")) == 41 and next_link(small) is None
    names = listed(large, "models", "data-model")
    assert names == [f"m-{i:05d}" for i in range(PAGE_LIMIT)]
    assert next_link(large) == f"/ui/?after=m-{PAGE_LIMIT - 1:05d}"
    # The same statements for 41 models as for 351, three of them for the listing itself.
    assert len(many) == len(few) <= 6, many
    assert not large.find_all("tr", data_model="m-00300")
    row = large.find("tr", data_model="m-00050")
    assert row.find("a", href="/ui/models/m-00050/releases/3.0").text == "3.0"
    assert [td.text for td in row.find_all("td")][3] == "3"

    pages = walk(client, "/ui/?limit=150", "models", "data-model")
    assert [len(p) for p in pages] == [150, 150, 51]
    assert sum(pages, []) == sorted(sum(pages, [])) and "tiny" in pages[-1]
    tiny = get(client, "/ui/?after=m-00349").find("tr", data_model="tiny")
    assert tiny.find("a", href="/ui/models/tiny/releases/2.0").text == "2.0"  # sealed, over the newer open 3.0
    assert tiny.find("a", href="/ui/models/tiny/channels/prod").text == "prod → 2.0"


def test_a_limited_token_pages_through_its_models_only(app: FastAPI, client: TestClient) -> None:
    add_models(app, 1500, releases=0)
    limited = make_token(app, ["read"], ["m-014*", "m-00003"], name="limited")
    with TestClient(app, headers={"Authorization": f"Bearer {limited}"}) as reader:
        with statements(app) as seen:
            pages = walk(reader, "/ui/?limit=5", "models", "data-model")
        names = sum(pages, [])
        assert names == ["m-00003"] + [f"m-0{i}" for i in range(1400, 1500)]
        assert all(len(p) <= 5 for p in pages)
        # Each page reads a bounded number of chunks, however sparse the token's models are.
        assert len(seen) <= len(pages) * 10


def test_model_page_pages_its_releases(app: FastAPI, client: TestClient) -> None:
    add_models(app, 1, releases=250)
    with statements(app) as seen:
        pages = walk(client, "/ui/models/m-00000", "releases", "data-version")
    assert [len(p) for p in pages] == [100, 100, 50]
    assert sum(pages, []) == [f"{v}.0" for v in range(250, 0, -1)]  # newest first
    assert len(seen) <= 3 * 8  # per page: the token, the model (thrice), the cursor, the releases, the channels
    response = client.get("/ui/models/m-00000?after=9.9")
    assert response.status_code == 422 and "PAGE_CURSOR_UNKNOWN" in response.text


def test_audit_and_channel_history_are_paged(app: FastAPI, client: TestClient) -> None:
    seed(client)
    with app.state.session_factory() as session:
        session.execute(
            insert(AuditEvent),
            [{"actor": "bench", "action": "model.touch", "target": "tiny", "model": "tiny", "details": {}}] * 230,
        )
        session.commit()
    pages = walk(client, "/ui/audit?model=tiny", "audit", "data-action")
    assert [len(p) for p in pages[:2]] == [PAGE_LIMIT, PAGE_LIMIT] and len(pages) == 3
    assert len(get(client, "/ui/audit?limit=1000").find_all("tr", data_action="model.touch")) == 230
    history = get(client, "/ui/models/tiny/channels/prod?limit=1")
    assert len(history.find("table", id="history").find_all("tr")) == 2  # the header and one event
    older = get(client, next_link(history) or "")
    assert "(new) → 1.0" in older.find("table", id="history").text and next_link(older) is None
    response = client.get("/ui/audit?limit=1001")
    assert response.status_code == 422
    for url in ("/ui/audit?after=2147483648", "/ui/models/tiny/channels/prod?after=2147483648"):
        # Past the ids the database holds (PostgreSQL: 32-bit): refused, not a server error.
        response = client.get(url)
        assert response.status_code == 422 and "INVALID_INPUT" in response.text, url
