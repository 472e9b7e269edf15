"""Derived stages: the stages a target adds per artifact, run from what the target declares.

A target declares each as data (`targets.base.DerivedStage`: its name, code version, the runtime its GPU
runner pins, what this machine lacks for it, and for one that makes an artifact, how it builds), as it
declares its export; `stage_of` makes the stage from it, once. Two shapes:

- one that evaluates: inputs the reference and the export; the export loaded in the stage's runtime and
  compared with the stored reference, as the eval stage compares every artifact, judged by the node's
  gate (`targets.trtllm.stages.GPU_EVAL`). Its report is published with the artifact under
  `<runtime>@<sku>` (`pipeline.build.eval_column`).
- one that makes an artifact: input the ingest; the target's `build` writes the artifact's files from the
  ingested source, and its record is an `ArtifactRecord` like an export's, published the same way
  (`targets.trtllm.stages.LEGACY_ENGINE`).

Either runs on a GPU runner of its node's SKU with the runtime pinned (`pipeline.requirements.
runner_requirements`); where this machine lacks that, the stage raises `Deferred` with what the target's
`deferral` says (the runner, what is missing), so the plan, the build report and the workflow's matrix
show it waiting for that runner.
"""

from __future__ import annotations

import functools
import shutil
from typing import Any

from kiln.core.errors import Deferred
from kiln.eval.report import EvalReport
from kiln.eval.run import evaluate_artifact
from kiln.pipeline.records import ArtifactRecord, DerivedParams, IngestRecord
from kiln.pipeline.requirements import Requirements, Sizing, runner_requirements
from kiln.pipeline.stage import Node, Stage, StageContext
from kiln.pipeline.stages.reference import stored_reference, stored_text
from kiln.targets.base import BuildRequest, DerivedArtifact, DerivedStage


def deferral(derived: DerivedStage, node: Node) -> dict[str, Any] | None:
    """What this machine lacks to run `node` (the runner it needs, what is missing), or None if nothing. The
    target's `deferral` reads the params it declared (`DerivedParams`, checked here first) as JSON."""
    return derived.deferral(DerivedParams.model_validate(node.params).as_params())


def _on_runner(ctx: StageContext) -> None:
    """Deferred, naming the runner, where this machine is not one that can run the node."""
    lacks = ctx.node.stage.lacks(ctx.node)
    if lacks is not None:
        raise Deferred(lacks[0], details=lacks[1])


def evaluate(derived: DerivedStage, ctx: StageContext) -> EvalReport:
    """The export, in the stage's runtime on this runner, compared with the stored reference."""
    _on_runner(ctx)
    gate = DerivedParams.model_validate(ctx.node.params).gate
    if gate is None:
        raise ValueError(f"{ctx.node.id}: an eval on a runner is judged by a gate, and its params have none")
    export = ctx.input("export")
    text = stored_text(ctx.input("reference"))
    return evaluate_artifact(
        stored_reference(ctx.input("reference")),
        derived.runtime,
        export.files_dir,
        text,
        gate,
    )


def build(derived: DerivedStage, ctx: StageContext) -> ArtifactRecord:
    """The target's artifact, built on this runner from the ingested source, with its record."""
    assert derived.build is not None
    _on_runner(ctx)
    p = DerivedParams.model_validate(ctx.node.params)
    ingest = ctx.input("ingest")
    work = ctx.out_dir.parent / "work"
    work.mkdir()
    try:
        made = derived.build(
            BuildRequest(p.as_params(), ingest.files_dir, ingest.record(IngestRecord).architecture, ctx.out_dir, work)
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return artifact_record(p, made)


def artifact_record(params: DerivedParams, made: DerivedArtifact) -> ArtifactRecord:
    """A derived artifact's record, as an export's: its name and quant from the node's params."""
    return ArtifactRecord(
        name=params.artifact,
        target=made.target,
        format=made.format,
        quant=params.quant,
        hardware=made.hardware,
        unsupported=made.unsupported,
        runtime=made.runtime,
        runtime_name=made.runtime_name,
        details=made.details,
    )


def needs(derived: DerivedStage, node: Node, sizing: Sizing) -> Requirements:
    """A replica of the artifact on GPUs of the node's SKU (as many as its weights need), with the runtime
    pinned as its params say; an eval also holds the comparison on the host."""
    p = DerivedParams.model_validate(node.params)
    host = sizing.compare_bytes if derived.build is None else 0
    return runner_requirements(sizing, derived.runtime, p.quant, p.sku, p.pinned(derived.runtime), host=host)


@functools.cache
def stage_of(derived: DerivedStage) -> Stage:
    """The stage that runs a target's `derived` nodes: one per declaration, so every node of it shares it."""
    return Stage(
        derived.kind,
        derived.code_version,
        functools.partial(evaluate if derived.build is None else build, derived),
        EvalReport if derived.build is None else ArtifactRecord,
        derived.description,
        deferral=functools.partial(deferral, derived),
        needs=functools.partial(needs, derived),
        params=DerivedParams,
    )
