"""The OCI distribution API at /v2/: a conformance subset keyed to the spec's pull endpoints.

end-1 `GET /v2/`, end-2 `GET|HEAD /v2/<name>/blobs/<digest>`, end-3 `GET|HEAD /v2/<name>/manifests/<reference>`,
end-8 `GET /v2/<name>/tags/list?n=&last=`, end-12 `GET /v2/<name>/referrers/<digest>`; plus the token
challenge and the spec's error shape. Both databases, through the app (tests/registry/test_oci_clients.py
drives oras and skopeo against a live server).
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from kiln.registry.app import create_app
from kiln.registry.attestations.models import Attestation
from kiln.registry.settings import RegistrySettings
from tests.registry.conftest import make_token
from tests.registry.helpers import make_release, post_eval, promote, publish, seal, sha, upload

MODEL = "tiny-llama"
GGUF = b"GGUF" + bytes(range(256)) * 40
CONFIG = b'{"model_type": "llama"}'
README = b"# tiny-llama\n"
FILES = {"model.gguf": GGUF, "config.json": CONFIG, "README.md": README}
TAG = "1.0.0-gguf-q4_k_m"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
INDEX = "application/vnd.oci.image.index.v1+json"
SIGNATURE = "application/vnd.dev.sigstore.bundle.v0.3+json"
PROVENANCE = "application/vnd.in-toto+json"


def _seed(client: TestClient) -> None:
    """tiny-llama 1.0.0 (sealed, on prod) with gguf-q4_k_m and hf-bf16; 2.0.0 still open."""
    make_release(client, model=MODEL, version="1.0.0", planned=["gguf-q4_k_m", "hf-bf16"])
    publish(client, "gguf-q4_k_m", FILES, ["cpu"], model=MODEL, version="1.0.0", quant="q4_k_m")
    publish(
        client,
        "hf-bf16",
        {"model.safetensors": b"weights" * 30, "config.json": CONFIG},
        ["h100"],
        model=MODEL,
        version="1.0.0",
        quant="bf16",
        target="hf-bundle",
        format="safetensors",
    )
    for name in ("gguf-q4_k_m", "hf-bf16"):
        assert post_eval(client, name, "passed", model=MODEL, version="1.0.0").status_code == 201
    seal(client, model=MODEL, version="1.0.0")
    assert promote(client, "1.0.0", model=MODEL, actor="ci").status_code == 200
    make_release(client, model=MODEL, version="2.0.0", planned=["gguf-q4_k_m"])
    publish(client, "gguf-q4_k_m", {"model.gguf": b"open"}, ["cpu"], model=MODEL, version="2.0.0")


@pytest.fixture
def seeded(client: TestClient) -> TestClient:
    _seed(client)
    return client


def oci_error(response: Any, status: int, code: str) -> dict[str, Any]:
    """Check the spec's error shape and return the error."""
    assert response.status_code == status, response.text[:500]
    errors = response.json()["errors"]
    assert len(errors) == 1 and set(errors[0]) == {"code", "message", "detail"}
    assert errors[0]["code"] == code, errors
    error: dict[str, Any] = errors[0]
    return error


def manifest_of(client: TestClient, reference: str, name: str = MODEL) -> tuple[dict[str, Any], str]:
    response = client.get(f"/v2/{name}/manifests/{reference}", headers={"Accept": MANIFEST})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == MANIFEST
    digest = f"sha256:{hashlib.sha256(response.content).hexdigest()}"
    assert response.headers["docker-content-digest"] == digest
    manifest: dict[str, Any] = response.json()
    return manifest, digest


def test_end_1_version_check(app: FastAPI, client: TestClient) -> None:
    with TestClient(app) as anonymous:  # anonymous reads are on by default
        response = anonymous.get("/v2/")
    assert response.status_code == 200 and response.json() == {}
    assert response.headers["docker-distribution-api-version"] == "registry/2.0"
    assert client.get("/v2/").status_code == 200


def test_end_3_manifests_by_tag_and_digest(seeded: TestClient) -> None:
    manifest, digest = manifest_of(seeded, TAG)
    assert manifest["schemaVersion"] == 2 and manifest["mediaType"] == MANIFEST
    assert manifest["artifactType"] == "application/vnd.cncf.model.manifest.v1+json"
    assert manifest["config"]["mediaType"] == "application/vnd.cncf.model.config.v1+json"
    layers = {layer["annotations"]["org.opencontainers.image.title"]: layer for layer in manifest["layers"]}
    assert {p: (layer["digest"], layer["size"]) for p, layer in layers.items()} == {
        p: (f"sha256:{sha(d)}", len(d)) for p, d in FILES.items()
    }
    assert layers["model.gguf"]["mediaType"] == "application/vnd.cncf.model.weight.v1.raw"
    assert layers["config.json"]["mediaType"] == "application/vnd.cncf.model.weight.config.v1.raw"
    assert layers["README.md"]["mediaType"] == "application/vnd.cncf.model.doc.v1.raw"
    assert manifest["annotations"]["org.opencontainers.image.version"] == "1.0.0"
    # Deterministic: the same manifest by the channel tag, by digest, under the namespace, and again.
    for reference, name in (("prod-gguf-q4_k_m", MODEL), (digest, MODEL), (TAG, f"kiln/{MODEL}"), (TAG, MODEL)):
        assert manifest_of(seeded, reference, name) == (manifest, digest)
    head = seeded.head(f"/v2/{MODEL}/manifests/{TAG}")
    assert head.status_code == 200 and head.content == b""
    assert head.headers["docker-content-digest"] == digest
    assert head.headers["content-type"] == MANIFEST
    assert int(head.headers["content-length"]) == len(seeded.get(f"/v2/{MODEL}/manifests/{TAG}").content)
    other, other_digest = manifest_of(seeded, "1.0.0-hf-bf16")
    assert other_digest != digest and other["annotations"]["dev.kiln.target"] == "hf-bundle"


def test_end_3_unknown_and_unserved_manifests(seeded: TestClient) -> None:
    for reference in ("2.0.0-gguf-q4_k_m", "9.9-gguf-q4_k_m", "staging-gguf-q4_k_m", "sha256:" + "0" * 64):
        oci_error(seeded.get(f"/v2/{MODEL}/manifests/{reference}"), 404, "MANIFEST_UNKNOWN")
    head = seeded.head(f"/v2/{MODEL}/manifests/2.0.0-gguf-q4_k_m")
    assert head.status_code == 404 and head.content == b""
    oci_error(seeded.get(f"/v2/nope/manifests/{TAG}"), 404, "NAME_UNKNOWN")
    oci_error(seeded.get(f"/v2/other/{MODEL}/manifests/{TAG}"), 400, "NAME_INVALID")
    oci_error(seeded.get(f"/v2/{MODEL}/manifests/sha256:xyz"), 400, "DIGEST_INVALID")
    oci_error(seeded.get(f"/v2/{MODEL}/manifests/-bad"), 400, "TAG_INVALID")
    # Pull only: a push is refused in the spec's shape, and changes nothing.
    oci_error(seeded.put(f"/v2/{MODEL}/manifests/new", json={}), 405, "UNSUPPORTED")
    oci_error(seeded.post(f"/v2/{MODEL}/blobs/uploads/"), 405, "UNSUPPORTED")
    oci_error(seeded.delete(f"/v2/{MODEL}/manifests/{TAG}"), 405, "UNSUPPORTED")
    assert seeded.get(f"/v2/{MODEL}/manifests/{TAG}").status_code == 200
    # A yanked release's tags are gone; the channel on it serves nothing either.
    assert seeded.post(f"/v1/models/{MODEL}/releases/1.0.0/yank", json={"reason": "bad"}).status_code == 200
    for reference in (TAG, "prod-gguf-q4_k_m"):
        oci_error(seeded.get(f"/v2/{MODEL}/manifests/{reference}"), 404, "MANIFEST_UNKNOWN")


def test_end_2_blobs_with_range(seeded: TestClient) -> None:
    manifest, _ = manifest_of(seeded, TAG)
    gguf = f"sha256:{sha(GGUF)}"
    response = seeded.get(f"/v2/{MODEL}/blobs/{gguf}")
    assert response.status_code == 200 and response.content == GGUF
    assert response.headers["docker-content-digest"] == gguf
    head = seeded.head(f"/v2/{MODEL}/blobs/{gguf}")
    assert head.status_code == 200 and int(head.headers["content-length"]) == len(GGUF)
    assert head.headers["docker-content-digest"] == gguf
    part = seeded.get(f"/v2/{MODEL}/blobs/{gguf}", headers={"Range": "bytes=100-199"})
    assert part.status_code == 206 and part.content == GGUF[100:200]
    assert part.headers["content-range"] == f"bytes 100-199/{len(GGUF)}"
    oci_error(seeded.get(f"/v2/{MODEL}/blobs/{gguf}", headers={"Range": "bytes=99999999-"}), 416, "UNSUPPORTED")
    # The config: derived, canonical, served by its digest, a valid ModelPack config.
    config = manifest["config"]
    body = seeded.get(f"/v2/{MODEL}/blobs/{config['digest']}")
    assert body.status_code == 200 and f"sha256:{hashlib.sha256(body.content).hexdigest()}" == config["digest"]
    assert len(body.content) == config["size"]
    parsed = json.loads(body.content)
    assert set(parsed) == {"descriptor", "modelfs", "config"}
    assert parsed["modelfs"]["diffIds"] == [layer["digest"] for layer in manifest["layers"]]
    assert parsed["config"] == {"format": "gguf-v3", "quantization": "q4_k_m"}
    assert seeded.head(f"/v2/{MODEL}/blobs/{config['digest']}").headers["content-length"] == str(config["size"])
    # Only this repository's served blobs: not an open release's, not another model's, not garbage.
    open_blob = f"sha256:{sha(b'open')}"
    oci_error(seeded.get(f"/v2/{MODEL}/blobs/{open_blob}"), 404, "BLOB_UNKNOWN")
    assert seeded.head(f"/v2/{MODEL}/blobs/{open_blob}").status_code == 404
    make_release(seeded, model="other", version="1.0", planned=["gguf-q8"])
    oci_error(seeded.get(f"/v2/other/blobs/{gguf}"), 404, "BLOB_UNKNOWN")
    oci_error(seeded.get(f"/v2/{MODEL}/blobs/sha512:abc"), 400, "DIGEST_INVALID")


def test_end_8_tags_list_paginates(seeded: TestClient) -> None:
    everything = seeded.get(f"/v2/{MODEL}/tags/list")
    assert everything.status_code == 200 and "link" not in everything.headers
    tags = ["1.0.0-gguf-q4_k_m", "1.0.0-hf-bf16", "prod-gguf-q4_k_m", "prod-hf-bf16"]
    assert everything.json() == {"name": MODEL, "tags": tags}
    seen: list[str] = []
    url: str | None = f"/v2/{MODEL}/tags/list?n=3"
    while url is not None:
        page = seeded.get(url)
        assert page.status_code == 200 and len(page.json()["tags"]) <= 3
        seen += page.json()["tags"]
        link = page.headers.get("link")
        url = link[1 : link.index(">")] if link else None
        assert link is None or link.endswith('; rel="next"')
    assert seen == tags
    assert seeded.get(f"/v2/{MODEL}/tags/list", params={"n": 2, "last": tags[1]}).json()["tags"] == tags[2:]
    assert seeded.get(f"/v2/{MODEL}/tags/list", params={"n": 0}).json()["tags"] == []
    oci_error(seeded.get(f"/v2/{MODEL}/tags/list", params={"n": -1}), 400, "UNSUPPORTED")
    oci_error(seeded.get("/v2/nope/tags/list"), 404, "NAME_UNKNOWN")


def test_tags_list_without_n_answers_a_page(seeded: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without `n` the listing still ends at a page (the API's largest), with a `Link` to the rest."""
    monkeypatch.setattr("kiln.registry.oci.routes.MAX_PAGE_LIMIT", 3)
    first = seeded.get(f"/v2/{MODEL}/tags/list")
    assert first.json()["tags"] == ["1.0.0-gguf-q4_k_m", "1.0.0-hf-bf16", "prod-gguf-q4_k_m"]
    assert first.headers["link"] == f'</v2/{MODEL}/tags/list?n=3&last=prod-gguf-q4_k_m>; rel="next"'
    assert seeded.get(first.headers["link"][1:].split(">")[0]).json()["tags"] == ["prod-hf-bf16"]


def _attest(app: FastAPI, client: TestClient, artifact: str, kind: str, media_type: str, content: bytes) -> str:
    """An attestation row for `artifact` of tiny-llama 1.0.0, with its blob uploaded."""
    from sqlalchemy import select

    from kiln.registry.artifacts.models import Artifact
    from kiln.registry.releases.models import Release

    digest = upload(client, content)
    with app.state.session_factory() as session:
        artifact_id = session.scalars(
            select(Artifact.id)
            .join(Release, Release.id == Artifact.release_id)
            .where(Release.version == "1.0.0", Artifact.name == artifact)
        ).one()
        session.add(
            Attestation(
                artifact_id=artifact_id, kind=kind, media_type=media_type, sha256=digest, size=len(content), signer="k"
            )
        )
        session.commit()
    return digest


def test_end_12_referrers_list_the_signature_and_provenance(app: FastAPI, seeded: TestClient) -> None:
    _, digest = manifest_of(seeded, TAG)
    empty = seeded.get(f"/v2/{MODEL}/referrers/{digest}")
    assert empty.status_code == 200 and empty.headers["content-type"] == INDEX
    assert empty.json() == {"schemaVersion": 2, "mediaType": INDEX, "manifests": []}
    bundle = b'{"mediaType": "application/vnd.dev.sigstore.bundle.v0.3+json"}'
    statement = b'{"_type": "https://in-toto.io/Statement/v1"}'
    _attest(app, seeded, "gguf-q4_k_m", "signature", SIGNATURE, bundle)
    _attest(app, seeded, "gguf-q4_k_m", "provenance", PROVENANCE, statement)
    assert manifest_of(seeded, TAG)[1] == digest  # attestations do not change the artifact's manifest
    index = seeded.get(f"/v2/{MODEL}/referrers/{digest}").json()
    assert {m["artifactType"] for m in index["manifests"]} == {SIGNATURE, PROVENANCE}
    for descriptor in index["manifests"]:
        assert descriptor["mediaType"] == MANIFEST
        referrer, referrer_digest = manifest_of(seeded, descriptor["digest"])
        assert referrer_digest == descriptor["digest"] and descriptor["size"] == len(
            json.dumps(referrer, separators=(",", ":"))
        )
        assert referrer["subject"]["digest"] == digest and referrer["artifactType"] == descriptor["artifactType"]
        (layer,) = referrer["layers"]
        blob = seeded.get(f"/v2/{MODEL}/blobs/{layer['digest']}")
        assert blob.status_code == 200 and blob.content == (bundle if layer["mediaType"] == SIGNATURE else statement)
        assert seeded.get(f"/v2/{MODEL}/blobs/{referrer['config']['digest']}").content == b"{}"
    only = seeded.get(f"/v2/{MODEL}/referrers/{digest}", params={"artifactType": SIGNATURE})
    assert [m["artifactType"] for m in only.json()["manifests"]] == [SIGNATURE]
    assert only.headers["oci-filters-applied"] == "artifactType"
    # The other artifact has none; an unknown subject has an empty list (never a 404); a bad digest is a 400.
    _, other = manifest_of(seeded, "1.0.0-hf-bf16")
    assert seeded.get(f"/v2/{MODEL}/referrers/{other}").json()["manifests"] == []
    assert seeded.get(f"/v2/{MODEL}/referrers/sha256:{'1' * 64}").json()["manifests"] == []
    oci_error(seeded.get(f"/v2/{MODEL}/referrers/nope"), 400, "DIGEST_INVALID")


def _basic(token: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"anyone:{token}".encode()).decode()}


def test_token_challenge_and_scopes(settings: RegistrySettings) -> None:
    app = create_app(settings.model_copy(update={"anonymous_read": False}))
    with TestClient(app, headers={"Authorization": f"Bearer {make_token(app, ['admin'], name='root')}"}) as admin:
        _seed(admin)
        make_release(admin, model="other-model", version="1.0", planned=["gguf-q8"])
    reader = make_token(app, ["read"], models=[MODEL], name="reader")
    elsewhere = make_token(app, ["read"], models=["other-*"], name="elsewhere")
    with TestClient(app) as bare:
        refused = bare.get("/v2/")
        oci_error(refused, 401, "UNAUTHORIZED")
        assert refused.headers["www-authenticate"] == 'Bearer realm="http://testserver/v2/token",service="kiln"'
        refused = bare.get(f"/v2/{MODEL}/manifests/{TAG}")
        oci_error(refused, 401, "UNAUTHORIZED")
        assert refused.headers["www-authenticate"].endswith(f',scope="repository:{MODEL}:pull"')
        assert bare.head(f"/v2/{MODEL}/manifests/{TAG}").status_code == 401
        oci_error(bare.get(f"/v2/{MODEL}/blobs/sha256:{sha(GGUF)}"), 401, "UNAUTHORIZED")
        # The challenge flow: Basic with the kiln token as password -> a bearer token that reads.
        oci_error(bare.get("/v2/token"), 401, "UNAUTHORIZED")
        oci_error(bare.get("/v2/token", headers=_basic("kiln_wrong")), 401, "UNAUTHORIZED")
        granted = bare.get(
            "/v2/token", params={"scope": f"repository:{MODEL}:pull", "service": "kiln"}, headers=_basic(reader)
        )
        assert granted.status_code == 200
        bearer = {"Authorization": f"Bearer {granted.json()['token']}"}
        assert granted.json()["access_token"] == granted.json()["token"]
        assert bare.get("/v2/", headers=bearer).status_code == 200
        assert bare.get(f"/v2/{MODEL}/manifests/{TAG}", headers=bearer).status_code == 200
        assert bare.get(f"/v2/{MODEL}/blobs/sha256:{sha(GGUF)}", headers=bearer).content == GGUF
        oci_error(
            bare.get(f"/v2/{MODEL}/manifests/{TAG}", headers={"Authorization": "Bearer kiln_nope"}), 401, "UNAUTHORIZED"
        )
        # A token for other models is denied this one, by every endpoint.
        other = {"Authorization": f"Bearer {elsewhere}"}
        for path in (
            f"/v2/{MODEL}/manifests/{TAG}",
            f"/v2/{MODEL}/blobs/sha256:{sha(GGUF)}",
            f"/v2/{MODEL}/tags/list",
            f"/v2/{MODEL}/referrers/sha256:{'1' * 64}",
        ):
            oci_error(bare.get(path, headers=other), 403, "DENIED")
        assert bare.get("/v2/other-model/tags/list", headers=other).json() == {"name": "other-model", "tags": []}
