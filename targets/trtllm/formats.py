"""Per kiln scheme: the checkpoint layout TensorRT-LLM documents for it, and the GPUs that run it, as data.

| scheme                    | TensorRT-LLM QuantAlgo    | written as                        | eval here                |
|---------------------------|---------------------------|-----------------------------------|--------------------------|
| bf16                      | (none)                    | plain HF checkpoint               | transformers, vLLM (CPU) |
| fp8                       | FP8_PER_CHANNEL_PER_TOKEN | compressed-tensors in config.json | transformers, vLLM (CPU) |
| fp8-kv8                   | FP8_PER_CHANNEL_PER_TOKEN | as fp8, with its kv_cache_scheme  | transformers, vLLM (CPU) |
| fp8-block                 | FP8_BLOCK_SCALES          | compressed-tensors in config.json | transformers, vLLM (CPU) |
| int4-rtn, w4a16-gptq/-awq | W4A16_AWQ                 | hf_quant_config.json, ModelOpt    | deferred (GPU)           |
| nvfp4-w4a4 (-gptq)        | NVFP4                     | hf_quant_config.json, ModelOpt    | deferred (GPU, sm100)    |
| mxfp4-experts             | MXFP4 (by GPU, see below) | the release's own layout          | transformers, vLLM (CPU) |

mxfp4-experts is gpt-oss's MXFP4 release as released (config.json's `quant_method: mxfp4`), which TensorRT-LLM reads
as W4A16_MXFP4 below sm100 and W4A8_MXFP4_MXFP8 from sm100 (`RELEASE_ALGOS`, `ALGO_ARCHES`' MXFP4 row).

Why W4A16_AWQ for all three int4 schemes: TensorRT-LLM's compressed-tensors reader has no weight-only
int branch (`quant_config_utils.py`), and its PyTorch backend builds per-group int4 Linears only
through `W4A16_AWQ_LinearMethod` (`get_quant_method` in `_torch/modules/linear.py`), which computes
(x * pre_quant_scale) @ (int4 * scale) with no zero point. kiln's int4 schemes are symmetric (no zero
point) with AWQ's smoothing already folded into the weights, so each is that layout with
pre_quant_scale = 1; the scheme's own method (rtn, gptq, awq) is recorded in the manifest.

NVFP4 is compressed-tensors' NVFP4 renamed and its tensor scales inverted (ModelOpt's `weight_scale_2` and
`input_scale` are compressed-tensors' `1 / weight_global_scale` and `1 / input_global_scale`; the packed E2M1
bytes and the E4M3 block scales are the same, low nibble first): the mapping compressed-tensors' own
ModelOpt converter (`ModelOptNvfp4Converter`) undoes, which a test runs on kiln's checkpoint.
TensorRT-LLM's `NVFP4LinearMethod` asserts that q/k/v and gate/up share their `weight_scale_2` and
`input_scale` exactly; llm-compressor shares the weight scales across those groups and observes one input
for each, and the export refuses a checkpoint where they differ.

Hardware: the "Hardware Support Matrix" of TensorRT-LLM's docs/source/features/quantization.md
(FP8 rowwise on Hopper; FP8 block scaling on Hopper and Blackwell sm100; W4A16 AWQ on Ampere, Ada,
Hopper; NVFP4 and MXFP4 on Blackwell), with compute capabilities from `core.hardware`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kiln.core.hardware import PROFILES, HardwareProfile
from kiln.quant.schemes import Verdict

# release: the pre-quantized release's own layout, its bytes and config.json's quantization_config as released.
Layout = Literal["dense", "compressed-tensors", "modelopt", "release"]
DOCS = "TensorRT-LLM docs/source/features/quantization.md"


@dataclass(frozen=True)
class TrtllmFormat:
    """How one kiln scheme is written for TensorRT-LLM and which runtime evaluates it here."""

    quant_algo: str | None
    layout: Layout
    # transformers and vLLM (numerics on CPU) or tensorrt_llm only (deferred to a GPU runner)
    eval_runtimes: tuple[str, ...]


FORMATS: dict[str, TrtllmFormat] = {
    "bf16": TrtllmFormat(None, "dense", ("transformers", "vllm")),
    "fp8": TrtllmFormat("FP8_PER_CHANNEL_PER_TOKEN", "compressed-tensors", ("transformers", "vllm")),
    "fp8-block": TrtllmFormat("FP8_BLOCK_SCALES", "compressed-tensors", ("transformers", "vllm")),
    # kv_cache_scheme in config.json becomes kv_cache_quant_algo FP8 (update_quant_config_from_compressed_tensors).
    "fp8-kv8": TrtllmFormat("FP8_PER_CHANNEL_PER_TOKEN", "compressed-tensors", ("transformers", "vllm")),
    "int4-rtn": TrtllmFormat("W4A16_AWQ", "modelopt", ("tensorrt_llm",)),
    "w4a16-gptq": TrtllmFormat("W4A16_AWQ", "modelopt", ("tensorrt_llm",)),
    "w4a16-awq": TrtllmFormat("W4A16_AWQ", "modelopt", ("tensorrt_llm",)),
    "nvfp4-w4a4": TrtllmFormat("NVFP4", "modelopt", ("tensorrt_llm",)),
    "nvfp4-w4a4-gptq": TrtllmFormat("NVFP4", "modelopt", ("tensorrt_llm",)),
    # gpt-oss's MXFP4 experts as released (`quant_method: mxfp4`), which its model class reads (`RELEASE_ALGOS`).
    "mxfp4-experts": TrtllmFormat("MXFP4", "release", ("transformers", "vllm")),
}

# Schemes TensorRT-LLM cannot load as kiln writes them, and why.
REFUSED: dict[str, str] = {
    "int8-w8a8": "TensorRT-LLM reads a compressed-tensors group by bit width and strategy only "
    "(quant_config_utils.py), so int8 W8A8 would load as FP8_PER_CHANNEL_PER_TOKEN; its own INT8 "
    "recipe is SmoothQuant with static scales, which kiln does not produce",
    "int8-w8a16": "TensorRT-LLM's compressed-tensors reader has no weight-only int branch, and its "
    f"documented quantization matrix ({DOCS}) lists no INT8 weight-only recipe for the PyTorch backend",
    "nvfp4-w4a16": f"its documented quantization matrix ({DOCS}) has no weight-only NVFP4 recipe",
    "mxfp4-w4a4": f"its documented quantization matrix ({DOCS}) has MXFP4 for MoE experts only (W4A8_MXFP4_FP8, "
    "W4A16_MXFP4), not for dense Linears",
}

# QuantAlgo -> why TensorRT-LLM's fused MoE cannot run a family's experts in it, for every family with experts
# (Qwen3-MoE, Mixtral). Read in tensorrt_llm/_torch/modules/fused_moe/ (main, 2026): each backend's `can_implement`
# (CutlassFusedMoE._QUANT_SUPPORT_TABLE: unquantized, FP8 per tensor, FP8_BLOCK_SCALES on sm90/sm120, NVFP4 on
# sm100/103/120/121, W4A16_NVFP4, W4A8_AWQ, per-channel W8A16 and W4A16, the MXFP4 and MXFP8 kinds;
# TRTLLMGenFusedMoE._SUPPORTED_QUANT_ALGOS: NVFP4, FP8_BLOCK_SCALES, W4A8_NVFP4_FP8 and the MXFP4 kinds on sm100;
# DeepGemm and CuteDSL: FP8 block and NVFP4 on sm100; Marlin: W4A16_NVFP4), resolved by `moe_resolution.py`, and
# the methods' loaders in `quantization.py`. NVFP4 loads (`NVFP4CutlassFusedMoEMethod`, `<e>.w1/w2/w3.weight`,
# `weight_scale`, `weight_scale_2`, `input_scale`), with each expert's w1 and w3 sharing weight_scale_2 and
# input_scale (`load_expert_fc31_alpha_nvfp4` asserts it; input scales are reduced by a max over the experts).
MOE_REFUSED: dict[str, str] = {
    "FP8_PER_CHANNEL_PER_TOKEN": "TensorRT-LLM's fused MoE has no FP8 rowwise method: no backend takes "
    "FP8_PER_CHANNEL_PER_TOKEN experts (CutlassFusedMoE._QUANT_SUPPORT_TABLE, "
    "TRTLLMGenFusedMoE._SUPPORTED_QUANT_ALGOS; PR #17433's review: 'there's no FP8-rowwise MoE method')",
    "FP8_BLOCK_SCALES": "TensorRT-LLM's FP8 block-scale fused MoE (DeepSeekFP8BlockScalesFusedMoEMethod) reads each "
    "expert's scales as <e>.w1/w2/w3.weight_scale_inv, and the Qwen3-MoE and Mixtral weight mappers pass "
    "compressed-tensors' weight_scale through unrenamed: the experts' scales would not load (a family whose model "
    "class reads DeepSeek's own FP8 spelling, `TargetMapping.trtllm_release_layouts`, is written in it instead)",
    "W4A16_AWQ": "no TensorRT-LLM fused-MoE backend runs per-group int4 weight-only experts: "
    "CutlassFusedMoE._QUANT_SUPPORT_TABLE has W4A8_AWQ (FP8 activations) and per-channel W4A16 only, the others "
    "NVFP4, FP8 block scaling and MXFP4",
}

# Release layouts a family's TensorRT-LLM model class reads as released (`TargetMapping.trtllm_release_layouts`), by
# the QuantAlgo TensorRT-LLM reads each as (`ModelConfig.load_hf_quant_config`, tensorrt_llm/_torch/model_config.py):
# `quant_method: fp8` with `weight_block_size` [128, 128] is FP8_BLOCK_SCALES; `quant_method: mxfp4` is chosen per GPU
# by `ModelConfig.get_mxfp4_quant_algo` (W4A16_MXFP4 below sm100, W4A8_MXFP4_MXFP8 or, on the Triton MoE backend,
# W4A8_MXFP4_FP8 from sm100), named "MXFP4" here.
RELEASE_ALGOS: dict[str, str] = {"fp8-block": "FP8_BLOCK_SCALES", "mxfp4": "MXFP4"}

# QuantAlgo -> the NVIDIA architectures TensorRT-LLM documents it on (None: bf16, sm80+). MXFP4 experts (gpt-oss's
# release) follow the fused MoE's backends rather than the docs' matrix: `ModelConfig.resolve_moe_backend` runs
# gpt-oss on TRITON on Hopper (W4A16_MXFP4), TRTLLM on sm100/103 and CUTLASS on sm120 (W4A8_MXFP4_MXFP8:
# CutlassFusedMoE._QUANT_SUPPORT_TABLE, sm100/103/120/121); below sm90 the algo is W4A16_MXFP4, which CUTLASS runs
# on sm90 alone.
ALGO_ARCHES: dict[str | None, tuple[str, ...]] = {
    None: ("sm80", "sm89", "sm90", "sm100"),
    "FP8": ("sm89", "sm90", "sm100"),
    "FP8_PER_CHANNEL_PER_TOKEN": ("sm90",),
    "FP8_BLOCK_SCALES": ("sm90", "sm100"),
    "W4A16_AWQ": ("sm80", "sm89", "sm90"),
    "W4A16_GPTQ": ("sm80", "sm89", "sm90"),
    "NVFP4": ("sm100",),
    "MXFP4": ("sm90", "sm100", "sm103", "sm120"),
}
# Hard floors behind the matrix, stated first when they are the reason.
ALGO_MIN_CC: dict[str, tuple[int, str]] = {
    "FP8": (89, "FP8 needs sm89+ (Ada/Hopper)"),
    "FP8_PER_CHANNEL_PER_TOKEN": (89, "FP8 needs sm89+ (Ada/Hopper)"),
    "FP8_BLOCK_SCALES": (89, "FP8 needs sm89+ (Ada/Hopper)"),
    "NVFP4": (100, "NVFP4 needs sm100 (Blackwell)"),
    "MXFP4": (90, "TensorRT-LLM's MXFP4 experts need sm90+ (W4A16_MXFP4 runs on Hopper alone, W4A8 on Blackwell)"),
}
ALGO_LABEL: dict[str | None, str] = {
    None: "bf16",
    "FP8": "FP8 per tensor",
    "FP8_PER_CHANNEL_PER_TOKEN": "FP8 rowwise (FP8_PER_CHANNEL_PER_TOKEN)",
    "FP8_BLOCK_SCALES": "FP8 block scaling (FP8_BLOCK_SCALES)",
    "W4A16_AWQ": "W4A16 AWQ",
    "W4A16_GPTQ": "W4A16 GPTQ",
    "NVFP4": "NVFP4",
    "MXFP4": "MXFP4 experts (W4A16_MXFP4 on Hopper, W4A8_MXFP4_MXFP8 on Blackwell)",
}


def algo_verdict(algo: str | None, hw: HardwareProfile) -> Verdict:
    """Whether TensorRT-LLM runs `algo` on `hw`, and why (or why not)."""
    if hw.vendor != "nvidia" or hw.compute_capability is None:
        return Verdict(compatible=False, reason=f"TensorRT-LLM runs on NVIDIA GPUs; {hw.name} is {hw.family}")
    floor = ALGO_MIN_CC.get(algo or "")
    if floor is not None and hw.compute_capability < floor[0]:
        return Verdict(compatible=False, reason=f"{floor[1]}; {hw.name} is {hw.arch}")
    archs = ALGO_ARCHES[algo]
    if hw.arch not in archs:
        return Verdict(
            compatible=False,
            reason=f"{DOCS} lists {ALGO_LABEL[algo]} on {', '.join(archs)} only; {hw.name} is {hw.arch}",
        )
    return Verdict(compatible=True, reason=f"TensorRT-LLM {ALGO_LABEL[algo]} on {hw.arch}")


def scheme_verdicts(scheme: str) -> dict[str, Verdict]:
    """For every hardware profile: whether a trtllm checkpoint of `scheme` runs there, and why."""
    fmt = FORMATS[scheme]
    return {name: algo_verdict(fmt.quant_algo, hw) for name, hw in PROFILES.items()}


# The oldest tensorrt_llm whose PyTorch backend loads each QuantAlgo as kiln writes it, and why. Release
# notes: github.com/NVIDIA/TensorRT-LLM/releases. No floor is claimed where none was established.
MIN_PYTORCH_BACKEND: dict[str | None, tuple[str, str]] = {
    "FP8_PER_CHANNEL_PER_TOKEN": (
        "1.3.0rc20",
        "compressed-tensors FP8 is read since PR #10796 (1.3.0rc1, January 2026), and a per-channel "
        "weight_scale stored [out, 1] loads only with PR #15415 (merged 2026-06-16; 1.3.0rc19's release "
        "notes end before it, 1.3.0rc20's list later PRs)",
    ),
    "FP8_BLOCK_SCALES": (
        "1.3.0rc1",
        "compressed-tensors FP8 with 128x128 blocks is read since PR #10796 (1.3.0rc1, January 2026)",
    ),
}
# The last tensorrt_llm with the TensorRT engine backend (trtllm-build, convert_checkpoint): 1.3.0rc20's
# release notes say it is the last RC supporting it; main removed it from 2026-06-30 on (PRs #15763,
# #15767, #15907, #15918; docs/source/legacy/tensorrt-backend-removal.md).
LAST_ENGINE_RELEASE = "1.3.0rc20"

# Legacy engine builds (trtllm-build) and GPU evals, per NVIDIA SKU of the hardware catalog: what
# nvidia-smi calls that GPU (the catalog entry's first product name).
ENGINE_SKUS: dict[str, str] = {name: hw.device_name for name, hw in PROFILES.items() if hw.vendor == "nvidia"}
# QuantAlgo -> why kiln builds no engine for it (the checkpoint still serves the PyTorch backend).
ENGINE_REFUSED: dict[str, str] = {
    "FP8_BLOCK_SCALES": "128x128 block-scaled FP8 is documented for TensorRT-LLM's PyTorch backend; kiln has no "
    "trtllm-build recipe for it",
}
