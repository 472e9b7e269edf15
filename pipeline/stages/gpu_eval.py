"""GPU eval stage: a trtllm checkpoint loaded by tensorrt_llm's PyTorch backend on one GPU SKU, and compared
with the stored reference there, as the eval stage compares every artifact on its runtime.

Inputs: the reference and the trtllm export. Params: the artifact, quant, SKU, the pinned tensorrt_llm
and the gate (`targets.trtllm.engines`). On a machine without that GPU or that tensorrt_llm the stage
raises `Deferred` with the runner it needs, so the plan, the build report and the workflow's matrix
show it waiting for that runner. Its report is published with the artifact as the eval of runtime
`tensorrt_llm@<sku>` (`pipeline.stages.publish`), beside the CPU one. That runner path has not been run here.
"""

from __future__ import annotations

from typing import Any

from core.errors import Deferred
from eval.gates import Gate
from eval.report import EvalReport
from eval.run import evaluate_artifact
from pipeline.requirements import Requirements, Sizing, runner_requirements
from pipeline.stage import Node, Stage, StageContext
from pipeline.stages.reference import stored_reference, stored_text
from targets.trtllm.engines import runner_needs


def deferral(node: Node) -> dict[str, Any] | None:
    """What this machine lacks to evaluate on `node`'s SKU (runner, missing), or None if nothing."""
    return runner_needs(node.params)


def run(ctx: StageContext) -> EvalReport:
    needs = deferral(ctx.node)
    if needs is not None:
        raise Deferred(
            f"{ctx.node.id}: deferred to a runner with {needs['runner']} ({'; '.join(needs['missing'])})",
            details=needs,
        )
    export = ctx.input("export")
    text = stored_text(ctx.input("reference"))
    return evaluate_artifact(
        stored_reference(ctx.input("reference")),
        "tensorrt_llm",
        export.files_dir,
        text,
        Gate(**ctx.node.params["gate"]),
    )


def needs(node: Node, sizing: Sizing) -> Requirements:
    """A replica of the checkpoint on GPUs of the node's SKU (as many as its weights need), with the pinned
    tensorrt_llm."""
    p = node.params
    return runner_requirements("gpu-eval", sizing, p["quant"], p["sku"], p["tensorrt_llm"])


STAGE = Stage(
    "gpu-eval",
    "1",
    run,
    EvalReport,
    "evaluate a trtllm checkpoint with tensorrt_llm's PyTorch backend on one GPU SKU",
    deferral=deferral,
    needs=needs,
)
