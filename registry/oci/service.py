"""What the OCI distribution names mean in the registry, and the OCI documents derived from artifacts.

- repository: a model name, optionally under the namespace `kiln` (`tiny-llama` or `kiln/tiny-llama`).
- tags: `<version>-<artifact>` for each artifact of a served (sealed, not yanked) release, and
  `<channel>-<artifact>` for the release a channel points to (a split's largest member); a channel
  wins over a version of the same name, as on the Hub-compatible routes. A version or channel whose
  tag would break the OCI tag grammar (a `+` in a version, or over 128 characters) has no tag: its
  artifacts are still reachable by digest.
- manifests: one OCI image manifest per artifact, derived from the artifact alone (its files, target,
  format, quant and hardware, and the model and version), as canonical JSON, so the same artifact
  always has the same manifest digest. Each file is one raw layer whose digest is the file's sha256:
  the registry's own blob, never copied. Its config is a ModelPack model config, derived the same way.
- referrers: each attestation of an artifact (signature, provenance) as a small manifest whose
  `subject` is the artifact's manifest and whose one layer is the attestation's blob.

Services raise kiln errors with the spec's codes (`registry.oci.media_types.OCI_ERROR_BY_KILN_CODE`);
the routes render them in the spec's error shape.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from core.digest import canonical_json
from core.errors import InvalidInput, NotFound
from registry.api.params import MODEL_NAME_PATTERN
from registry.artifacts.models import Artifact, ArtifactFile
from registry.attestations.models import Attestation
from registry.channels.models import Channel
from registry.models.models import Model
from registry.oci import media_types as mt
from registry.releases.models import Release

NAMESPACE = "kiln"
_MODEL = re.compile(MODEL_NAME_PATTERN.removeprefix("^").removesuffix("$"))


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


def model_name(repository: str) -> str:
    """The model a repository name names: `<model>` or `kiln/<model>`; NAME_INVALID otherwise."""
    namespace, _, name = repository.rpartition("/")
    if namespace not in ("", NAMESPACE) or not _MODEL.fullmatch(name):
        raise InvalidInput(
            f"repository {repository!r} is not '<model>' or '{NAMESPACE}/<model>'",
            code="NAME_INVALID",
            details={"repository": repository},
        )
    return name


def find_model(session: Session, repository: str) -> Model:
    name = model_name(repository)
    row = session.scalars(select(Model).where(Model.name == name)).one_or_none()
    if row is None:
        raise NotFound(f"repository {repository!r} not found", code="NAME_UNKNOWN", details={"repository": repository})
    return row


def _served() -> Any:
    return (Release.status == "sealed") & Release.yanked_at.is_(None)


def tag(ref: str, artifact: str) -> str | None:
    """The OCI tag of `artifact` under a version or channel `ref`, or None where the grammar forbids one."""
    name = f"{ref}-{artifact}"
    return name if mt.TAG.fullmatch(name) else None


def tag_table(session: Session, model: Model) -> dict[str, int]:
    """Every tag of the model's repository -> the id of the artifact it names."""
    rows = session.execute(
        select(Artifact.id, Artifact.name, Release.id, Release.version)
        .join(Artifact.release)
        .where(Release.model_id == model.id, _served())
        .order_by(Release.id, Artifact.id)  # a tag two (version, artifact) pairs spell names the newer release's
    ).all()
    by_release: dict[int, list[tuple[int, str]]] = {}
    tags: dict[str, int] = {}
    for artifact_id, name, release_id, version in rows:
        by_release.setdefault(release_id, []).append((artifact_id, name))
        if (t := tag(version, name)) is not None:
            tags[t] = artifact_id
    channels = session.execute(select(Channel.name, Channel.release_id).where(Channel.model_id == model.id)).all()
    for channel, release_id in channels:  # after the versions: a channel wins over a version of its name
        for artifact_id, name in by_release.get(release_id, []):
            if (t := tag(channel, name)) is not None:
                tags[t] = artifact_id
    return tags


def served_artifacts(session: Session, model: Model, artifact_id: int | None = None) -> list[Served]:
    """The model's artifacts in served releases (or the one with `artifact_id`, if served), files loaded."""
    query = (
        select(Artifact, Release.version)
        .join(Artifact.release)
        .where(Release.model_id == model.id, _served())
        .options(selectinload(Artifact.files))
        .order_by(Artifact.id)
    )
    if artifact_id is not None:
        query = query.where(Artifact.id == artifact_id)
    return [Served(model.name, version, artifact) for artifact, version in session.execute(query).all()]


def model_config(served: Served) -> Document:
    """The ModelPack model config (`application/vnd.cncf.model.config.v1+json`) of an artifact.

    Only the schema's own fields (it allows no others); kiln's own facts (target, hardware) are
    annotations on the manifest."""
    a = served.artifact
    config = {
        "descriptor": {"name": served.model, "version": served.version, "revision": a.manifest_digest},
        "modelfs": {"type": "layers", "diffIds": [f"sha256:{f.sha256}" for f in a.files]},
        "config": {"format": a.format, "quantization": a.quant},
    }
    return Document(mt.MODEL_CONFIG, canonical_json(config))


def artifact_manifest(served: Served) -> Document:
    """The OCI image manifest of an artifact: ModelPack artifact type, one raw layer per file."""
    a = served.artifact
    layers = [
        {
            "mediaType": mt.layer_media_type(f.path),
            "digest": f"sha256:{f.sha256}",
            "size": f.size,
            "annotations": {mt.TITLE: f.path, mt.MODEL_FILEPATH: f.path},
        }
        for f in a.files
    ]
    manifest = {
        "schemaVersion": 2,
        "mediaType": mt.IMAGE_MANIFEST,
        "artifactType": mt.MODEL_ARTIFACT_TYPE,
        "config": model_config(served).descriptor(),
        "layers": layers,
        "annotations": {
            mt.VERSION: served.version,
            mt.KILN_MODEL: served.model,
            mt.KILN_ARTIFACT: a.name,
            mt.KILN_TARGET: a.target,
            mt.KILN_HARDWARE: ",".join(a.hardware),
            mt.KILN_MANIFEST_DIGEST: a.manifest_digest,
        },
    }
    return Document(mt.IMAGE_MANIFEST, canonical_json(manifest))


def attestation_manifest(subject: Document, attestation: Attestation) -> Document:
    """An attestation as a referrer of its artifact's manifest: empty config, its blob as the one layer."""
    manifest = {
        "schemaVersion": 2,
        "mediaType": mt.IMAGE_MANIFEST,
        "artifactType": attestation.media_type,
        "config": {"mediaType": mt.EMPTY_CONFIG, "digest": f"sha256:{mt.EMPTY_CONFIG_SHA256}", "size": 2},
        "layers": [
            {"mediaType": attestation.media_type, "digest": f"sha256:{attestation.sha256}", "size": attestation.size}
        ],
        "subject": subject.descriptor(),
        "annotations": {mt.KILN_ATTESTATION_KIND: attestation.kind},
    }
    return Document(mt.IMAGE_MANIFEST, canonical_json(manifest))


def _attestations(session: Session, artifact_ids: list[int]) -> dict[int, list[Attestation]]:
    rows = session.scalars(
        select(Attestation).where(Attestation.artifact_id.in_(artifact_ids)).order_by(Attestation.kind)
    ).all()
    out: dict[int, list[Attestation]] = {}
    for row in rows:
        out.setdefault(row.artifact_id, []).append(row)
    return out


@dataclass(frozen=True)
class Derived:
    """The documents derived from one served artifact: its manifest, its config, its attestations' manifests."""

    artifact_id: int
    manifest: Document
    config: Document
    referrers: tuple[Document, ...]

    def documents(self) -> tuple[Document, ...]:
        return (self.manifest, self.config, *self.referrers)

    def find(self, sha256: str) -> Document | None:
        return next((d for d in self.documents() if d.sha256 == sha256), None)


def derive(session: Session, model: Model, artifact_id: int | None = None) -> list[Derived]:
    """The derived documents of the model's served artifacts (or of the one with `artifact_id`)."""
    served = served_artifacts(session, model, artifact_id)
    attestations = _attestations(session, [s.artifact.id for s in served])
    out = []
    for s in served:
        manifest = artifact_manifest(s)
        referrers = tuple(attestation_manifest(manifest, a) for a in attestations.get(s.artifact.id, []))
        out.append(Derived(s.artifact.id, manifest, model_config(s), referrers))
    return out


class DigestIndex:
    """sha256 of a derived document -> the artifact it derives from, so a lookup by digest re-derives one
    artifact instead of all of a model's. Entries never go stale in a way that matters: an artifact's
    rows never change, and every hit is re-derived and compared (a miss falls back to the full scan).
    Bounded: cleared when full, since the digests asked are the caller's to choose (only found ones are kept)."""

    def __init__(self, size: int = 100_000) -> None:
        self._size = size
        self._entries: dict[str, int] = {}

    def get(self, sha256: str) -> int | None:
        return self._entries.get(sha256)

    def add(self, derived: Derived) -> None:
        if len(self._entries) >= self._size:
            self._entries.clear()
        for document in derived.documents():
            self._entries[document.sha256] = derived.artifact_id


def find_derived(session: Session, model: Model, index: DigestIndex, sha256: str) -> tuple[Derived, Document] | None:
    """The served artifact of `model` that derives the document with this sha256, and that document."""
    artifact_id = index.get(sha256)
    if artifact_id is not None:
        for derived in derive(session, model, artifact_id):
            if (document := derived.find(sha256)) is not None:
                return derived, document
    found = None
    for derived in derive(session, model):
        index.add(derived)
        if found is None and (document := derived.find(sha256)) is not None:
            found = derived, document
    return found


def manifest_unknown(repository: str, reference: str) -> NotFound:
    return NotFound(
        f"manifest {reference!r} not found in {repository!r}",
        code="MANIFEST_UNKNOWN",
        details={"repository": repository, "reference": reference},
    )


def resolve_manifest(session: Session, model: Model, index: DigestIndex, repository: str, reference: str) -> Document:
    """The manifest `reference` (a tag or a `sha256:` digest) names in the model's repository."""
    digest = mt.DIGEST.fullmatch(reference)
    if digest is not None:
        found = find_derived(session, model, index, digest["hex"])
        if found is None or found[1].media_type != mt.IMAGE_MANIFEST:
            raise manifest_unknown(repository, reference)
        return found[1]
    if ":" in reference:
        raise InvalidInput(
            f"digest {reference!r} is not 'sha256:<64 lowercase hex>'",
            code="DIGEST_INVALID",
            details={"reference": reference},
        )
    if not mt.TAG.fullmatch(reference):
        raise InvalidInput(
            f"tag {reference!r} is not a valid OCI tag", code="TAG_INVALID", details={"reference": reference}
        )
    artifact_id = tag_table(session, model).get(reference)
    served = served_artifacts(session, model, artifact_id) if artifact_id is not None else []
    if not served:
        raise manifest_unknown(repository, reference)
    return artifact_manifest(served[0])


def check_digest(digest: str) -> str:
    """The hex of a `sha256:<hex>` digest; DIGEST_INVALID otherwise."""
    match = mt.DIGEST.fullmatch(digest)
    if match is None:
        raise InvalidInput(
            f"digest {digest!r} is not 'sha256:<64 lowercase hex>'", code="DIGEST_INVALID", details={"digest": digest}
        )
    return match["hex"]


@dataclass(frozen=True)
class StoredBlob:
    sha256: str


def find_blob(
    session: Session, model: Model, index: DigestIndex, repository: str, digest: str
) -> StoredBlob | Document:
    """A blob of the repository: a file or attestation of a served artifact (stored), or a derived config."""
    hex_ = check_digest(digest)
    served_file = session.execute(
        select(ArtifactFile.sha256)
        .join(Artifact, Artifact.id == ArtifactFile.artifact_id)
        .join(Release, Release.id == Artifact.release_id)
        .where(ArtifactFile.sha256 == hex_, Release.model_id == model.id, _served())
        .limit(1)
    ).first()
    if served_file is None:
        served_file = session.execute(
            select(Attestation.sha256)
            .join(Artifact, Artifact.id == Attestation.artifact_id)
            .join(Release, Release.id == Artifact.release_id)
            .where(Attestation.sha256 == hex_, Release.model_id == model.id, _served())
            .limit(1)
        ).first()
    if served_file is not None:
        return StoredBlob(hex_)
    if hex_ == mt.EMPTY_CONFIG_SHA256:
        return Document(mt.EMPTY_CONFIG, mt.EMPTY_CONFIG_BYTES)
    found = find_derived(session, model, index, hex_)
    if found is None or found[1].media_type != mt.MODEL_CONFIG:
        raise NotFound(
            f"blob {digest} not found in {repository!r}",
            code="BLOB_UNKNOWN",
            details={"repository": repository, "digest": digest},
        )
    return found[1]


def referrers_index(
    session: Session, model: Model, index: DigestIndex, digest: str, artifact_type: str | None
) -> Document:
    """The image index of the manifests whose subject is `digest` (empty when there are none)."""
    hex_ = check_digest(digest)
    found = find_derived(session, model, index, hex_)
    referrers = found[0].referrers if found is not None and found[1] is found[0].manifest else ()
    manifests = []
    for referrer in referrers:
        parsed = _loads(referrer.body)
        if artifact_type is not None and parsed["artifactType"] != artifact_type:
            continue
        manifests.append(referrer.descriptor(artifactType=parsed["artifactType"], annotations=parsed["annotations"]))
    body = {"schemaVersion": 2, "mediaType": mt.IMAGE_INDEX, "manifests": manifests}
    return Document(mt.IMAGE_INDEX, canonical_json(body))


def _loads(body: bytes) -> dict[str, Any]:
    value: dict[str, Any] = json.loads(body)
    return value


def tags_page(tags: list[str], n: int | None, last: str | None) -> tuple[list[str], bool]:
    """Tags in lexical order after `last`, at most `n` of them; and whether more follow."""
    ordered = sorted(tags)
    if last is not None:
        ordered = [t for t in ordered if t > last]
    if n is None:
        return ordered, False
    return ordered[:n], len(ordered) > n
