"""TensorRT engines per GPU SKU: the recipe's build matrix, the trtllm-build command, and the runner it needs.

An engine is tied to the GPU architecture and the TensorRT version it was built with, so kiln builds
one per SKU and offers it to that SKU alone. The build needs a pinned tensorrt_llm that still ships
`trtllm-build` (the TensorRT backend; releases from 2026 on have only the PyTorch backend) and a GPU
of that SKU. Where either is missing the engine stage is deferred to a runner that has them, with
the exact commands, never faked.

trtllm-build's arguments: tensorrt_llm/commands/build.py (`--checkpoint_dir`, `--output_dir`,
`--max_batch_size`, `--max_input_len`, `--max_seq_len`, and the plugin options of
tensorrt_llm/plugin/plugin.py such as `--gemm_plugin` and `--use_fp8_context_fmha`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import shutil
import subprocess
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from core.errors import InvalidInput, UnknownName
from core.hardware import PROFILES
from targets.base import DerivedArtifact
from targets.hf_bundle.export import DEFAULT_SHARD_BYTES
from targets.trtllm.formats import ENGINE_REFUSED, ENGINE_SKUS, FORMATS, algo_verdict

# The last tensorrt_llm line kiln pins for engines: it still has trtllm-build and the TensorRT backend.
DEFAULT_TENSORRT_LLM = "0.21.0"
_VERSION = r"^[0-9]+\.[0-9]+\.[0-9]+([.+-]?[A-Za-z0-9.]+)?$"
# Paths inside the engine stage's working directory (the commands are the same in plan, report and run).
CHECKPOINT_DIR = "trtllm-checkpoint"
ENGINE_DIR = "engine"


class EngineMatrix(BaseModel):
    """`params.engines` of a trtllm entry: which SKUs get an engine, and the limits it is built for."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    skus: list[str] = Field(min_length=1)
    max_batch_size: int = Field(gt=0, le=4096)
    max_input_len: int = Field(gt=0)
    max_seq_len: int = Field(gt=0)
    tensorrt_llm: str = Field(default=DEFAULT_TENSORRT_LLM, pattern=_VERSION)

    @field_validator("skus")
    @classmethod
    def _known_skus(cls, skus: list[str]) -> list[str]:
        for sku in skus:
            if sku not in ENGINE_SKUS:
                raise ValueError(f"unknown engine SKU {sku!r}; known: {', '.join(ENGINE_SKUS)}")
        if len(set(skus)) != len(skus):
            raise ValueError(f"skus repeats a name: {skus}")
        return skus

    @model_validator(mode="after")
    def _limits(self) -> EngineMatrix:
        if self.max_seq_len <= self.max_input_len:
            raise ValueError(
                f"max_seq_len ({self.max_seq_len}) must exceed max_input_len ({self.max_input_len}): "
                "it counts the prompt and the generated tokens"
            )
        return self


class TrtllmParams(BaseModel):
    """The recipe's `params` for a trtllm entry."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_shard_bytes: int = Field(default=DEFAULT_SHARD_BYTES, gt=0)
    engines: EngineMatrix | None = None


def parse_params(params: dict[str, Any]) -> TrtllmParams:
    """Validated params; an unknown SKU lists the known ones."""
    try:
        return TrtllmParams.model_validate(params)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or 'params'}: {err['msg'].removeprefix('Value error, ')}"
            for err in e.errors()
        )
        if any("unknown engine SKU" in err["msg"] for err in e.errors()):
            raise UnknownName(f"trtllm params: {problems}", details={"known": list(ENGINE_SKUS)}) from None
        raise InvalidInput(f"trtllm params: {problems}", code="TARGET_PARAMS") from None


def check_engine_skus(quant: str, matrix: EngineMatrix) -> None:
    """Refuse an engine SKU that cannot serve `quant`, naming the SKU and the reason."""
    algo = FORMATS[quant].quant_algo
    if algo in ENGINE_REFUSED:
        raise InvalidInput(
            f"trtllm-{quant}: no engines for {algo}: {ENGINE_REFUSED[algo]}",
            code="ENGINE_UNSUPPORTED",
            details={"quant": quant, "quant_algo": algo},
        )
    for sku in matrix.skus:
        verdict = algo_verdict(algo, PROFILES[sku])
        if not verdict.compatible:
            raise InvalidInput(
                f"trtllm-{quant} engine for {sku}: {verdict.reason}",
                code="ENGINE_SKU_INCOMPATIBLE",
                details={"quant": quant, "sku": sku, "reason": verdict.reason},
            )


def build_flags(quant: str, sku: str) -> list[str]:
    """trtllm-build options for `quant` on `sku`: GEMM plugin dtype and, for FP8 on Hopper, FP8 context FMHA."""
    algo = FORMATS[quant].quant_algo
    flags = ["--gpt_attention_plugin", "auto", "--kv_cache_type", "paged"]
    if algo is None:
        return [*flags, "--gemm_plugin", "bfloat16"]
    if algo.startswith("FP8"):
        # FP8 context attention runs on Hopper's FP8 FMHA kernels; the GEMMs follow the checkpoint (auto).
        fmha = ["--use_fp8_context_fmha", "enable"] if PROFILES[sku].arch == "sm90" else []
        return [*flags, "--gemm_plugin", "auto", *fmha]
    # Weight-only int4: the groupwise weight-only plugin is chosen from the checkpoint's quant config.
    return [*flags, "--gemm_plugin", "auto"]


def build_command(quant: str, sku: str, matrix: EngineMatrix) -> list[str]:
    """The trtllm-build argv for one engine, run in the engine stage's working directory."""
    return [
        "trtllm-build",
        "--checkpoint_dir",
        CHECKPOINT_DIR,
        "--output_dir",
        ENGINE_DIR,
        "--max_batch_size",
        str(matrix.max_batch_size),
        "--max_input_len",
        str(matrix.max_input_len),
        "--max_seq_len",
        str(matrix.max_seq_len),
        *build_flags(quant, sku),
    ]


def engine_artifacts(name: str, quant: str, params: dict[str, Any]) -> list[DerivedArtifact]:
    """One engine per SKU of `params.engines` (none without it), each built from the export `name`."""
    matrix = parse_params(params).engines
    if matrix is None:
        return []
    limits = {
        "max_batch_size": matrix.max_batch_size,
        "max_input_len": matrix.max_input_len,
        "max_seq_len": matrix.max_seq_len,
    }
    return [
        DerivedArtifact(
            kind="engine",
            artifact=f"{name}-{sku}",
            params={
                "artifact": f"{name}-{sku}",
                "quant": quant,
                "sku": sku,
                "limits": limits,
                "tensorrt_llm": matrix.tensorrt_llm,
                "command": build_command(quant, sku, matrix),
            },
        )
        for sku in matrix.skus
    ]


def runner(sku: str, pin: str) -> str:
    """The runner an engine needs, in the words the plan and the report show."""
    return f"{sku} GPU with tensorrt_llm=={pin}"


def gpus_matching(nvidia_smi_csv: str, sku: str) -> list[str]:
    """GPU names in `nvidia-smi --query-gpu=name --format=csv,noheader` output that are the SKU's GPU."""
    # Word boundaries: "NVIDIA A100-SXM4-80GB" is an A100; "NVIDIA GH200 480GB" is not an H200.
    want = re.compile(rf"\b{ENGINE_SKUS[sku]}\b", re.IGNORECASE)
    return [line.strip() for line in nvidia_smi_csv.splitlines() if want.search(line)]


def missing_for(sku: str, pin: str) -> list[str]:
    """What this machine lacks to build an engine for `sku` with tensorrt_llm `pin` (empty: nothing)."""
    missing = []
    if importlib.util.find_spec("tensorrt_llm") is None:
        missing.append("tensorrt_llm is not importable")
    else:
        have = importlib.metadata.version("tensorrt_llm")
        if have != pin:
            missing.append(f"tensorrt_llm {have} is installed; the recipe pins {pin}")
    if shutil.which("trtllm-build") is None:
        missing.append("trtllm-build is not on PATH")
    smi = shutil.which("nvidia-smi")
    if smi is None:
        missing.append("nvidia-smi is not on PATH (no NVIDIA GPU)")
    else:
        out = subprocess.run(
            [smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=60
        )
        if out.returncode != 0 or not gpus_matching(out.stdout, sku):
            found = ", ".join(out.stdout.split("\n")).strip(", ") or out.stderr.strip() or "none"
            missing.append(f"no {ENGINE_SKUS[sku]} GPU (nvidia-smi: {found})")
    return missing
