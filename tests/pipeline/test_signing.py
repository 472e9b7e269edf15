"""Signing an artifact's files and provenance, and verifying a directory offline (interop with model-signing)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from model_signing import verifying as ms_verifying

from kiln.core.digest import sha256_file
from kiln.core.errors import DigestMismatch
from kiln.core.manifest import ArtifactManifest, FileEntry
from kiln.core.signing import (
    PROVENANCE_FILE,
    SIGNATURE_FILE,
    SLSA_PROVENANCE_V1,
    KeyInvalid,
    SignatureInvalid,
    load_public_key,
    verify_attestation,
    verify_directory,
)
from kiln.pipeline.signing import SigningKey, provenance_statement, sign_files, sign_provenance


def write_key_pair(directory: Path, curve: ec.EllipticCurve | None = None) -> tuple[SigningKey, Path]:
    private = ec.generate_private_key(curve or ec.SECP256R1())
    key = directory / "key.pem"
    key.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    pub = directory / "key.pub"
    pub.write_bytes(
        private.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return SigningKey(key), pub


def artifact(directory: Path) -> ArtifactManifest:
    (directory / "sub").mkdir(parents=True)
    (directory / "model.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 40)
    (directory / "sub" / "config.json").write_text('{"a": 1}')
    files = [
        FileEntry(path=p.relative_to(directory).as_posix(), sha256=sha256_file(p), size=p.stat().st_size)
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    ]
    return ArtifactManifest(
        name="gguf-q8", target="gguf", format="gguf-v3", quant="q8_0", hardware=["cpu"], files=files
    )


@pytest.fixture
def signed(tmp_path: Path) -> tuple[Path, Path, ArtifactManifest]:
    """An artifact directory with its signature and provenance beside the files, and the public key."""
    files = tmp_path / "artifact"
    manifest = artifact(files)
    key, pub = write_key_pair(tmp_path)
    statement = provenance_statement(
        manifest,
        model="tiny",
        version="1.0",
        source_digest="0" * 64,
        source_files=[{"path": "model.safetensors", "sha256": "1" * 64, "size": 10}],
        stages={"export/gguf-q8": {"cache_key": "2" * 64, "params": {"quant": "q8_0"}, "host": "h"}},
        evals={"llama.cpp": {"status": "passed", "metrics": {"kl": 0.001}}},
    )
    signature = sign_files(files, manifest, key, model="tiny", version="1.0")
    provenance = sign_provenance(statement, key)
    (files / SIGNATURE_FILE).write_bytes(signature)
    (files / PROVENANCE_FILE).write_bytes(provenance)
    return files, pub, manifest


def test_signature_is_model_signing_format_and_verifies_offline(signed: tuple[Path, Path, ArtifactManifest]) -> None:
    files, pub, manifest = signed
    key = load_public_key(pub.read_bytes())
    result = verify_directory(files, key)
    assert result.files == {f.path: f.sha256 for f in manifest.files}
    assert result.provenance is not None
    predicate = result.provenance["predicate"]
    assert result.provenance["predicateType"] == SLSA_PROVENANCE_V1
    assert predicate["buildDefinition"]["internalParameters"]["stages"]["export/gguf-q8"]["cache_key"] == "2" * 64
    assert predicate["runDetails"]["byproducts"][0]["annotations"]["metrics"] == {"kl": 0.001}
    assert verify_attestation((files / SIGNATURE_FILE).read_bytes(), key, "signature").files == result.files
    # The OpenSSF tool's own verifier accepts kiln's signature (it hashes the directory itself).
    ms_verifying.Config().use_elliptic_key_verifier(public_key=pub).set_ignore_unsigned_files(True).verify(
        files, files / SIGNATURE_FILE
    )


def test_one_changed_byte_is_named(signed: tuple[Path, Path, ArtifactManifest]) -> None:
    files, pub, _ = signed
    data = bytearray((files / "model.gguf").read_bytes())
    data[100] ^= 1
    (files / "model.gguf").write_bytes(bytes(data))
    with pytest.raises(DigestMismatch, match=r"file model\.gguf: digest mismatch") as info:
        verify_directory(files, load_public_key(pub.read_bytes()))
    assert info.value.details["files"] == ["model.gguf"]


def test_added_and_removed_files_are_named(signed: tuple[Path, Path, ArtifactManifest]) -> None:
    files, pub, _ = signed
    (files / "sub" / "config.json").unlink()
    (files / "extra.bin").write_bytes(b"x")
    with pytest.raises(DigestMismatch) as info:
        verify_directory(files, load_public_key(pub.read_bytes()))
    assert "file extra.bin: not signed" in info.value.message
    assert "file sub/config.json: signed but missing" in info.value.message


def test_another_key_or_an_altered_bundle_is_refused(
    signed: tuple[Path, Path, ArtifactManifest], tmp_path: Path
) -> None:
    files, pub, _ = signed
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    _, other_pub = write_key_pair(other_dir, ec.SECP384R1())
    with pytest.raises(SignatureInvalid, match="not signed by key"):
        verify_directory(files, load_public_key(other_pub.read_bytes()))
    bundle = json.loads((files / SIGNATURE_FILE).read_text())
    bundle["dsseEnvelope"]["payload"] = bundle["dsseEnvelope"]["payload"][:-8] + "AAAAAAA="
    (files / SIGNATURE_FILE).write_text(json.dumps(bundle))
    with pytest.raises(SignatureInvalid):
        verify_directory(files, load_public_key(pub.read_bytes()))


def test_unsupported_keys_are_refused(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives.asymmetric import ed25519

    pem = (
        ed25519.Ed25519PrivateKey.generate()
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    with pytest.raises(KeyInvalid, match="elliptic-curve"):
        load_public_key(pem)
    with pytest.raises(KeyInvalid):
        load_public_key(b"not a key")


def test_publish_signs_every_artifact_and_verify_checks_the_download(tmp_path: Path) -> None:
    """`kiln publish --signing-key` into a registry that trusts the key: sealed (so every artifact is signed),
    and `kiln verify MODEL@VERSION/ARTIFACT` passes on the download."""
    import yaml

    from kiln.client import RegistryClient
    from tests.model_factory import make_model

    root = tmp_path / "recipe"
    make_model(root / "model", hidden_size=64, intermediate_size=128, num_kv_heads=2)
    (root / "heldout.txt").write_text("def f(x):\n    return [x, x + 1, str(x)]\n" * 40)
    recipe = {
        "model": "m",
        "version": "1",
        "source": "model",
        "eval": {"text": "heldout.txt", "max_tokens": 64, "window": 32, "greedy_prompts": 1, "greedy_tokens": 2},
        "targets": [{"target": "gguf", "quants": ["f16", "q8_0"]}],
    }
    (root / "kiln.yaml").write_text(yaml.safe_dump(recipe))
    key, pub = write_key_pair(tmp_path)
    registry, work = str(tmp_path / "registry"), str(tmp_path / "work")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}

    def kiln(*args: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, "-m", "kiln", *args], capture_output=True, text=True, env=env, timeout=600
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done

    kiln("keys", "add", str(pub), "--model", "m", "--registry", registry)
    kiln("publish", str(root / "kiln.yaml"), "--work-dir", work, "--registry", registry, "--signing-key", str(key.path))
    with RegistryClient.connect(registry) as client:
        release = client.get_release("m", "1")
        assert release.status == "sealed"
        kinds = {a.name: [x.kind for x in client.list_attestations("m", "1", a.name)] for a in release.artifacts}
    assert kinds == {"gguf-f16": ["provenance", "signature"], "gguf-q8_0": ["provenance", "signature"]}
    out = kiln("verify", "m@1/gguf-q8_0", "--key", str(pub), "--registry", registry, "--json")
    assert json.loads(out.stdout)["verified"] is True
    # The provenance names the recipe by its digest, beside the source's files.
    from kiln.pipeline.recipe import load_recipe

    with RegistryClient.connect(registry) as client:
        client.download("/v1/models/m/releases/1/artifacts/gguf-q8_0/attestations/provenance", tmp_path / "prov")
    statement = verify_attestation(
        (tmp_path / "prov").read_bytes(), load_public_key(pub.read_bytes()), "provenance"
    ).statement
    dependencies = {
        d["name"]: d["digest"]["sha256"] for d in statement["predicate"]["buildDefinition"]["resolvedDependencies"]
    }
    assert dependencies["recipe"] == load_recipe(root / "kiln.yaml").digest()
    assert any(name.startswith("source/") for name in dependencies)
    # Each stage names the libraries it ran with, at their installed versions (the standard library aside).
    stages = statement["predicate"]["buildDefinition"]["internalParameters"]["stages"]
    export = stages["export/gguf-q8_0"]["libraries"]
    assert export["safetensors"] == importlib.metadata.version("safetensors")
    assert export["numpy"] == importlib.metadata.version("numpy")
    assert "pydantic" in export and not {"json", "os", "sys"} & set(export)


def kiln_verify(directory: Path, pub: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "kiln", "verify", str(directory), "--key", str(pub), *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_kiln_verify_names_the_artifact_the_signature_claims(signed: tuple[Path, Path, ArtifactManifest]) -> None:
    files, pub, _ = signed
    done = kiln_verify(files, pub, "--json")
    assert done.returncode == 0, done.stderr
    claims = json.loads(done.stdout)["claims"]
    assert {k: claims[k] for k in ("model", "version", "artifact", "quant", "hardware")} == {
        "model": "tiny",
        "version": "1.0",
        "artifact": "gguf-q8",
        "quant": "q8_0",
        "hardware": ["cpu"],
    }


@pytest.mark.parametrize("path", ["model.gguf", "sub/config.json", SIGNATURE_FILE, PROVENANCE_FILE])
def test_kiln_verify_refuses_a_symlinked_file(
    signed: tuple[Path, Path, ArtifactManifest], tmp_path: Path, path: str
) -> None:
    """A file replaced by a link to a copy of its very bytes: refused, whatever it points to."""
    files, pub, _ = signed
    copy = tmp_path / "outside" / path
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_bytes((files / path).read_bytes())
    (files / path).unlink()
    (files / path).symlink_to(copy)
    done = kiln_verify(files, pub)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "[FILE_IS_SYMLINK]" in done.stderr and path in done.stderr
    assert "Traceback" not in done.stderr


def test_kiln_verify_refuses_a_deeply_nested_bundle_without_a_traceback(
    signed: tuple[Path, Path, ArtifactManifest],
) -> None:
    files, pub, _ = signed
    depth = 200_000
    (files / SIGNATURE_FILE).write_bytes(b"[" * depth + b"]" * depth)
    done = kiln_verify(files, pub, "--json")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "[INVALID_JSON]" in done.stderr and "nests deeper than" in done.stderr
    assert "Traceback" not in done.stderr and "RecursionError" not in done.stderr
    assert json.loads(done.stdout)["error"]["code"] == "INVALID_JSON"
