"""The API's listings a page at a time, on SQLite and PostgreSQL: every list route answers at most `limit` rows
(PAGE_LIMIT unless asked, at most MAX_PAGE_LIMIT) in a stable order, names the next page in a `Link` header, and
reads each page in a number of SQL statements that does not grow with the rows listed; walking the links lists
every row exactly once. Bad paging parameters are refused with the API's error shape and a stable code."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest
from fastapi import FastAPI
from sqlalchemy import insert, select
from sqlalchemy.orm import Session
from starlette.testclient import TestClient

from kiln.client import RegistryClient
from kiln.core.hardware import builtin_catalog
from kiln.registry.app import create_app
from kiln.registry.artifacts.models import Artifact
from kiln.registry.attestations.models import TrustedKey
from kiln.registry.audit.models import AuditEvent
from kiln.registry.auth.cache import TokenCache
from kiln.registry.auth.models import Token
from kiln.registry.channels.models import Channel, ChannelEvent
from kiln.registry.hardware.models import HardwareEntry
from kiln.registry.models.models import Model
from kiln.registry.paging import MAX_PAGE_LIMIT, PAGE_LIMIT
from kiln.registry.performance.models import PerformanceRecord
from kiln.registry.releases.models import Release
from kiln.registry.settings import RegistrySettings
from kiln.registry.webhooks.models import Webhook, WebhookDelivery
from tests.registry.conftest import make_token
from tests.registry.helpers import assert_error, make_release, post_eval, promote, publish, seal
from tests.registry.test_web_paging import statements

START = datetime(2026, 1, 1, tzinfo=UTC)
EXTRA = PAGE_LIMIT + 37  # rows each listing gets on top of the base registry: more than one page
ART = "/v1/models/tiny/releases/1.0/artifacts/gguf-q8"


@dataclass(frozen=True)
class Base:
    """What the base registry holds that the seeds refer to."""

    model: int
    release: int
    artifact: int
    channel: int
    webhook: int
    event: int


@dataclass(frozen=True)
class Listing:
    url: str
    seed: Callable[[Session, Base], list[str]]  # adds EXTRA rows; their keys, in the order listed
    keys: Callable[[Any], list[str]] = lambda body: [str(row["id"]) for row in body]
    bad_after: str = "0"  # an `after` the route refuses as invalid input


def _ids(session: Session, column: Any, *where: Any) -> list[str]:
    return [str(i) for i in session.scalars(select(column).where(*where).order_by(column))]


def seed_models(session: Session, base: Base) -> list[str]:
    names = [f"m-{i:05d}" for i in range(EXTRA)]
    session.execute(insert(Model), [{"name": n, "description": "", "created_at": START} for n in names])
    return names


def seed_releases(session: Session, base: Base) -> list[str]:
    # All at one instant: the order among them is the id's, newest first.
    versions = [f"9.{i}" for i in range(EXTRA)]
    rows = [
        {
            "model_id": base.model,
            "version": v,
            "source_digest": "d" * 64,
            "lineage": {},
            "model_config": {},
            "planned_artifacts": ["gguf-q8"],
            "status": "open",
            "created_at": START,
        }
        for v in versions
    ]
    session.execute(insert(Release), rows)
    return versions[::-1]


def seed_artifacts(session: Session, base: Base) -> list[str]:
    names = [f"a-{i:05d}" for i in range(EXTRA)]
    row = {
        "release_id": base.release,
        "target": "gguf",
        "format": "gguf-v3",
        "quant": "q8_0",
        "hardware": ["cpu"],
        "unsupported": {},
        "runtime": {},
        "provenance": {},
        "manifest_digest": "0" * 64,
        "total_size": 1,
    }
    session.execute(insert(Artifact), [{**row, "name": n} for n in names])
    return names


def seed_channels(session: Session, base: Base) -> list[str]:
    names = [f"c-{i:04d}" for i in range(EXTRA)]
    session.execute(
        insert(Channel),
        [{"model_id": base.model, "name": n, "release_id": base.release, "evals_through": 0} for n in names],
    )
    return names


def seed_history(session: Session, base: Base) -> list[str]:
    reasons = [f"e-{i:04d}" for i in range(EXTRA)]
    session.execute(
        insert(ChannelEvent),
        [{"channel_id": base.channel, "to_version": "1.0", "forced": False, "reason": r} for r in reasons],
    )
    return reasons[::-1]


def seed_performance(session: Session, base: Base) -> list[str]:
    record = {
        "artifact_id": base.artifact,
        "hardware": "cpu",
        "runtime": "llama.cpp",
        "runtime_version": "b4000",
        "tp": 1,
        "context": 4096,
        "concurrency": 1,
        "tokens_per_s": 10.0,
        "ttft_ms": 100.0,
        "itl_p50_ms": 10.0,
        "itl_p99_ms": 20.0,
        "recorded_by": "bench",
    }
    session.execute(insert(PerformanceRecord), [record] * EXTRA)
    return _ids(session, PerformanceRecord.id)[::-1]


def seed_hardware(session: Session, base: Base) -> list[str]:
    """SKUs before, between and after the built-in ones, and one overriding a built-in entry."""
    cpu = builtin_catalog().get("cpu").model_dump(mode="json")
    names = sorted([f"a{i:03d}" for i in range(EXTRA // 2)] + [f"z{i:03d}" for i in range(EXTRA - EXTRA // 2 - 1)])
    names = sorted([*names, "h100"])
    session.execute(
        insert(HardwareEntry), [{"name": n, "profile": {**cpu, "name": n}, "updated_by": "bench"} for n in names]
    )
    return names


def seed_audit(session: Session, base: Base) -> list[str]:
    event = {"actor": "bench", "action": "model.touch", "target": "tiny", "model": "tiny", "details": {}}
    session.execute(insert(AuditEvent), [event] * EXTRA)
    return _ids(session, AuditEvent.id, AuditEvent.action == "model.touch")[::-1]


def seed_tokens(session: Session, base: Base) -> list[str]:
    session.execute(
        insert(Token),
        [
            {
                "name": f"t-{i}",
                "token_hash": f"{i:064x}",
                "prefix": "kiln_x",
                "scopes": ["read"],
                "models": ["tiny*"] if i % 2 else [],
                "created_by": "bench",
            }
            for i in range(EXTRA)
        ],
    )
    return _ids(session, Token.id, Token.created_by == "bench")


PEM = "-----BEGIN PUBLIC KEY-----\nMCowBQYDK2VwAyEA\n-----END PUBLIC KEY-----\n"


def seed_keys(session: Session, base: Base) -> list[str]:
    # Key ids descending as they are added: the listing is in the order keys were added, not by key id.
    key_ids = [f"{EXTRA - i:064x}" for i in range(EXTRA)]
    session.execute(
        insert(TrustedKey),
        [{"key_id": k, "model_pattern": "tiny*", "public_key_pem": PEM, "created_by": "bench"} for k in key_ids],
    )
    return key_ids


def seed_webhooks(session: Session, base: Base) -> list[str]:
    hook = {"url": "https://hooks.example/x", "secret": "s" * 32, "events": ["channel.promote"], "created_by": "b"}
    session.execute(insert(Webhook), [{**hook, "model_pattern": "tiny*" if i % 2 else "*"} for i in range(EXTRA)])
    return _ids(session, Webhook.id, Webhook.id != base.webhook)


def seed_deliveries(session: Session, base: Base) -> list[str]:
    delivery = {"webhook_id": base.webhook, "audit_event_id": base.event, "event": "channel.promote", "payload": {}}
    session.execute(insert(WebhookDelivery), [delivery] * EXTRA)
    return _ids(session, WebhookDelivery.id)[::-1]


LISTINGS: dict[str, Listing] = {
    "models": Listing("/v1/models", seed_models, lambda body: [r["name"] for r in body], bad_after="Not A Name"),
    "model-releases": Listing(
        "/v1/models/tiny", seed_releases, lambda body: list(body["releases"]), bad_after="not a version!"
    ),
    "releases": Listing(
        "/v1/models/tiny/releases", seed_releases, lambda body: [r["version"] for r in body], "not a version!"
    ),
    "artifacts": Listing(
        "/v1/models/tiny/releases/1.0/artifacts", seed_artifacts, lambda body: [r["name"] for r in body], "A/B"
    ),
    "channels": Listing("/v1/models/tiny/channels", seed_channels, lambda body: [r["name"] for r in body], "Prod"),
    "channel-history": Listing(
        "/v1/models/tiny/channels/prod", seed_history, lambda body: [str(e["reason"]) for e in body["history"]]
    ),
    "performance": Listing(f"{ART}/performance", seed_performance),
    "hardware": Listing("/v1/hardware", seed_hardware, lambda body: [h["name"] for h in body], bad_after="H100!"),
    "audit": Listing("/v1/audit", seed_audit),
    "tokens": Listing("/v1/tokens", seed_tokens),
    "keys": Listing("/v1/keys", seed_keys, lambda body: [k["key_id"] for k in body], bad_after="not-hex"),
    "webhooks": Listing("/v1/webhooks", seed_webhooks),
    "webhook-deliveries": Listing("/v1/webhooks/1/deliveries", seed_deliveries),
}


def seed_base(app: FastAPI, client: TestClient) -> Base:
    """tiny@1.0 with gguf-q8 (evaluated, sealed, on prod) and a webhook with nothing delivered yet."""
    make_release(client)
    publish(client, "gguf-q8", {"model.gguf": b"q8" * 64}, ["cpu"])
    assert post_eval(client, "gguf-q8", "passed").status_code == 201
    seal(client)
    assert promote(client).status_code == 200
    with app.state.session_factory() as session:
        webhook = Webhook(
            url="https://hooks.example/first", secret="s" * 32, events=["channel.promote"], model_pattern="*"
        )
        webhook.created_by = "bench"
        session.add(webhook)
        session.flush()
        base = Base(
            model=session.scalars(select(Model.id).where(Model.name == "tiny")).one(),
            release=session.scalars(select(Release.id).where(Release.version == "1.0")).one(),
            artifact=session.scalars(select(Artifact.id).where(Artifact.name == "gguf-q8")).one(),
            channel=session.scalars(select(Channel.id).where(Channel.name == "prod")).one(),
            webhook=webhook.id,
            event=session.scalars(select(AuditEvent.id).order_by(AuditEvent.id)).first() or 0,
        )
        session.commit()
    assert base.webhook == 1  # the deliveries' URL names it
    return base


def seeded(app: FastAPI, client: TestClient, listing: Listing) -> list[str]:
    base = seed_base(app, client)
    with app.state.session_factory() as session:
        keys = listing.seed(session, base)
        session.commit()
    assert len(keys) == EXTRA
    return keys


def next_link(response: Any) -> str | None:
    link = response.headers.get("link")
    if link is None:
        return None
    assert link.startswith("<") and link.endswith('>; rel="next"'), link
    return str(link[1 : -len('>; rel="next"')])


@pytest.fixture
def app(settings: RegistrySettings) -> FastAPI:
    """The registry, its token cache kept for the whole test: on a loaded machine a walk outlasts the 5 s it
    keeps a token, and the lookup after would add a statement to one page."""
    app = create_app(settings)
    app.state.token_cache = TokenCache(app.state.session_factory, ttl_s=3600)
    return app


def walk(app: FastAPI, client: TestClient, listing: Listing, url: str) -> tuple[list[list[str]], list[int]]:
    """Every page from `url` on, following the `Link` headers: each page's keys, and its SQL statements."""
    pages: list[list[str]] = []
    counts: list[int] = []
    next_url: str | None = url
    while next_url is not None:
        with statements(app) as seen:
            response = client.get(next_url)
        assert response.status_code == 200, response.text[:2000]
        pages.append(listing.keys(response.json()))
        counts.append(len(seen))
        next_url = next_link(response)
        assert len(pages) <= 2 * EXTRA
    return pages, counts


@pytest.mark.parametrize("name", list(LISTINGS))
def test_every_listing_is_walked_a_page_at_a_time_in_a_fixed_number_of_queries(
    app: FastAPI, client: TestClient, name: str
) -> None:
    listing = LISTINGS[name]
    keys = seeded(app, client, listing)
    everything = client.get(listing.url, params={"limit": MAX_PAGE_LIMIT})
    assert everything.status_code == 200 and next_link(everything) is None
    whole = listing.keys(everything.json())
    assert len(whole) > PAGE_LIMIT and len(set(whole)) == len(whole)
    assert [k for k in whole if k in set(keys)] == keys  # the seeded rows, in the listing's order
    client.get(listing.url)  # warm what the app reads once (the token, the settings)

    pages, counts = walk(app, client, listing, listing.url)
    assert [len(p) for p in pages[:-1]] == [PAGE_LIMIT] * (len(pages) - 1) and 0 < len(pages[-1]) <= PAGE_LIMIT
    assert sum(pages, []) == whole  # every row once, in order
    smaller, small_counts = walk(app, client, listing, f"{listing.url}?limit=45")
    assert [len(p) for p in smaller[:-1]] == [45] * (len(smaller) - 1) and sum(smaller, []) == whole
    # The same statements for every page past the first (the first may skip reading a cursor), whatever
    # the page's size and however many rows the table holds.
    print(f"{name}: {len(whole)} rows, statements per page {counts} (limit=45: {small_counts})")  # shown with -s
    assert len(set(counts[1:] + small_counts[1:])) == 1, (counts, small_counts)
    assert counts[0] == small_counts[0] <= counts[-1] <= 6, (counts, small_counts)


@pytest.mark.parametrize("name", list(LISTINGS))
def test_bad_paging_parameters_are_refused_with_a_stable_code(app: FastAPI, client: TestClient, name: str) -> None:
    listing = LISTINGS[name]
    seed_base(app, client)
    for query in (
        {"limit": 0},
        {"limit": MAX_PAGE_LIMIT + 1},
        {"limit": "ten"},
        {"limit": -1},
        {"after": listing.bad_after},
    ):
        error = assert_error(client.get(listing.url, params=query), 422, "INVALID_INPUT")
        assert error["details"]["errors"][0]["loc"] == ["query", next(iter(query))]


def test_a_cursor_naming_nothing_listable_is_refused(app: FastAPI, client: TestClient) -> None:
    seed_base(app, client)
    for url in ("/v1/models/tiny/releases?after=9.9", "/v1/models/tiny?after=9.9", f"/v1/keys?after={'a' * 64}"):
        assert_error(client.get(url), 422, "PAGE_CURSOR_UNKNOWN")
    assert_error(client.get("/v1/models/nobody/releases?after=1.0"), 404, "NOT_FOUND")


def test_the_next_link_keeps_the_query_and_the_root_path(app: FastAPI, client: TestClient) -> None:
    seeded(app, client, LISTINGS["audit"])
    first = client.get("/v1/audit?model=tiny&limit=2")
    ids = [e["id"] for e in first.json()]
    assert next_link(first) == f"/v1/audit?model=tiny&after={ids[-1]}&limit=2"
    assert client.get("/v1/audit").headers["link"] == f'</v1/audit?after={ids[0] - PAGE_LIMIT + 1}>; rel="next"'
    with TestClient(app, root_path="/registry", headers=dict(client.headers)) as proxied:
        link = next_link(proxied.get("/v1/audit?limit=2"))
        assert link is not None and link.startswith("/registry/v1/audit?after=")
        assert [e["id"] for e in proxied.get(link).json()] == [ids[0] - 2, ids[0] - 3]


def test_a_limited_token_pages_through_what_it_may_see(app: FastAPI, client: TestClient) -> None:
    """Listings filtered by a token's patterns (tokens, webhooks, keys, models): only what it may see, each row
    once, each page in a bounded number of statements however sparse its rows are."""
    base = seed_base(app, client)
    with app.state.session_factory() as session:
        for seed in (seed_tokens, seed_webhooks, seed_keys, seed_models):
            seed(session, base)
        session.commit()
    admin = make_token(app, ["admin"], ["tiny*"], name="tiny-admin")
    with TestClient(app, headers={"Authorization": f"Bearer {admin}"}) as limited:
        for url, expected in (
            ("/v1/tokens?limit=5", EXTRA // 2 + 1),  # the odd ones of the seed, and its own
            ("/v1/webhooks?limit=5", EXTRA // 2),
            ("/v1/keys?limit=5", EXTRA),
            ("/v1/models?limit=5", 1),
        ):
            listing = Listing(url, seed_models, LISTINGS[url.split("?")[0].split("/")[2]].keys)
            pages, counts = walk(app, limited, listing, url)
            rows = sum(pages, [])
            assert len(rows) == len(set(rows)) == expected, url
            assert all(len(p) <= 5 for p in pages) and max(counts) <= 10, (url, counts)


def test_the_client_follows_the_pages(app: FastAPI, client: TestClient) -> None:
    base = seed_base(app, client)
    with app.state.session_factory() as session:
        releases = seed_releases(session, base)
        hardware = seed_hardware(session, base)
        keys = seed_keys(session, base)
        tokens = seed_tokens(session, base)
        session.execute(
            insert(AuditEvent),
            [{"actor": "bench", "action": "model.touch", "target": "tiny", "model": "tiny", "details": {}}]
            * (MAX_PAGE_LIMIT + 10),
        )
        session.commit()
    registry = RegistryClient(client, "test", on_close=lambda: None)
    assert [r.version for r in registry.list_releases("tiny")] == ["1.0", *releases]
    assert [m.name for m in registry.list_models()] == ["tiny"]
    listed = [h.name for h in registry.hardware()]
    assert listed == sorted({*hardware, *builtin_catalog().profiles}) and len(listed) > PAGE_LIMIT
    assert [k.key_id for k in registry.list_keys()] == keys
    assert [str(t.id) for t in registry.list_tokens()][-EXTRA:] == tokens
    events = registry.audit("tiny", limit=MAX_PAGE_LIMIT + 5)
    assert len(events) == MAX_PAGE_LIMIT + 5 and len({e.id for e in events}) == len(events)
    assert [e.id for e in events] == sorted((e.id for e in events), reverse=True)
    assert len(registry.audit(limit=3)) == 3


def test_hardware_pages_merge_the_registrys_entries_with_the_builtin_ones(app: FastAPI, client: TestClient) -> None:
    base = seed_base(app, client)
    with app.state.session_factory() as session:
        seed_hardware(session, base)
        session.commit()
    pages, _ = walk(app, client, LISTINGS["hardware"], "/v1/hardware?limit=7")
    names = sum(pages, [])
    assert names == sorted({*names}) and set(builtin_catalog().profiles) <= set(names)
    sources = {h["name"]: h["source"] for h in client.get("/v1/hardware?limit=1000").json()}
    assert sources["h100"] == "registry (overrides builtin)" and sources["a000"] == "registry"
    assert sources["cpu"] == "builtin"


@pytest.mark.parametrize("name", list(LISTINGS))
def test_a_query_parameter_the_listing_does_not_take_is_refused(app: FastAPI, client: TestClient, name: str) -> None:
    """Found by the fuzz suite: `?=0.0` (an empty name) was answered 200, and a next page's URL carries the query."""
    seed_base(app, client)
    url = LISTINGS[name].url
    for query in ("=0.0", "colour=blue"):
        assert_error(client.get(f"{url}{'&' if '?' in url else '?'}{query}"), 422, "INVALID_INPUT")
