"""Model cars: an artifact as a container image that KServe runs beside its server, files under `/models`.

The image is the base image's layers (`registry.oci.base_image`), then one uncompressed tar layer per
artifact file holding `models/<path>`. A tar layer is derived from the stored blob: a header, the blob's
own bytes, then zeros. It is never stored; it is streamed from the blob, with Range. Its digest needs one
read of the file, so it is computed the first time the image's manifest is asked for by tag, and recorded
(`TarLayer`, with the header as written) for every later pull, on every replica.

Headers are deterministic: mode 0644 (directories 0755), owner root, mtime 0, PAX records only where
ustar cannot say it (long or non-ASCII names, files of 8 GiB and more). So the same file at the same path
always makes the same layer, whichever artifact or model it is in.
"""

from __future__ import annotations

import hashlib
import logging
import tarfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import PurePosixPath
from typing import Any, Final

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.digest import canonical_json
from registry.artifacts.models import ArtifactFile
from registry.blobs.store import BlobStore
from registry.db import insert_once
from registry.oci import media_types as mt
from registry.oci.base_image import BaseImage
from registry.oci.documents import Document, Served, kiln_annotations
from registry.oci.models import TarLayer

log = logging.getLogger(__name__)

MODELS_DIR: Final = "models"
BLOCK: Final = 512
END_OF_ARCHIVE: Final = 2 * BLOCK

LayerMap = dict[tuple[str, str], TarLayer]  # (blob sha256, path) -> its layer


def _entry(name: str, kind: bytes, mode: int, size: int = 0) -> bytes:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.mtime = kind, mode, size, 0
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def tar_header(path: str, size: int) -> bytes:
    """The tar entries before a file's bytes: each directory from `models/` down, then the file's header."""
    parts = PurePosixPath(MODELS_DIR, path).parts
    directories = ["/".join(parts[: i + 1]) for i in range(len(parts) - 1)]
    return b"".join(
        [
            *(_entry(d, tarfile.DIRTYPE, 0o755) for d in directories),
            _entry("/".join(parts), tarfile.REGTYPE, 0o644, size),
        ]
    )


def tar_trailer(size: int) -> bytes:
    """The zeros after a file's `size` bytes: padding to a whole block, then the end-of-archive blocks."""
    return bytes(-size % BLOCK + END_OF_ARCHIVE)


def known_layers(session: Session, files: Iterable[ArtifactFile]) -> LayerMap:
    """The recorded layers of these files."""
    wanted = {(f.sha256, f.path) for f in files}
    if not wanted:
        return {}
    rows = session.scalars(select(TarLayer).where(TarLayer.blob_sha256.in_({sha for sha, _ in wanted}))).all()
    return {(r.blob_sha256, r.path): r for r in rows if (r.blob_sha256, r.path) in wanted}


def _hash_layer(store: BlobStore, file: ArtifactFile) -> TarLayer:
    header, trailer = tar_header(file.path, file.size), tar_trailer(file.size)
    digest = hashlib.sha256(header)
    started = time.monotonic()
    for chunk in store.open_range(file.sha256):
        digest.update(chunk)
    digest.update(trailer)
    log.info("model car layer models/%s: %d bytes hashed in %.1f s", file.path, file.size, time.monotonic() - started)
    return TarLayer(
        sha256=digest.hexdigest(),
        blob_sha256=file.sha256,
        path=file.path,
        size=len(header) + file.size + len(trailer),
        file_size=file.size,
        header=header,
    )


def record_layers(sessions: Callable[[], Session], store: BlobStore, files: Iterable[ArtifactFile]) -> LayerMap:
    """The layers of these files, hashing (one streamed read each) and recording those not recorded yet.

    Each is committed as soon as it is hashed, so an interrupted first pull of a large artifact keeps
    what it has done; two replicas hashing the same file record one row."""
    files = list(files)
    with sessions() as session:
        layers = known_layers(session, files)
    for file in files:
        key = (file.sha256, file.path)
        if key in layers:
            continue
        row = _hash_layer(store, file)
        with sessions() as session:

            def recorded(session: Session = session, file: ArtifactFile = file) -> TarLayer | None:
                return session.scalars(
                    select(TarLayer).where(TarLayer.blob_sha256 == file.sha256, TarLayer.path == file.path)
                ).one_or_none()

            layers[key], _ = insert_once(session, row, recorded)
            session.commit()
    return layers


def has_layers(served: Served, layers: LayerMap) -> bool:
    return all((f.sha256, f.path) in layers for f in served.artifact.files)


def image_config(served: Served, base: BaseImage, layers: LayerMap) -> Document:
    """The image config: the base's platform and run settings, its diff ids, then each file layer's."""
    config: dict[str, Any] = {
        k: base.config[k] for k in ("architecture", "os", "variant", "os.version", "os.features") if k in base.config
    }
    if isinstance(base.config.get("config"), dict):
        config["config"] = base.config["config"]
    files = [f"sha256:{layers[(f.sha256, f.path)].sha256}" for f in served.artifact.files]
    config["rootfs"] = {"type": "layers", "diff_ids": [*base.diff_ids, *files]}
    return Document(mt.IMAGE_CONFIG, canonical_json(config))


def image_manifest(served: Served, base: BaseImage, layers: LayerMap) -> Document:
    """The model car's image manifest: the base's layers, then one tar layer per file."""
    files = []
    for f in served.artifact.files:
        layer = layers[(f.sha256, f.path)]
        descriptor = {"mediaType": mt.LAYER_TAR, "digest": f"sha256:{layer.sha256}", "size": layer.size}
        files.append({**descriptor, "annotations": {mt.MODEL_FILEPATH: f.path}})
    annotations = {**kiln_annotations(served), mt.BASE_DIGEST: base.manifest_digest}
    if base.name is not None:
        annotations[mt.BASE_NAME] = base.name
    manifest = {
        "schemaVersion": 2,
        "mediaType": mt.IMAGE_MANIFEST,
        "config": image_config(served, base, layers).descriptor(),
        "layers": [*base.layers, *files],
        "annotations": annotations,
    }
    return Document(mt.IMAGE_MANIFEST, canonical_json(manifest))


Part = tuple[int, Callable[[int, int], Iterator[bytes]]]  # a length, and how to read [start, stop) of it


def _bytes(data: bytes) -> Part:
    return len(data), lambda start, stop: iter((data[start:stop],))


def read_parts(parts: list[Part], start: int, stop: int) -> Iterator[bytes]:
    """Bytes `[start, stop)` of the concatenation of `parts`, reading only the parts that overlap it."""
    offset = 0
    for length, read in parts:
        first, last = max(start - offset, 0), min(stop - offset, length)
        if first < last:
            yield from read(first, last)
        offset += length


def read_layer(store: BlobStore, layer: TarLayer, start: int, stop: int) -> Iterator[bytes]:
    """Bytes `[start, stop)` of a file's tar layer: its header, the stored blob's bytes, the trailer."""

    def blob(first: int, last: int) -> Iterator[bytes]:
        return store.open_range(layer.blob_sha256, first, last)

    parts = [_bytes(layer.header), (layer.file_size, blob), _bytes(tar_trailer(layer.file_size))]
    return read_parts(parts, start, stop)
