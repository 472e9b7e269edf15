"""Where stage outputs live: a `StageStore`, on this machine's disk or shared through object storage.

`WorkDir` (`pipeline.stage`) is the store on one machine. `RemoteStageStore` shares one between
machines through an S3 bucket (`--store s3://bucket/prefix`, `KILN_STORE`), with a `WorkDir` as each
machine's local copy: a stage reads its inputs from local files, as it always does, and what it
makes is pushed to the bucket when it commits.

In the bucket:

    <prefix>/<stage>/<key>/stage.json   the same stage.json as on disk (record, files, provenance)
    <prefix>/blobs/ab/cd/<sha256>       every file of every output, by content

Files are stored by content rather than under `<stage>/<key>/files/`: two machines that finish the
same key at once upload their files without ever overwriting each other's (the same bytes land on
the same key; other bytes on another), and `stage.json` is written last, with a conditional put
(`If-None-Match: *`), so exactly one of them becomes the output. The other adopts the winner's (its
local copy is replaced by the one in the bucket), and both report the same digest. A reader that
finds `stage.json` finds every blob it names; one that does not finds nothing, never a half output.

What comes out of the bucket is checked like any untrusted input: `stage.json` is parsed strictly,
must name the node and key it was looked up by, its record must validate against the stage's
type, every file path is a safe relative path, and every file is verified against its sha256 and
size as it is downloaded (into the local store's temporary directory, renamed into place whole).

External inputs (the held-out and calibration texts) go to the bucket by content too, so a worker
needs nothing but the store and the recipe.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from core.errors import DigestMismatch, InvalidInput, KilnError, StageFailed, Unavailable
from core.manifest import FileEntry
from pipeline.stage import (
    OUTPUT_DIR,
    STAGE_FILE,
    Node,
    StageInputMissing,
    StageOutput,
    StageRecord,
    StageRecordCorrupt,
    WorkDir,
    output_digest,
    read_stage_record,
)

STORE_ENV = "KILN_STORE"
ENDPOINT_ENVS = ("KILN_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
MAX_STAGE_JSON = 64 * 1024 * 1024
_NOT_FOUND = ("NoSuchKey", "404", "NotFound")
CHUNK = 8 * 1024 * 1024


class StageStore(Protocol):
    """Finished stage outputs by (stage, key), and external input files by sha256."""

    @property
    def local(self) -> WorkDir:
        """This machine's store: where outputs are materialised, and where logs and temporaries go."""
        ...

    def lookup(self, node: Node, key: str) -> StageOutput | None:
        """The finished output of `node` at `key`, on local disk; None when no machine has made it."""
        ...

    def digest(self, node: Node, key: str) -> str | None:
        """The digest of the output of (node, key) without materialising it; None when no machine made it."""
        ...

    def new_temp(self, stage: str, key: str) -> Path: ...

    def commit(self, node: Node, key: str, tmp: Path, result: Any, provenance: dict[str, Any]) -> StageOutput:
        """Make the temporary output at `tmp` the output of (node, key), for every machine of the store."""
        ...

    def discard(self, tmp: Path) -> None: ...

    def keep_log(self, node: Node, tmp: Path) -> Path | None: ...

    def sweep_stale(self) -> int: ...

    def put_external(self, path: Path, digest: str) -> None:
        """Keep the file at `path` (sha256 `digest`) where every machine of the store can read it."""
        ...

    def external(self, digest: str) -> Path:
        """A local copy of the external input `digest`; StageInputMissing when the store has none."""
        ...


class RemoteStageStore:
    """A stage store in an S3 bucket, materialised on this machine into the `WorkDir` `local`."""

    def __init__(self, url: str, local: WorkDir, *, client: Any = None, endpoint_url: str | None = None) -> None:
        from storage.s3 import S3BlobStore, make_s3_client, parse_s3_url

        self.url = url.rstrip("/")
        self.bucket, self.prefix = parse_s3_url(url)
        self._local = local
        self.client = client if client is not None else make_s3_client(endpoint_url or _endpoint_from_env())
        self.blobs = S3BlobStore(self.bucket, self.prefix + "blobs/", client=self.client)

    def __repr__(self) -> str:
        return f"RemoteStageStore({self.url!r})"

    @property
    def local(self) -> WorkDir:
        return self._local

    # -- outputs -----------------------------------------------------------------------------------

    def stage_key(self, node: Node, key: str) -> str:
        return f"{self.prefix}{node.stage.name}/{key}/{STAGE_FILE}"

    def lookup(self, node: Node, key: str) -> StageOutput | None:
        found = self._local.lookup(node, key)
        if found is not None:
            if self._exists(self.stage_key(node, key)):
                return found
            # Made here before this work dir was given a shared store: share it now (never rebuilt).
            if self._push(node, key, found.path, found.files):
                return found
            self._local.remove(node, key)  # another machine shared its own at the same moment: theirs
        meta = self._get(self.stage_key(node, key))
        if meta is None:
            return None
        return self._materialise(node, key, meta)

    def digest(self, node: Node, key: str) -> str | None:
        local = self._local.digest(node, key)
        if local is not None:
            return local
        meta = self._get(self.stage_key(node, key))
        if meta is None:
            return None
        record = self._checked(node, key, meta)
        return output_digest(record.files, record.result)

    def new_temp(self, stage: str, key: str) -> Path:
        return self._local.new_temp(stage, key)

    def discard(self, tmp: Path) -> None:
        self._local.discard(tmp)

    def keep_log(self, node: Node, tmp: Path) -> Path | None:
        return self._local.keep_log(node, tmp)

    def sweep_stale(self) -> int:
        return self._local.sweep_stale()

    def commit(self, node: Node, key: str, tmp: Path, result: Any, provenance: dict[str, Any]) -> StageOutput:
        """The bucket first, then this machine's copy: an output is never here without being there."""
        files = self._local.seal(node, key, tmp, result, provenance)
        if self._push(node, key, tmp, files):
            return self._local.install(node, key, tmp)
        # Another machine committed this key first: its output is the output, here too.
        self._local.discard(tmp)
        theirs = self._get(self.stage_key(node, key))
        if theirs is None:
            raise Unavailable(f"stage store {self.url}: {node.id} at {key[:12]} vanished after a conflicting commit")
        self._local.remove(node, key)
        return self._materialise(node, key, theirs)

    def _push(self, node: Node, key: str, path: Path, files: list[FileEntry]) -> bool:
        """Every blob of the output at `path`, then its stage.json if none is there; False when one was."""
        for f in files:  # blobs first: a stage.json never names a file the bucket lacks
            if not self.blobs.exists(f.sha256):
                self.blobs.put_stream(f.sha256, _chunks(path / OUTPUT_DIR / f.path))
        return self._put_if_absent(self.stage_key(node, key), (path / STAGE_FILE).read_bytes())

    def _materialise(self, node: Node, key: str, meta: bytes) -> StageOutput:
        """Download the output `meta` (a stage.json from the bucket) into the local store, verified."""
        files = self._checked(node, key, meta).files
        tmp = self._local.new_temp(node.stage.name, key)
        try:
            for f in files:
                target = tmp / OUTPUT_DIR / f.path
                target.parent.mkdir(parents=True, exist_ok=True)
                self._download(f, target)
            (tmp / STAGE_FILE).write_bytes(meta)
            out = self._local.install(node, key, tmp)
        except BaseException:
            self._local.discard(tmp)
            raise
        return out

    def _download(self, f: FileEntry, target: Path) -> None:
        from storage.store import BlobNotFound

        h = hashlib.sha256()
        size = 0
        try:
            with open(target, "wb") as out:
                for chunk in self.blobs.open_range(f.sha256):
                    h.update(chunk)
                    size += len(chunk)
                    out.write(chunk)
        except BlobNotFound:
            raise StageFailed(
                f"stage store {self.url}: {f.path} (sha256 {f.sha256}) is named by a stage.json but missing",
                code="STAGE_STORE_CORRUPT",
                details={"sha256": f.sha256, "path": f.path},
            ) from None
        if h.hexdigest() != f.sha256 or size != f.size:
            raise DigestMismatch(
                f"stage store {self.url}: {f.path} has sha256 {h.hexdigest()} ({size} bytes), "
                f"not the {f.sha256} ({f.size} bytes) its stage.json names",
                details={"path": f.path, "expected": f.sha256, "actual": h.hexdigest()},
            )

    def _checked(self, node: Node, key: str, meta: bytes) -> StageRecord:
        """A stage.json from the bucket, once it is shown to be the output of (node, key)."""
        where = f"{self.url}/{node.stage.name}/{key}/{STAGE_FILE}"
        try:
            return read_stage_record(node, key, meta, where)
        except StageRecordCorrupt as e:
            raise StageFailed(
                f"stage store {self.url}: {e.message}",
                code="STAGE_STORE_CORRUPT",
                details={"stage": node.id, "key": key, "path": where},
            ) from None

    # -- external inputs ---------------------------------------------------------------------------

    def put_external(self, path: Path, digest: str) -> None:
        self._local.put_external(path, digest)
        if not self.blobs.exists(digest):
            self.blobs.put_stream(digest, _chunks(self._local.external(digest)))

    def external(self, digest: str) -> Path:
        path = self._local.external_path(digest)
        if path.is_file():
            return path
        from storage.store import BlobNotFound

        tmp = path.with_name(f".tmp-{digest[:16]}-{os.getpid()}-dl")
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._download(FileEntry(path="external", sha256=digest, size=self.blobs.size(digest)), tmp)
            os.replace(tmp, path)
        except BlobNotFound:
            raise StageInputMissing(
                f"stage store {self.url} has no external input with sha256 {digest}", details={"sha256": digest}
            ) from None
        finally:
            tmp.unlink(missing_ok=True)
        return path

    # -- S3 objects --------------------------------------------------------------------------------

    def _request(self, operation: str, absent: tuple[str, ...], **kwargs: Any) -> Any:
        """S3 `operation` on this bucket; None when S3 answers with a code of `absent`, and any other
        failure as STAGE_STORE_UNAVAILABLE (nothing above this class knows about boto)."""
        from storage.s3 import error_code, is_boto_error

        try:
            return getattr(self.client, operation)(Bucket=self.bucket, **kwargs)
        except Exception as exc:
            if not is_boto_error(exc):
                raise
            if error_code(exc) in absent:
                return None
            raise self._unavailable(exc) from None

    def _get(self, key: str) -> bytes | None:
        response = self._request("get_object", _NOT_FOUND, Key=key)
        if response is None:
            return None
        body = response["Body"]
        try:
            data: bytes = body.read(MAX_STAGE_JSON + 1)
        finally:
            body.close()
        if len(data) > MAX_STAGE_JSON:
            raise StageFailed(
                f"stage store {self.url}: {key} is larger than {MAX_STAGE_JSON} bytes",
                code="STAGE_STORE_CORRUPT",
                details={"path": key},
            )
        return data

    def _exists(self, key: str) -> bool:
        return self._request("head_object", _NOT_FOUND, Key=key) is not None

    def _put_if_absent(self, key: str, data: bytes) -> bool:
        """Write `key` unless it exists (S3's conditional put); False when another writer was first."""
        conflict = ("PreconditionFailed", "412", "ConditionalRequestConflict")
        written = self._request(
            "put_object", conflict, Key=key, Body=data, IfNoneMatch="*", ContentType="application/json"
        )
        return written is not None

    def _unavailable(self, exc: BaseException) -> KilnError:
        from storage.s3 import error_code

        code = error_code(exc) or type(exc).__name__
        return Unavailable(
            f"stage store {self.url} failed: {code}", code="STAGE_STORE_UNAVAILABLE", details={"s3": code}
        )


def _chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            yield chunk


def _endpoint_from_env() -> str | None:
    """An S3-compatible endpoint (MinIO, a test server), from the first of `ENDPOINT_ENVS` set."""
    return next((os.environ[name] for name in ENDPOINT_ENVS if os.environ.get(name)), None)


def open_store(url: str | None, local_root: Path) -> StageStore:
    """The work directory `local_root` alone (`url` None), or the shared store `url` (`s3://bucket/prefix`)
    with `local_root` as this machine's copy."""
    local = WorkDir(local_root)
    if url is None:
        return local
    if not url.startswith("s3://"):
        raise InvalidInput(
            f"--store {url!r}: a shared stage store is an s3://bucket/prefix URL (the local one is --work-dir)",
            code="INVALID_STORE_URL",
        )
    return RemoteStageStore(url, local)


def require_input(store: StageStore, node: Node, key: str) -> StageOutput:
    """The finished output of an input `node` at `key`; an error naming the key when no machine made it."""
    found = store.lookup(node, key)
    if found is None:
        raise StageInputMissing(
            f"{node.id} (key {key}) is not in the store: run it first (`kiln run-stage` or a build)",
            details={"stage": node.id, "key": key},
        )
    return found
