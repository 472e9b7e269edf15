"""Stages, graph nodes, cache keys and the content-addressed work directory.

A stage's output lives at `<work>/<stage>/<key>/` where key = sha256 of canonical JSON of
(stage name, code version, params, each input's digest under its role, external digests by name).
Outputs are written into a temporary directory and renamed into place only after `stage.json` is
written, so a stage killed mid-way leaves only a `.tmp-*` directory that is never mistaken for done.
A stage returns a typed record (`pipeline.records`); `stage.json` stores it as the output's
`result`, and reading it back validates it against the stage's record type.

A `stage.json` is read like any untrusted input (`read_stage_record`): one that is not JSON kiln
accepts, has another shape, names another key, or lists files that are missing or not what it says
(size, sha256: verified through a stat-keyed cache, so a file is re-read only after it changed) is
corrupt (STAGE_RECORD_CORRUPT). In the work dir such an output is moved aside under `corrupt/`,
logged, and the stage is built again.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import shutil
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from core import __version__
from core.digest import HashCache, is_sha256, sha256_file, sha256_json
from core.errors import KilnError, StageFailed
from core.manifest import FileEntry
from core.untrusted import InvalidJSON, loads_json
from pipeline.requirements import Requirements, Sizing, requirements

STAGE_FILE = "stage.json"
EXTERNAL_DIR = "external"
LOG_FILE = "stage.log"  # what the stage's libraries printed; beside stage.json, not part of the output
OUTPUT_DIR = "files"
LOG_TAIL_LINES = 20
CORRUPT_DIR = "corrupt"  # outputs whose stage.json or files were found corrupt, moved aside
VERIFIED_FILE = ".verified-files.json"  # sha256 of output files by stat (core.digest.HashCache)
MAX_STAGE_JSON = 64 * 1024 * 1024
R = TypeVar("R", bound=BaseModel)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageOutput:
    """A finished stage: its files under `files_dir`, its JSON result, and a digest of both."""

    node_id: str
    key: str
    path: Path
    result: BaseModel  # the stage's record type (`Stage.record`)
    files: list[FileEntry]
    provenance: dict[str, Any]

    @property
    def files_dir(self) -> Path:
        return self.path / OUTPUT_DIR

    @property
    def digest(self) -> str:
        return output_digest(self.files, self.result)

    def record(self, kind: type[R]) -> R:
        """The result as the record type the caller expects; a different one is a graph built wrong."""
        if not isinstance(self.result, kind):
            raise TypeError(f"{self.node_id} holds a {type(self.result).__name__}, not a {kind.__name__}")
        return self.result


def output_digest(files: list[FileEntry], result: BaseModel) -> str:
    """What identifies a stage output: sha256 of canonical JSON of its files (path, sha256, size) and record."""
    return sha256_json({"files": [f.model_dump() for f in files], "result": result.model_dump(mode="json")})


@dataclass
class StageContext:
    node: Node
    out_dir: Path  # write outputs here (a temporary directory)
    inputs: dict[str, StageOutput]  # by role
    progress: Callable[[int, int | None], None] = lambda advance, total: None
    # sha256 -> a local copy of that external input (`StageStore.external`)
    fetch_external: Callable[[str], Path] | None = None

    def external(self, name: str) -> Path:
        """A local copy of the file the node names as external input `name` (by digest, from the store)."""
        if name not in self.node.external or self.fetch_external is None:
            raise KeyError(f"{self.node.id} has no external input {name!r}")
        return self.fetch_external(self.node.external[name])

    def input(self, role: str) -> StageOutput:
        """The input the node gets under `role` (see `Node.inputs`)."""
        if role not in self.inputs:
            raise KeyError(f"{self.node.id} has no {role!r} input; it has {', '.join(self.inputs) or 'none'}")
        return self.inputs[role]

    def record(self, role: str, kind: type[R]) -> R:
        """The record of the input under `role`, as `kind`."""
        return self.input(role).record(kind)


@dataclass(frozen=True)
class Stage:
    name: str
    code_version: str
    run: Callable[[StageContext], BaseModel]
    record: type[BaseModel]  # what `run` returns and `stage.json` holds
    description: str = ""
    # A stage with effects outside the work dir (publishing) runs every time; its target makes it idempotent.
    cacheable: bool = True
    # A stage that reads what only the machine that planned the build has (the recipe's source directory, the
    # registry named on its command line): executors that spread stages over machines run it there.
    on_driver: bool = False
    # For a stage that needs hardware or software this machine may lack: what a node still needs here
    # ({"runner", "command", "missing", ...}), or None when it can run. `kiln plan` asks without running.
    deferral: Callable[[Node], dict[str, Any] | None] | None = None
    # What a node of this stage needs of the machine that runs it, for the model and device of `Sizing`;
    # None: `pipeline.requirements.requirements(name, sizing, node)`, the stage's row of the table.
    needs: Callable[[Node, Sizing], Requirements] | None = None

    def requirements(self, node: Node, sizing: Sizing) -> Requirements:
        return self.needs(node, sizing) if self.needs is not None else requirements(self.name, sizing, node)


@dataclass(frozen=True)
class Node:
    """One stage applied to given params and inputs. `external` digests name data outside the graph."""

    id: str  # "<stage>/<name>", e.g. "export/gguf-q4_0"
    stage: Stage
    params: dict[str, Any]
    inputs: dict[str, str] = field(default_factory=dict)  # role -> node id, e.g. {"source": "ingest/source"}
    external: dict[str, str] = field(default_factory=dict)  # name -> digest of data outside the graph
    args: dict[str, Any] = field(default_factory=dict)  # where to find things (paths, URLs): not in the key
    # What the machine that runs it must offer (`pipeline.requirements`); not in the key.
    requires: Requirements = field(default_factory=lambda: Requirements(cpus=1, memory_bytes=0))

    def cache_key(self, input_digests: dict[str, str]) -> str:
        """sha256 of canonical JSON; each input's digest keeps its role (`input_digests` is by node id)."""
        return sha256_json(
            {
                "stage": self.stage.name,
                "code_version": self.stage.code_version,
                "params": self.params,
                "inputs": {role: input_digests[node_id] for role, node_id in self.inputs.items()},
                "external": self.external,
            }
        )


class StageInputMissing(KilnError):
    """A stage's input (an upstream output, or an external file by digest) is not in the store."""

    code = "STAGE_INPUT_MISSING"


class StageRecordCorrupt(KilnError):
    """A stage.json that is not a stage record of the key it was found under, or whose files do not match it."""

    code = "STAGE_RECORD_CORRUPT"


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
        if not meta.is_file():
            return None
        try:
            with open(meta, "rb") as f:
                raw = f.read(MAX_STAGE_JSON + 1)
        except OSError as e:
            raise StageRecordCorrupt(
                f"{meta} cannot be read ({e.strerror})", details={"stage": node.id, "key": key, "path": str(meta)}
            ) from None
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
            if not file.is_file() or file.is_symlink():
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

    def commit(self, node: Node, key: str, tmp: Path, result: BaseModel, provenance: dict[str, Any]) -> StageOutput:
        """Manifest the temp output, write stage.json last, then rename the directory into place."""
        self.seal(node, key, tmp, result, provenance)
        return self.install(node, key, tmp)

    def seal(self, node: Node, key: str, tmp: Path, result: BaseModel, provenance: dict[str, Any]) -> list[FileEntry]:
        """Write the temp output's stage.json (its files, hashed, and `result`); the output is then complete."""
        files_dir = tmp / OUTPUT_DIR
        files = [
            FileEntry(path=p.relative_to(files_dir).as_posix(), sha256=sha256_file(p), size=p.stat().st_size)
            for p in sorted(files_dir.rglob("*"))
            if p.is_file()
        ]
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
        except OSError:
            if not (final / STAGE_FILE).is_file():
                raise
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


@contextlib.contextmanager
def captured_output(log: Path) -> Iterator[None]:
    """Send this process's stdout and stderr to `log`, and restore them afterwards: file descriptors 1
    and 2 (C libraries, subprocesses) and Python's `sys.stdout`/`sys.stderr` (which may not write to
    those descriptors, e.g. under a test runner's capture)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fds = os.dup(1), os.dup(2)
    saved_streams = sys.stdout, sys.stderr
    try:
        with open(log, "a", buffering=1, encoding="utf-8", errors="replace") as f:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            sys.stdout = sys.stderr = f
            try:
                yield
            finally:
                f.flush()
                sys.stdout, sys.stderr = saved_streams
                os.dup2(saved_fds[0], 1)
                os.dup2(saved_fds[1], 2)
    finally:
        os.close(saved_fds[0])
        os.close(saved_fds[1])


def log_tail(log: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    """The last lines of a stage log (progress-bar carriage returns folded), to quote in an error."""
    with open(log, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
        text = f.read().decode("utf-8", "replace")
    return [line.rsplit("\r", 1)[-1] for line in text.splitlines() if line.strip()][-lines:]


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


@functools.cache
def _distributions_by_module() -> dict[str, list[str]]:
    return dict(importlib.metadata.packages_distributions())  # scans what is installed: once per process


def library_versions() -> dict[str, str]:
    """The versions of the installed distributions whose modules this process has loaded (the standard
    library aside): what a stage ran with. In a process that ran earlier stages it includes theirs."""
    by_module = _distributions_by_module()
    loaded = {name.partition(".")[0] for name in list(sys.modules)} - set(sys.stdlib_module_names)
    names = sorted({dist for module in loaded for dist in by_module.get(module, [])})
    return {name: version for name in names if (version := _version(name)) is not None}


@functools.cache
def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def provenance(node: Node, key: str, inputs: dict[str, StageOutput], started: float) -> dict[str, Any]:
    return {
        "stage": node.stage.name,
        "code_version": node.stage.code_version,
        "cache_key": key,
        "params": node.params,
        "inputs": {role: {"node": o.node_id, "digest": o.digest} for role, o in inputs.items()},
        "external": node.external,
        "kiln_version": __version__,
        "python": platform.python_version(),
        "libraries": library_versions(),
        "host": socket.gethostname(),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "duration_s": round(time.time() - started, 3),
    }
