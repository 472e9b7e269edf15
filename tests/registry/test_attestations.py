"""Signed artifacts in the registry: trusted keys (admin, audited), signatures verified on upload, sealing and
promotion refused for unsigned artifacts, and `kiln verify` of a download catching a tampered blob."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from kiln.core.manifest import ArtifactManifest
from kiln.core.signing import PROVENANCE_FILE, SIGNATURE_FILE
from kiln.pipeline.signing import SigningKey, provenance_statement, sign_files, sign_provenance
from tests.pipeline.test_signing import write_key_pair
from tests.registry.conftest import make_token
from tests.registry.helpers import (
    assert_error,
    make_release,
    manifest,
    overwrite_stored_blob,
    post_eval,
    promote,
    publish,
    seal,
    serve_in_thread,
    sha,
    upload,
)

FILES = {"model.gguf": b"GGUF" + bytes(range(256)) * 8, "tokenizer.json": b'{"v": 1}'}
ATTESTATIONS = "/v1/models/tiny/releases/1.0/artifacts/gguf-q8/attestations"


def bundles(tmp_path: Path, key: SigningKey, files: dict[str, bytes] = FILES, version: str = "1.0") -> dict[str, bytes]:
    """The signature and provenance of tiny@`version`/gguf-q8 with `files`, as `kiln publish` makes them."""
    root = tmp_path / f"files-{sha(repr(sorted(files.items())).encode())[:8]}-{key.path.parent.name}"
    for path, data in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
    m = ArtifactManifest.model_validate(manifest("gguf-q8", files, ["cpu"]))
    statement = provenance_statement(
        m, model="tiny", version=version, source_digest="0" * 64, source_files=[], stages={}, evals={}
    )
    return {
        "signature": sign_files(root, m, key, model="tiny", version=version),
        "provenance": sign_provenance(statement, key),
    }


def attach(client: TestClient, kind: str, data: bytes) -> Any:
    return client.post(ATTESTATIONS, json={"kind": kind, "sha256": upload(client, data), "size": len(data)})


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, tuple[SigningKey, Path]]:
    pairs = {}
    for name in ("trusted", "other"):
        (tmp_path / name).mkdir()
        pairs[name] = write_key_pair(tmp_path / name)
    return pairs


@pytest.fixture
def trusted(client: TestClient, keys: dict[str, tuple[SigningKey, Path]]) -> dict[str, Any]:
    response = client.post("/v1/keys", json={"model_pattern": "tin*", "public_key_pem": keys["trusted"][1].read_text()})
    assert response.status_code == 201, response.text
    body: dict[str, Any] = response.json()
    return body


def published(client: TestClient) -> None:
    make_release(client)
    publish(client, "gguf-q8", FILES, ["cpu"])
    assert post_eval(client, "gguf-q8", "passed", metrics={"kl": 0.001}).status_code == 201


def test_keys_are_admin_only_and_audited(app: FastAPI, client: TestClient, keys: dict[str, Any]) -> None:
    pem = keys["trusted"][1].read_text()
    publisher = make_token(app, ["publish"], name="ci")
    refused = client.post(
        "/v1/keys",
        json={"model_pattern": "tiny", "public_key_pem": pem},
        headers={"Authorization": f"Bearer {publisher}"},
    )
    assert_error(refused, 403, "FORBIDDEN")
    created = client.post("/v1/keys", json={"model_pattern": "tiny", "public_key_pem": pem})
    assert created.status_code == 201
    kid = created.json()["key_id"]
    assert client.post("/v1/keys", json={"model_pattern": "tiny", "public_key_pem": pem}).status_code == 200
    assert_error(client.post("/v1/keys", json={"model_pattern": "tiny", "public_key_pem": "junk"}), 422, "KEY_INVALID")
    revoked = client.post(
        f"/v1/keys/{kid}/revoke", json={"reason": "rotated"}, headers={"Authorization": f"Bearer {publisher}"}
    )
    assert_error(revoked, 403, "FORBIDDEN")
    assert client.post(f"/v1/keys/{kid}/revoke", json={"reason": "rotated"}).json()["revoked_at"] is not None
    assert_error(client.post("/v1/keys", json={"model_pattern": "tiny", "public_key_pem": pem}), 409, "KEY_REVOKED")
    events = [(e["action"], e["target"]) for e in client.get("/v1/audit").json()]
    assert ("key.add", kid) in events and ("key.revoke", kid) in events


def test_signed_artifact_is_accepted_served_and_sealed(
    client: TestClient, keys: dict[str, Any], trusted: dict[str, Any], tmp_path: Path
) -> None:
    published(client)
    assert_error(client.post("/v1/models/tiny/releases/1.0/seal"), 409, "ARTIFACT_UNSIGNED")
    made = bundles(tmp_path, keys["trusted"][0])
    for kind, data in made.items():
        response = attach(client, kind, data)
        assert response.status_code == 201, response.text
        assert response.json()["signer"] == trusted["key_id"]
    assert attach(client, "signature", made["signature"]).status_code == 200  # the same again: a no-op
    seal(client)
    listed = client.get(ATTESTATIONS).json()
    assert [a["kind"] for a in listed] == ["provenance", "signature"]
    download = client.get(f"{ATTESTATIONS}/signature")
    assert download.status_code == 200 and download.content == made["signature"]
    assert promote(client).status_code == 200
    # Sealed: a fresh signature that verifies just as well is answered with the stored one.
    again = attach(client, "signature", bundles(tmp_path / "again", keys["trusted"][0])["signature"])
    assert again.status_code == 200 and again.json()["sha256"] == sha(made["signature"])


def test_wrong_key_other_files_or_no_key_are_refused(client: TestClient, keys: dict[str, Any], tmp_path: Path) -> None:
    published(client)
    made = bundles(tmp_path, keys["trusted"][0])
    assert_error(attach(client, "signature", made["signature"]), 422, "NO_TRUSTED_KEY")
    client.post("/v1/keys", json={"model_pattern": "tiny", "public_key_pem": keys["trusted"][1].read_text()})
    wrong = assert_error(
        attach(client, "signature", bundles(tmp_path, keys["other"][0])["signature"]), 422, "SIGNATURE_INVALID"
    )
    assert "not signed by a key trusted" in wrong["message"]
    other_files = {**FILES, "model.gguf": FILES["model.gguf"][:-1] + b"!"}
    mismatch = assert_error(
        attach(client, "signature", bundles(tmp_path, keys["trusted"][0], other_files)["signature"]),
        422,
        "ATTESTATION_SUBJECT_MISMATCH",
    )
    assert "file model.gguf: digest mismatch" in mismatch["message"]
    assert_error(attach(client, "provenance", b'{"not": "a bundle"}'), 422, "SIGNATURE_INVALID")
    assert client.get(ATTESTATIONS).json() == []


def test_revoked_key_refuses_uploads_and_promotion(
    client: TestClient, keys: dict[str, Any], trusted: dict[str, Any], tmp_path: Path
) -> None:
    published(client)
    made = bundles(tmp_path, keys["trusted"][0])
    assert attach(client, "signature", made["signature"]).status_code == 201
    seal(client)
    client.post(f"/v1/keys/{trusted['key_id']}/revoke", json={"reason": "leaked"})
    assert_error(attach(client, "provenance", made["provenance"]), 422, "KEY_REVOKED")
    assert_error(promote(client, force=True, reason="anyway"), 409, "ARTIFACT_UNSIGNED")
    # A new key signs the sealed release again; then it may be promoted.
    client.post("/v1/keys", json={"model_pattern": "tiny", "public_key_pem": keys["other"][1].read_text()})
    assert attach(client, "signature", bundles(tmp_path, keys["other"][0])["signature"]).status_code == 201
    assert promote(client).status_code == 200


def test_models_without_keys_need_no_signature_until_one_is_trusted(
    client: TestClient, keys: dict[str, Any], tmp_path: Path
) -> None:
    client.post("/v1/keys", json={"model_pattern": "llama-*", "public_key_pem": keys["trusted"][1].read_text()})
    published(client)
    seal(client)
    assert promote(client).status_code == 200
    # Its own key trusted later: the sealed release is promoted again only once it is signed.
    client.post("/v1/keys", json={"model_pattern": "tiny", "public_key_pem": keys["other"][1].read_text()})
    assert_error(promote(client, channel="staging"), 409, "ARTIFACT_UNSIGNED")
    assert attach(client, "signature", bundles(tmp_path, keys["other"][0])["signature"]).status_code == 201
    assert promote(client, channel="staging").status_code == 200


def test_kiln_verify_passes_on_a_download_and_names_a_tampered_file(
    app: FastAPI,
    client: TestClient,
    keys: dict[str, Any],
    trusted: dict[str, Any],
    tmp_path: Path,
) -> None:
    published(client)
    made = bundles(tmp_path, keys["trusted"][0])
    for kind, data in made.items():
        assert attach(client, kind, data).status_code == 201
    seal(client)
    pub = str(keys["trusted"][1])
    env = {**os.environ, "KILN_TOKEN": make_token(app, ["read"], name="reader")}

    def verify(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "kiln", "verify", *args, "--key", pub, "--registry", f"http://127.0.0.1:{port}"]
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)

    with serve_in_thread(app) as port:
        ok = verify("tiny@1.0/gguf-q8", "--json", "--download-to", str(tmp_path / "download"))
        assert ok.returncode == 0, ok.stderr
        out = json.loads(ok.stdout)
        assert out.pop("claims")["version"] == "1.0"
        assert out == {"verified": True, "files": 2, "key_id": trusted["key_id"], "provenance": True}
        assert (tmp_path / "download" / SIGNATURE_FILE).is_file() and (
            tmp_path / "download" / PROVENANCE_FILE
        ).is_file()
        # The registry serves the signature of tiny@2.0's artifact with the very same files: refused.
        store = app.state.blob_store
        overwrite_stored_blob(
            store, sha(made["signature"]), bundles(tmp_path / "2.0", keys["trusted"][0], version="2.0")["signature"]
        )
        other = verify("tiny@1.0/gguf-q8", "--json")
        assert other.returncode == 2, other.stdout + other.stderr
        error = json.loads(other.stdout)["error"]
        assert error["code"] == "ATTESTATION_CLAIM_MISMATCH"
        assert {k: error["details"][k] for k in ("field", "expected", "got")} == {
            "field": "version",
            "expected": "1.0",
            "got": "2.0",
        }
        overwrite_stored_blob(store, sha(made["signature"]), made["signature"])
        # One byte of a published file changes in the blob store: a fresh download no longer verifies.
        tampered = bytearray(FILES["model.gguf"])
        tampered[7] ^= 0xFF
        overwrite_stored_blob(app.state.blob_store, sha(FILES["model.gguf"]), bytes(tampered))
        bad = verify("tiny@1.0/gguf-q8")
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert "file model.gguf: digest mismatch" in bad.stderr
    # The earlier, untampered download still verifies offline, as a directory.
    again = subprocess.run(
        [sys.executable, "-m", "kiln", "verify", str(tmp_path / "download"), "--key", pub],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0, again.stderr


def test_an_open_release_with_attestations_can_be_abandoned(
    client: TestClient, keys: dict[str, Any], trusted: dict[str, Any], tmp_path: Path
) -> None:
    published(client)
    assert attach(client, "signature", bundles(tmp_path, keys["trusted"][0])["signature"]).status_code == 201
    response = client.post("/v1/models/tiny/releases/1.0/abandon", json={"reason": "bad build"})
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "abandoned"


def test_signed_channels_serve_only_signed_artifacts_even_without_keys(
    app: FastAPI, client: TestClient, keys: dict[str, Any], tmp_path: Path
) -> None:
    settings = app.state.settings
    before = settings.signed_channels
    settings.signed_channels = ["prod"]
    try:
        published(client)
        seal(client)
        assert promote(client, channel="staging").status_code == 200  # not a signed channel
        error = assert_error(promote(client, force=True, reason="anyway"), 409, "ARTIFACT_UNSIGNED")
        assert "serves only signed artifacts" in error["message"] and error["details"]["unsigned"] == ["gguf-q8"]
        split = client.put("/v1/models/tiny/channels/prod/split", json={"weights": [{"version": "1.0", "weight": 100}]})
        assert_error(split, 409, "ARTIFACT_UNSIGNED")
        client.post("/v1/keys", json={"model_pattern": "tiny", "public_key_pem": keys["trusted"][1].read_text()})
        assert attach(client, "signature", bundles(tmp_path, keys["trusted"][0])["signature"]).status_code == 201
        assert promote(client).status_code == 200
    finally:
        settings.signed_channels = before
