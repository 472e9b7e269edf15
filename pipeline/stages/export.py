"""Export stage: one target's artifact for one quant, written by the target's export function.

Exports of a quant the target lists in `quantized_input` also get the shared quantize stage's
output; every other export reads only the ingested source. What the target wrote is then linted by the
target's own lint (`TargetSpec.lint`, `targets.lint`) against the source's config: an error-level finding
fails the stage (ArtifactLintFailed, its code the finding's, naming the tensor) before anything downstream
evaluates or publishes the artifact.
"""

from __future__ import annotations

from kiln.pipeline.records import ArtifactRecord, ExportParams, PreparedRecord
from kiln.pipeline.requirements import Requirements, Sizing, streamed_requirements
from kiln.pipeline.stage import Node, Stage, StageContext
from kiln.pipeline.stages.ingest import open_ingested
from kiln.targets.base import ExportRequest, get_target
from kiln.targets.lint import LintRequest


def run(ctx: StageContext) -> ArtifactRecord:
    p = ExportParams.model_validate(ctx.node.params)
    spec = get_target(p.target)
    quantized = None
    if p.quant in spec.quantized_input:
        from kiln.pipeline.stages.quantize import open_output

        quantized = open_output(ctx.input("quantized"))
    prepared = ctx.record("prepared", PreparedRecord).data if "prepared" in ctx.inputs else None
    source = open_ingested(ctx.input("ingest"))
    shape = source.shape
    total = sum(t.nbytes for t in source.tensors.values())
    try:
        result = spec.export(
            source,
            ExportRequest(
                quant=p.quant,
                out_dir=ctx.out_dir,
                params=p.params,
                model_name=p.model,
                on_progress=lambda n: ctx.progress(n, total),
                quantized=quantized,
                prepared=prepared,
            ),
        )
    finally:
        source.close()
    produced = sorted(x.relative_to(ctx.out_dir).as_posix() for x in ctx.out_dir.rglob("*") if x.is_file())
    if produced != sorted(result.files):
        raise RuntimeError(f"target {spec.name} reported files {result.files} but wrote {produced}")
    details = result.details
    if spec.lint is not None:
        report = spec.lint(LintRequest(ctx.out_dir, shape=shape, quant=p.quant))
        report.raise_for_errors(ctx.node.id)
        details = {**details, "lint": report.summary()}
    # Per artifact: a target's schemes may run on different hardware (fp8 needs sm89+), and a source may narrow them
    # (the export's own verdicts, which then give the reasons too); the recipe may narrow it further.
    served = result.served()
    hardware = list(served) if served is not None else list(spec.hardware)
    if p.hardware is not None:
        hardware = [hw for hw in hardware if hw in p.hardware]
    verdicts = result.verdicts if result.verdicts is not None else spec.compatibility(p.quant, p.params)
    unsupported = {
        hw: v.reason if not v.compatible else "not among the hardware the recipe builds this artifact for"
        for hw, v in verdicts.items()
        if hw not in hardware
    }
    return ArtifactRecord(
        name=p.artifact,
        target=spec.name,
        format=spec.format,
        quant=p.quant,
        hardware=hardware,
        unsupported=unsupported,
        runtime=result.runtime,
        runtime_name=(result.eval_runtimes or spec.runtimes_for(p.quant))[0],
        eval_runtimes=list(result.eval_runtimes or spec.runtimes_for(p.quant)),
        details=details,
        passed_through=result.passed_through,
        dequantized=result.dequantized,
    )


# 7: the artifact is linted, and its record says so (`details.lint`)
def needs(node: Node, sizing: Sizing) -> Requirements:
    """An export streams a tensor at a time on the CPU, holding its target's `export_tensor_copies` of the largest."""
    p = ExportParams.model_validate(node.params)
    return streamed_requirements("export", sizing, get_target(p.target).export_copies(p.quant))


def hint(node: Node) -> str:
    """What to try when an export fails: the target's other quants, and other targets, build without this one."""
    p = ExportParams.model_validate(node.params)
    return f"without {p.quant} in {p.target}'s quants, the recipe's other artifacts build"


STAGE = Stage(
    "export",
    "8",
    run,
    ArtifactRecord,
    "write one target's artifact for one quant",
    needs=needs,
    hint=hint,
    params=ExportParams,
)
