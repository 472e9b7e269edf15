"""Ingest stage: check the release and place it in the content-addressed store without a second copy.

A local source is hashed once (through the work dir's stat-keyed hash cache, so a source the plan or an
earlier ingest hashed is not read again) and each file it uses is placed in the output by a reflink, a hard
link or a symbolic link to it (`storage.links`): never a copy, unless the recipe says `source_copy: true`.
The store verifies those files like any other (size, sha256 re-read only after a file's stat changed), so a
source edited in place after ingest is noticed, never served as what was hashed.

A pre-quantized release (FP8 block, MXFP4: `formats.prequantized`) is checked like any other tensor data:
its quantized tensors are paired with their scales from the headers as it is opened, and every scale is read
and checked here (finite and > 0, valid E8M0), a small part of the weights (1/4,096 of an FP8 block release's
with float32 scales, 1/17 of MXFP4 experts'); the values themselves are checked as they are dequantized, by
the stages that read them. Its quantization is recorded (`IngestRecord.quantization`): part of the source's
identity, as config.json and the weights already are of its digest.
"""

from __future__ import annotations

from pathlib import Path

from kiln.core.digest import HashCache, file_stamp
from kiln.core.error_codes import Codes
from kiln.core.errors import SourceInvalid, StageFailed
from kiln.core.manifest import FileEntry
from kiln.formats.hf_model import SourceModel, open_source
from kiln.pipeline.records import IgnoredFile, IngestParams, IngestRecord
from kiln.pipeline.remote_source import S3Source
from kiln.pipeline.stage import Node, Stage, StageContext, StageOutput
from kiln.storage.links import place


class SourceChanged(SourceInvalid):
    """A source file is not what the plan (or the ingest that hashed it) saw."""

    code = Codes.SOURCE_CHANGED


def run(ctx: StageContext) -> IngestRecord:
    source = _download(ctx) if "source_url" in ctx.node.args else _place_local(ctx)
    if "origin" in ctx.node.args:  # where the source came from (a hub repo at its pinned commit)
        ctx.notes["source"] = ctx.node.args["origin"]
    source.check_scales()
    return IngestRecord(
        source_digest=source.digest,
        source_files=source.files,
        shape=source.shape.record(),
        architecture=source.shape.architecture,
        tensors=len(source.tensors),
        parameters=sum(t.numel for t in source.tensors.values()),
        # Files left alone (pickle checkpoints beside SafeTensors, ...): in the build report, and warned about.
        ignored=[IgnoredFile(path=path, reason=reason) for path, reason in source.ignored],
        quantization=source.quantization,
    )


def _place_local(ctx: StageContext) -> SourceModel:
    """Hash the source once (or take the digests recorded for it), check it is what the plan keyed, and place
    each file it uses in the output: cloned, hard-linked or referenced, copied only when the node says so."""
    args = ctx.node.args
    if args.get("unhashed"):
        raise StageFailed(f"{ctx.node.id} was planned without hashing its source (`kiln plan`); build to ingest it")
    source_dir = Path(args["source_dir"])
    hashes = HashCache(Path(args["hash_cache"]))
    stamps: dict[str, list[int]] = {}

    def hasher(path: Path) -> str:
        # Taken before it is read: a write while it is read moves the stamp, and its link is refused.
        stamps[path.relative_to(source_dir).as_posix()] = file_stamp(path)
        return hashes.sha256(path)

    source = open_source(source_dir, hasher=hasher, allowed_roots=args.get("allowed_roots", []))
    hashes.save()
    planned: dict[str, str] = args.get("files", {})
    changed = sorted(f.path for f in source.files if planned.get(f.path) != f.sha256) if planned else []
    if changed or source.digest != ctx.node.external["source"]:
        files = changed or sorted(f.path for f in source.files)
        raise SourceChanged(
            f"{source_dir}: {', '.join(files)} changed since the build was planned; plan again",
            details={"source": str(source_dir), "files": files},
        )
    copy = IngestParams.model_validate(ctx.node.params).copy_source
    total = sum(f.size for f in source.files)
    for f in source.files:
        src, dest = source_dir / f.path, ctx.out_dir / f.path
        how = place(src, dest, copy=copy)
        if how != "copy":  # a copy is hashed as the store seals it; a link holds what was hashed if unchanged since
            if file_stamp(src) != stamps[f.path]:
                raise SourceChanged(
                    f"{src} changed while it was ingested; run again",
                    details={"source": str(source_dir), "files": [f.path]},
                )
            if how == "hardlink":  # the link moved the source's ctime: its recorded digest is still true
                hashes.remember_linked(src, f.sha256, stamps[f.path])
            ctx.hashed[f.path] = (f.sha256, file_stamp(dest))
        ctx.progress(f.size, total)
    hashes.save()
    return source


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
            code=Codes.SOURCE_CHANGED,
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
    """Open the ingested source without hashing again: its files were hashed when the stage committed, and
    the store verified them (by stat, re-reading only a changed file) when it looked the output up."""
    known = output.record(IngestRecord).source_files
    committed = {f.path: f for f in output.files}
    for f in known:
        if committed.get(f.path) != f:
            raise SourceInvalid(f"ingested file {f.path} does not match the source it was copied from")
    # Files referenced in place are symbolic links out of the output: to the source the stage checked.
    referenced = [
        (output.files_dir / f.path).resolve().parent for f in known if (output.files_dir / f.path).is_symlink()
    ]
    return open_source(output.files_dir, known_files=known, allowed_roots=referenced)


STAGE = Stage(
    "ingest",
    "3",  # 3: the shape's summary names the heads, intermediate size and tied embeddings (replica sizing)
    run,
    IngestRecord,
    "check the SafeTensors release and record the sha256 of every file",
    on_driver=True,
    references=True,
    params=IngestParams,
)


def remote_node(source: SourceModel, url: str) -> Node:
    """The ingest node of a source in a bucket, planned from its header mirror (`pipeline.remote_source`):
    keyed by the listing of the files it uses (name, size, ETag), which its run checks again."""
    return Node(
        "ingest/source",
        STAGE,
        params=IngestParams().as_params(),
        external={"source": source.digest},
        args={"source_url": url, "files": {f.path: f.sha256 for f in source.files}},
    )


def node(
    source: SourceModel,
    source_dir: Path,
    hash_cache: Path,
    *,
    copy: bool = False,
    origin: dict[str, str] | None = None,
) -> Node:
    """The graph's one ingest node: keyed by the source's digest, hashed through `hash_cache`.

    The directories `source` was opened with (`--allow-outside`) travel in the node's args, so the
    stage checks the links it places against the same rule the plan did. `copy` (the recipe's
    `source_copy`) copies the files instead of linking them; `origin` (a hub repo and its pinned commit)
    goes into the output's provenance.
    """
    args: dict[str, object] = {
        "source_dir": str(source_dir),
        "hash_cache": str(hash_cache),
        "allowed_roots": [str(r) for r in source.allowed_roots],
        "files": {f.path: f.sha256 for f in source.files},
    }
    if origin is not None:
        args["origin"] = origin
    # Linked or copied, the output is the same files: `copy` keys another output only when it is asked for.
    return Node(
        "ingest/source",
        STAGE,
        params=IngestParams(copy=copy).as_params(),
        external={"source": source.digest},
        args=args,
    )


def unhashed_node(source: SourceModel, source_dir: Path, unhashed: list[str]) -> Node:
    """The ingest node `kiln plan` shows for a source some of whose files no ingest has hashed yet: planning reads
    headers, never the weights, so its key is not known; a build hashes the source once and keys it."""
    return Node(
        "ingest/source",
        STAGE,
        params=IngestParams().as_params(),
        external={"source": "unhashed"},
        args={"source_dir": str(source_dir), "unhashed": unhashed},
    )
