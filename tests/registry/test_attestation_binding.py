"""A signature and provenance hold only for the artifact they were made for.

model-a@1.0.0/gguf-q8 is published and signed; its genuine bundles are then attached to artifacts with
the very same files that are not it (another model's with other target, quant and hardware; the same
artifact of model-a@1.0.1; another artifact name in model-a@1.0.0): each is refused naming the claim
that differs, and no release with a refused attachment seals. Bundles made before claims were bound,
and a bundle nested 200,000 deep, are refused with their own codes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from model_signing import hashing as ms_hashing
from model_signing import signing as ms_signing
from starlette.testclient import TestClient

from kiln.core.manifest import ArtifactManifest
from kiln.core.signing import load_private_key, sign_statement
from kiln.pipeline.signing import SigningKey, provenance_statement, sign_files, sign_provenance
from tests.pipeline.test_signing import write_key_pair
from tests.registry.helpers import assert_error, make_release, manifest, post_eval, publish, seal, sha, upload

FILES = {"model.gguf": b"GGUF" + bytes(range(256)) * 8, "tokenizer.json": b'{"v": 1}'}
GGUF_Q8: dict[str, Any] = {"hardware": ["cpu"], "quant": "q8_0", "target": "gguf", "format": "gguf-v3"}
# model-b's artifact: the same files, published as something else entirely.
BUNDLE_FP8: dict[str, Any] = {
    "hardware": ["h100"],
    "quant": "fp8",
    "target": "hf-bundle",
    "format": "safetensors",
    "runtime": {"vllm": ">=0.6"},
}


def attestations(model: str, version: str, name: str) -> str:
    return f"/v1/models/{model}/releases/{version}/artifacts/{name}/attestations"


def attach(client: TestClient, model: str, version: str, name: str, kind: str, data: bytes) -> Any:
    body = {"kind": kind, "sha256": upload(client, data), "size": len(data)}
    return client.post(attestations(model, version, name), json=body)


def artifact_dir(tmp_path: Path, files: dict[str, bytes]) -> Path:
    root = tmp_path / f"files-{sha(repr(sorted(files.items())).encode())[:8]}"
    for path, data in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
    return root


def signed(
    tmp_path: Path, key: SigningKey, model: str, version: str, name: str, files: dict[str, bytes] = FILES, **extra: Any
) -> dict[str, bytes]:
    """The signature and provenance `kiln publish` makes for `model@version/name`."""
    m = ArtifactManifest.model_validate(manifest(name, files, **{**GGUF_Q8, **extra}))
    statement = provenance_statement(
        m, model=model, version=version, source_digest="0" * 64, source_files=[], stages={}, evals={}
    )
    return {
        "signature": sign_files(artifact_dir(tmp_path, files), m, key, model=model, version=version),
        "provenance": sign_provenance(statement, key),
    }


@pytest.fixture
def key(client: TestClient, tmp_path: Path) -> SigningKey:
    (tmp_path / "key").mkdir()
    private, pub = write_key_pair(tmp_path / "key")
    response = client.post("/v1/keys", json={"model_pattern": "model-*", "public_key_pem": pub.read_text()})
    assert response.status_code == 201, response.text
    return private


def release(client: TestClient, model: str, version: str, artifacts: dict[str, dict[str, Any]]) -> None:
    """`model@version` with each artifact published from FILES, with a passing eval."""
    make_release(client, model=model, version=version, planned=list(artifacts))
    for name, extra in artifacts.items():
        publish(client, name, FILES, model=model, version=version, **{**extra})
        assert post_eval(client, name, "passed", model=model, version=version, metrics={"kl": 0.001}).status_code == 201


def test_a_genuine_bundle_holds_only_for_its_own_artifact(client: TestClient, key: SigningKey, tmp_path: Path) -> None:
    release(client, "model-a", "1.0.0", {"gguf-q8": GGUF_Q8, "gguf-q8-copy": GGUF_Q8})
    release(client, "model-a", "1.0.1", {"gguf-q8": GGUF_Q8})
    release(client, "model-b", "1.0.0", {"gguf-q8": BUNDLE_FP8})
    genuine = signed(tmp_path, key, "model-a", "1.0.0", "gguf-q8")

    for kind, data in genuine.items():
        created = attach(client, "model-a", "1.0.0", "gguf-q8", kind, data)
        assert created.status_code == 201, created.text
        # The same bundle again is answered with the stored attestation, nothing changed.
        replay = attach(client, "model-a", "1.0.0", "gguf-q8", kind, data)
        assert replay.status_code == 200, replay.text
        assert replay.json() == created.json()
    assert len(client.get(attestations("model-a", "1.0.0", "gguf-q8")).json()) == 2

    elsewhere = [
        # (a) another model's artifact with identical files, claiming another target, quant and hardware
        (
            ("model-b", "1.0.0", "gguf-q8"),
            "model",
            "model-a",
            "model-b",
            {"target", "format", "quant", "hardware", "runtime"},
        ),
        # (b) the same artifact of the next version
        (("model-a", "1.0.1", "gguf-q8"), "version", "1.0.0", "1.0.1", set()),
        # (c) another artifact name in the same release
        (("model-a", "1.0.0", "gguf-q8-copy"), "artifact", "gguf-q8", "gguf-q8-copy", set()),
    ]
    for (model, version, name), field, got, expected, also in elsewhere:
        for kind, data in genuine.items():
            error = assert_error(attach(client, model, version, name, kind, data), 422, "ATTESTATION_CLAIM_MISMATCH")
            assert error["details"]["field"] == field
            assert (error["details"]["got"], error["details"]["expected"]) == (got, expected)
            assert set(error["details"]["fields"]) == {field} | also, error
            assert f"{model}@{version}/{name}" in error["message"]
        assert client.get(attestations(model, version, name)).json() == []

    # Signatures are required for these models (a key is trusted for them): nothing refused counts.
    for model, version, unsigned in [
        ("model-a", "1.0.0", ["gguf-q8-copy"]),
        ("model-a", "1.0.1", ["gguf-q8"]),
        ("model-b", "1.0.0", ["gguf-q8"]),
    ]:
        error = assert_error(client.post(f"/v1/models/{model}/releases/{version}/seal"), 409, "ARTIFACT_UNSIGNED")
        assert error["details"]["unsigned"] == unsigned
    # Each signed with its own bundles, they seal.
    copy = signed(tmp_path / "copy", key, "model-a", "1.0.0", "gguf-q8-copy")
    assert attach(client, "model-a", "1.0.0", "gguf-q8-copy", "signature", copy["signature"]).status_code == 201
    seal(client, "1.0.0", "model-a")


def test_claims_and_subjects_are_each_checked(client: TestClient, key: SigningKey, tmp_path: Path) -> None:
    """Signed for this very artifact but claiming another quant, or naming other files: refused, each
    with its own code."""
    release(client, "model-a", "1.0.0", {"gguf-q8": GGUF_Q8})
    other_quant = signed(tmp_path / "quant", key, "model-a", "1.0.0", "gguf-q8", quant="q4_k_m")
    for kind, data in other_quant.items():
        error = assert_error(
            attach(client, "model-a", "1.0.0", "gguf-q8", kind, data), 422, "ATTESTATION_CLAIM_MISMATCH"
        )
        assert {k: error["details"][k] for k in ("field", "expected", "got")} == {
            "field": "quant",
            "expected": "q8_0",
            "got": "q4_k_m",
        }
    other_files = {**FILES, "tokenizer.json": b'{"v": 2}'}
    m = ArtifactManifest.model_validate(manifest("gguf-q8", other_files, **GGUF_Q8))
    signature = sign_files(artifact_dir(tmp_path, other_files), m, key, model="model-a", version="1.0.0")
    error = assert_error(
        attach(client, "model-a", "1.0.0", "gguf-q8", "signature", signature), 422, "ATTESTATION_SUBJECT_MISMATCH"
    )
    assert error["details"]["problems"] == [error["details"]["problems"][0]]
    assert error["details"]["problems"][0].startswith("file tokenizer.json: digest mismatch")


def test_bundles_without_claims_are_refused(client: TestClient, key: SigningKey, tmp_path: Path) -> None:
    """A model signature named after its directory (as model-signing and kiln before claims make it), and
    a provenance without hardware and runtime: valid signatures that name no artifact."""
    release(client, "model-a", "1.0.0", {"gguf-q8": GGUF_Q8})
    directory = artifact_dir(tmp_path, FILES)
    plain = tmp_path / "plain.sig"
    hashing = ms_hashing.Config().use_file_serialization(hashing_algorithm="sha256", allow_symlinks=False)
    ms_signing.Config().set_hashing_config(hashing).use_elliptic_key_signer(private_key=key.path).sign(directory, plain)
    error = assert_error(
        attach(client, "model-a", "1.0.0", "gguf-q8", "signature", plain.read_bytes()),
        422,
        "ATTESTATION_CLAIMS_MISSING",
    )
    assert directory.name in error["details"]["subject"]

    m = ArtifactManifest.model_validate(manifest("gguf-q8", FILES, **GGUF_Q8))
    statement = provenance_statement(
        m, model="model-a", version="1.0.0", source_digest="0" * 64, source_files=[], stages={}, evals={}
    )
    for field in ("hardware", "runtime"):
        del statement["predicate"]["buildDefinition"]["externalParameters"][field]
    old = sign_statement(statement, load_private_key(key.path))
    error = assert_error(
        attach(client, "model-a", "1.0.0", "gguf-q8", "provenance", old), 422, "ATTESTATION_CLAIMS_MISSING"
    )
    assert error["details"]["missing"] == ["hardware", "runtime"]
    assert client.get(attestations("model-a", "1.0.0", "gguf-q8")).json() == []


def test_a_deeply_nested_bundle_is_refused_not_a_server_error(client: TestClient, key: SigningKey) -> None:
    release(client, "model-a", "1.0.0", {"gguf-q8": GGUF_Q8})
    depth = 200_000
    nested = (
        b'{"mediaType": "application/vnd.dev.sigstore.bundle.v0.3+json", "x": ' + b"[" * depth + b"]" * depth + b"}"
    )
    for kind in ("signature", "provenance"):
        error = assert_error(attach(client, "model-a", "1.0.0", "gguf-q8", kind, nested), 422, "INVALID_JSON")
        assert "nests deeper than" in error["message"]


@pytest.mark.parametrize(
    ("recorded", "claimed"),
    [({"flag": 1}, {"flag": True}), ({"n": 1}, {"n": 1.0}), ({"n": 0}, {"n": False}), ({"n": [1]}, {"n": [True]})],
)
def test_claims_are_compared_as_json_not_python_values(
    client: TestClient, key: SigningKey, tmp_path: Path, recorded: dict[str, Any], claimed: dict[str, Any]
) -> None:
    """`true` is not `1` and `1.0` is not `1` in a signed claim, though Python finds them equal."""
    release(client, "model-a", "1.0.0", {"gguf-q8": {**GGUF_Q8, "runtime": recorded}})
    for kind, data in signed(tmp_path, key, "model-a", "1.0.0", "gguf-q8", runtime=claimed).items():
        error = assert_error(
            attach(client, "model-a", "1.0.0", "gguf-q8", kind, data), 422, "ATTESTATION_CLAIM_MISMATCH"
        )
        assert (error["details"]["field"], error["details"]["expected"]) == ("runtime", recorded)
    for kind, data in signed(tmp_path / "same", key, "model-a", "1.0.0", "gguf-q8", runtime=recorded).items():
        assert attach(client, "model-a", "1.0.0", "gguf-q8", kind, data).status_code == 201
