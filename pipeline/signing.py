"""Signing what a build publishes: the OpenSSF model signature of an artifact's files, and its SLSA provenance.

The signature is made by the `model-signing` package (its elliptic-curve key signer over a per-file
sha256 manifest of the artifact's directory, the manifest named by the artifact's claims); the
provenance statement is built here from what the stages recorded, with the same claims in its
external parameters, and signed with the same key (`core.signing`). Both are Sigstore bundles; what
binds them to one artifact is described in `core.signing`.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model_signing import hashing as ms_hashing
from model_signing import manifest as ms_manifest
from model_signing._signing import sign_ec_key as ms_ec_key
from model_signing._signing import signing as ms_signing

from kiln.core import __version__
from kiln.core.errors import DigestMismatch
from kiln.core.manifest import ArtifactManifest
from kiln.core.signing import (
    IN_TOTO_STATEMENT_V1,
    SLSA_PROVENANCE_V1,
    ArtifactClaims,
    file_differences,
    load_private_key,
    sign_statement,
    verify_attestation,
)

SIGNING_KEY_ENV = "KILN_SIGNING_KEY"  # path of the PEM private key `kiln publish` signs with
SIGNING_KEY_PASSWORD_ENV = "KILN_SIGNING_KEY_PASSWORD"
BUILD_TYPE = "https://github.com/kiln/kiln/build/v1"  # what `externalParameters` and `internalParameters` mean


@dataclass(frozen=True)
class SigningKey:
    """A publisher's private key file (PEM, EC P-256/P-384/P-521), and its password if encrypted."""

    path: Path
    password: str | None = None

    @classmethod
    def from_env(cls) -> SigningKey | None:
        """The key named by $KILN_SIGNING_KEY (`kiln publish --signing-key` sets it), or None."""
        path = os.environ.get(SIGNING_KEY_ENV)
        return cls(Path(path), os.environ.get(SIGNING_KEY_PASSWORD_ENV) or None) if path else None


def claims_of(manifest: ArtifactManifest, *, model: str, version: str) -> ArtifactClaims:
    """What the signature and the provenance of `manifest`'s artifact in `model@version` claim."""
    return ArtifactClaims.of(**manifest.claims(model=model, version=version))


def sign_files(files_dir: Path, manifest: ArtifactManifest, key: SigningKey, *, model: str, version: str) -> bytes:
    """The model signature (a Sigstore bundle) of the artifact in `files_dir` as `model@version`, checked
    to cover exactly the manifest's files with the manifest's digests: what was signed is what is published.

    model-signing hashes the directory; the manifest it signs is named by the artifact's claims
    (`ArtifactClaims.signed_name`) instead of the directory's name, which binds the signature to them."""
    private = load_private_key(key.path, key.password)  # KEY_INVALID with the reason, before model-signing's
    hashing = ms_hashing.Config().use_file_serialization(hashing_algorithm="sha256", allow_symlinks=False)
    hashed = hashing.hash(files_dir)
    serialization = ms_manifest.SerializationType.from_args(hashed.serialization_type)
    claims = claims_of(manifest, model=model, version=version)
    named = ms_manifest.Manifest(
        claims.signed_name(),
        [serialization.new_item(rd.identifier, rd.digest) for rd in hashed.resource_descriptors()],
        serialization,
    )
    signature = ms_ec_key.Signer(key.path, key.password).sign(ms_signing.Payload(named))
    with tempfile.TemporaryDirectory(prefix="kiln-sign-") as tmp:
        out = Path(tmp) / "model.sig"
        signature.write(out)
        bundle = out.read_bytes()
    signed = verify_attestation(bundle, private.public_key(), "signature")
    problems = file_differences(signed.files, {f.path: f.sha256 for f in manifest.files})
    if problems:
        raise DigestMismatch(f"{files_dir} changed since its manifest was made: " + "; ".join(problems))
    return bundle


def provenance_statement(
    manifest: ArtifactManifest,
    *,
    model: str,
    version: str,
    source_digest: str,
    source_files: list[Mapping[str, Any]],
    stages: Mapping[str, Mapping[str, Any]],
    evals: Mapping[str, Mapping[str, Any]],
    recipe_digest: str | None = None,
) -> dict[str, Any]:
    """An in-toto statement with a SLSA v1 provenance predicate for one artifact.

    Subjects: the artifact's files. Build definition: the artifact's claims (`claims_of`: the release,
    the artifact's name, target, format, quant, hardware and runtime), the recipe's digest
    (`Recipe.digest`) and the source release's digests;
    internal parameters: each stage that made it (cache key, code version, params, tool versions,
    host, when). Run details: the builder (kiln and its version) and the eval results.
    """
    first = min((s.get("started_at", "") for s in stages.values()), default="")
    return {
        "_type": IN_TOTO_STATEMENT_V1,
        "subject": [{"name": f.path, "digest": {"sha256": f.sha256}} for f in manifest.files],
        "predicateType": SLSA_PROVENANCE_V1,
        "predicate": {
            "buildDefinition": {
                "buildType": BUILD_TYPE,
                "externalParameters": {
                    **claims_of(manifest, model=model, version=version).as_dict(),
                    **({"recipe": {"digest": {"sha256": recipe_digest}}} if recipe_digest else {}),
                },
                "internalParameters": {"stages": {k: dict(v) for k, v in sorted(stages.items())}},
                "resolvedDependencies": [
                    *([{"name": "recipe", "digest": {"sha256": recipe_digest}}] if recipe_digest else []),
                    {"name": "source", "digest": {"sha256": source_digest}},
                    *({"name": f"source/{f['path']}", "digest": {"sha256": f["sha256"]}} for f in source_files),
                ],
            },
            "runDetails": {
                "builder": {"id": f"kiln/{__version__}", "version": {"kiln": __version__}},
                "metadata": {"startedOn": first} if first else {},
                "byproducts": [
                    {"name": f"eval/{runtime}", "annotations": dict(result)}
                    for runtime, result in sorted(evals.items())
                ],
            },
        },
    }


def sign_provenance(statement: Mapping[str, Any], key: SigningKey) -> bytes:
    """The provenance statement signed with the publisher's key (a Sigstore bundle)."""
    return sign_statement(statement, load_private_key(key.path, key.password))
