"""Bounded work per token request: patterns per token, cost per pattern, and a listing that compares each
pair of patterns once (issue 40, section 3).

A scoped admin could create a token with 40 patterns such as `other-*a??????????0000`, each an
automaton of thousands of states, contained in its own `other-*`: creation took 14.6 s and every later
`GET /v1/tokens` 13 s. Such a pattern is now refused at creation, a token names at most
`MAX_TOKEN_PATTERNS`, and the rows stored before the bound are listed in bounded time.
"""

from __future__ import annotations

import time

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from kiln.registry.auth.models import Token
from kiln.registry.auth.patterns import MAX_PATTERN_STATES, check_pattern, pattern_contains, pattern_states
from kiln.registry.auth.service import MAX_TOKEN_PATTERNS
from tests.registry.conftest import make_token
from tests.registry.helpers import assert_error

EXPENSIVE = "other-*a??????????0000"  # 6,151 states: contained in `other-*`, costly to prove


def _scoped_admin(app: FastAPI) -> TestClient:
    return TestClient(app, headers={"Authorization": f"Bearer {make_token(app, ['admin'], ['other-*'], 'other')}"})


def test_a_costly_pattern_is_refused_with_a_code(app: FastAPI) -> None:
    with _scoped_admin(app) as admin:
        started = time.monotonic()
        error = assert_error(
            admin.post("/v1/tokens", json={"name": "t", "scopes": ["read"], "models": [EXPENSIVE] * 40}),
            422,
            "TOO_MANY_PATTERNS",
        )
        assert error["details"]["max"] == MAX_TOKEN_PATTERNS
        error = assert_error(
            admin.post("/v1/tokens", json={"name": "t", "scopes": ["read"], "models": [EXPENSIVE]}),
            422,
            "PATTERN_TOO_COMPLEX",
        )
        assert error["details"] == {"pattern": EXPENSIVE, "max_states": MAX_PATTERN_STATES}
        assert time.monotonic() - started < 2
        made = admin.post("/v1/tokens", json={"name": "t", "scopes": ["read"], "models": ["other-a*", "other-b?"]})
        assert made.status_code == 201
        assert [t["name"] for t in admin.get("/v1/tokens").json()] == ["other", "t"]


def test_a_costly_webhook_pattern_is_refused_with_a_code(client: TestClient) -> None:
    spec = {"url": "https://hooks.example.com/kiln", "events": ["release.seal"], "model_pattern": EXPENSIVE}
    assert_error(client.post("/v1/webhooks", json=spec), 422, "PATTERN_TOO_COMPLEX")


@pytest.mark.parametrize(
    "pattern", ["*", "tiny-*", "llama-3-*-instruct", "*a?????", "[abc]*-v?-*-q?_k_m", "a*b*c*d*e*f*g*h*i*j"]
)
def test_ordinary_patterns_are_within_the_bound(pattern: str) -> None:
    check_pattern(pattern)


@pytest.mark.timing
def test_the_pattern_check_and_comparisons_take_bounded_time() -> None:
    """The check stops counting at the bound, so even a pattern of 2^60 states is refused at once;
    any two patterns the check accepts are compared exactly, quickly."""
    worst = ["*a" + "?" * 62, "a*b" + "?" * 20 + "*c" + "?" * 20, "*[ab]" + "?" * 59 + "0000", EXPENSIVE]
    for pattern in worst:
        started = time.perf_counter()
        assert pattern_states(pattern) == MAX_PATTERN_STATES + 1
        assert time.perf_counter() - started < 0.05, pattern
    accepted = ["*a?????", "*b????", "*[ab]????", "*a?b?c", "?*a???", "tiny-*", "*-*-*-*-*-*"]
    started = time.perf_counter()
    for outer in accepted:
        check_pattern(outer)
        for inner in accepted:
            pattern_contains.__wrapped__(outer, inner)
    assert time.perf_counter() - started < 1.0


@pytest.mark.timing
def test_a_listing_with_costly_stored_patterns_is_bounded_and_not_repeated(app: FastAPI) -> None:
    """Rows stored before the bound (written straight to the database): the first listing compares each
    pair once, within the pair bound; the next compares none."""
    with app.state.session_factory() as session:
        for i in range(2):
            models = [f"other-*{c}??????????{i:04d}" for c in "abcdefgh"]
            session.add(
                Token(
                    name=f"old{i}",
                    token_hash=f"{i:064x}",
                    prefix="kiln_old",
                    scopes=["read"],
                    models=models,
                    created_by="test",
                )
            )
        session.commit()
    with _scoped_admin(app) as admin:
        started = time.monotonic()
        first = admin.get("/v1/tokens")
        first_s = time.monotonic() - started
        started = time.monotonic()
        again = admin.get("/v1/tokens")
        again_s = time.monotonic() - started
    assert first.status_code == 200 and again.json() == first.json()
    assert first_s < 3.0 and again_s < 0.2, (first_s, again_s)
