"""The documents the registry derives for OCI clients, and the served artifact they derive from."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from kiln.registry.artifacts.service import Artifact
from kiln.registry.oci import media_types as mt


@dataclass(frozen=True)
class Document:
    """A JSON document the registry derives (a manifest, an index, a config blob): its bytes and media type."""

    media_type: str
    body: bytes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.body).hexdigest()

    @property
    def digest(self) -> str:
        return f"sha256:{self.sha256}"

    def descriptor(self, **extra: Any) -> dict[str, Any]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": len(self.body), **extra}


@dataclass(frozen=True)
class Served:
    """An artifact of a served release (files loaded), as an OCI repository holds it."""

    model: str
    version: str
    artifact: Artifact


def kiln_annotations(served: Served) -> dict[str, str]:
    """What kiln says about an artifact on each of its manifests: version, model, artifact, target, hardware."""
    a = served.artifact
    return {
        mt.VERSION: served.version,
        mt.KILN_MODEL: served.model,
        mt.KILN_ARTIFACT: a.name,
        mt.KILN_TARGET: a.target,
        mt.KILN_HARDWARE: ",".join(a.hardware),
        mt.KILN_MANIFEST_DIGEST: a.manifest_digest,
    }
