"""An artifact's identity is one record (`core.manifest.ArtifactIdentity`): every record that names an artifact
embeds it, reads it from rows and records the same way, and a signature's claims are made of it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from kiln.core.manifest import ArtifactIdentity, ArtifactManifest, FileEntry, FileOut
from kiln.core.resolve import ResolvedArtifact
from kiln.core.signing import ArtifactClaims, check_claims
from kiln.pipeline.records import ArtifactRecord
from kiln.pipeline.signing import claims_of
from kiln.routing.records import Placement

IDENTITY: dict[str, Any] = {
    "name": "hf-bundle-fp8",
    "target": "hf-bundle",
    "format": "safetensors",
    "quant": "fp8",
    "hardware": ["mi300x", "h100"],
    "runtime": {"loaders": {"vllm": ">=0.9"}},
}
FILE = FileEntry(path="model.safetensors", sha256="ab" * 32, size=1)


def _manifest() -> ArtifactManifest:
    return ArtifactManifest(**IDENTITY, unsupported={"cpu": "fp8 needs a GPU"}, files=[FILE])


def test_every_record_that_names_an_artifact_embeds_the_identity() -> None:
    for record in (ArtifactManifest, ArtifactRecord, ResolvedArtifact):
        assert issubclass(record, ArtifactIdentity), record
        assert {f: record.model_fields[f].annotation for f in ArtifactIdentity.model_fields} == {
            f: ArtifactIdentity.model_fields[f].annotation for f in ArtifactIdentity.model_fields
        }, record
    assert Placement.model_fields["artifact"].annotation in (ArtifactIdentity, "ArtifactIdentity")


def test_the_identity_reads_from_a_row_or_a_record_its_own_fields_alone() -> None:
    manifest = _manifest()
    identity = ArtifactIdentity.of(manifest)
    assert type(identity) is ArtifactIdentity and identity.model_dump() == IDENTITY
    row = SimpleNamespace(**IDENTITY, manifest_digest="cd" * 32, total_size=1, provenance={"x": 1})
    assert ArtifactIdentity.of(row) == identity
    # A record that embeds it is read from a row with what the row lacks given by name.
    files = [FileOut(path=FILE.path, sha256=FILE.sha256, size=1, url="https://registry.example/f")]
    resolved = ResolvedArtifact.of(identity, manifest_digest="cd" * 32, files=files)
    assert ArtifactIdentity.of(resolved) == identity and resolved.files == files
    # The manifest read back from its row is the one published: the same content digest.
    again = ArtifactManifest.of(row, files=[FILE], unsupported=manifest.unsupported)
    assert again.content_digest() == manifest.content_digest()


def test_the_identity_checks_what_the_manifest_checked() -> None:
    for field, bad in (("name", "../etc"), ("target", "-x"), ("hardware", ["H100 SXM"]), ("runtime", [])):
        with pytest.raises(ValidationError):
            ArtifactIdentity(**{**IDENTITY, field: bad})


def test_a_runtime_stored_before_the_bounds_is_read_in_its_place_and_refused_when_sent() -> None:
    """What an older registry stored past today's JSON bounds: read from its row as STORED_VALUE_UNREADABLE (the
    row answers), refused where a publisher sends it."""
    deep: Any = 1
    for _ in range(300):
        deep = [deep]
    for bad in ({"x": deep}, {"x": 10**3999}, {"x": float("nan")}):
        row = SimpleNamespace(**{**IDENTITY, "runtime": bad})
        read = ArtifactIdentity.of(row)
        assert read.runtime["error"]["code"] == "STORED_VALUE_UNREADABLE" and read.name == IDENTITY["name"]
        assert ResolvedArtifact.of(row, manifest_digest="cd" * 32, files=[]).runtime == read.runtime
        with pytest.raises(ValidationError):
            ArtifactIdentity.model_validate({**IDENTITY, "runtime": bad})
        with pytest.raises(ValidationError):
            ArtifactManifest.model_validate({**IDENTITY, "runtime": bad, "files": [FILE.model_dump()]})


def test_a_signatures_claims_are_the_identity_in_its_release() -> None:
    manifest = _manifest()
    claims = claims_of(manifest, model="m", version="1.0")
    expected = ArtifactIdentity.of(manifest).claims(model="m", version="1.0")
    assert claims.as_dict() == expected
    assert expected["artifact"] == "hf-bundle-fp8" and expected["hardware"] == ["h100", "mi300x"]
    assert set(expected) == set(ArtifactClaims.FIELDS)
    check_claims(claims, expected, "the statement")
    # What the registry compares them with: the same record read from its row, compared as canonical JSON.
    row = SimpleNamespace(**{**IDENTITY, "hardware": ["h100", "mi300x"]})
    check_claims(claims, ArtifactIdentity.of(row).claims(model="m", version="1.0"), "the statement")
