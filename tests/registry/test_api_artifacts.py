"""Artifacts and eval results through the HTTP API: blobs first, immutability, downloads, safe paths."""

from __future__ import annotations

from typing import Any

from starlette.testclient import TestClient

from tests.registry.helpers import (
    assert_error,
    eval_metrics,
    make_release,
    manifest,
    post_eval,
    publish,
    seal,
    sha,
    upload,
)

FILES = {"model.gguf": b"G" * 3000, "tokenizer/tokenizer.json": b'{"v": 1}'}
ARTIFACTS = "/v1/models/tiny/releases/1.0/artifacts"


def test_publish_needs_blobs_first(client: TestClient) -> None:
    make_release(client)
    upload(client, FILES["model.gguf"])
    body = manifest("gguf-q8", FILES, ["cpu"])
    error = assert_error(client.post(ARTIFACTS, json=body), 422, "BLOB_MISSING")
    assert "tokenizer/tokenizer.json" in error["message"]
    assert [m["path"] for m in error["details"]["missing"]] == ["tokenizer/tokenizer.json"]
    assert client.get(ARTIFACTS).json() == []


def test_publish_checks_blob_sizes(client: TestClient) -> None:
    make_release(client)
    for data in FILES.values():
        upload(client, data)
    body = manifest("gguf-q8", FILES, ["cpu"])
    body["files"][0]["size"] += 1
    error = assert_error(client.post(ARTIFACTS, json=body), 422, "BLOB_MISSING")
    assert "has 3000 bytes, not 3001" in error["message"]


def test_publish_is_idempotent(client: TestClient) -> None:
    make_release(client)
    first = publish(client, "gguf-q8", FILES, ["cpu", "edge"])
    assert first["manifest"]["files"][0]["path"] == "model.gguf"
    assert first["eval_status"] == "not_evaluated"
    assert first["total_size"] == 3000 + len(FILES["tokenizer/tokenizer.json"])
    # Same content, different provenance: still the same artifact.
    again = client.post(ARTIFACTS, json=manifest("gguf-q8", FILES, ["cpu", "edge"], provenance={"host": "other"}))
    assert again.status_code == 200
    assert again.json()["manifest_digest"] == first["manifest_digest"]
    assert again.json()["manifest"]["provenance"] == {"host": "test"}


def test_conflicting_artifact_is_409_and_changes_nothing(client: TestClient) -> None:
    make_release(client)
    first = publish(client, "gguf-q8", FILES, ["cpu"])
    other = {**FILES, "model.gguf": b"H" * 3000}
    upload(client, other["model.gguf"])
    error = assert_error(client.post(ARTIFACTS, json=manifest("gguf-q8", other, ["cpu"])), 409, "CONFLICT")
    assert error["details"]["stored_digest"] == first["manifest_digest"]
    assert_error(client.post(ARTIFACTS, json=manifest("gguf-q8", FILES, ["cpu", "h100"])), 409, "CONFLICT")
    stored = client.get(f"{ARTIFACTS}/gguf-q8").json()
    assert stored["manifest_digest"] == first["manifest_digest"]
    assert stored["hardware"] == ["cpu"]
    post_eval(client, "gguf-q8", "passed")
    seal(client)
    assert client.get(f"{ARTIFACTS}/gguf-q8/files/model.gguf").content == FILES["model.gguf"]


def test_publish_to_unknown_release_is_404(client: TestClient) -> None:
    make_release(client)
    error = assert_error(
        client.post("/v1/models/tiny/releases/2.0/artifacts", json=manifest("a", FILES, [])), 404, "NOT_FOUND"
    )
    assert "tiny@2.0" in error["message"]


def test_artifact_detail_has_download_urls(client: TestClient) -> None:
    make_release(client)
    publish(client, "gguf-q8", FILES, ["cpu"])
    post_eval(client, "gguf-q8", "passed")
    seal(client)
    detail = client.get(f"{ARTIFACTS}/gguf-q8").json()
    assert detail["model"] == "tiny" and detail["version"] == "1.0"
    urls = {f["path"]: f["url"] for f in detail["files"]}
    assert urls["tokenizer/tokenizer.json"] == (
        "http://testserver/v1/models/tiny/releases/1.0/artifacts/gguf-q8/files/tokenizer/tokenizer.json"
    )
    for path, url in urls.items():
        response = client.get(url)
        assert response.status_code == 200
        assert response.content == FILES[path]
        assert response.headers["etag"] == f'"{sha(FILES[path])}"'
    assert [a["name"] for a in client.get(ARTIFACTS).json()] == ["gguf-q8"]
    assert_error(client.get(f"{ARTIFACTS}/nope"), 404, "NOT_FOUND")


def test_file_download_supports_range_and_etag(client: TestClient) -> None:
    make_release(client)
    publish(client, "gguf-q8", FILES, ["cpu"])
    post_eval(client, "gguf-q8", "passed")
    seal(client)
    url = f"{ARTIFACTS}/gguf-q8/files/model.gguf"
    part = client.get(url, headers={"Range": "bytes=-100"})
    assert part.status_code == 206
    assert part.headers["content-range"] == "bytes 2900-2999/3000"
    assert part.content == FILES["model.gguf"][-100:]
    etag = part.headers["etag"]
    assert client.get(url, headers={"If-None-Match": etag}).status_code == 304
    assert_error(client.get(url, headers={"Range": "bytes=5000-"}), 416, "RANGE_NOT_SATISFIABLE")
    head = client.head(url)
    assert head.status_code == 200 and head.headers["content-length"] == "3000"
    # HEAD answers as GET does, Range and If-None-Match included.
    assert client.head(url, headers={"If-None-Match": etag}).status_code == 304
    head_part = client.head(url, headers={"Range": "bytes=-100"})
    assert head_part.status_code == 206 and head_part.headers["content-range"] == "bytes 2900-2999/3000"
    assert_error(client.get(f"{ARTIFACTS}/gguf-q8/files/other.gguf"), 404, "NOT_FOUND")


def test_path_traversal_is_rejected(client: TestClient) -> None:
    make_release(client, planned=["evil", "good"])
    upload(client, b"secret")
    for path in ["../escape", "/etc/passwd", "a/../../b", "a//b", "a\\b", "./a", "model.gguf\n", "a\n/b"]:
        body = manifest("evil", {"x": b"secret"}, ["cpu"])
        body["files"][0]["path"] = path
        assert_error(client.post(ARTIFACTS, json=body), 422, "INVALID_INPUT")
    publish(client, "good", {"model.gguf": b"secret"}, ["cpu"])
    for raw in ["..%2F..%2Fetc%2Fpasswd", "%2E%2E/x", "a/%2E%2E/model.gguf"]:
        assert_error(client.get(f"{ARTIFACTS}/good/files/{raw}"), 422, "INVALID_INPUT")


def test_manifest_is_validated(client: TestClient) -> None:
    make_release(client, planned=["a"])
    changes: list[dict[str, Any]] = [
        {"name": "Bad Name"},
        {"name": "a\n"},
        {"files": []},
        {"extra": 1},
        {"hardware": "cpu"},
        {"hardware": ["cpu\n"]},
        {"target": "g" * 65},
        {"quant": "q4\n"},
        {"format": ""},
    ]
    for change in changes:
        body = {**manifest("a", FILES, ["cpu"]), **change}
        assert_error(client.post(ARTIFACTS, json=body), 422, "INVALID_INPUT")
    body = manifest("a", FILES, ["cpu"])
    body["files"][0]["sha256"] = "XYZ"
    assert_error(client.post(ARTIFACTS, json=body), 422, "INVALID_INPUT")


def test_evals_are_idempotent_and_immutable(client: TestClient) -> None:
    make_release(client)
    publish(client, "gguf-q8", FILES, ["cpu"])
    fields: dict[str, Any] = {"metrics": {"kl": 0.01, "top1": 0.99}, "gates": {"max_kl": 0.05}}
    first = post_eval(client, "gguf-q8", "passed", **fields)
    assert first.status_code == 201, first.text
    assert first.json()["status"] == "passed"
    assert post_eval(client, "gguf-q8", "passed", **fields).status_code == 200
    error = assert_error(post_eval(client, "gguf-q8", "failed", **fields, reason="kl 0.2 > 0.05"), 409, "CONFLICT")
    assert error["details"]["stored_status"] == "passed"
    assert_error(post_eval(client, "gguf-q8", "passed", metrics={"kl": 0.02}), 409, "CONFLICT")
    # Another runtime is another result.
    assert (
        post_eval(client, "gguf-q8", "not_evaluated", runtime="vllm-rocm", reason="needs an MI300X").status_code == 201
    )
    evals = client.get(f"{ARTIFACTS}/gguf-q8").json()["evals"]
    assert [(e["runtime"], e["status"]) for e in evals] == [("llama.cpp", "passed"), ("vllm-rocm", "not_evaluated")]
    assert_error(post_eval(client, "gguf-q8", "great"), 422, "INVALID_INPUT")
    assert_error(post_eval(client, "nope", "passed"), 404, "NOT_FOUND")


def test_eval_metrics_and_gates_are_typed_records(client: TestClient) -> None:
    make_release(client)
    publish(client, "gguf-q8", FILES, ["cpu"])
    url = f"{ARTIFACTS}/gguf-q8/evals"
    # A metric missing, or a threshold the gate does not know: refused, naming the field.
    partial = {"runtime": "llama.cpp", "status": "passed", "metrics": {"kl": 0.01}}
    error = assert_error(client.post(url, json=partial), 422, "INVALID_INPUT")
    assert "top1" in str(error["details"])
    unknown = {"runtime": "llama.cpp", "status": "passed", "metrics": eval_metrics(), "gates": {"kl": 0.05}}
    assert "kl" in str(assert_error(client.post(url, json=unknown), 422, "INVALID_INPUT")["details"])
    # A NaN (a runtime's non-finite logits) is sent and stored as "NaN", and the same result again is the same.
    nan = {"runtime": "llama.cpp", "status": "failed", "metrics": eval_metrics(kl="NaN"), "reason": "kl NaN"}
    first = client.post(url, json=nan)
    assert first.status_code == 201, first.text
    assert first.json()["metrics"] == eval_metrics(kl="NaN") and first.json()["gates"] is None
    assert client.post(url, json=nan).status_code == 200
    # `{}`, how a publisher from before the typed fields says "none measured", is none.
    old = {"runtime": "vllm", "status": "not_evaluated", "metrics": {}, "gates": {}, "reason": "needs a GPU"}
    assert client.post(url, json=old).status_code == 201
    assert client.post(url, json={**old, "metrics": None, "gates": None}).status_code == 200
    evals = client.get(f"{ARTIFACTS}/gguf-q8").json()["evals"]
    assert [(e["runtime"], e["metrics"] is None) for e in evals] == [("llama.cpp", False), ("vllm", True)]
    # The API's schema shows the fields, not an object of anything.
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    assert set(schemas["EvalMetrics"]["properties"]) == set(eval_metrics())
    assert set(schemas["Gate"]["properties"]) == {"max_kl", "min_top1", "max_ppl_increase", "min_greedy_match"}


def test_evals_record_the_runtime_version(client: TestClient) -> None:
    make_release(client)
    publish(client, "gguf-q8", FILES, ["cpu"])
    fields: dict[str, Any] = {"metrics": {"kl": 0.01}, "runtime_version": "llama-cpp-python 0.3.36"}
    first = post_eval(client, "gguf-q8", "passed", **fields)
    assert first.status_code == 201, first.text
    assert first.json()["runtime_version"] == "llama-cpp-python 0.3.36"
    assert post_eval(client, "gguf-q8", "passed", **fields).status_code == 200
    # The version is part of the result: the same numbers from another version, or from an unrecorded
    # one, are a different result.
    other = {**fields, "runtime_version": "llama-cpp-python 0.3.37"}
    assert_error(post_eval(client, "gguf-q8", "passed", **other), 409, "CONFLICT")
    assert_error(post_eval(client, "gguf-q8", "passed", metrics=fields["metrics"]), 409, "CONFLICT")
    # Not sent: recorded as not known (None), and an old client's repeat of it is the same result.
    assert post_eval(client, "gguf-q8", "passed", runtime="jax", metrics={"kl": 0.02}).status_code == 201
    assert post_eval(client, "gguf-q8", "passed", runtime="jax", metrics={"kl": 0.02}).status_code == 200
    for version in (
        "transformers 5.17.0, torch 2.13.0+cpu",
        "vLLM 0.32.0 (CPU)",
        "jax 0.10.2, orbax-checkpoint 0.12.8",
    ):
        response = post_eval(client, "gguf-q8", "passed", runtime=f"r{len(version)}", runtime_version=version)
        assert response.status_code == 201, (version, response.text)
    for bad in ("", " leading", "trailing ", "a<b>", "tab\there", "new\nline", 'quote"', "x" * 201, 7):
        assert_error(post_eval(client, "gguf-q8", "passed", runtime="vllm", runtime_version=bad), 422, "INVALID_INPUT")
    evals = {e["runtime"]: e["runtime_version"] for e in client.get(f"{ARTIFACTS}/gguf-q8").json()["evals"]}
    assert evals["llama.cpp"] == "llama-cpp-python 0.3.36" and evals["jax"] is None
    release = client.get("/v1/models/tiny/releases/1.0").json()
    listed = {e["runtime"]: e["runtime_version"] for e in release["artifacts"][0]["evals"]}
    assert listed["llama.cpp"] == "llama-cpp-python 0.3.36"


def test_an_eval_on_one_gpu_sku_is_named_runtime_at_sku(client: TestClient) -> None:
    make_release(client)
    publish(client, "gguf-q8", FILES, ["cpu", "h100"])
    # How the publish stage records a GPU runner's eval: `<runtime>@<hardware>`, beside the runtime's own.
    response = post_eval(client, "gguf-q8", "passed", runtime="tensorrt_llm@h100", metrics={"kl": 0.004})
    assert response.status_code == 201, response.text
    assert (
        post_eval(client, "gguf-q8", "not_evaluated", runtime="tensorrt_llm", reason="needs an H100").status_code == 201
    )
    assert post_eval(client, "gguf-q8", "passed", runtime="llama.cpp@h100-sxm").status_code == 201
    evals = client.get(f"{ARTIFACTS}/gguf-q8").json()["evals"]
    assert [e["runtime"] for e in evals] == ["llama.cpp@h100-sxm", "tensorrt_llm", "tensorrt_llm@h100"]
    # One SKU, lowercase, after a runtime name; 64 characters in all.
    for bad in ("@h100", "tensorrt_llm@", "tensorrt_llm@H100", "a@b@c", "trt@h100/x", "t@" + "h" * 63):
        assert_error(post_eval(client, "gguf-q8", "passed", runtime=bad), 422, "INVALID_INPUT")
    assert post_eval(client, "gguf-q8", "passed", runtime="t@" + "h" * 62).status_code == 201


def test_release_shows_artifacts_evals_and_gate_status(client: TestClient) -> None:
    make_release(client, planned=["a-pass", "b-fail", "c-none"])
    publish(client, "a-pass", {"a": b"1"}, ["cpu"])
    publish(client, "b-fail", {"b": b"2"}, ["cpu"])
    publish(client, "c-none", {"c": b"3"}, ["cpu"])
    post_eval(client, "a-pass", "passed")
    post_eval(client, "b-fail", "passed")
    post_eval(client, "b-fail", "failed", runtime="vllm", reason="top1 0.7 < 0.9")
    release = client.get("/v1/models/tiny/releases/1.0").json()
    status = {a["name"]: a["eval_status"] for a in release["artifacts"]}
    assert status == {"a-pass": "passed", "b-fail": "failed", "c-none": "not_evaluated"}
    b = next(a for a in release["artifacts"] if a["name"] == "b-fail")
    assert {e["runtime"]: e["reason"] for e in b["evals"]} == {"llama.cpp": None, "vllm": "top1 0.7 < 0.9"}
