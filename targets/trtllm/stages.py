"""The stages trtllm adds per artifact, declared as data (`targets.base.DerivedStage`), and the nodes of each.

- `GPU_EVAL` (`gpu-eval/<artifact>@<sku>`, per SKU of `params.gpus`): the checkpoint loaded by tensorrt_llm's
  PyTorch backend on a GPU of that SKU and compared with the stored reference there, as the eval stage
  compares every artifact on its runtime. Its report is published with the artifact as the eval of runtime
  `tensorrt_llm@<sku>`, beside the CPU one.
- `LEGACY_ENGINE` (`engine/<artifact>-<sku>`, per SKU of `params.legacy_engines`): a TensorRT engine built by
  a pinned tensorrt_llm that still has trtllm-build, from the bf16 source with that release's own
  quantization. Its params hold the exact command templates (`engines.legacy_commands`); they run on the
  runner in a scratch directory, with `{examples}` the TensorRT-LLM checkout's `examples/` at the pinned tag
  (`$TRTLLM_EXAMPLES`), `{source}` the ingested source, `{checkpoint}` and `{engine}` directories of the
  stage; the convert step is the family's converter's (`engines.CONVERT_FLAGS`). The engine is recorded as
  quantized on the runner by that release (ModelOpt calibration for fp8 and int4_awq), not by kiln's
  quantize stage: kiln's quantized checkpoint is not what that release's converters read.

The pipeline runs both (`pipeline.stages.derived`). On a machine without that GPU or that tensorrt_llm
(this one), `deferral` says what is missing, so the plan, the build report and the registry show the node
deferred to the runner it needs, with the commands; nothing is built or published. Neither runner path
has run here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import TYPE_CHECKING, Any

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput, StageFailed
from kiln.core.hardware import PROFILES
from kiln.targets.base import BuildRequest, DerivedArtifact, DerivedNode, DerivedStage
from kiln.targets.trtllm.engines import (
    CHECKPOINT,
    ENGINE,
    EXAMPLES,
    SOURCE,
    legacy_commands,
    parse_params,
    runner,
    runner_needs,
)
from kiln.targets.trtllm.formats import FORMATS

if TYPE_CHECKING:
    from kiln.formats.architectures.shape import ModelShape

ENGINE_FORMAT = "trtllm-engine"
EXAMPLES_ENV = "TRTLLM_EXAMPLES"
RUNTIME = "tensorrt_llm"


def engine_deferral(params: dict[str, Any]) -> dict[str, Any] | None:
    """What this machine lacks to build an engine of `params` (runner, commands, missing), or None if nothing."""
    needs = runner_needs(params, engine=True) or {"runner": runner(params["sku"], params[RUNTIME]), "missing": []}
    if not os.environ.get(EXAMPLES_ENV):
        needs["missing"].append(f"${EXAMPLES_ENV} (TensorRT-LLM's examples/ at v{params[RUNTIME]}) is not set")
    if not needs["missing"]:
        return None
    return {**needs, "sku": params["sku"], RUNTIME: params[RUNTIME], "command": params["commands"]}


def engine_artifact(params: dict[str, Any], versions: dict[str, str], files: list[str]) -> DerivedArtifact:
    """What an engine's manifest declares. Its hardware is the SKU alone: an engine is tied to the GPU
    architecture and TensorRT version."""
    sku = params["sku"]
    hw = PROFILES[sku]
    why = f"engine built for {sku} ({hw.arch}) with TensorRT {versions['tensorrt']}; engines run on that SKU only"
    quantized_by = (
        f"tensorrt_llm {versions['tensorrt_llm']} examples/quantization/quantize.py (ModelOpt), on the runner"
        if params["quant"] != "bf16"
        else None
    )
    return DerivedArtifact(
        target="trtllm",
        format=ENGINE_FORMAT,
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
        runtime_name=RUNTIME,
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


def build_engine(req: BuildRequest) -> DerivedArtifact:
    """Run the engine's commands on this runner, in `req.work_dir`, and move the engine into `req.out_dir`."""
    import tensorrt
    import tensorrt_llm

    p = req.params
    versions = {"tensorrt": str(tensorrt.__version__), "tensorrt_llm": str(tensorrt_llm.__version__)}
    if versions["tensorrt_llm"] != p[RUNTIME]:
        raise StageFailed(f"tensorrt_llm {versions['tensorrt_llm']} is installed, the recipe pins {p[RUNTIME]}")
    places = {
        EXAMPLES: os.environ[EXAMPLES_ENV],
        SOURCE: str(req.source_dir),
        CHECKPOINT: str(req.work_dir / "checkpoint"),
        ENGINE: str(req.work_dir / "engine"),
    }
    for argv in filled(p["commands"], places):
        done = subprocess.run(argv, cwd=req.work_dir, capture_output=True, text=True)
        if done.returncode != 0:
            raise StageFailed(f"{argv[0]} {argv[1]} exited {done.returncode}: {done.stderr[-2000:]}")
    for f in sorted((req.work_dir / "engine").iterdir()):
        shutil.move(str(f), req.out_dir / f.name)
    return engine_artifact(p, versions, sorted(f.name for f in req.out_dir.iterdir()))


GPU_EVAL = DerivedStage(
    kind="gpu-eval",
    code_version="1",
    description="evaluate a trtllm checkpoint with tensorrt_llm's PyTorch backend on one GPU SKU",
    runtime=RUNTIME,
    deferral=runner_needs,
)
LEGACY_ENGINE = DerivedStage(
    kind="engine",
    code_version="5",
    description="build a TensorRT engine per GPU SKU from the bf16 source, with a pinned release that has trtllm-build",
    runtime=RUNTIME,
    deferral=engine_deferral,
    build=build_engine,
)


def derived_nodes(name: str, quant: str, params: dict[str, Any], shape: ModelShape) -> list[DerivedNode]:
    """`TargetSpec.derived`: a GPU eval of export `name` per SKU of `params.gpus`, and a legacy engine per
    SKU of `params.legacy_engines` (built from the bf16 source, so its input is the ingest, not the export,
    with the family's converter)."""
    parsed = parse_params(params)
    nodes: list[DerivedNode] = []
    if parsed.gpus is not None:
        nodes += [
            DerivedNode(
                stage=GPU_EVAL,
                name=f"{name}@{sku}",
                params={
                    "artifact": name,
                    "quant": quant,
                    "runtime": RUNTIME,
                    "sku": sku,
                    RUNTIME: parsed.gpus.tensorrt_llm,
                },
                inputs=("reference", "export"),
                evaluates=name,
            )
            for sku in parsed.gpus.skus
        ]
    matrix = parsed.legacy_engines
    if matrix is not None:
        converter = shape.arch.target("trtllm").trtllm_converter
        if converter is None:  # refused at plan time (`engines.check_converter`); never planned
            raise InvalidInput(f"no TensorRT backend converter for {shape.architecture}", code=Codes.ENGINE_UNSUPPORTED)
        limits = {
            "max_batch_size": matrix.max_batch_size,
            "max_input_len": matrix.max_input_len,
            "max_seq_len": matrix.max_seq_len,
        }
        nodes += [
            DerivedNode(
                stage=LEGACY_ENGINE,
                name=f"{name}-{sku}",
                params={
                    "artifact": f"{name}-{sku}",
                    "quant": quant,
                    "sku": sku,
                    "limits": limits,
                    RUNTIME: matrix.tensorrt_llm,
                    "commands": legacy_commands(quant, sku, matrix, converter),
                },
                inputs=("ingest",),
            )
            for sku in matrix.skus
        ]
    return nodes
