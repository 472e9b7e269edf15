"""Stages, graph nodes, cache keys and the content-addressed work directory.

A stage's output lives at `<work>/<stage>/<key>/` where key = sha256 of canonical JSON of
(stage name, code version, params, input digests). Outputs are written into a temporary
directory and renamed into place only after `stage.json` is written, so a stage killed
mid-way leaves only a `.tmp-*` directory that is never mistaken for done.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln import __version__
from kiln.digest import sha256_file, sha256_json
from kiln.manifest import FileEntry

STAGE_FILE = "stage.json"
OUTPUT_DIR = "files"


@dataclass(frozen=True)
class StageOutput:
    """A finished stage: its files under `files_dir`, its JSON result, and a digest of both."""

    node_id: str
    key: str
    path: Path
    result: dict[str, Any]
    files: list[FileEntry]
    provenance: dict[str, Any]

    @property
    def files_dir(self) -> Path:
        return self.path / OUTPUT_DIR

    @property
    def digest(self) -> str:
        return sha256_json({"files": [f.model_dump() for f in self.files], "result": self.result})


@dataclass
class StageContext:
    node: Node
    out_dir: Path  # write outputs here (a temporary directory)
    inputs: dict[str, StageOutput]  # by node id
    progress: Callable[[int, int | None], None] = lambda advance, total: None

    def input(self, stage_name: str) -> StageOutput:
        """The single input produced by a stage of this name."""
        found = [o for nid, o in self.inputs.items() if nid.split("/", 1)[0] == stage_name]
        if len(found) != 1:
            raise KeyError(f"{self.node.id} expects exactly one {stage_name!r} input, has {len(found)}")
        return found[0]


@dataclass(frozen=True)
class Stage:
    name: str
    code_version: str
    run: Callable[[StageContext], dict[str, Any]]
    description: str = ""
    resources: dict[str, float] = field(default_factory=lambda: {"CPU": 1})  # what an executor must provide
    # A stage with effects outside the work dir (publishing) runs every time; its target makes it idempotent.
    cacheable: bool = True
    # For a stage that needs hardware or software this machine may lack: what a node still needs here
    # ({"runner", "command", "missing", ...}), or None when it can run. `kiln plan` asks without running.
    deferral: Callable[[Node], dict[str, Any] | None] | None = None


@dataclass(frozen=True)
class Node:
    """One stage applied to given params and inputs. `external` digests name data outside the graph."""

    id: str  # "<stage>/<name>", e.g. "export/gguf-q4_0"
    stage: Stage
    params: dict[str, Any]
    inputs: tuple[str, ...] = ()
    external: dict[str, str] = field(default_factory=dict)
    args: dict[str, Any] = field(default_factory=dict)  # where to find things (paths, URLs): not in the key

    def cache_key(self, input_digests: dict[str, str]) -> str:
        return sha256_json(
            {
                "stage": self.stage.name,
                "code_version": self.stage.code_version,
                "params": self.params,
                "inputs": sorted([*input_digests.values(), *self.external.values()]),
            }
        )


class WorkDir:
    """The content-addressed store of stage outputs on one machine."""

    def __init__(self, root: Path):
        self.root = root

    def final_path(self, stage: str, key: str) -> Path:
        return self.root / stage / key

    def lookup(self, node: Node, key: str) -> StageOutput | None:
        path = self.final_path(node.stage.name, key)
        meta = path / STAGE_FILE
        if not meta.is_file():
            return None
        data = json.loads(meta.read_text())
        return StageOutput(
            node_id=node.id,
            key=key,
            path=path,
            result=data["result"],
            files=[FileEntry(**f) for f in data["files"]],
            provenance=data["provenance"],
        )

    def new_temp(self, stage: str, key: str) -> Path:
        tmp = self.root / stage / f".tmp-{key[:16]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        (tmp / OUTPUT_DIR).mkdir(parents=True)
        return tmp

    def commit(
        self, node: Node, key: str, tmp: Path, result: dict[str, Any], provenance: dict[str, Any]
    ) -> StageOutput:
        """Manifest the temp output, write stage.json last, then rename the directory into place."""
        files_dir = tmp / OUTPUT_DIR
        files = [
            FileEntry(path=p.relative_to(files_dir).as_posix(), sha256=sha256_file(p), size=p.stat().st_size)
            for p in sorted(files_dir.rglob("*"))
            if p.is_file()
        ]
        payload = {
            "node": node.id,
            "key": key,
            "result": result,
            "files": [f.model_dump() for f in files],
            "provenance": provenance,
        }
        with open(tmp / STAGE_FILE, "w") as f:
            json.dump(payload, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        final = self.final_path(node.stage.name, key)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / STAGE_FILE).is_file():
                raise
            shutil.rmtree(tmp)  # another run finished the same key first; identical by construction
        out = self.lookup(node, key)
        assert out is not None
        return out

    def discard(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    def sweep_stale(self) -> int:
        """Remove temp dirs left by runs that died (their process is gone)."""
        removed = 0
        for tmp in self.root.glob("*/.tmp-*"):
            try:
                pid = int(tmp.name.split("-")[2])
            except (IndexError, ValueError):
                pid = -1
            if pid != os.getpid() and not _alive(pid):
                shutil.rmtree(tmp, ignore_errors=True)
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


def provenance(node: Node, key: str, inputs: dict[str, StageOutput], started: float) -> dict[str, Any]:
    return {
        "stage": node.stage.name,
        "code_version": node.stage.code_version,
        "cache_key": key,
        "params": node.params,
        "inputs": {nid: o.digest for nid, o in inputs.items()},
        "external": node.external,
        "kiln_version": __version__,
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "duration_s": round(time.time() - started, 3),
    }
