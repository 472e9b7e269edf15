"""Releases are built, then sealed: an open release is invisible to everything that serves, sealing
checks it is complete, a sealed release never changes, and an abandoned one is collected."""

from __future__ import annotations

from datetime import timedelta

from fastapi import FastAPI
from starlette.testclient import TestClient

from kiln.registry.blobs.gc import collect_garbage
from tests.registry.conftest import make_token
from tests.registry.helpers import assert_error, make_release, manifest, post_eval, promote, publish, seal, sha, upload

RELEASE = "/v1/models/tiny/releases/1.0"
Q4 = {"model-q4.gguf": b"q4" * 50}  # smaller: resolve prefers it
Q8 = {"model-q8.gguf": b"q8" * 100}


def _open_release(client: TestClient) -> None:
    """tiny@1.0 planning gguf-q4 and gguf-q8, with gguf-q4 published and evaluated."""
    make_release(client, planned=["gguf-q4", "gguf-q8"])
    publish(client, "gguf-q4", Q4, ["cpu"], quant="q4_k_m")
    post_eval(client, "gguf-q4", "passed", metrics={"kl": 0.01})


def _sealed_on_prod(client: TestClient) -> None:
    _open_release(client)
    publish(client, "gguf-q8", Q8, ["cpu"])
    post_eval(client, "gguf-q8", "passed", metrics={"kl": 0.001})
    seal(client)
    assert promote(client).status_code == 200


def test_an_open_release_is_served_by_no_name(client: TestClient) -> None:
    _open_release(client)
    release = client.get(RELEASE).json()
    assert (release["status"], release["missing"]) == ("open", ["gguf-q8"])
    assert_error(promote(client), 409, "RELEASE_NOT_SEALED")
    assert_error(promote(client, channel="dev"), 409, "RELEASE_NOT_SEALED")
    assert_error(client.get(f"{RELEASE}/artifacts/gguf-q4/files/model-q4.gguf"), 409, "RELEASE_NOT_SEALED")
    commit = client.get(f"{RELEASE}/artifacts/gguf-q4").json()["manifest_digest"][:40]
    for revision in ("1.0%2Fgguf-q4", commit):
        hub = client.get(f"/tiny/resolve/{revision}/model-q4.gguf")
        assert hub.status_code == 404 and hub.headers["X-Error-Code"] == "RevisionNotFound", revision
    with TestClient(client.app) as anonymous:  # type: ignore[arg-type]
        assert_error(anonymous.get(f"/v1/blobs/{sha(Q4['model-q4.gguf'])}"), 404, "BLOB_NOT_FOUND")
    assert_error(client.get("/v1/resolve", params={"model": "tiny", "hardware": "cpu"}), 404, "NOT_FOUND")


def test_sealing_checks_every_planned_artifact_and_its_eval(client: TestClient) -> None:
    _open_release(client)
    error = assert_error(client.post(f"{RELEASE}/seal"), 409, "RELEASE_INCOMPLETE")
    assert error["details"]["missing"] == ["gguf-q8"] and error["details"]["unevaluated"] == []
    publish(client, "gguf-q8", Q8, ["cpu"])
    error = assert_error(client.post(f"{RELEASE}/seal"), 409, "RELEASE_INCOMPLETE")
    assert error["details"] == {"model": "tiny", "version": "1.0", "missing": [], "unevaluated": ["gguf-q8"]}
    assert client.get(RELEASE).json()["status"] == "open"
    # A reason it was not evaluated counts: it is recorded, and shown.
    post_eval(client, "gguf-q8", "not_evaluated", runtime="llama.cpp-metal", reason="needs an apple runner")
    sealed = client.post(f"{RELEASE}/seal")
    assert sealed.status_code == 201 and sealed.json()["status"] == "sealed" and sealed.json()["sealed_at"]
    assert client.post(f"{RELEASE}/seal").status_code == 200  # idempotent
    event = client.get("/v1/audit", params={"model": "tiny"}).json()[0]
    assert (event["action"], event["details"]["artifacts"]) == ("release.seal", ["gguf-q4", "gguf-q8"])


def test_an_artifact_the_release_did_not_plan_is_refused(client: TestClient) -> None:
    _open_release(client)
    upload(client, b"extra")
    body = manifest("gguf-q2", {"m.gguf": b"extra"}, ["cpu"])
    error = assert_error(client.post(f"{RELEASE}/artifacts", json=body), 409, "ARTIFACT_NOT_PLANNED")
    assert error["details"]["planned"] == ["gguf-q4", "gguf-q8"]


def test_a_sealed_release_never_changes(app: FastAPI, client: TestClient) -> None:
    _sealed_on_prod(client)
    publisher = make_token(app, ["publish"], name="publisher")
    with TestClient(app, headers={"Authorization": f"Bearer {publisher}"}) as ci:
        # Re-publishing identical content (a re-run) is accepted as is...
        again = ci.post(f"{RELEASE}/artifacts", json=manifest("gguf-q4", Q4, ["cpu"], quant="q4_k_m"))
        assert again.status_code == 200
        # ...different content, or a new artifact, is not.
        upload(ci, b"better q4")
        other = manifest("gguf-q4", {"model-q4.gguf": b"better q4"}, ["cpu"], quant="q4_k_m")
        assert_error(ci.post(f"{RELEASE}/artifacts", json=other), 409, "CONFLICT")
        extra = manifest("gguf-q2", {"model.gguf": b"better q4"}, ["cpu"])
        assert_error(ci.post(f"{RELEASE}/artifacts", json=extra), 409, "RELEASE_SEALED")
        assert_error(ci.post(f"{RELEASE}/abandon", json={"reason": "x"}), 409, "RELEASE_SEALED")
    assert [a["name"] for a in client.get(RELEASE).json()["artifacts"]] == ["gguf-q4", "gguf-q8"]
    # Yanked: still sealed, still nothing added.
    assert client.post(f"{RELEASE}/yank", json={"reason": "bad"}).status_code == 200
    assert_error(client.post(f"{RELEASE}/artifacts", json=extra), 409, "RELEASE_SEALED")


def test_a_later_eval_changes_prod_only_through_a_new_promotion(app: FastAPI, client: TestClient) -> None:
    _sealed_on_prod(client)
    before = client.get("/v1/resolve", params={"model": "tiny", "hardware": "cpu"}).json()
    assert before["artifact"]["name"] == "gguf-q4"
    publisher = make_token(app, ["publish"], name="publisher")
    with TestClient(app, headers={"Authorization": f"Bearer {publisher}"}) as ci:
        # A failed eval under a new runtime name, from a token that may not promote to prod.
        late = post_eval(ci, "gguf-q4", "failed", runtime="vllm-cpu", reason="garbage")
        assert late.status_code == 201
        post_eval(ci, "gguf-q8", "failed", runtime="vllm-cpu", reason="garbage")
        assert_error(promote(ci), 403, "FORBIDDEN")
    # Kept and shown...
    evals = client.get(f"{RELEASE}/artifacts/gguf-q4").json()["evals"]
    assert {e["runtime"]: e["status"] for e in evals} == {"llama.cpp": "passed", "vllm-cpu": "failed"}
    # ...but prod still serves what was promoted.
    after = client.get("/v1/resolve", params={"model": "tiny", "hardware": "cpu"}).json()
    assert after == before
    # A promotion by a promote token now sees the failures and needs force to go ahead.
    assert_error(promote(client), 409, "EVAL_GATE_FAILED")
    assert promote(client, force=True, reason="vllm-cpu is not what serves prod").status_code == 200
    assert_error(client.get("/v1/resolve", params={"model": "tiny", "hardware": "cpu"}), 404, "NO_COMPATIBLE_ARTIFACT")


def test_an_abandoned_release_is_dropped_and_its_blobs_collected(app: FastAPI, client: TestClient) -> None:
    _open_release(client)
    abandoned = client.post(f"{RELEASE}/abandon", json={"reason": "bad source"})
    assert abandoned.status_code == 200
    body = abandoned.json()
    assert (body["status"], body["abandon_reason"]) == ("abandoned", "bad source")
    assert client.get(RELEASE).json()["artifacts"] == []
    assert client.post(f"{RELEASE}/abandon", json={"reason": "again"}).status_code == 200  # idempotent
    for attempt in (
        client.post(f"{RELEASE}/artifacts", json=manifest("gguf-q4", Q4, ["cpu"], quant="q4_k_m")),
        post_eval(client, "gguf-q4", "passed"),
        client.post(f"{RELEASE}/seal"),
    ):
        assert attempt.status_code in (404, 409), attempt.text
    assert_error(client.post(f"{RELEASE}/seal"), 409, "RELEASE_ABANDONED")
    assert_error(promote(client), 409, "RELEASE_NOT_SEALED")
    assert_error(client.post(f"{RELEASE}/yank", json={"reason": "x"}), 409, "RELEASE_NOT_SEALED")
    event = client.get("/v1/audit", params={"model": "tiny"}).json()[0]
    assert (event["action"], event["details"]["dropped_artifacts"]) == ("release.abandon", ["gguf-q4"])
    report = collect_garbage(app.state.session_factory, app.state.blob_store, app.state.blob_references, timedelta(0))
    assert [b.sha256 for b in report.deleted] == [sha(Q4["model-q4.gguf"])]


def test_a_publish_run_again_after_a_crash_completes_the_same_open_release(client: TestClient) -> None:
    # The first run died after one of two artifacts; the second run repeats everything.
    _open_release(client)
    for _ in range(2):
        make_release(client, planned=["gguf-q4", "gguf-q8"])
        publish(client, "gguf-q4", Q4, ["cpu"], quant="q4_k_m")
        assert post_eval(client, "gguf-q4", "passed", metrics={"kl": 0.01}).status_code in (200, 201)
        publish(client, "gguf-q8", Q8, ["cpu"])
        assert post_eval(client, "gguf-q8", "passed").status_code in (200, 201)
        seal(client)
    assert client.get(RELEASE).json()["status"] == "sealed"
