"""Models and releases through the HTTP API: idempotent creation, immutability, errors."""

from __future__ import annotations

from starlette.testclient import TestClient

from kiln.core.shape import ShapeRecord
from tests.registry.helpers import LLAMA_CONFIG, SOURCE_DIGEST, assert_error, make_release

RELEASE = {
    "version": "1.0",
    "source_digest": SOURCE_DIGEST,
    "planned_artifacts": ["gguf-q8"],
    "lineage": {"hf": "x"},
    "model_config": LLAMA_CONFIG,
}


def test_create_model_is_idempotent(client: TestClient) -> None:
    first = client.post("/v1/models", json={"name": "tiny-llama", "description": "a small one"})
    assert first.status_code == 201
    assert first.json()["name"] == "tiny-llama"
    again = client.post("/v1/models", json={"name": "tiny-llama", "description": "a small one"})
    assert again.status_code == 200
    assert again.json() == first.json()
    # No description: accept the existing model as it is.
    assert client.post("/v1/models", json={"name": "tiny-llama"}).status_code == 200
    error = assert_error(
        client.post("/v1/models", json={"name": "tiny-llama", "description": "other"}), 409, "CONFLICT"
    )
    assert error["details"]["stored"] == "a small one"
    assert client.get("/v1/models/tiny-llama").json()["description"] == "a small one"


def test_list_and_get_models(client: TestClient) -> None:
    make_release(client, "b-model", "1.0")
    make_release(client, "b-model", "2.0")
    make_release(client, "a-model", "0.1")
    assert [m["name"] for m in client.get("/v1/models").json()] == ["a-model", "b-model"]
    detail = client.get("/v1/models/b-model").json()
    assert detail["releases"] == ["2.0", "1.0"]
    assert detail["channels"] == {}


def test_model_name_is_validated(client: TestClient) -> None:
    for bad in ["Upper", "-lead", "a" * 65, "sp ace", "x/y"]:
        error = assert_error(client.post("/v1/models", json={"name": bad}), 422, "INVALID_INPUT")
        assert "name" in error["message"]
    assert_error(client.get("/v1/models/UPPER"), 422, "INVALID_INPUT")


def test_unknown_model_is_404(client: TestClient) -> None:
    error = assert_error(client.get("/v1/models/nope"), 404, "NOT_FOUND")
    assert "nope" in error["message"]
    assert_error(client.post("/v1/models/nope/releases", json=RELEASE), 404, "NOT_FOUND")


def test_release_create_is_idempotent(client: TestClient) -> None:
    client.post("/v1/models", json={"name": "m"})
    first = client.post("/v1/models/m/releases", json=RELEASE)
    assert first.status_code == 201, first.text
    body = first.json()
    assert body["model"] == "m" and body["version"] == "1.0"
    assert body["model_config"] == LLAMA_CONFIG and body["lineage"] == {"hf": "x"}
    assert body["status"] == "open" and body["planned_artifacts"] == ["gguf-q8"]
    again = client.post("/v1/models/m/releases", json=RELEASE)
    assert again.status_code == 200
    assert again.json() == body


def test_release_is_immutable(client: TestClient) -> None:
    client.post("/v1/models", json={"name": "m"})
    client.post("/v1/models/m/releases", json=RELEASE)
    changed = {**RELEASE, "source_digest": "b" * 64, "model_config": {"num_hidden_layers": 2}}
    error = assert_error(client.post("/v1/models/m/releases", json=changed), 409, "CONFLICT")
    assert error["details"]["differing"] == ["source_digest", "model_config"]
    replanned = {**RELEASE, "planned_artifacts": ["gguf-q8", "gguf-q4"]}
    error = assert_error(client.post("/v1/models/m/releases", json=replanned), 409, "CONFLICT")
    assert error["details"]["differing"] == ["planned_artifacts"]
    stored = client.get("/v1/models/m/releases/1.0").json()
    assert stored["source_digest"] == SOURCE_DIGEST
    assert stored["model_config"] == LLAMA_CONFIG


def test_a_release_is_the_same_only_as_the_same_json(client: TestClient) -> None:
    """`true` is not `1`, nor `1.0`: a replay that differs so is a conflict, not the stored release."""
    client.post("/v1/models", json={"name": "m"})
    assert client.post("/v1/models/m/releases", json={**RELEASE, "lineage": {"flag": 1}}).status_code == 201
    for lineage in ({"flag": True}, {"flag": 1.0}):
        error = assert_error(
            client.post("/v1/models/m/releases", json={**RELEASE, "lineage": lineage}), 409, "CONFLICT"
        )
        assert error["details"]["differing"] == ["lineage"]
    assert client.post("/v1/models/m/releases", json={**RELEASE, "lineage": {"flag": 1}}).status_code == 200


def test_release_fields_are_validated(client: TestClient) -> None:
    client.post("/v1/models", json={"name": "m"})
    for bad in [
        {**RELEASE, "version": "../1"},
        {**RELEASE, "version": ""},
        {**RELEASE, "source_digest": "sha256:" + "a" * 64},
        {**RELEASE, "unexpected": 1},
        {**RELEASE, "model_config": []},
        {**RELEASE, "planned_artifacts": []},
        {**RELEASE, "planned_artifacts": ["a", "a"]},
        {**RELEASE, "planned_artifacts": ["Bad Name"]},
        {**RELEASE, "version": "1.0\n"},
    ]:
        assert_error(client.post("/v1/models/m/releases", json=bad), 422, "INVALID_INPUT")
    assert client.get("/v1/models/m/releases").json() == []


def test_list_and_get_releases(client: TestClient) -> None:
    make_release(client, "m", "1.0")
    make_release(client, "m", "1.1+build.7")
    versions = [r["version"] for r in client.get("/v1/models/m/releases").json()]
    assert versions == ["1.1+build.7", "1.0"]
    detail = client.get("/v1/models/m/releases/1.1+build.7").json()
    assert detail["artifacts"] == [] and detail["channels"] == []
    error = assert_error(client.get("/v1/models/m/releases/9.9"), 404, "NOT_FOUND")
    assert "m@9.9" in error["message"]


def test_error_shape_for_framework_errors(client: TestClient) -> None:
    assert_error(client.get("/v1/no/such/route"), 404, "NOT_FOUND")
    assert_error(client.delete("/v1/models"), 405, "METHOD_NOT_ALLOWED")
    malformed = client.post("/v1/models", content=b"{not json", headers={"Content-Type": "application/json"})
    assert_error(malformed, 422, "INVALID_JSON")


def test_healthz_and_openapi(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok", "checks": {}}
    spec = client.get("/openapi.json").json()
    tags = {op["tags"][0] for path in spec["paths"].values() for op in path.values()}
    assert {"models", "releases", "artifacts", "blobs", "channels", "resolve", "audit", "tokens", "health"} <= tags
    release_schema = spec["components"]["schemas"]["ReleaseCreate"]
    assert "model_config" in release_schema["properties"]
    assert "ErrorResponse" in spec["components"]["schemas"]


def test_the_shape_record_kiln_publishes_is_stored_as_sent_and_reads_back(client: TestClient) -> None:
    """The pipeline sends the ingest stage's `ShapeRecord` as JSON; the release keeps that JSON, which resolve
    reads back as the same record, and the OpenAPI names its fields."""
    record = ShapeRecord.from_untrusted(LLAMA_CONFIG)
    assert isinstance(record, ShapeRecord)
    sent = record.model_dump(mode="json")
    make_release(client, "shaped", model_config=sent)
    stored = client.get("/v1/models/shaped/releases/1.0").json()["model_config"]
    assert stored == sent and ShapeRecord.from_untrusted(stored) == record
    documented = client.get("/openapi.json").json()["components"]["schemas"]["ReleaseCreate"]["properties"]
    assert all(name in documented["model_config"]["description"] for name in ShapeRecord.model_fields)
    assert ShapeRecord.model_validate(documented["model_config"]["examples"][0]).num_layers == 32
