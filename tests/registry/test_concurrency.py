"""Many writers at once, through a real server: promotions of one channel are serialised into a true
history chain, and concurrent publishers of one version with different contents get one winner and
clean 409s, never a 500 (on SQLite and on PostgreSQL)."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx2
from fastapi import FastAPI
from starlette.testclient import TestClient

from tests.registry.helpers import (
    SOURCE_DIGEST,
    make_release,
    manifest,
    post_eval,
    publish,
    seal,
    serve_in_thread,
    upload,
)

WRITERS = 16


def _all_at_once(port: int, token: str, requests: list[tuple[str, str, dict[str, Any]]]) -> list[httpx2.Response]:
    """Send every request at once, each from its own connection."""
    headers = {"Authorization": f"Bearer {token}"}

    def send(request: tuple[str, str, dict[str, Any]]) -> httpx2.Response:
        method, path, body = request
        with httpx2.Client(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=60) as http:
            return http.request(method, path, json=body)

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(send, requests))


def test_concurrent_promotions_of_one_channel_form_a_chain(app: FastAPI, client: TestClient, admin_token: str) -> None:
    for version in ("1.0", "2.0"):
        make_release(client, version=version)
        publish(client, "gguf-q8", {"m.gguf": version.encode() * 10}, ["cpu"], version=version)
        post_eval(client, "gguf-q8", "passed", version=version)
        seal(client, version)
    with serve_in_thread(app) as port:
        requests = [
            ("POST", "/v1/models/tiny/channels/prod", {"version": "1.0" if i % 2 else "2.0", "actor": f"job-{i}"})
            for i in range(WRITERS)
        ]
        responses = _all_at_once(port, admin_token, requests)
    assert [r.status_code for r in responses] == [200] * WRITERS, [r.text[:200] for r in responses if r.is_error]
    history = client.get("/v1/models/tiny/channels/prod").json()["history"][::-1]  # oldest first
    assert len(history) == WRITERS and history[0]["from_version"] is None
    for before, after in zip(history, history[1:], strict=False):
        assert after["from_version"] == before["to_version"], history
    audit = [e for e in client.get("/v1/audit", params={"model": "tiny"}).json() if e["action"] == "channel.promote"]
    chain = [(e["details"]["before"]["version"], e["details"]["after"]["version"]) for e in reversed(audit)]
    assert chain == [(h["from_version"], h["to_version"]) for h in history]
    assert client.get("/v1/models/tiny/channels/prod").json()["version"] == history[-1]["to_version"]


def test_concurrent_publishers_of_one_version_with_two_contents(
    app: FastAPI, client: TestClient, admin_token: str
) -> None:
    client.post("/v1/models", json={"name": "tiny"})
    contents = [b"content A" * 100, b"content B" * 100]
    for data in contents:
        upload(client, data)
    with serve_in_thread(app) as port:
        # The release itself: two source digests race for one version.
        releases = [
            (
                "POST",
                "/v1/models/tiny/releases",
                {
                    "version": "1.0",
                    "source_digest": SOURCE_DIGEST if i % 2 else "b" * 64,
                    "planned_artifacts": ["gguf-q8"],
                },
            )
            for i in range(WRITERS)
        ]
        answers = _all_at_once(port, admin_token, releases)
        _one_winner(answers, [str(body["source_digest"]) for _, _, body in releases], "source_digest")
        # Its artifact: two contents race for one name.
        bodies = [manifest("gguf-q8", {"model.gguf": contents[i % 2]}, ["cpu"]) for i in range(WRITERS)]
        path = "/v1/models/tiny/releases/1.0/artifacts"
        answers = _all_at_once(port, admin_token, [("POST", path, body) for body in bodies])
        _one_winner(answers, [body["files"][0]["sha256"] for body in bodies], "manifest")
    stored = client.get(f"{path}/gguf-q8").json()
    assert stored["manifest"]["files"][0]["sha256"] in {b["files"][0]["sha256"] for b in bodies}


def _one_winner(answers: list[httpx2.Response], sent: list[str], what: str) -> None:
    """Every request with the winning content succeeded (one 201, the rest 200); every other got 409."""
    statuses = Counter(r.status_code for r in answers)
    assert set(statuses) <= {200, 201, 409}, [r.text[:200] for r in answers if r.status_code not in (200, 201, 409)]
    won = {s for r, s in zip(answers, sent, strict=True) if r.status_code in (200, 201)}
    assert len(won) == 1, (what, statuses)
    for response, content in zip(answers, sent, strict=True):
        expected = (200, 201) if content in won else (409,)
        assert response.status_code in expected, (what, response.status_code, response.text[:200])
    assert statuses[201] == 1, (what, statuses)
