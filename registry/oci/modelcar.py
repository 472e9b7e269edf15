"""Model cars: an artifact as a container image that KServe runs beside its server, files under `/models`.

The image is the base image's layers (`registry.oci.base_image`), then uncompressed tar layers holding
the artifact's files at `models/<path>`: one layer per file, or, for an artifact of more than
MAX_FILE_LAYERS files (a 405B model's 191 shards, an orbax checkpoint's arrays), consecutive files packed
into MAX_FILE_LAYERS layers of about equal bytes, since overlay filesystems stack a bounded number of
layers. A tar layer is derived from stored blobs: for each file, a header, the blob's own bytes, zeros to a
whole block; then the end-of-archive blocks. It is never stored; it is streamed from the blobs, with Range.
Its digest needs one read of its files (checked against their sha256 on the way), so it is computed once
and recorded (`TarLayer`, with the headers as written) for every later pull, on every replica: in the
background after a release is sealed, or else when the image's manifest is first asked for by tag.

Headers are deterministic: mode 0644 (directories 0755), owner root, mtime 0, PAX records only where
ustar cannot say it (long names, files of 8 GiB and more). So the same files at the same paths always make
the same layer, whichever artifact or model they are in.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import tarfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import PurePosixPath
from typing import Any, Final, cast

from sqlalchemy import CursorResult, delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, defer

from kiln.core.digest import canonical_json, sha256_json
from kiln.core.error_codes import Codes
from kiln.core.errors import KilnError
from kiln.registry.artifacts.service import ArtifactFile, artifact_files, release_artifacts
from kiln.registry.db import insert_once, utcnow
from kiln.registry.oci import media_types as mt
from kiln.registry.oci.base_image import BaseImage
from kiln.registry.oci.documents import Document, Served, kiln_annotations
from kiln.registry.oci.models import LayerHashing, TarLayer, TarLayerBlob
from kiln.storage.store import BlobStore

log = logging.getLogger(__name__)

MODELS_DIR: Final = "models"
BLOCK: Final = 512
END_OF_ARCHIVE: Final = 2 * BLOCK
# The most file layers a model car has: with a base of a few layers it stays under the 125 that Docker's
# overlay2 driver stacks (containerd's overlay allows about 500).
MAX_FILE_LAYERS: Final = 100
# Rows asked for in one query (a bound on bind parameters: PostgreSQL allows 65,535).
QUERY_BATCH: Final = 1000
# Hashing the same layer twice at once in one process waits for the first instead (striped locks); across
# replicas, a claim in the database (`LayerHashing`) does: held LEASE_S, renewed every RENEW_S while hashing.
_LOCKS: Final = tuple(threading.Lock() for _ in range(64))
LEASE_S: Final = 60.0
RENEW_S: Final = 10.0
WAIT_POLL_S: Final = 0.5

Group = tuple[ArtifactFile, ...]  # the files of one layer, in path order
LayerMap = dict[str, TarLayer]  # members_key -> its layer


def _entry(name: str, kind: bytes, mode: int, size: int = 0) -> bytes:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.mtime = kind, mode, size, 0
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def tar_header(path: str, size: int) -> bytes:
    """The tar entries before a file's bytes: each directory from `models/` down, then the file's header."""
    parts = PurePosixPath(MODELS_DIR, path).parts
    directories = ["/".join(parts[: i + 1]) for i in range(len(parts) - 1)]
    entries = [_entry(d, tarfile.DIRTYPE, 0o755) for d in directories]
    return b"".join([*entries, _entry("/".join(parts), tarfile.REGTYPE, 0o644, size)])


def padding(size: int) -> int:
    """Zeros after a file's `size` bytes, to a whole tar block."""
    return -size % BLOCK


def groups(files: Sequence[ArtifactFile]) -> list[Group]:
    """An artifact's files as layers: one each, or consecutive files in MAX_FILE_LAYERS groups of about
    equal bytes. Deterministic: the same files always make the same groups."""
    files = sorted(files, key=lambda f: f.path)
    if len(files) <= MAX_FILE_LAYERS:
        return [(f,) for f in files]
    out: list[Group] = []
    start, taken = 0, 0
    total = sum(f.size for f in files) or 1
    for i, f in enumerate(files):
        taken += f.size
        layers_left = MAX_FILE_LAYERS - len(out) - 1
        files_left = len(files) - i - 1
        # Close the group at its share of the bytes, or when the rest just fills one layer each.
        if layers_left > 0 and (taken * MAX_FILE_LAYERS >= total * (len(out) + 1) or files_left <= layers_left):
            out.append(tuple(files[start : i + 1]))
            start = i + 1
    if start < len(files):
        out.append(tuple(files[start:]))
    return out


def members_key(group: Group) -> str:
    return sha256_json([[f.path, f.sha256, f.size] for f in group])


def known_layers(session: Session, keys: Iterable[str]) -> LayerMap:
    """The recorded layers with these member keys (without their headers: only serving reads them)."""
    keys = sorted(set(keys))
    out: LayerMap = {}
    for i in range(0, len(keys), QUERY_BATCH):
        query = select(TarLayer).where(TarLayer.members_key.in_(keys[i : i + QUERY_BATCH]))
        out.update((r.members_key, r) for r in session.scalars(query.options(defer(TarLayer.headers))))
    return out


def corrupt(file: ArtifactFile, what: str) -> KilnError:
    return KilnError(
        f"the stored blob of {file.path!r} ({file.sha256}) is corrupt: {what}; restore it from a good copy",
        code=Codes.BLOB_CORRUPT,
        details={"path": file.path, "sha256": file.sha256},
    )


def _hash_layer(store: BlobStore, group: Group, renew: Callable[[], None] = lambda: None) -> TarLayer:
    """Read the group's blobs once: the layer's digest, and each blob's own, which must be its file's.
    `renew` is called after each chunk (to keep this replica's claim on the work)."""
    headers = [tar_header(f.path, f.size) for f in group]
    layer = hashlib.sha256()
    started = time.monotonic()
    with ThreadPoolExecutor(1) as pool:  # hashlib lets go of the GIL: both digests at once on two cores
        for file, header in zip(group, headers, strict=True):
            layer.update(header)
            content, size = hashlib.sha256(), 0
            for chunk in store.open_range(file.sha256):
                pending = pool.submit(content.update, chunk)
                layer.update(chunk)
                size += len(chunk)
                pending.result()
                renew()
            if size != file.size:
                raise corrupt(file, f"{size} bytes where {file.size} were published")
            if content.hexdigest() != file.sha256:
                raise corrupt(file, f"its bytes hash to {content.hexdigest()}")
            layer.update(bytes(padding(file.size)))
    layer.update(bytes(END_OF_ARCHIVE))
    nbytes = sum(f.size for f in group)
    log.info(
        "model car layer of %d file(s), %d bytes, hashed in %.1f s", len(group), nbytes, time.monotonic() - started
    )
    return TarLayer(
        sha256=layer.hexdigest(),
        members_key=members_key(group),
        member_count=len(group),
        members=[
            {"path": f.path, "sha256": f.sha256, "size": f.size, "header": len(h)}
            for f, h in zip(group, headers, strict=True)
        ],
        size=sum(len(h) + f.size + padding(f.size) for h, f in zip(headers, group, strict=True)) + END_OF_ARCHIVE,
        headers=b"".join(headers),
    )


def _claim(sessions: Callable[[], Session], key: str, holder: str) -> bool:
    """Claim the hashing of layer `key` for LEASE_S: True when no other replica holds a live claim."""
    now = utcnow()
    expires = now + timedelta(seconds=LEASE_S)
    with sessions() as session:
        taken = session.execute(
            update(LayerHashing)
            .where(LayerHashing.members_key == key, LayerHashing.expires_at < now)
            .values(holder=holder, expires_at=expires)
        )
        if cast(CursorResult[Any], taken).rowcount == 1:  # a dead replica's claim, taken over
            session.commit()
            return True
        if session.get(LayerHashing, key) is not None:
            return False
        try:
            session.add(LayerHashing(members_key=key, holder=holder, expires_at=expires))
            session.commit()
        except IntegrityError:  # claimed by another replica meanwhile
            session.rollback()
            return False
        return True


def _renewer(sessions: Callable[[], Session], key: str, holder: str) -> Callable[[], None]:
    """What keeps a claim alive while a large layer is hashed: a renewal every RENEW_S at most."""
    last = time.monotonic()

    def renew() -> None:
        nonlocal last
        if time.monotonic() - last < RENEW_S:
            return
        last = time.monotonic()
        with sessions() as session:
            session.execute(
                update(LayerHashing)
                .where(LayerHashing.members_key == key, LayerHashing.holder == holder)
                .values(expires_at=utcnow() + timedelta(seconds=LEASE_S))
            )
            session.commit()

    return renew


def _release(session: Session, key: str, holder: str) -> None:
    session.execute(delete(LayerHashing).where(LayerHashing.members_key == key, LayerHashing.holder == holder))


def _record(sessions: Callable[[], Session], store: BlobStore, group: Group) -> TarLayer:
    """The recorded layer of `group`, hashing it here unless another thread or replica is: then this waits
    for its record (or for its claim to lapse, if it died)."""
    key = members_key(group)
    holder = f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}"
    with _LOCKS[int(key[:8], 16) % len(_LOCKS)]:
        while True:
            with sessions() as session:
                found = known_layers(session, [key]).get(key)
            if found is not None:
                return found
            if _claim(sessions, key, holder):
                break
            time.sleep(WAIT_POLL_S)
        try:
            row = _hash_layer(store, group, _renewer(sessions, key, holder))
            with sessions() as session:

                def recorded() -> TarLayer | None:
                    return session.scalars(select(TarLayer).where(TarLayer.members_key == key)).one_or_none()

                row, inserted = insert_once(session, row, recorded)
                if inserted:
                    for blob in sorted({f.sha256 for f in group}):
                        session.add(TarLayerBlob(layer_sha256=row.sha256, blob_sha256=blob))
                _release(session, key, holder)
                session.commit()
            return row
        finally:
            with sessions() as session:  # after a failure: others may try at once
                _release(session, key, holder)
                session.commit()


def record_layers(
    sessions: Callable[[], Session], store: BlobStore, files: Sequence[ArtifactFile], known: LayerMap | None = None
) -> LayerMap:
    """The layers of an artifact's files, hashing (one streamed read of each file) and recording those not
    recorded yet. Each is committed as soon as it is hashed, so an interrupted first pull of a large
    artifact keeps what it has done; replicas hashing the same layer at once record one row."""
    layers = dict(known or {})
    for group in groups(files):
        key = members_key(group)
        if key not in layers:
            layers[key] = _record(sessions, store, group)
    return layers


def served_layers(
    session: Session, write_sessions: Callable[[], Session], store: BlobStore, served: Served
) -> LayerMap:
    """The layers of a served artifact, read with the request's `session`; those not recorded yet are
    hashed and recorded (with `write_sessions`), after `session` is closed: hashing a large artifact
    takes minutes, and holds no database connection meanwhile."""
    files = served.artifact.files
    known = known_layers(session, [members_key(g) for g in groups(files)])
    if artifact_layers(served, known) is not None:
        return known
    session.close()
    return record_layers(write_sessions, store, files, known)


def record_release_layers(sessions: Callable[[], Session], store: BlobStore, release_id: int) -> None:
    """Hash and record the layers of a just-sealed release's artifacts (run after the seal is answered).

    A failure is logged, not raised: the first pull of a model car hashes whatever is missing."""
    with sessions() as session:
        artifacts = [a.id for a in release_artifacts(session, release_id)]
    for artifact_id in artifacts:
        with sessions() as session:
            files = artifact_files(session, artifact_id)
        try:
            record_layers(sessions, store, files)
        except Exception:
            log.exception(
                "model car layers of artifact %d were not recorded; its first pull will hash them", artifact_id
            )


def artifact_layers(served: Served, layers: LayerMap) -> list[tuple[Group, TarLayer]] | None:
    """The artifact's groups with their recorded layers; None while any is not recorded."""
    out = []
    for group in groups(served.artifact.files):
        layer = layers.get(members_key(group))
        if layer is None:
            return None
        out.append((group, layer))
    return out


def _recorded(served: Served, layers: LayerMap) -> list[tuple[Group, TarLayer]]:
    found = artifact_layers(served, layers)
    if found is None:
        raise KeyError(f"model car layers of {served.artifact.name} are not recorded")
    return found


def image_config(served: Served, base: BaseImage, layers: LayerMap) -> Document:
    """The image config: the base's platform and run settings, its diff ids, then each file layer's."""
    config: dict[str, Any] = {
        k: base.config[k] for k in ("architecture", "os", "variant", "os.version", "os.features") if k in base.config
    }
    if isinstance(base.config.get("config"), dict):
        config["config"] = base.config["config"]
    files = [f"sha256:{layer.sha256}" for _, layer in _recorded(served, layers)]
    config["rootfs"] = {"type": "layers", "diff_ids": [*base.diff_ids, *files]}
    return Document(mt.IMAGE_CONFIG, canonical_json(config))


def image_manifest(served: Served, base: BaseImage, layers: LayerMap) -> Document:
    """The model car's image manifest: the base's layers, then the file layers (a file's path annotated
    on a layer of one file)."""
    files = []
    for group, layer in _recorded(served, layers):
        descriptor: dict[str, Any] = {"mediaType": mt.LAYER_TAR, "digest": f"sha256:{layer.sha256}", "size": layer.size}
        if len(group) == 1:
            descriptor["annotations"] = {mt.MODEL_FILEPATH: group[0].path}
        files.append(descriptor)
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
    """Bytes `[start, stop)` of a tar layer: per member its header, its stored blob's bytes and padding;
    then the end-of-archive blocks."""
    parts: list[Part] = []
    offset = 0
    for member in layer.members:
        header = layer.headers[offset : offset + member["header"]]
        offset += member["header"]
        sha256, size = member["sha256"], member["size"]

        def blob(first: int, last: int, sha256: str = sha256) -> Iterator[bytes]:
            return store.open_range(sha256, first, last)

        parts += [_bytes(header), (size, blob), _bytes(bytes(padding(size)))]
    parts.append(_bytes(bytes(END_OF_ARCHIVE)))
    return read_parts(parts, start, stop)
