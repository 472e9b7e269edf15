"""Legacy engine stage: a TensorRT engine for one trtllm artifact on one GPU SKU, built by a pinned
tensorrt_llm that still has trtllm-build, from the bf16 source with that release's own quantization.

Input: the ingested source (bf16). Params: the artifact, quant, SKU, the recipe's limits, the pin and
the exact command templates (`targets.trtllm.engines.legacy_commands`). The commands run on the
runner in a working directory, with `{examples}` the TensorRT-LLM checkout's `examples/` at the pinned
tag (`$TRTLLM_EXAMPLES`), `{source}` the ingested source, `{checkpoint}` and `{engine}` directories
of the stage; `{family}` is the architecture's converter (`CONVERTERS`). The engine is recorded as
quantized on the runner by that release (ModelOpt calibration for fp8 and int4_awq), not by kiln's
quantize stage: kiln's quantized checkpoint is not what that release's converters read.

On this machine (no tensorrt_llm, no NVIDIA GPU) the stage raises `Deferred` with the runner it needs
and the commands, so the plan, the build report and the registry show it as deferred to that runner;
nothing is built or published. That runner path has not been run here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any

from core.errors import Deferred, StageFailed
from core.hardware import PROFILES
from pipeline.records import ArtifactRecord, IngestRecord
from pipeline.requirements import runner_requirements
from pipeline.stage import Node, Stage, StageContext
from targets.trtllm.engines import CHECKPOINT, CONVERTERS, ENGINE, EXAMPLES, SOURCE, runner, runner_needs
from targets.trtllm.formats import FORMATS

FORMAT = "trtllm-engine"
EXAMPLES_ENV = "TRTLLM_EXAMPLES"


def deferral(node: Node) -> dict[str, Any] | None:
    """What this machine lacks to build `node`'s engine (runner, commands, missing), or None if nothing."""
    p = node.params
    needs = runner_needs(p, engine=True) or {"runner": runner(p["sku"], p["tensorrt_llm"]), "missing": []}
    if not os.environ.get(EXAMPLES_ENV):
        needs["missing"].append(f"${EXAMPLES_ENV} (TensorRT-LLM's examples/ at v{p['tensorrt_llm']}) is not set")
    if not needs["missing"]:
        return None
    return {**needs, "sku": p["sku"], "tensorrt_llm": p["tensorrt_llm"], "command": p["commands"]}


def engine_result(params: dict[str, Any], versions: dict[str, str], files: list[str]) -> ArtifactRecord:
    """The engine's record: an ArtifactRecord, like an export's, so it is published the same way.

    Its hardware is the SKU alone: an engine is tied to the GPU architecture and TensorRT version.
    """
    sku = params["sku"]
    hw = PROFILES[sku]
    why = f"engine built for {sku} ({hw.arch}) with TensorRT {versions['tensorrt']}; engines run on that SKU only"
    quantized_by = (
        f"tensorrt_llm {versions['tensorrt_llm']} examples/quantization/quantize.py (ModelOpt), on the runner"
        if params["quant"] != "bf16"
        else None
    )
    return ArtifactRecord(
        artifact=params["artifact"],
        target="trtllm",
        format=FORMAT,
        quant=params["quant"],
        hardware=[sku],
        unsupported={name: why for name in PROFILES if name != sku},
        runtime={
            "loaders": {"tensorrt_llm": f"=={versions['tensorrt_llm']} (TensorRT backend)"},
            "sku": sku,
            "compute_capability": hw.compute_capability,
            "tensorrt": versions["tensorrt"],
            "tensorrt_llm": versions["tensorrt_llm"],
            "limits": params["limits"],
            "quant_algo": FORMATS[params["quant"]].quant_algo,
            "quantized_by": quantized_by,
            "built_from": "the bf16 source",
        },
        runtime_name="tensorrt_llm",
        details={"commands": params["commands"], "files": files},
    )


def filled(commands: list[list[str]], places: dict[str, str]) -> list[list[str]]:
    """The command templates with their placeholders replaced (`{examples}`, `{source}`, ...)."""
    out = []
    for argv in commands:
        line = []
        for arg in argv:
            for key, value in places.items():
                arg = arg.replace(key, value)
            line.append(arg)
        out.append(line)
    return out


def run(ctx: StageContext) -> ArtifactRecord:
    p = ctx.node.params
    needs = deferral(ctx.node)
    if needs is not None:
        raise Deferred(
            f"{ctx.node.id}: deferred to a runner with {needs['runner']} ({'; '.join(needs['missing'])})",
            details=needs,
        )
    import tensorrt
    import tensorrt_llm

    versions = {"tensorrt": str(tensorrt.__version__), "tensorrt_llm": str(tensorrt_llm.__version__)}
    if versions["tensorrt_llm"] != p["tensorrt_llm"]:
        raise StageFailed(f"tensorrt_llm {versions['tensorrt_llm']} is installed, the recipe pins {p['tensorrt_llm']}")
    ingest = ctx.input("ingest")
    work = ctx.out_dir.parent / "work"
    work.mkdir()
    places = {
        EXAMPLES: os.environ[EXAMPLES_ENV],
        "{family}": CONVERTERS[ingest.record(IngestRecord).architecture],
        SOURCE: str(ingest.files_dir),
        CHECKPOINT: str(work / "checkpoint"),
        ENGINE: str(work / "engine"),
    }
    try:
        for argv in filled(p["commands"], places):
            done = subprocess.run(argv, cwd=work, capture_output=True, text=True)
            if done.returncode != 0:
                raise StageFailed(f"{argv[0]} {argv[1]} exited {done.returncode}: {done.stderr[-2000:]}")
        for f in sorted((work / "engine").iterdir()):
            shutil.move(str(f), ctx.out_dir / f.name)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return engine_result(p, versions, sorted(f.name for f in ctx.out_dir.iterdir()))


STAGE = Stage(
    "engine",
    "3",
    run,
    ArtifactRecord,
    "build a TensorRT engine per GPU SKU from the bf16 source, with a pinned release that has trtllm-build",
    deferral=deferral,
    needs=lambda node, sizing: runner_requirements(
        "engine", sizing, node.params["quant"], node.params["sku"], node.params["tensorrt_llm"]
    ),
)
