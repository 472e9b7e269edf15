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
- model cars: the repository `modelcar/<model>` has the same tags, each naming the artifact as a
  container image for KServe (`registry.oci.modelcar`): the configured base image, then the files
  under `/models`. Offered when the registry has a base image (KILN_REGISTRY_MODELCAR_BASE).

Services raise kiln errors with the spec's codes (`registry.oci.media_types.OCI_ERROR_BY_KILN_CODE`);
the routes render them in the spec's error shape.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, delete, false, select
from sqlalchemy.orm import InstrumentedAttribute, Session

from kiln.core.digest import canonical_json
from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput, NotFound
from kiln.registry.api.params import MODEL_NAME_PATTERN
from kiln.registry.artifacts import service as artifacts
from kiln.registry.attestations.service import Attestation, artifact_ids_attested_by, attestations_by_artifact
from kiln.registry.channels.service import channel_release_ids
from kiln.registry.models.service import Model, find_model
from kiln.registry.oci import media_types as mt
from kiln.registry.oci import modelcar
from kiln.registry.oci.base_image import BaseImage
from kiln.registry.oci.documents import Document, Served, kiln_annotations
from kiln.registry.oci.models import TarLayer, TarLayerBlob
from kiln.registry.releases import contents
from kiln.registry.releases.service import served_release_ids

NAMESPACE = "kiln"
MODELCAR_NAMESPACE = "modelcar"
_MODEL = re.compile(MODEL_NAME_PATTERN.removeprefix("^").removesuffix("$"))


@dataclass(frozen=True)
class Repository:
    """A repository as a client named it: the model, and the base image when it is the model-car layout."""

    name: str
    model: Model
    car: BaseImage | None = None


def model_name(repository: str) -> str:
    """The model a repository name names: `<model>`, `kiln/<model>` or `modelcar/<model>`; NAME_INVALID otherwise."""
    namespace, slash, name = repository.rpartition("/")
    if (slash and namespace not in (NAMESPACE, MODELCAR_NAMESPACE)) or not _MODEL.fullmatch(name):
        raise InvalidInput(
            f"repository {repository!r} is not '<model>', '{NAMESPACE}/<model>' or '{MODELCAR_NAMESPACE}/<model>'",
            code=Codes.NAME_INVALID,
            details={"repository": repository},
        )
    return name


def find_repository(session: Session, repository: str, car: BaseImage | None) -> Repository:
    """The repository `repository` names; NAME_UNKNOWN for an unknown model, or model cars without a base image."""
    name = model_name(repository)
    wants_car = repository.startswith(f"{MODELCAR_NAMESPACE}/")
    if wants_car and car is None:
        raise NotFound(
            f"repository {repository!r} not found: this registry offers no model cars "
            "(it has no base image; KILN_REGISTRY_MODELCAR_BASE)",
            code=Codes.NAME_UNKNOWN,
            details={"repository": repository},
        )
    row = find_model(session, name)
    if row is None:
        raise NotFound(
            f"repository {repository!r} not found", code=Codes.NAME_UNKNOWN, details={"repository": repository}
        )
    return Repository(repository, row, car if wants_car else None)


def tag(ref: str, artifact: str) -> str | None:
    """The OCI tag of `artifact` under a version or channel `ref`, or None where the grammar forbids one."""
    name = f"{ref}-{artifact}"
    return name if mt.TAG.fullmatch(name) else None


def tag_table(session: Session, model: Model) -> dict[str, int]:
    """Every tag of the model's repository -> the id of the artifact it names."""
    # By release, then artifact: a tag two (version, artifact) pairs spell names the newer release's.
    rows = sorted(contents.served_artifacts(session, model.id), key=lambda va: (va[1].release_id, va[1].id))
    by_release: dict[int, list[tuple[int, str]]] = {}
    tags: dict[str, int] = {}
    for version, a in rows:
        by_release.setdefault(a.release_id, []).append((a.id, a.name))
        if (t := tag(version, a.name)) is not None:
            tags[t] = a.id
    for channel, release_id in channel_release_ids(
        session, model.id
    ):  # after the versions: a channel wins over a version of its name
        for artifact_id, name in by_release.get(release_id, []):
            if (t := tag(channel, name)) is not None:
                tags[t] = artifact_id
    return tags


def served_artifacts(session: Session, model: Model, artifact_id: int | None = None) -> list[Served]:
    """The model's artifacts in served releases (or the one with `artifact_id`, if served), files loaded."""
    served = contents.served_artifacts(session, model.id, *artifacts.WITH_FILES, artifact_id=artifact_id)
    return [Served(model.name, version, a) for version, a in served]


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
        "annotations": kiln_annotations(served),
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


def derive(
    session: Session, repo: Repository, artifact_id: int | None = None, layers: modelcar.LayerMap | None = None
) -> list[Derived]:
    """The derived documents of the repository's served artifacts (or of the one with `artifact_id`).

    In the model-car layout, only of the artifacts whose tar layers are recorded (`layers`, or the
    database's): the others' manifests have not been asked for by tag yet, so no client has their digests."""
    served = served_artifacts(session, repo.model, artifact_id)
    if repo.car is not None:
        if layers is None:
            keys = [modelcar.members_key(g) for s in served for g in modelcar.groups(s.artifact.files)]
            layers = modelcar.known_layers(session, keys)
        served = [s for s in served if modelcar.artifact_layers(s, layers) is not None]
    attestations = attestations_by_artifact(session, [s.artifact.id for s in served])
    out = []
    for s in served:
        if repo.car is None:
            manifest, config = artifact_manifest(s), model_config(s)
        else:
            assert layers is not None
            manifest, config = modelcar.image_manifest(s, repo.car, layers), modelcar.image_config(s, repo.car, layers)
        referrers = tuple(attestation_manifest(manifest, a) for a in attestations.get(s.artifact.id, []))
        out.append(Derived(s.artifact.id, manifest, config, referrers))
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


def find_derived(
    session: Session, repo: Repository, index: DigestIndex, sha256: str
) -> tuple[Derived, Document] | None:
    """The served artifact of the repository that derives the document with this sha256, and that document."""
    artifact_id = index.get(sha256)
    if artifact_id is not None:
        for derived in derive(session, repo, artifact_id):
            if (document := derived.find(sha256)) is not None:
                return derived, document
    found = None
    for derived in derive(session, repo):
        index.add(derived)
        if found is None and (document := derived.find(sha256)) is not None:
            found = derived, document
    return found


def manifest_unknown(repository: str, reference: str) -> NotFound:
    return NotFound(
        f"manifest {reference!r} not found in {repository!r}",
        code=Codes.MANIFEST_UNKNOWN,
        details={"repository": repository, "reference": reference},
    )


def resolve_manifest(
    session: Session,
    repo: Repository,
    index: DigestIndex,
    reference: str,
    record_layers: Callable[[Served], modelcar.LayerMap],
) -> Document:
    """The manifest `reference` (a tag or a `sha256:` digest) names in the repository.

    A model car's manifest by tag has its file layers hashed and recorded first where they are not
    (`record_layers`: one read of each such file)."""
    repository = repo.name
    digest = mt.DIGEST.fullmatch(reference)
    if digest is not None:
        found = find_derived(session, repo, index, digest["hex"])
        if found is None or found[1].media_type != mt.IMAGE_MANIFEST:
            raise manifest_unknown(repository, reference)
        return found[1]
    if ":" in reference:
        raise InvalidInput(
            f"digest {reference!r} is not 'sha256:<64 lowercase hex>'",
            code=Codes.DIGEST_INVALID,
            details={"reference": reference},
        )
    if not mt.TAG.fullmatch(reference):
        raise InvalidInput(
            f"tag {reference!r} is not a valid OCI tag", code=Codes.TAG_INVALID, details={"reference": reference}
        )
    artifact_id = tag_table(session, repo.model).get(reference)
    served = served_artifacts(session, repo.model, artifact_id) if artifact_id is not None else []
    if not served:
        raise manifest_unknown(repository, reference)
    if repo.car is None:
        return artifact_manifest(served[0])
    (derived,) = derive(session, repo, served[0].artifact.id, record_layers(served[0]))
    index.add(derived)
    return derived.manifest


def check_digest(digest: str) -> str:
    """The hex of a `sha256:<hex>` digest; DIGEST_INVALID otherwise."""
    match = mt.DIGEST.fullmatch(digest)
    if match is None:
        raise InvalidInput(
            f"digest {digest!r} is not 'sha256:<64 lowercase hex>'",
            code=Codes.DIGEST_INVALID,
            details={"digest": digest},
        )
    return match["hex"]


@dataclass(frozen=True)
class StoredBlob:
    sha256: str


@dataclass(frozen=True)
class BaseLayer:
    """A layer of the model-car base image, served from its layout."""

    car: BaseImage
    sha256: str
    size: int


def _served_tar_layer(session: Session, model: Model, sha256: str) -> TarLayer | None:
    """The recorded tar layer with this digest, if its files are files of one served artifact of `model`."""
    layer = session.get(TarLayer, sha256)
    if layer is None:
        return None
    first = layer.members[0]
    candidates = artifacts.served_among(
        session, served_release_ids(model.id), artifacts.artifact_ids_with_blob(first["sha256"], first["path"])
    )
    wanted = {(m["path"], m["sha256"], m["size"]) for m in layer.members}
    for artifact_id in candidates:
        files = artifacts.artifact_files(session, artifact_id)
        if wanted <= {(f.path, f.sha256, f.size) for f in files}:
            return layer
    return None


def find_blob(
    session: Session, repo: Repository, index: DigestIndex, digest: str
) -> StoredBlob | Document | BaseLayer | TarLayer:
    """A blob of the repository: a file or attestation of a served artifact (stored), or a derived config;
    in the model-car layout also a base image layer or a file's tar layer."""
    model, repository = repo.model, repo.name
    hex_ = check_digest(digest)
    # A file of a served artifact, or else an attestation of one.
    served = served_release_ids(model.id)
    if artifacts.served_among(session, served, artifacts.artifact_ids_with_blob(hex_)) or artifacts.served_among(
        session, served, artifact_ids_attested_by(hex_)
    ):
        return StoredBlob(hex_)
    if hex_ == mt.EMPTY_CONFIG_SHA256:
        return Document(mt.EMPTY_CONFIG, mt.EMPTY_CONFIG_BYTES)
    if repo.car is not None:
        if (layer := repo.car.layer(hex_)) is not None:
            return BaseLayer(repo.car, hex_, int(layer["size"]))
        if (tar_layer := _served_tar_layer(session, model, hex_)) is not None:
            return tar_layer
    found = find_derived(session, repo, index, hex_)
    if found is None or found[1].media_type not in (mt.MODEL_CONFIG, mt.IMAGE_CONFIG):
        raise NotFound(
            f"blob {digest} not found in {repository!r}",
            code=Codes.BLOB_UNKNOWN,
            details={"repository": repository, "digest": digest},
        )
    return found[1]


def referrers_index(
    session: Session, repo: Repository, index: DigestIndex, digest: str, artifact_type: str | None
) -> Document:
    """The image index of the manifests whose subject is `digest` (empty when there are none)."""
    hex_ = check_digest(digest)
    found = find_derived(session, repo, index, hex_)
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


def tags_page(tags: list[str], n: int, last: str | None) -> tuple[list[str], bool]:
    """Tags in lexical order after `last`, at most `n` of them; and whether more follow."""
    ordered = sorted(tags)
    if last is not None:
        ordered = [t for t in ordered if t > last]
    return ordered[:n], len(ordered) > n


class ModelCarLayerBlobs:
    """Model-car layers are made of blobs but do not keep them: a layer goes with any blob it holds
    (`registry.blobs.references.BlobReferences`)."""

    def holds(self, sha256: InstrumentedAttribute[str]) -> ColumnElement[bool]:
        return false()

    def drop_with(self, session: Session, sha256: str) -> None:
        drop_layers_holding(session, sha256)


def drop_layers_holding(session: Session, sha256: str) -> None:
    """Delete the recorded model-car layers that hold the blob (garbage collection, before it deletes the
    blob's row: that takes the link rows with it)."""
    held = select(TarLayerBlob.layer_sha256).where(TarLayerBlob.blob_sha256 == sha256)
    session.execute(delete(TarLayer).where(TarLayer.sha256.in_(held)).execution_options(synchronize_session=False))
