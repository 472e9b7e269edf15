"""Engine stage: a TensorRT engine for one trtllm checkpoint on one GPU SKU, built with trtllm-build.

Input: the trtllm export (the HF-format checkpoint). Params: the artifact, quant, SKU, the recipe's
limits, the pinned tensorrt_llm and the exact trtllm-build argv (`targets.trtllm.engines`).

On this machine (no tensorrt_llm, no NVIDIA GPU) the stage raises `Deferred` with the runner it needs
and the command, so the plan, the build report and the registry show it as deferred to that runner;
nothing is built or published. On a runner with the SKU's GPU and the pinned tensorrt_llm it
converts the checkpoint with tensorrt_llm's own API, runs trtllm-build, and records the SKU, compute
capability and the TensorRT and TensorRT-LLM versions; the artifact's hardware is that SKU alone.
That runner path has not been run here.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

from core.errors import Deferred, StageFailed
from core.hardware import PROFILES
from pipeline.records import ArtifactRecord
from pipeline.requirements import requirements
from pipeline.stage import Node, Stage, StageContext
from targets.trtllm.engines import CHECKPOINT_DIR, ENGINE_DIR, missing_for, runner
from targets.trtllm.formats import FORMATS

FORMAT = "trtllm-engine"


def deferral(node: Node) -> dict[str, Any] | None:
    """What this machine lacks to build `node`'s engine (runner, command, missing), or None if nothing."""
    p = node.params
    missing = missing_for(p["sku"], p["tensorrt_llm"])
    if not missing:
        return None
    return {
        "runner": runner(p["sku"], p["tensorrt_llm"]),
        "sku": p["sku"],
        "compute_capability": PROFILES[p["sku"]].compute_capability,
        "tensorrt_llm": p["tensorrt_llm"],
        "command": p["command"],
        "missing": missing,
    }


def engine_result(params: dict[str, Any], versions: dict[str, str], files: list[str]) -> ArtifactRecord:
    """The engine's record: an ArtifactRecord, like an export's, so it is published the same way.

    Its hardware is the SKU alone: an engine is tied to the GPU architecture and TensorRT version.
    """
    sku = params["sku"]
    hw = PROFILES[sku]
    why = f"engine built for {sku} ({hw.arch}) with TensorRT {versions['tensorrt']}; engines run on that SKU only"
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
        },
        runtime_name="tensorrt_llm",
        details={"command": params["command"], "files": files},
    )


def convert_checkpoint(hf_dir: Path, checkpoint_dir: Path, quant: str) -> None:
    """The HF-format checkpoint -> a TensorRT-LLM checkpoint, with tensorrt_llm's own converter (runner only)."""
    from tensorrt_llm.models.automodel import AutoModelForCausalLM
    from tensorrt_llm.models.modeling_utils import QuantConfig

    algo = FORMATS[quant].quant_algo
    quant_config = QuantConfig(quant_algo=algo, group_size=128 if algo == "W4A16_AWQ" else None)
    model_cls = AutoModelForCausalLM.get_trtllm_model_class(str(hf_dir))
    model = model_cls.from_hugging_face(str(hf_dir), dtype="bfloat16", quant_config=quant_config)
    model.save_checkpoint(str(checkpoint_dir), save_config=True)


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

    work = ctx.out_dir.parent / "work"
    work.mkdir()
    try:
        convert_checkpoint(ctx.input("export").files_dir, work / CHECKPOINT_DIR, p["quant"])
        done = subprocess.run(p["command"], cwd=work, capture_output=True, text=True)
        if done.returncode != 0:
            raise StageFailed(f"trtllm-build exited {done.returncode}: {done.stderr[-2000:]}")
        for f in sorted((work / ENGINE_DIR).iterdir()):
            shutil.move(str(f), ctx.out_dir / f.name)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    versions = {"tensorrt": str(tensorrt.__version__), "tensorrt_llm": str(tensorrt_llm.__version__)}
    if versions["tensorrt_llm"] != p["tensorrt_llm"]:
        raise StageFailed(f"built with tensorrt_llm {versions['tensorrt_llm']}, the recipe pins {p['tensorrt_llm']}")
    return engine_result(p, versions, sorted(f.name for f in ctx.out_dir.iterdir()))


STAGE = Stage(
    "engine",
    "2",
    run,
    ArtifactRecord,
    "build a TensorRT engine for one trtllm checkpoint on one GPU SKU (trtllm-build)",
    deferral=deferral,
    needs=lambda node, size: requirements(
        "engine", size, runtime="tensorrt_llm", sku=node.params["sku"], version=node.params["tensorrt_llm"]
    ),
)
