"""Reads by digest respect scopes, step by step; keys belong to the models their pattern matches.

Two tenants publish with tokens limited to `a-*` and `b-*`. A blob is readable only through what the
caller may read: a sealed release of its models (files, signature, provenance), an open release of a
model it publishes, or its own upload. Anything else is a 404, exactly as for a blob that does not exist.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from starlette.testclient import TestClient

from kiln.core.manifest import ArtifactManifest
from kiln.pipeline.signing import SigningKey, provenance_statement, sign_files, sign_provenance
from tests.pipeline.test_signing import write_key_pair
from tests.registry.conftest import make_token
from tests.registry.helpers import (
    assert_error,
    make_release,
    manifest,
    post_eval,
    publish,
    seal,
    serve_in_thread,
    sha,
    upload,
)

WEIGHTS = b"tenant a's weights" * 50
FILES = {"model.gguf": WEIGHTS}


def _as(app: FastAPI, token: str | None) -> TestClient:
    return TestClient(app, headers={"Authorization": f"Bearer {token}"} if token else {})


def _bundles(tmp_path: Path, key: SigningKey) -> dict[str, bytes]:
    root = tmp_path / "signed"
    root.mkdir()
    (root / "model.gguf").write_bytes(WEIGHTS)
    m = ArtifactManifest.model_validate(manifest("gguf-q8", FILES, ["cpu"]))
    statement = provenance_statement(
        m, model="a-model", version="1.0", source_digest="0" * 64, source_files=[], stages={}, evals={}
    )
    return {
        "signature": sign_files(root, m, key, model="a-model", version="1.0"),
        "provenance": sign_provenance(statement, key),
    }


def _readable(client: TestClient, digest: str) -> bool:
    got, head = client.get(f"/v1/blobs/{digest}"), client.head(f"/v1/blobs/{digest}")
    assert got.status_code == head.status_code, (got.status_code, head.status_code)
    if got.status_code == 404:
        assert_error(got, 404, "BLOB_NOT_FOUND")
        return False
    assert got.status_code == 200, got.text
    return True


def test_a_tenant_reads_only_blobs_reachable_from_what_it_may_read(app: FastAPI, tmp_path: Path) -> None:
    root = _as(app, make_token(app, ["admin"], name="root"))
    (tmp_path / "key").mkdir()
    key, public = write_key_pair(tmp_path / "key")
    assert root.post("/v1/keys", json={"model_pattern": "a-*", "public_key_pem": public.read_text()}).status_code == 201
    tenant_a = _as(app, make_token(app, ["publish"], ["a-*"], name="a-ci"))
    reader_a = _as(app, make_token(app, ["read"], ["a-*"], name="a-reader"))
    tenant_b = _as(app, make_token(app, ["publish"], ["b-*"], name="b-ci"))
    anonymous = _as(app, None)
    never_stored = "0" * 64

    # An open upload of tenant A: A reads it back; B, A's reader and anonymous callers get the 404 a
    # digest nobody stored gets.
    digest = upload(tenant_a, WEIGHTS)
    assert _readable(tenant_a, digest)
    for other in (tenant_b, reader_a, anonymous):
        assert not _readable(other, digest)
        assert not _readable(other, never_stored)

    # Attached to A's open release, signed: A's publishers read it all, nobody else yet.
    make_release(tenant_a, model="a-model", planned=["gguf-q8"])
    publish(tenant_a, "gguf-q8", FILES, ["cpu"], model="a-model")
    assert post_eval(tenant_a, "gguf-q8", "passed", model="a-model").status_code == 201
    bundles = _bundles(tmp_path, key)
    attestations = "/v1/models/a-model/releases/1.0/artifacts/gguf-q8/attestations"
    for kind, data in bundles.items():
        response = tenant_a.post(attestations, json={"kind": kind, "sha256": upload(tenant_a, data), "size": len(data)})
        assert response.status_code == 201, response.text
    held = [digest, sha(bundles["signature"]), sha(bundles["provenance"])]
    for blob in held:
        assert _readable(tenant_a, blob)
        assert not _readable(tenant_b, blob) and not _readable(reader_a, blob) and not _readable(anonymous, blob)

    # Sealed: A's readers (and anonymous readers of a public registry) see files and bundles; B still not.
    seal(tenant_a, model="a-model")
    for blob in held:
        assert _readable(reader_a, blob) and _readable(anonymous, blob)
        assert not _readable(tenant_b, blob)
    assert_error(tenant_b.get(f"{attestations}/signature"), 403, "FORBIDDEN")

    # B uploads the same bytes itself: it proved it holds them, so it reads its own upload.
    wrong = tenant_b.put(f"/v1/blobs/{digest}", content=b"not the bytes")
    assert_error(wrong, 422, "DIGEST_MISMATCH")
    assert not _readable(tenant_b, digest)
    again = tenant_b.put(f"/v1/blobs/{digest}", content=WEIGHTS)
    assert again.status_code == 200, again.text
    assert _readable(tenant_b, digest) and tenant_b.get(f"/v1/blobs/{digest}").content == WEIGHTS
    assert not _readable(tenant_b, sha(bundles["signature"]))


def test_a_limited_admin_changes_only_keys_within_its_patterns(app: FastAPI, tmp_path: Path) -> None:
    pems = []
    for name in ("everything", "tiny", "other", "star"):
        (tmp_path / name).mkdir()
        pems.append(write_key_pair(tmp_path / name)[1].read_text())
    root = _as(app, make_token(app, ["admin"], name="root"))
    other_admin = _as(app, make_token(app, ["admin"], ["other-*"], name="other-admin"))
    other_reader = _as(app, make_token(app, ["read"], ["other-*"], name="other-reader"))

    def add(client: TestClient, pattern: str, pem: str) -> Any:
        return client.post("/v1/keys", json={"model_pattern": pattern, "public_key_pem": pem})

    everything = add(root, "*", pems[0]).json()["key_id"]
    tiny = add(root, "tiny-*", pems[1]).json()["key_id"]
    for pattern in ("*", "o*", "other*", "tiny-*", "[a-z]*"):
        assert_error(add(other_admin, pattern, pems[3]), 403, "FORBIDDEN")
    mine = add(other_admin, "other-m*", pems[2])
    assert mine.status_code == 201, mine.text
    # Revoking: another model's key is not there for it; a key for every model is seen but not its to revoke.
    assert_error(other_admin.post(f"/v1/keys/{tiny}/revoke", json={}), 404, "NOT_FOUND")
    assert_error(other_admin.post(f"/v1/keys/{everything}/revoke", json={}), 403, "FORBIDDEN")
    assert other_admin.post(f"/v1/keys/{mine.json()['key_id']}/revoke", json={}).status_code == 200
    assert all(k["revoked_at"] is None for k in root.get("/v1/keys").json() if k["key_id"] in (tiny, everything))
    # Lists: a caller limited to other-* sees the keys that can sign its models, never tiny-*'s.
    for client in (other_admin, other_reader):
        assert sorted(k["model_pattern"] for k in client.get("/v1/keys").json()) == ["*", "other-m*"]
    assert len(root.get("/v1/keys").json()) == 3

    # The hardware catalog serves every model: no limited admin changes it, and resolve still works.
    cpu = {k: v for k, v in root.get("/v1/hardware/cpu").json().items() if k != "source"}
    assert_error(other_admin.put("/v1/hardware/cpu", json={**cpu, "devices_per_node": 7}), 403, "FORBIDDEN")
    assert_error(other_admin.delete("/v1/hardware/cpu"), 403, "FORBIDDEN")
    assert root.get("/v1/hardware/cpu").json()["source"] == "builtin"


def test_kiln_verify_refuses_a_key_the_registry_revoked(app: FastAPI, tmp_path: Path) -> None:
    root = _as(app, make_token(app, ["admin"], name="root"))
    (tmp_path / "key").mkdir()
    key, public = write_key_pair(tmp_path / "key")
    kid = root.post("/v1/keys", json={"model_pattern": "a-*", "public_key_pem": public.read_text()}).json()["key_id"]
    make_release(root, model="a-model", planned=["gguf-q8"])
    publish(root, "gguf-q8", FILES, ["cpu"], model="a-model")
    assert post_eval(root, "gguf-q8", "passed", model="a-model").status_code == 201
    attestations = "/v1/models/a-model/releases/1.0/artifacts/gguf-q8/attestations"
    for kind, data in _bundles(tmp_path, key).items():
        assert root.post(attestations, json={"kind": kind, "sha256": upload(root, data), "size": len(data)}).status_code
    seal(root, model="a-model")
    env = {**os.environ, "KILN_TOKEN": make_token(app, ["read"], ["a-*"], name="reader")}

    def verify() -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "kiln", "verify", "a-model@1.0/gguf-q8", "--json", "--key", str(public)]
        argv += ["--registry", f"http://127.0.0.1:{port}"]
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)

    with serve_in_thread(app) as port:
        ok = verify()
        assert ok.returncode == 0, ok.stderr
        assert json.loads(ok.stdout)["key_id"] == kid
        assert root.post(f"/v1/keys/{kid}/revoke", json={"reason": "leaked"}).status_code == 200
        refused = verify()
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "revoked" in refused.stderr and kid in refused.stderr
