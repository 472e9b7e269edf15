"""Promotion through the HTTP API: the eval gate, forced promotions with a reason, history and audit."""

from __future__ import annotations

from starlette.testclient import TestClient

from tests.registry.helpers import assert_error, make_release, post_eval, promote, publish, seal


def two_releases(client: TestClient, q4: str = "passed", **q4_eval: str) -> None:
    """1.0 (gguf-q8, passed) and 2.0 (gguf-q8 passed, gguf-q4 with the status `q4`), both sealed."""
    make_release(client, version="1.0")
    make_release(client, version="2.0", planned=["gguf-q4", "gguf-q8"])
    publish(client, "gguf-q8", {"m": b"one"}, ["cpu"], version="1.0")
    publish(client, "gguf-q8", {"m": b"two"}, ["cpu"], version="2.0")
    publish(client, "gguf-q4", {"m": b"two-q4"}, ["cpu"], version="2.0")
    post_eval(client, "gguf-q8", "passed", version="1.0")
    post_eval(client, "gguf-q8", "passed", version="2.0")
    post_eval(client, "gguf-q4", q4, version="2.0", **q4_eval)
    seal(client, "1.0")
    seal(client, "2.0")


def test_promote_and_history(client: TestClient) -> None:
    two_releases(client)
    first = promote(client, "1.0", actor="ci")
    assert first.status_code == 200, first.text
    assert first.json()["version"] == "1.0"
    second = promote(client, "2.0", actor="alice", reason="new quant")
    assert second.status_code == 200
    channel = client.get("/v1/models/tiny/channels/prod").json()
    assert channel["version"] == "2.0"
    history = [(e["from_version"], e["to_version"], e["forced"], e["actor"]) for e in channel["history"]]
    assert history == [
        ("1.0", "2.0", False, "token:test-admin (alice)"),
        (None, "1.0", False, "token:test-admin (ci)"),
    ]
    promote(client, "1.0", channel="dev")
    listed = client.get("/v1/models/tiny/channels").json()
    assert [(c["name"], c["version"]) for c in listed] == [("dev", "1.0"), ("prod", "2.0")]
    assert client.get("/v1/models/tiny").json()["channels"] == {"dev": "1.0", "prod": "2.0"}
    assert client.get("/v1/models/tiny/releases/1.0").json()["channels"] == ["dev"]


def test_failed_gate_refuses_promotion(client: TestClient) -> None:
    two_releases(client, "failed", reason="kl 0.3 > 0.1")
    promote(client, "1.0")
    error = assert_error(promote(client, "2.0"), 409, "EVAL_GATE_FAILED")
    assert "gguf-q4" in error["message"] and "gguf-q8" not in error["message"]
    assert error["details"]["failing"] == [
        {"artifact": "gguf-q4", "failed": [{"runtime": "llama.cpp", "reason": "kl 0.3 > 0.1"}]}
    ]
    channel = client.get("/v1/models/tiny/channels/prod").json()
    assert channel["version"] == "1.0" and len(channel["history"]) == 1
    # not_evaluated does not block.
    make_release(client, version="3.0")
    publish(client, "gguf-q8", {"m": b"three"}, ["cpu"], version="3.0")
    post_eval(client, "gguf-q8", "not_evaluated", version="3.0", reason="runner needed")
    seal(client, "3.0")
    assert promote(client, "3.0").status_code == 200


def test_forced_promotion_needs_a_reason(client: TestClient) -> None:
    two_releases(client, "failed")
    for reason in [None, "", "   "]:
        error = assert_error(promote(client, "2.0", force=True, reason=reason), 422, "INVALID_INPUT")
        assert "reason" in error["message"]
    assert_error(client.get("/v1/models/tiny/channels/prod"), 404, "NOT_FOUND")


def test_forced_promotion_is_audited(client: TestClient) -> None:
    two_releases(client, "failed", reason="top1 too low")
    promote(client, "1.0", actor="ci")
    forced = promote(client, "2.0", force=True, reason="hotfix: q4 unused in prod", actor="alice")
    assert forced.status_code == 200, forced.text
    event = forced.json()["history"][0]
    assert event["forced"] is True and event["reason"] == "hotfix: q4 unused in prod"
    audit = client.get("/v1/audit", params={"model": "tiny"}).json()
    assert [a["action"] for a in audit] == ["channel.promote.forced", "channel.promote", "release.seal", "release.seal"]
    record = audit[0]
    assert record["actor"] == "token:test-admin (alice)"
    assert record["target"] == "tiny/prod"
    assert record["reason"] == "hotfix: q4 unused in prod"
    assert record["details"]["before"] == {"version": "1.0"}
    assert record["details"]["after"]["version"] == "2.0"
    assert record["details"]["overridden_failures"][0]["artifact"] == "gguf-q4"
    assert client.get("/v1/audit", params={"model": "other"}).json() == []
    assert [a["action"] for a in client.get("/v1/audit").json()][-1] == "token.create"  # the test's own token


def test_open_release_cannot_be_promoted(client: TestClient) -> None:
    make_release(client)
    error = assert_error(promote(client, "1.0"), 409, "RELEASE_NOT_SEALED")
    assert "tiny@1.0" in error["message"]
    publish(client, "gguf-q8", {"m": b"one"}, ["cpu"])
    assert_error(promote(client, "1.0"), 409, "RELEASE_NOT_SEALED")


def test_promotion_errors(client: TestClient) -> None:
    make_release(client)
    assert_error(promote(client, "9.9"), 404, "NOT_FOUND")
    assert_error(promote(client, "1.0", model="nope"), 404, "NOT_FOUND")
    assert_error(promote(client, "1.0", channel="Prod"), 422, "INVALID_INPUT")
    assert_error(promote(client, "1.0", force="maybe"), 422, "INVALID_INPUT")
    assert_error(client.get("/v1/models/tiny/channels/prod"), 404, "NOT_FOUND")
    assert client.get("/v1/models/tiny/channels").json() == []
