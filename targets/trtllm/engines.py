"""TensorRT-LLM on GPU runners, per SKU: evaluating the checkpoint there (the default), and legacy engines.

The per-SKU job of a trtllm artifact (`params.gpus`) loads the HF-format checkpoint kiln wrote with
tensorrt_llm's PyTorch backend (`LLM(model=DIR)`, what `trtllm-serve DIR` serves) on a GPU of that SKU
and evaluates it there against the same reference as every runtime (`eval.runtimes.tensorrt_llm_runtime`,
the `gpu-eval` stage). TensorRT-LLM's main branch removed the TensorRT engine backend (`trtllm-build`,
`convert_checkpoint`) from 2026-06-30 on (PRs #15763, #15767, #15907, #15918; its docs'
`legacy/tensorrt-backend-removal.md`): checkpoints load directly, with no build step. The pin must
be a release whose reader loads the checkpoint's QuantAlgo as kiln writes it
(`formats.MIN_PYTORCH_BACKEND`); an older one is refused when the recipe is read.

Legacy engines (`params.legacy_engines`, opt-in, for fleets still on a release with `trtllm-build`,
1.3.0rc20 at the latest) are not built from kiln's quantized checkpoint: that release's converters
quantize from bf16 themselves (ModelOpt calibration in `examples/quantization/quantize.py`), so an
engine is built from the bf16 source with that release's own quantization, on the runner, and recorded
so. The commands, as the pinned release's examples take them (examples/models/core/llama/README.md,
examples/quantization/quantize.py, tensorrt_llm/commands/build.py), with `{examples}` the runner's
TensorRT-LLM checkout's `examples/` at the pinned tag and the other `{...}` the stage's directories:

    bf16:      python3 {examples}/models/core/<converter>/convert_checkpoint.py --model_dir {source}
                   --output_dir {checkpoint} --dtype bfloat16 --tp_size 1  (gemma: its own flags)
    fp8:       python3 {examples}/quantization/quantize.py --model_dir {source} --dtype bfloat16
                   --qformat fp8 --kv_cache_dtype fp8 --calib_size 512 --output_dir {checkpoint} --tp_size 1
    w4a16-awq: python3 {examples}/quantization/quantize.py ... --qformat int4_awq --awq_block_size 128
                   --calib_size 32 ...
    then:      trtllm-build --checkpoint_dir {checkpoint} --output_dir {engine} --max_batch_size N
                   --max_input_len N --max_seq_len N <plugin flags>

The converter is the family's (`TargetMapping.trtllm_converter` in its architecture record: llama for Llama,
Mistral and Mixtral, qwen for Qwen2, gemma for Gemma 3, phi for Phi-3); Qwen3 and Qwen3-MoE have none (the
TensorRT backend never converted them: NVIDIA/TensorRT-LLM issues #5450, #5978) and are refused with that reason.

An engine is tied to the GPU architecture and the TensorRT version it was built with, so it is
offered to its SKU alone. Where the GPU or the pinned package is missing, either stage is deferred
to a runner that has them, with the exact commands, never faked. Neither has run here.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import shutil
import subprocess
from typing import TYPE_CHECKING, Any

from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput, UnknownName
from kiln.core.hardware import PROFILES
from kiln.targets.hf_bundle.export import DEFAULT_SHARD_BYTES
from kiln.targets.trtllm.formats import (
    ENGINE_REFUSED,
    ENGINE_SKUS,
    FORMATS,
    LAST_ENGINE_RELEASE,
    MIN_PYTORCH_BACKEND,
    algo_verdict,
)

if TYPE_CHECKING:
    from kiln.formats.architectures.shape import ModelShape

# What the per-SKU evaluation pins by default: the oldest release that loads every scheme kiln writes.
DEFAULT_PYTORCH_TENSORRT_LLM = max((v for v, _ in MIN_PYTORCH_BACKEND.values()), key=Version)
# What legacy engines pin by default: the last 0.x line, with trtllm-build.
DEFAULT_ENGINE_TENSORRT_LLM = "0.21.0"
_VERSION = r"^[0-9]+\.[0-9]+\.[0-9]+([.+-]?[A-Za-z0-9.]+)?$"
# The placeholders of the legacy commands (filled by the engine stage on its runner).
EXAMPLES, SOURCE, CHECKPOINT, ENGINE = "{examples}", "{source}", "{checkpoint}", "{engine}"
# How each examples/models/core/<converter>/convert_checkpoint.py takes the bf16 source and the checkpoint it writes,
# by converter (the family's `TargetMapping.trtllm_converter`): llama (Llama, Mistral, Mixtral), qwen and phi take
# --model_dir/--output_dir/--tp_size (their READMEs); gemma takes --ckpt-type hf --model-dir/--output-model-dir
# and --world-size (examples/models/core/gemma/README.md, "Run Gemma 3").
_MODEL_DIR_FLAGS = ("--model_dir", SOURCE, "--output_dir", CHECKPOINT, "--dtype", "bfloat16", "--tp_size", "1")
CONVERT_FLAGS: dict[str, tuple[str, ...]] = {
    "llama": _MODEL_DIR_FLAGS,
    "qwen": _MODEL_DIR_FLAGS,
    "phi": _MODEL_DIR_FLAGS,
    "gemma": (
        "--ckpt-type", "hf", "--model-dir", SOURCE, "--output-model-dir", CHECKPOINT,
        "--dtype", "bfloat16", "--world-size", "1",
    ),
}  # fmt: skip
# kiln scheme -> quantize.py's --qformat and its options (None: bf16, convert_checkpoint.py).
LEGACY_QFORMATS: dict[str, list[str] | None] = {
    "bf16": None,
    "fp8": ["--qformat", "fp8", "--kv_cache_dtype", "fp8", "--calib_size", "512"],
    "w4a16-awq": ["--qformat", "int4_awq", "--awq_block_size", "128", "--calib_size", "32"],
}
LEGACY_REFUSED: dict[str, str] = {
    "int4-rtn": "the pinned release's own int4 quantization is AWQ (int4_awq), not round-to-nearest: an engine "
    "would not be this scheme",
    "w4a16-gptq": "the pinned release's quantize.py has no GPTQ format: an engine would not be this scheme",
    "fp8-kv8": "the pinned release's quantize.py calibrates its own FP8 weight and KV-cache scales: its engine "
    "(--qformat fp8 --kv_cache_dtype fp8) is the fp8 scheme's legacy engine, not this checkpoint",
    "nvfp4-w4a4": "the pinned release's quantize.py calibrates its own NVFP4 scales (--qformat nvfp4): an engine "
    "would not be this checkpoint; the PyTorch backend loads the checkpoint itself on Blackwell",
    "nvfp4-w4a4-gptq": "the pinned release's quantize.py has no GPTQ format and calibrates its own NVFP4 scales: "
    "an engine would not be this checkpoint; the PyTorch backend loads the checkpoint itself on Blackwell",
    "mxfp4-experts": "a legacy engine is built from the bf16 source by convert_checkpoint.py or quantize.py's own "
    "quantization, neither of which writes the release's MXFP4 experts: an engine would not be this checkpoint; the "
    "PyTorch backend loads the release's own layout itself (Hopper and Blackwell)",
    **{q: f"{ENGINE_REFUSED[f.quant_algo]}" for q, f in FORMATS.items() if f.quant_algo in ENGINE_REFUSED},
}


def _version(value: str, field: str) -> Version:
    try:
        return Version(value)
    except InvalidVersion:
        raise ValueError(f"{field}: {value!r} is not a version") from None


class SkuList(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    skus: list[str] = Field(min_length=1)

    @field_validator("skus")
    @classmethod
    def _known_skus(cls, skus: list[str]) -> list[str]:
        for sku in skus:
            if sku not in ENGINE_SKUS:
                raise ValueError(f"unknown engine SKU {sku!r}; known: {', '.join(ENGINE_SKUS)}")
        if len(set(skus)) != len(skus):
            raise ValueError(f"skus repeats a name: {skus}")
        return skus


class GpuRunners(SkuList):
    """`params.gpus`: the SKUs on whose GPUs the checkpoint is loaded and evaluated (PyTorch backend)."""

    tensorrt_llm: str = Field(default=DEFAULT_PYTORCH_TENSORRT_LLM, pattern=_VERSION)

    @field_validator("tensorrt_llm")
    @classmethod
    def _parses(cls, v: str) -> str:
        _version(v, "tensorrt_llm")
        return v


class EngineMatrix(SkuList):
    """`params.legacy_engines`: which SKUs get a TensorRT engine, the limits it is built for, and a release
    that still has trtllm-build."""

    max_batch_size: int = Field(gt=0, le=4096)
    max_input_len: int = Field(gt=0)
    max_seq_len: int = Field(gt=0)
    tensorrt_llm: str = Field(default=DEFAULT_ENGINE_TENSORRT_LLM, pattern=_VERSION)

    @model_validator(mode="after")
    def _limits(self) -> EngineMatrix:
        if self.max_seq_len <= self.max_input_len:
            raise ValueError(
                f"max_seq_len ({self.max_seq_len}) must exceed max_input_len ({self.max_input_len}): "
                "it counts the prompt and the generated tokens"
            )
        if _version(self.tensorrt_llm, "tensorrt_llm") > Version(LAST_ENGINE_RELEASE):
            raise ValueError(
                f"tensorrt_llm {self.tensorrt_llm} has no trtllm-build: the TensorRT backend's last release is "
                f"{LAST_ENGINE_RELEASE}; use gpus: to evaluate the checkpoint on its PyTorch backend"
            )
        return self


class TrtllmParams(BaseModel):
    """The recipe's `params` for a trtllm entry."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_shard_bytes: int = Field(default=DEFAULT_SHARD_BYTES, gt=0)
    gpus: GpuRunners | None = None
    legacy_engines: EngineMatrix | None = None

    @model_validator(mode="before")
    @classmethod
    def _engines_renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "engines" in data:
            raise ValueError(
                "engines: TensorRT-LLM no longer builds engines (its TensorRT backend was removed after "
                f"{LAST_ENGINE_RELEASE}); gpus: {{skus: [...]}} evaluates the checkpoint on each SKU, and "
                "legacy_engines: {skus, max_batch_size, max_input_len, max_seq_len} builds engines with a "
                "release that still has trtllm-build"
            )
        return data


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
        raise InvalidInput(f"trtllm params: {problems}", code=Codes.TARGET_PARAMS) from None


def check_skus(quant: str, params: TrtllmParams) -> None:
    """Refuse a SKU that cannot serve `quant`, a pin too old to load it, and an engine kiln cannot build."""
    algo = FORMATS[quant].quant_algo
    skus = [*(params.gpus.skus if params.gpus else []), *(params.legacy_engines.skus if params.legacy_engines else [])]
    for sku in skus:
        verdict = algo_verdict(algo, PROFILES[sku])
        if not verdict.compatible:
            raise InvalidInput(
                f"trtllm-{quant} on {sku}: {verdict.reason}",
                code=Codes.ENGINE_SKU_INCOMPATIBLE,
                details={"quant": quant, "sku": sku, "reason": verdict.reason},
            )
    if params.gpus is not None and algo in MIN_PYTORCH_BACKEND:
        floor, why = MIN_PYTORCH_BACKEND[algo]
        if Version(params.gpus.tensorrt_llm) < Version(floor):
            raise InvalidInput(
                f"trtllm-{quant}: tensorrt_llm {params.gpus.tensorrt_llm} cannot load it; it needs >= {floor}: {why}",
                code=Codes.TENSORRT_LLM_TOO_OLD,
                details={"quant": quant, "pinned": params.gpus.tensorrt_llm, "minimum": floor},
            )
    if params.legacy_engines is not None and quant in LEGACY_REFUSED:
        raise InvalidInput(
            f"trtllm-{quant}: no legacy engine: {LEGACY_REFUSED[quant]}",
            code=Codes.ENGINE_UNSUPPORTED,
            details={"quant": quant},
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


def check_converter(shape: ModelShape, quant: str, params: TrtllmParams) -> None:
    """With legacy engines asked for: refuse a family no release kiln pins converts, with the record's reason."""
    mapping = shape.arch.target("trtllm")
    if params.legacy_engines is None or mapping.trtllm_converter is not None:
        return
    reason = mapping.trtllm_no_converter or f"kiln knows no TensorRT backend converter for {shape.architecture}"
    raise InvalidInput(
        f"trtllm-{quant}: no legacy engine for {shape.architecture} ({shape.family}): {reason}",
        code=Codes.ENGINE_UNSUPPORTED,
        details={"quant": quant, "architecture": shape.architecture, "reason": reason},
    )


def legacy_commands(quant: str, sku: str, matrix: EngineMatrix, converter: str) -> list[list[str]]:
    """The argv templates of one legacy engine: convert (with the family's `converter`) or quantize the bf16
    source, then trtllm-build."""
    options = LEGACY_QFORMATS[quant]
    if options is None:
        script = f"{EXAMPLES}/models/core/{converter}/convert_checkpoint.py"
        convert = ["python3", script, *CONVERT_FLAGS[converter]]
    else:
        convert = ["python3", f"{EXAMPLES}/quantization/quantize.py", "--model_dir", SOURCE, "--dtype", "bfloat16"]
        convert += [*options, "--output_dir", CHECKPOINT, "--tp_size", "1"]
    build = ["trtllm-build", "--checkpoint_dir", CHECKPOINT, "--output_dir", ENGINE]
    build += ["--max_batch_size", str(matrix.max_batch_size), "--max_input_len", str(matrix.max_input_len)]
    build += ["--max_seq_len", str(matrix.max_seq_len), *build_flags(quant, sku)]
    return [convert, build]


def runner(sku: str, pin: str) -> str:
    """The runner a per-SKU stage needs, in the words the plan and the report show."""
    return f"{sku} GPU with tensorrt_llm=={pin}"


def gpus_matching(nvidia_smi_csv: str, sku: str) -> list[str]:
    """GPU names in `nvidia-smi --query-gpu=name --format=csv,noheader` output that are the SKU's GPU."""
    # Word boundaries: "NVIDIA A100-SXM4-80GB" is an A100; "NVIDIA GH200 480GB" is not an H200.
    want = re.compile(rf"\b{ENGINE_SKUS[sku]}\b", re.IGNORECASE)
    return [line.strip() for line in nvidia_smi_csv.splitlines() if want.search(line)]


def runner_needs(params: dict[str, Any], *, engine: bool = False) -> dict[str, Any] | None:
    """What this machine lacks to run a per-SKU stage of `params` (sku, tensorrt_llm): the runner it needs,
    the SKU, its compute capability, the pin and what is missing; None when nothing is."""
    missing = missing_for(params["sku"], params["tensorrt_llm"], engine=engine)
    if not missing:
        return None
    return {
        "runner": runner(params["sku"], params["tensorrt_llm"]),
        "sku": params["sku"],
        "compute_capability": PROFILES[params["sku"]].compute_capability,
        "tensorrt_llm": params["tensorrt_llm"],
        "missing": missing,
    }


def missing_for(sku: str, pin: str, *, engine: bool = False) -> list[str]:
    """What this machine lacks to run tensorrt_llm `pin` on a GPU of `sku` (with trtllm-build when
    `engine`); empty: nothing."""
    missing = []
    if importlib.util.find_spec("tensorrt_llm") is None:
        missing.append("tensorrt_llm is not importable")
    else:
        have = importlib.metadata.version("tensorrt_llm")
        if have != pin:
            missing.append(f"tensorrt_llm {have} is installed; the recipe pins {pin}")
    if engine and shutil.which("trtllm-build") is None:
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
