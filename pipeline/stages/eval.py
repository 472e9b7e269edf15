"""Eval stage: load one artifact in the runtime that serves it and compare it with the stored reference.

A runtime that kiln runs on the stage's device (transformers, the JAX forward, vLLM) is a compute stage,
placed on the build's device (`EvalParams.device`, `pipeline.placement`); the others run where they
always do (llama.cpp's CPU build). vLLM is placed too: on the CPU in its CPU build, on a GPU in its CUDA
build, over the GPUs the stage was granted (`eval.runtimes.vllm_runtime`).

transformers holds the artifact as the plan decided for the stage's memory budget (`node.requires.weights`,
`eval.runtimes.residency`): whole, or one layer at a time; either way its greedy agreement is teacher-forced
(`eval.run.measure`), so the weights are read once and the report is the same."""

from __future__ import annotations

from typing import Any

from kiln.core.errors import StageFailed
from kiln.eval.report import EvalReport
from kiln.eval.run import evaluate_artifact
from kiln.eval.runtimes.capabilities import vllm_capabilities
from kiln.eval.runtimes.environments import variant_for
from kiln.pipeline.placement import computes_on_device, stage_device
from kiln.pipeline.records import ArtifactRecord, EvalParams
from kiln.pipeline.requirements import Requirements, Sizing, eval_requirements, placed_kind
from kiln.pipeline.stage import Node, Stage, StageContext
from kiln.pipeline.stages.reference import stored_reference, stored_text


def run(ctx: StageContext) -> EvalReport:
    export = ctx.input("export")
    text = stored_text(ctx.input("reference"))
    p = EvalParams.model_validate(ctx.node.params)
    runtime = p.runtime
    runtimes = export.record(ArtifactRecord).runtimes
    if runtime not in runtimes:  # the plan asked the target; the export says what it wrote
        raise StageFailed(f"{ctx.node.id}: planned for runtime {runtime!r}, the export is served by {runtimes}")
    # A runtime that loads one file (llama.cpp) gets that file; one that loads a directory gets the directory.
    files = [f.path for f in export.files]
    artifact = export.files_dir / files[0] if len(files) == 1 else export.files_dir
    # `cuda` (every GPU the stage was granted: vLLM's tensor parallelism) or `cuda:N`, as placed.
    options: dict[str, object] = {"device": str(stage_device(ctx.node))} if computes_on_device(ctx.node) else {}
    if p.capabilities is not None:  # the verdict the plan keyed it by, for the runtime to check where it runs
        options["capabilities"] = p.capabilities
    if runtime == "transformers" and ctx.node.requires.weights is not None:
        options["residency"] = ctx.node.requires.weights  # whole or streamed, as the plan sized the stage
    record = export.record(ArtifactRecord)
    if runtime == "transformers" and record.passed_through is not None and record.dequantized is None:
        # Every quantized weight is the release's own, stored as released: its activation scheme is the release's
        # too, which the reference leaves out; the eval compares the weights (`leave_activations`).
        options["quantize_activations"] = False
    report = evaluate_artifact(
        stored_reference(ctx.input("reference")),
        runtime,
        artifact,
        text,
        p.gate,
        **options,
    )
    return report


def runtime_params(runtime: str, device: str = "cpu") -> dict[str, Any]:
    """What an eval node's params (`EvalParams`) say of the machine for `runtime` on the build's device kind,
    decided when the graph is planned: for vLLM on the CPU, what it can run on this CPU
    (`eval.runtimes.capabilities`), so another verdict is another key; on a GPU, the environment it runs in (its
    lock's digest)."""
    if runtime == "vllm" and device == "cuda":
        return {"environment": variant_for("vllm", "cuda").digest()}
    if runtime == "vllm":
        return {"capabilities": vllm_capabilities()}
    return {}


def needs(node: Node, sizing: Sizing) -> Requirements:
    """The artifact's quant in the runtime its target evaluates it with (`EvalParams.runtime`), on the device
    it was placed on (a serving runtime: on the plan's device, `pipeline.requirements.eval_requirements`)."""
    p = EvalParams.model_validate(node.params)
    return eval_requirements(sizing, p.runtime, p.quant, device=placed_kind(node))


STAGE = Stage(
    "eval",
    "6",
    run,
    EvalReport,
    "compare one artifact, in its own runtime, with the reference",
    needs=needs,
    params=EvalParams,
)
