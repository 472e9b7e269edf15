"""Where stage outputs live: a `StageStore`, on this machine's disk or shared through object storage.

`WorkDir` is the store on one machine: `<work>/<stage>/<key>/`, written into a temporary directory and
renamed into place only after `stage.json` is written, so a stage killed mid-way leaves only a `.tmp-*`
directory that is never mistaken for done. A `stage.json` is read like any untrusted input
(`read_stage_record`): one that is not JSON kiln accepts, has another shape, names another key, or lists
files that are missing or not what it says (size, sha256: verified through a stat-keyed cache, so a file
is re-read only after it changed) is corrupt (STAGE_RECORD_CORRUPT); in the work dir such an output is moved
aside under `corrupt/`, logged, and the stage is built again. `RemoteStageStore` shares one between
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
import json
import logging
import os
import shutil
import stat
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ValidationError

from kiln.core.digest import HashCache, file_stamp, is_sha256, sha256_file
from kiln.core.error_codes import Codes
from kiln.core.errors import DigestMismatch, InvalidInput, KilnError, StageFailed, Unavailable
from kiln.core.manifest import FileEntry
from kiln.core.untrusted import InvalidJSON, loads_json
from kiln.pipeline.stage import (
    CORRUPT_DIR,
    EXTERNAL_DIR,
    LOG_FILE,
    OUTPUT_DIR,
    STAGE_FILE,
    VERIFIED_FILE,
    Node,
    StageOutput,
    output_digest,
)

STORE_ENV = "KILN_STORE"
ENDPOINT_ENVS = ("KILN_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
MAX_STAGE_JSON = 64 * 1024 * 1024
_NOT_FOUND = ("NoSuchKey", "404", "NotFound")
CHUNK = 8 * 1024 * 1024
log = logging.getLogger(__name__)
# Files a stage linked into its output, by path: (sha256, `core.digest.file_stamp` when it was hashed).
Hashed = dict[str, tuple[str, list[int]]] | None


class StageInputMissing(KilnError):
    """A stage's input (an upstream output, or an external file by digest) is not in the store."""

    code = Codes.STAGE_INPUT_MISSING


class StageRecordCorrupt(KilnError):
    """A stage.json that is not a stage record of the key it was found under, or whose files do not match it."""

    code = Codes.STAGE_RECORD_CORRUPT


@dataclass(frozen=True)
class StageRecord:
    """What a stage.json holds, once checked: the stage's record, its files and its provenance."""

    result: BaseModel
    files: list[FileEntry]
    provenance: dict[str, Any]


def read_stage_record(node: Node, key: str, meta: bytes, where: str, *, check_node: bool = True) -> StageRecord:
    """The stage.json `meta` (read from `where`) as the output of `node` at `key`; StageRecordCorrupt,
    naming `where`, when it is not JSON kiln accepts, has another shape, names another key (or node, with
    `check_node`), or lists a file twice."""

    def corrupt(why: str) -> StageRecordCorrupt:
        return StageRecordCorrupt(f"{where} {why}", details={"stage": node.id, "key": key, "path": where})

    if len(meta) > MAX_STAGE_JSON:
        raise corrupt(f"is larger than {MAX_STAGE_JSON} bytes")
    try:
        data = loads_json(meta, what="stage.json")
    except InvalidJSON as e:
        raise corrupt(f"is not valid JSON ({e.message})") from None
    if not isinstance(data, dict):
        raise corrupt(f"holds a JSON {type(data).__name__}, not a stage record")
    if data.get("key") != key or (check_node and data.get("node") != node.id):
        raise corrupt("names another node or key")
    try:
        result = node.stage.record.model_validate(data["result"])
        files = [FileEntry.model_validate(f) for f in data["files"]]
        provenance = data["provenance"]
    except KeyError as e:
        raise corrupt(f"has no {e.args[0]!r}") from None
    except (TypeError, ValidationError) as e:
        raise corrupt(f"does not hold a {node.stage.record.__name__} and its files ({type(e).__name__})") from None
    if not isinstance(provenance, dict):
        raise corrupt("has a provenance that is not an object")
    if len({f.path for f in files}) != len(files):
        raise corrupt("lists a file twice")
    return StageRecord(result, files, provenance)


class WorkDir:
    """The content-addressed store of stage outputs on one machine (`pipeline.store.StageStore`).

    `<root>/<stage>/<key>/` holds a finished output (`files/` and `stage.json`), `<root>/external/<sha256>`
    the files a recipe names outside the graph (held-out and calibration texts), by content.
    """

    def __init__(self, root: Path):
        self.root = root
        self._verified: HashCache | None = None

    @property
    def verified(self) -> HashCache:
        """sha256 of output files by stat: a cached lookup re-reads only a file that changed."""
        if self._verified is None:
            self._verified = HashCache(self.root / VERIFIED_FILE)
        return self._verified

    @property
    def local(self) -> WorkDir:
        return self

    def external_path(self, digest: str) -> Path:
        if not is_sha256(digest):
            raise StageInputMissing(f"{digest!r} is not a sha256 digest")
        return self.root / EXTERNAL_DIR / digest

    def put_external(self, path: Path, digest: str) -> None:
        """Keep a copy of `path`, whose sha256 is `digest`, under that digest (checked while copying)."""
        final = self.external_path(digest)
        if final.is_file():
            return
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".tmp-{digest[:16]}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        h = hashlib.sha256()
        try:
            with open(path, "rb") as src, open(tmp, "wb") as dst:
                while chunk := src.read(8 << 20):
                    h.update(chunk)
                    dst.write(chunk)
            if h.hexdigest() != digest:
                raise StageFailed(f"{path} changed while the build was planned (sha256 {h.hexdigest()}, not {digest})")
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)

    def external(self, digest: str) -> Path:
        """The stored file of sha256 `digest`; StageInputMissing when the store has none."""
        path = self.external_path(digest)
        if not path.is_file():
            raise StageInputMissing(f"the store has no external input with sha256 {digest}", details={"sha256": digest})
        return path

    def final_path(self, stage: str, key: str) -> Path:
        return self.root / stage / key

    def lookup(self, node: Node, key: str) -> StageOutput | None:
        """The finished output of `node` at `key`, its files checked against its stage.json; None when there
        is none, or when it was corrupt (then moved aside under `corrupt/`, and logged, to be built again)."""
        try:
            return self._read(node, key, verify=True)
        except StageRecordCorrupt as e:
            self._set_aside(node, key, e)
            return None

    def _read(self, node: Node, key: str, *, verify: bool) -> StageOutput | None:
        path = self.final_path(node.stage.name, key)
        meta = path / STAGE_FILE
        where = {"stage": node.id, "key": key, "path": str(meta)}
        if not os.path.lexists(path):
            return None
        # An output is renamed into place with its stage.json: one that is missing, or is a directory, a FIFO
        # or a device, is corrupt (and is never opened: a FIFO would block).
        if not meta.is_file():
            why = "is not a regular file" if os.path.lexists(meta) else "is missing"
            raise StageRecordCorrupt(f"{meta} {why}", details=where)
        try:
            with os.fdopen(os.open(meta, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    raise StageRecordCorrupt(f"{meta} is not a regular file", details=where)
                raw = f.read(MAX_STAGE_JSON + 1)
        except OSError as e:
            raise StageRecordCorrupt(f"{meta} cannot be read ({e.strerror})", details=where) from None
        record = read_stage_record(node, key, raw, str(meta), check_node=False)
        if verify:
            self._verify_files(node, key, path, record.files)
        return StageOutput(
            node_id=node.id,
            key=key,
            path=path,
            result=record.result,
            files=record.files,
            provenance=record.provenance,
        )

    def _verify_files(self, node: Node, key: str, path: Path, files: list[FileEntry]) -> None:
        """Every file the stage.json lists is there with its size and sha256 (re-hashed only when changed)."""
        for entry in files:
            file = path / OUTPUT_DIR / entry.path
            why = None
            if not file.is_file() or (file.is_symlink() and not node.stage.references):
                why = "is missing"
            elif file.stat().st_size != entry.size:
                why = f"has {file.stat().st_size} bytes, not the {entry.size} its stage.json records"
            elif (actual := self.verified.sha256(file)) != entry.sha256:
                why = f"has sha256 {actual}, not the {entry.sha256} its stage.json records"
            if why is not None:
                self.verified.save()
                raise StageRecordCorrupt(
                    f"{file} {why}", details={"stage": node.id, "key": key, "path": str(path / STAGE_FILE)}
                )
        self.verified.save()

    def _set_aside(self, node: Node, key: str, error: StageRecordCorrupt) -> None:
        """Move a corrupt output out of the store (kept under `corrupt/` to look at), so it is built again."""
        final = self.final_path(node.stage.name, key)
        when = time.strftime("%Y%m%dT%H%M%S")
        aside = self.root / CORRUPT_DIR / f"{node.stage.name}-{key[:16]}-{when}-{uuid.uuid4().hex[:8]}"
        try:
            aside.parent.mkdir(parents=True, exist_ok=True)
            os.rename(final, aside)
        except FileNotFoundError:
            return  # another process moved it first
        except OSError as e:
            raise StageRecordCorrupt(
                f"{error.message}; it could not be moved aside ({e.strerror}): delete {final} to rebuild it",
                details=error.details,
            ) from None
        log.warning("%s [%s]: %s; moved aside to %s, building it again", node.id, error.code, error.message, aside)

    def digest(self, node: Node, key: str) -> str | None:
        """The digest of the finished output of (node, key), or None: what a downstream key is made of."""
        out = self.lookup(node, key)
        return out.digest if out is not None else None

    def new_temp(self, stage: str, key: str) -> Path:
        tmp = self.root / stage / f".tmp-{key[:16]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        (tmp / OUTPUT_DIR).mkdir(parents=True)
        return tmp

    def commit(
        self, node: Node, key: str, tmp: Path, result: BaseModel, provenance: dict[str, Any], hashed: Hashed = None
    ) -> StageOutput:
        """Manifest the temp output, write stage.json last, then rename the directory into place."""
        self.seal(node, key, tmp, result, provenance, hashed)
        return self.install(node, key, tmp)

    def seal(
        self, node: Node, key: str, tmp: Path, result: BaseModel, provenance: dict[str, Any], hashed: Hashed = None
    ) -> list[FileEntry]:
        """Write the temp output's stage.json (its files, hashed, and `result`); the output is then complete.
        A file in `hashed` (`StageContext.hashed`) is not read again while its stamp is what the stage saw."""
        files_dir = tmp / OUTPUT_DIR
        files = []
        for p in sorted(files_dir.rglob("*")):
            if not p.is_file():
                continue
            path = p.relative_to(files_dir).as_posix()
            known = (hashed or {}).get(path)
            digest = known[0] if known is not None and file_stamp(p) == known[1] else sha256_file(p)
            files.append(FileEntry(path=path, sha256=digest, size=p.stat().st_size))
        if not isinstance(result, node.stage.record):
            raise StageFailed(f"{node.id} returned a {type(result).__name__}, not a {node.stage.record.__name__}")
        payload = {
            "node": node.id,
            "key": key,
            "record": node.stage.record.__name__,
            "result": result.model_dump(mode="json"),
            "files": [f.model_dump() for f in files],
            "provenance": provenance,
        }
        with open(tmp / STAGE_FILE, "w") as f:
            json.dump(payload, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        return files

    def install(self, node: Node, key: str, tmp: Path) -> StageOutput:
        """Rename a complete temporary output (`files/` and `stage.json`, written last) into place."""
        final = self.final_path(node.stage.name, key)
        try:
            os.rename(tmp, final)
        except OSError as e:
            if not (final / STAGE_FILE).is_file():
                raise StageRecordCorrupt(
                    f"{final} is in the way of the output just built ({e.strerror}): delete it to build it again",
                    details={"stage": node.id, "key": key, "path": str(final)},
                ) from None
            shutil.rmtree(tmp)  # another run finished the same key first; identical by construction
            out = self._read(node, key, verify=True)
        else:
            out = self._read(node, key, verify=False)  # its files were hashed as they were sealed or fetched
            assert out is not None
            for entry in out.files:
                self.verified.remember(out.files_dir / entry.path, entry.sha256)
            self.verified.save()
        assert out is not None
        return out

    def remove(self, node: Node, key: str) -> None:
        """Drop a finished output (to replace it with the one another machine committed first)."""
        final = self.final_path(node.stage.name, key)
        if final.exists():
            gone = final.with_name(f".tmp-{key[:16]}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            os.rename(final, gone)  # out of sight at once, then deleted
            shutil.rmtree(gone, ignore_errors=True)

    def keep_log(self, node: Node, tmp: Path) -> Path | None:
        """Keep a failed stage's log under `<work>/logs/` (its temporary directory is about to go)."""
        log = tmp / LOG_FILE
        if not log.is_file() or log.stat().st_size == 0:
            return None
        kept = self.root / "logs" / f"{node.id.replace('/', '-')}-{time.strftime('%Y%m%dT%H%M%S')}.log"
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(log, kept)
        return kept

    def discard(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    def sweep_stale(self) -> int:
        """Remove temporary outputs and files left by runs that died (their process is gone)."""
        removed = 0
        for tmp in self.root.glob("*/.tmp-*"):
            try:
                pid = int(tmp.name.split("-")[2])
            except (IndexError, ValueError):
                pid = -1
            if pid != os.getpid() and not _alive(pid):
                if tmp.is_dir():
                    shutil.rmtree(tmp, ignore_errors=True)
                else:
                    tmp.unlink(missing_ok=True)
                removed += 1
        return removed


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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

    def commit(
        self, node: Node, key: str, tmp: Path, result: Any, provenance: dict[str, Any], hashed: Hashed = None
    ) -> StageOutput:
        """Make the temporary output at `tmp` the output of (node, key), for every machine of the store (the
        files of `hashed`, `StageContext.hashed`, by the digests the stage gave while they are unchanged)."""
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
        from kiln.storage.s3 import S3BlobStore, make_s3_client, parse_s3_url

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

    def commit(
        self, node: Node, key: str, tmp: Path, result: Any, provenance: dict[str, Any], hashed: Hashed = None
    ) -> StageOutput:
        """The bucket first, then this machine's copy: an output is never here without being there (a file
        linked into the output is uploaded as its bytes)."""
        files = self._local.seal(node, key, tmp, result, provenance, hashed)
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
        from kiln.storage.store import BlobNotFound

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
                code=Codes.STAGE_STORE_CORRUPT,
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
                code=Codes.STAGE_STORE_CORRUPT,
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
        from kiln.storage.store import BlobNotFound

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
        from kiln.storage.s3 import error_code, is_boto_error

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
                code=Codes.STAGE_STORE_CORRUPT,
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
        from kiln.storage.s3 import error_code

        code = error_code(exc) or type(exc).__name__
        return Unavailable(
            f"stage store {self.url} failed: {code}", code=Codes.STAGE_STORE_UNAVAILABLE, details={"s3": code}
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
            code=Codes.INVALID_STORE_URL,
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
