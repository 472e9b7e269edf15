"""Ingest stage: copy the checked release (hard links where possible) into the content-addressed store."""

from __future__ import annotations

import shutil
from pathlib import Path

from core.digest import HashCache
from core.errors import SourceInvalid
from core.manifest import FileEntry
from formats.hf_model import SourceModel, open_source
from pipeline.records import IgnoredFile, IngestRecord
from pipeline.remote_source import S3Source
from pipeline.stage import Node, Stage, StageContext, StageOutput


def run(ctx: StageContext) -> IngestRecord:
    if "source_url" in ctx.node.args:
        source = _download(ctx)
    else:
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
        shape=source.shape.record(),
        architecture=source.shape.architecture,
        tensors=len(source.tensors),
        parameters=sum(t.numel for t in source.tensors.values()),
        # Files left alone (pickle checkpoints beside SafeTensors, ...): in the build report, and warned about.
        ignored=[IgnoredFile(path=path, reason=reason) for path, reason in source.ignored],
    )


def _download(ctx: StageContext) -> SourceModel:
    """A source in a bucket: every file the plan uses, streamed into the output with ranged GETs (each one
    as listed at plan time, or refused), then checked and hashed like a local source."""
    remote = S3Source(ctx.node.args["source_url"])
    planned: dict[str, str] = ctx.node.args["files"]  # name -> its listing identity
    listing = remote.listing()
    changed = sorted(n for n, identity in planned.items() if n not in listing or listing[n].identity != identity)
    if changed:
        raise SourceInvalid(
            f"{remote.url}: {', '.join(changed)} changed since the build was planned; run again",
            code="SOURCE_CHANGED",
            details={"files": changed},
        )
    total = sum(listing[n].size for n in planned)
    hashed = []
    for name in planned:
        hashed.append(FileEntry(path=name, sha256=remote.download(name, ctx.out_dir / name), size=listing[name].size))
        ctx.progress(listing[name].size, total)
    source = open_source(ctx.out_dir, known_files=hashed)  # hashed while they streamed in
    if sorted(f.path for f in source.files) != sorted(planned):
        raise SourceInvalid(f"{remote.url}: the downloaded copy uses other files than the plan did")
    return source


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
    "3",  # 3: the shape's summary names the heads, intermediate size and tied embeddings (replica sizing)
    run,
    IngestRecord,
    "check the SafeTensors release and record the sha256 of every file",
    on_driver=True,
)


def remote_node(source: SourceModel, url: str) -> Node:
    """The ingest node of a source in a bucket, planned from its header mirror (`pipeline.remote_source`):
    keyed by the listing of the files it uses (name, size, ETag), which its run checks again."""
    return Node(
        "ingest/source",
        STAGE,
        params={},
        external={"source": source.digest},
        args={"source_url": url, "files": {f.path: f.sha256 for f in source.files}},
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
