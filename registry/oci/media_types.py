"""OCI and CNCF ModelPack names as data: media types, annotation keys, error codes, and which layer type a file is.

Sources: OCI image-spec v1.1 (`manifest.md`, `image-index.md`, `manifest.md#guidelines-for-artifact-usage`
for the empty config), OCI distribution-spec v1.1 (`spec.md`: error codes, the tag grammar, the referrers
API), and the CNCF ModelPack model-spec `specs-go/v1/mediatype.go`, `annotations.go`, `config.go`.
"""

from __future__ import annotations

import re
from typing import Final

from kiln.core.error_codes import Codes

# OCI image-spec v1.1.
IMAGE_MANIFEST: Final = "application/vnd.oci.image.manifest.v1+json"
IMAGE_INDEX: Final = "application/vnd.oci.image.index.v1+json"
IMAGE_CONFIG: Final = "application/vnd.oci.image.config.v1+json"
LAYER_TAR: Final = "application/vnd.oci.image.layer.v1.tar"
# The layer types a model car's base image may have (what `skopeo copy ... oci:DIR` writes).
BASE_LAYER_TYPES: Final = frozenset(
    {LAYER_TAR, "application/vnd.oci.image.layer.v1.tar+gzip", "application/vnd.oci.image.layer.v1.tar+zstd"}
)
# The config of an artifact that has none: the two bytes `{}` (image-spec, guidelines for artifact usage).
EMPTY_CONFIG: Final = "application/vnd.oci.empty.v1+json"
EMPTY_CONFIG_BYTES: Final = b"{}"
EMPTY_CONFIG_SHA256: Final = "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"

# CNCF ModelPack model-spec v1.
MODEL_ARTIFACT_TYPE: Final = "application/vnd.cncf.model.manifest.v1+json"
MODEL_CONFIG: Final = "application/vnd.cncf.model.config.v1+json"
MODEL_WEIGHT_RAW: Final = "application/vnd.cncf.model.weight.v1.raw"
MODEL_WEIGHT_CONFIG_RAW: Final = "application/vnd.cncf.model.weight.config.v1.raw"
MODEL_DOC_RAW: Final = "application/vnd.cncf.model.doc.v1.raw"
MODEL_CODE_RAW: Final = "application/vnd.cncf.model.code.v1.raw"

# Annotation keys.
TITLE: Final = "org.opencontainers.image.title"  # what oras names a pulled layer's file
VERSION: Final = "org.opencontainers.image.version"
BASE_DIGEST: Final = "org.opencontainers.image.base.digest"
BASE_NAME: Final = "org.opencontainers.image.base.name"
REF_NAME: Final = "org.opencontainers.image.ref.name"  # a manifest's tag in an OCI image layout's index
MODEL_FILEPATH: Final = "org.cncf.model.filepath"
KILN_MODEL: Final = "dev.kiln.model"
KILN_ARTIFACT: Final = "dev.kiln.artifact"
KILN_TARGET: Final = "dev.kiln.target"
KILN_HARDWARE: Final = "dev.kiln.hardware"
KILN_MANIFEST_DIGEST: Final = "dev.kiln.manifest-digest"  # the artifact's own manifest digest (its Hub commit)
KILN_ATTESTATION_KIND: Final = "dev.kiln.attestation.kind"

# A file's layer type, by its name: the first rule that matches wins; anything else is weights.
# Raw (untarred) layers: each file's bytes are the stored blob itself, so nothing is copied.
LAYER_TYPE_RULES: Final[tuple[tuple[re.Pattern[str], str], ...]] = (
    (re.compile(r"(?i)(^|/)(readme|license|licence|notice|model_card)[^/]*$|\.md$"), MODEL_DOC_RAW),
    (re.compile(r"(?i)\.(py|sh)$"), MODEL_CODE_RAW),
    (
        re.compile(r"(?i)\.(json|yaml|yml|txt|model|tiktoken|jinja)$|(^|/)_?(checkpoint_)?metadata$"),
        MODEL_WEIGHT_CONFIG_RAW,
    ),
)

# distribution-spec: the tag grammar, and a digest reference (only sha256: the registry's blobs are sha256).
TAG: Final = re.compile(r"[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}")
DIGEST: Final = re.compile(r"sha256:(?P<hex>[0-9a-f]{64})")

# distribution-spec error codes, each with its HTTP status, keyed by the kiln error code that stands for it.
OCI_ERROR_BY_KILN_CODE: Final[dict[str, tuple[str, int]]] = {
    Codes.NAME_UNKNOWN: ("NAME_UNKNOWN", 404),
    Codes.NAME_INVALID: ("NAME_INVALID", 400),
    Codes.MANIFEST_UNKNOWN: ("MANIFEST_UNKNOWN", 404),
    Codes.TAG_INVALID: ("TAG_INVALID", 400),
    Codes.BLOB_UNKNOWN: ("BLOB_UNKNOWN", 404),
    Codes.BLOB_NOT_FOUND: ("BLOB_UNKNOWN", 404),
    Codes.DIGEST_INVALID: ("DIGEST_INVALID", 400),
    Codes.UNAUTHORIZED: ("UNAUTHORIZED", 401),
    Codes.INVALID_TOKEN: ("UNAUTHORIZED", 401),
    Codes.FORBIDDEN: ("DENIED", 403),
    Codes.INVALID_INPUT: ("UNSUPPORTED", 400),
    Codes.OCI_PUSH_UNSUPPORTED: ("UNSUPPORTED", 405),
    Codes.OCI_ENDPOINT_UNKNOWN: ("UNSUPPORTED", 404),
    # A byte range outside the blob: the spec names no code for a 416; its parameters are unsupported.
    Codes.RANGE_NOT_SATISFIABLE: ("UNSUPPORTED", 416),
}


def layer_media_type(path: str) -> str:
    """The ModelPack layer media type of an artifact file at `path`."""
    for pattern, media_type in LAYER_TYPE_RULES:
        if pattern.search(path):
            return media_type
    return MODEL_WEIGHT_RAW
