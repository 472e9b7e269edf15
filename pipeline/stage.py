"""Stages, graph nodes, cache keys, stage logs and provenance (the work directory is `pipeline.store.WorkDir`).

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
import importlib.metadata
import logging
import os
import platform
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from kiln.core import __version__
from kiln.core.digest import sha256_json
from kiln.core.manifest import FileEntry
from kiln.pipeline.records import StageParams
from kiln.pipeline.requirements import Requirements, Sizing, requirements

STAGE_FILE = "stage.json"
EXTERNAL_DIR = "external"
LOG_FILE = "stage.log"  # what the stage's libraries printed; beside stage.json, not part of the output
OUTPUT_DIR = "files"
LOG_TAIL_LINES = 20
CORRUPT_DIR = "corrupt"  # outputs whose stage.json or files were found corrupt, moved aside
VERIFIED_FILE = ".verified-files.json"  # sha256 of output files by stat (core.digest.HashCache)
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
    # Files the stage put in `out_dir` without writing them (links to files it hashed), by path: their sha256
    # and `core.digest.file_stamp` then. The store takes the digest while the stamp holds, reading nothing again.
    hashed: dict[str, tuple[str, list[int]]] = field(default_factory=dict)
    # What the stage adds to its output's provenance (where its data came from); never part of its digest.
    notes: dict[str, Any] = field(default_factory=dict)

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
    # Its output's files may be symbolic links to files outside the store (ingest's source, referenced in place
    # where it can be neither cloned nor hard-linked): verified by content like any other file.
    references: bool = False
    # What a node of this stage needs of the machine that runs it, for the model and device of `Sizing`;
    # None: `pipeline.requirements.requirements(name, sizing, node)`, the stage's row of the table.
    needs: Callable[[Node, Sizing], Requirements] | None = None
    # What a user can try when a node of this stage fails unexpectedly (quoted in its STAGE_FAILED message).
    hint: Callable[[Node], str] | None = None
    # The record its nodes' params are (`pipeline.records.StageParams`): the planner writes them from it and the
    # stage reads them back through it. None: params of any shape.
    params: type[StageParams] | None = None

    def requirements(self, node: Node, sizing: Sizing) -> Requirements:
        return self.needs(node, sizing) if self.needs is not None else requirements(self.name, sizing, node)

    def lacks(self, node: Node) -> tuple[str, dict[str, Any]] | None:
        """Why this machine cannot run `node` (`deferral`): the message and details its deferral reports, or None."""
        needs = self.deferral(node) if self.deferral is not None else None
        if needs is None:
            return None
        return f"{node.id}: deferred to a runner with {needs['runner']} ({'; '.join(needs['missing'])})", needs


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


def write_traceback(log: Path, error: BaseException) -> None:
    """Append `error`'s traceback (its causes included) to a stage log, after what the stage's libraries printed."""
    with open(log, "a", encoding="utf-8", errors="replace") as f:
        f.write("\n" + "".join(traceback.format_exception(error)))


# The directory holding kiln's top-level packages (a checkout, or the install's site-packages).
_ROOT = Path(__file__).resolve().parents[1]
_LIBRARIES = "/site-packages/"


def _is_kiln(filename: str) -> bool:
    """Whether a frame's file is kiln's own, in a checkout (an installed kiln's frames count as libraries')."""
    return _LIBRARIES not in filename.replace(os.sep, "/") and Path(filename).resolve().is_relative_to(_ROOT)


def _frame_path(filename: str) -> str:
    path = filename.replace(os.sep, "/")
    if _LIBRARIES in path:
        return path.rsplit(_LIBRARIES, 1)[1]
    if _is_kiln(filename):
        return Path(filename).resolve().relative_to(_ROOT).as_posix()
    return path


def raised_at(error: BaseException) -> str:
    """Where `error` was raised, as `path:line in function`; when that is a library's code, also the innermost
    call from kiln's own (`..., from quant/calibrated.py:712 in calibrate`). Library paths are relative to
    site-packages, kiln's to its root."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "an unknown place"

    def where(frame: traceback.FrameSummary) -> str:
        return f"{_frame_path(frame.filename)}:{frame.lineno} in {frame.name}"

    if _is_kiln(frames[-1].filename):
        return where(frames[-1])
    ours = next((f for f in reversed(frames) if _is_kiln(f.filename)), None)
    return where(frames[-1]) + (f", from {where(ours)}" if ours is not None else "")


def one_line(error: BaseException, limit: int = 300) -> str:
    """`Type: message` on one line, at most `limit` characters of the message (a KeyError of a tensor spans several)."""
    text = " ".join(str(error).split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


@functools.cache
def _distributions_by_module() -> dict[str, list[str]]:
    return dict(importlib.metadata.packages_distributions())  # scans what is installed: once per process


def library_versions() -> dict[str, str]:
    """The versions of the installed distributions whose modules this process has loaded (the standard
    library aside): what a stage ran with. In a process that ran earlier stages it includes theirs."""
    by_module = _distributions_by_module()
    loaded = {name.partition(".")[0] for name in list(sys.modules)} - set(sys.stdlib_module_names)
    names = sorted({dist for module in loaded for dist in by_module.get(module, [])})
    return {name: version for name in names if (version := distribution_version(name)) is not None}


@functools.cache
def distribution_version(distribution: str) -> str | None:
    """The installed version of `distribution`, or None where it is not installed."""
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
