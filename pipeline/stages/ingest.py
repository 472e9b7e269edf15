"""Ingest stage: copy the checked release (hard links where possible) into the content-addressed store."""

from __future__ import annotations

import shutil
from pathlib import Path

from core.digest import HashCache
from core.errors import SourceInvalid
from formats.hf_model import SourceModel, open_source
from pipeline.records import IgnoredFile, IngestRecord
from pipeline.stage import Node, Stage, StageContext, StageOutput


def run(ctx: StageContext) -> IngestRecord:
    source_dir = Path(ctx.node.args["source_dir"])
    hashes = HashCache(Path(ctx.node.args["hash_cache"]))
    allowed = ctx.node.args.get("allowed_roots", [])
    source = open_source(source_dir, hasher=hashes.sha256, allowed_roots=allowed)
    if source.digest != ctx.node.external["source"]:
        raise SourceInvalid(f"{source_dir} changed while the build was planned; run again")
    total = sum(f.size for f in source.files)
    for f in source.files:
        # A copy, never a hard link: editing the source in place must not change what is stored.
        shutil.copyfile(source_dir / f.path, ctx.out_dir / f.path)
        ctx.progress(f.size, total)
    return IngestRecord(
        source_digest=source.digest,
        source_files=source.files,
        shape=source.shape.summary(),
        architecture=source.shape.architecture,
        tensors=len(source.tensors),
        parameters=sum(t.numel for t in source.tensors.values()),
        # Files left alone (pickle checkpoints beside SafeTensors, ...): in the build report, and warned about.
        ignored=[IgnoredFile(path=path, reason=reason) for path, reason in source.ignored],
    )


def open_ingested(output: StageOutput) -> SourceModel:
    """Open the ingested copy without hashing again: its files were hashed when the stage committed."""
    known = output.record(IngestRecord).source_files
    committed = {f.path: f for f in output.files}
    for f in known:
        if committed.get(f.path) != f:
            raise SourceInvalid(f"ingested file {f.path} does not match the source it was copied from")
    return open_source(output.files_dir, known_files=known)


STAGE = Stage(
    "ingest",
    "2",
    run,
    IngestRecord,
    "check the SafeTensors release and record the sha256 of every file",
    on_driver=True,
)


def node(source: SourceModel, source_dir: Path, hash_cache: Path) -> Node:
    """The graph's one ingest node: keyed by the source's digest, re-hashing through `hash_cache`.

    The directories `source` was opened with (`--allow-outside`) travel in the node's args, so the
    stage checks the links it copies against the same rule the plan did.
    """
    return Node(
        "ingest/source",
        STAGE,
        params={},
        external={"source": source.digest},
        args={
            "source_dir": str(source_dir),
            "hash_cache": str(hash_cache),
            "allowed_roots": [str(r) for r in source.allowed_roots],
        },
    )
