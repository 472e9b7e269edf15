"""FP4 (E2M1) weights: NVFP4 for NVIDIA Blackwell, MXFP4 (the OCP MX format) for Blackwell and AMD gfx950.

- NVFP4: 16 values under one E4M3 scale, times one float32 scale per tensor (compressed-tensors
  `nvfp4-pack-quantized`: `weight_packed` uint8, `weight_scale` float8_e4m3fn, `weight_global_scale`).
  W4A4 (`nvfp4-w4a4`) also quantizes activations to NVFP4 at run time, with a static per-tensor scale observed
  on calibration text (`input_global_scale`); FP4 tensor cores take both operands from Blackwell (sm100+, vLLM's
  CUTLASS kernel). On older NVIDIA GPUs vLLM runs the same checkpoint weight-only, through its Marlin FP4
  kernel (bf16 activations), as it runs `nvfp4-w4a16` everywhere. ROCm has no NVFP4 kernel (emulation only).
- MXFP4: 32 values under one E8M0 (power-of-two) scale (`mxfp4-pack-quantized`: `weight_packed`,
  `weight_scale` uint8), activations quantized the same way at run time. Native on NVIDIA sm100+ (FlashInfer)
  and AMD gfx950 (MI350X/MI355X, vLLM's AITER kernels); Marlin FP4 weight-only on older NVIDIA GPUs; gfx942
  (MI300X/MI325X) only emulates it.

Source: vLLM's compressed-tensors schemes (`CompressedTensorsW4A4Fp4`, `CompressedTensorsW4A4Mxfp4`) and their
kernel choices (vLLM 0.33). GGUF's own `nvfp4` and `mxfp4` are llama.cpp types (`targets.gguf`).

- `mxfp4-experts`: gpt-oss as OpenAI ships it, the release's own layout (`quant_method: mxfp4`): its stacked 3-D
  experts in MXFP4 (`*_blocks`, `*_scales`), weight-only, everything else bf16. kiln writes it only by keeping an
  MXFP4 release's bytes (`release_only`): it quantizes no stacked experts. vLLM 0.32 serves it with
  `GptOssMxfp4MoEMethod` (model_executor/layers/quantization/mxfp4.py: `Mxfp4Config.get_min_capability` 80), whose
  experts kernel `select_mxfp4_moe_backend` picks in the order of `_get_priority_backends_for_gpt_oss`
  (model_executor/layers/fused_moe/oracle/mxfp4.py), each class's `_supports_current_device` deciding: FlashInfer's
  TRT-LLM MoE on sm100/sm103 (fused_moe/experts/trtllm_mxfp4_moe.py: capability family 100), the OpenAI Triton
  kernels on sm90 to sm12x (experts/gpt_oss_triton_kernels_moe.py, after Marlin on sm12x), FlashInfer's CUTLASS MoE
  on sm90/sm100/sm120, Marlin from sm75 (experts/marlin_moe.py); on ROCm AITER's CK kernel on gfx950
  (experts/rocm_aiter_moe.py: `on_gfx950`) and its Triton W4A16 kernel on gfx942 and gfx950
  (experts/aiter_mxfp4_w4a16_moe.py), both with AITER enabled (`VLLM_ROCM_USE_AITER=1`), else an emulation.

They are quantized by llm-compressor's `QuantizationModifier` (`minmax`: the weights' min-max scales,
NVFP4's tensor scales shared across the fused q/k/v and gate/up projections, as vLLM fuses them), or, for
`nvfp4-w4a4-gptq`, by its `GPTQModifier` (the same scales, each weight column rounded to make up for the
error of those before it on sample text: the checkpoint is laid out exactly as `nvfp4-w4a4`'s), in
`quant.calibrated`; which device takes which format natively is the hardware catalog's `fp4` fact.
"""

from __future__ import annotations

from typing import Literal

from kiln.core.hardware import Fp4Format, HardwareProfile
from kiln.quant.methods.base import EXPERTS_LEFT_BF16, GateDefaults, Method, SourceRoute, dequantizes, keeps, refuses
from kiln.quant.methods.dense import LOSSLESS
from kiln.quant.schemes import ActivationQuant, Scheme, Verdict, WeightQuant

# W4A4 rounds activations too, so it gets the widest gate; weight-only FP4 sits with round-to-nearest int4.
W4A4 = GateDefaults(max_kl=0.25, min_top1=0.75, max_ppl_increase=0.25)
W4A16 = GateDefaults(max_kl=0.15, min_top1=0.80, max_ppl_increase=0.15)

_NVFP4_WEIGHTS = WeightQuant(num_bits=4, type="float", strategy="tensor_group", group_size=16)
_NVFP4_ACTIVATIONS = ActivationQuant(num_bits=4, type="float", strategy="tensor_group", group_size=16, dynamic="local")
_MXFP4_WEIGHTS = WeightQuant(num_bits=4, type="float", strategy="group", group_size=32)
_MXFP4_ACTIVATIONS = ActivationQuant(num_bits=4, type="float", strategy="group", group_size=32)


def _format(method: Method) -> Fp4Format:
    return "nvfp4" if method.scheme.format == "nvfp4-pack-quantized" else "mxfp4"


def _on_cuda(method: Method, hw: HardwareProfile) -> Verdict:
    fmt = _format(method).upper()
    if method.scheme.input_activations is not None and _format(method) in hw.fp4:
        kernel = "CUTLASS" if fmt == "NVFP4" else "FlashInfer"
        return Verdict(compatible=True, reason=f"native {fmt} W4A4 matmuls on {hw.arch} ({kernel})")
    # vLLM's Marlin FP4 kernel dequantizes the weights before a bf16 matmul, from sm80 on.
    why = "weight-only" if method.scheme.input_activations is None else f"{hw.arch} has no FP4 tensor cores"
    return Verdict(compatible=True, reason=f"{why}: {fmt} weights through vLLM's Marlin FP4 kernel, bf16 activations")


def _on_rocm(method: Method, hw: HardwareProfile) -> Verdict:
    fmt = _format(method)
    if fmt == "nvfp4":
        return Verdict(compatible=False, reason=f"vLLM has no NVFP4 kernels on ROCm ({hw.arch}), only emulation")
    if fmt in hw.fp4:
        return Verdict(compatible=True, reason=f"native MXFP4 W4A4 matmuls on {hw.arch} (vLLM's AITER kernels)")
    return Verdict(compatible=False, reason=f"MXFP4 needs FP4 units (gfx950); {hw.name} ({hw.arch}) only emulates it")


# An FP8 release for the GPUs whose FP4 units take the format: the release dequantized, then FP4 at half its bytes.
_FROM_FP8: dict[str, SourceRoute] = {
    "nvfp4-pack-quantized": dequantizes(
        "NVFP4 for Blackwell (sm100, FP4 tensor cores): the release dequantized, then FP4 at about half its bytes"
    ),
    "mxfp4-pack-quantized": dequantizes(
        "MXFP4 for MI350X/MI355X (gfx950, FP4 units): the release dequantized, then FP4 at about half its bytes"
    ),
}


# MXFP4 is the release's own number format, not its layout: compressed-tensors' MXFP4 W4A4 quantizes 2-D Linears and
# their activations, gpt-oss stores stacked experts weight-only under `quant_method: mxfp4`.
_FROM_MXFP4: dict[str, SourceRoute] = {
    "mxfp4-pack-quantized": refuses(
        "the release's MXFP4 is weight-only, on its stacked 3-D experts, under its own quant_method (mxfp4); "
        "compressed-tensors' MXFP4 W4A4 quantizes 2-D Linears and their activations, so it would requantize the "
        "attention and write the experts in bf16, four times their released bytes; mxfp4-experts writes the "
        "release's own layout as it is (and GGUF: every type kiln writes keeps its expert blocks)"
    ),
}


def _fp4(
    name: str,
    description: str,
    weights: WeightQuant,
    activations: ActivationQuant | None,
    gate: GateDefaults,
    method: Literal["minmax", "gptq"] = "minmax",
) -> Method:
    scheme = Scheme(
        name=name,
        description=description,
        weights=weights,
        input_activations=activations,
        format="nvfp4-pack-quantized" if weights.group_size == 16 else "mxfp4-pack-quantized",
        method=method,
    )
    return Method(
        scheme,
        weight_dtype="float4_e2m1",
        activation_dtype="bfloat16" if activations is None else "float4_e2m1",
        gate=gate,
        on_cuda=_on_cuda,
        on_rocm=_on_rocm,
        from_sources={
            "fp8-block": _FROM_FP8[scheme.format],
            "mxfp4": _FROM_MXFP4.get(scheme.format, EXPERTS_LEFT_BF16),
        },
    )


def _experts_on_cuda(method: Method, hw: HardwareProfile) -> Verdict:
    cc = hw.compute_capability or 0
    if cc // 10 == 10:
        kernel = "FlashInfer's TRT-LLM MXFP4 MoE"
    elif cc >= 120:
        kernel = "vLLM's Marlin FP4 MoE (before the OpenAI Triton kernels on sm12x)"
    elif cc >= 90:
        kernel = "the OpenAI Triton MoE kernels (FlashInfer's CUTLASS MoE, then Marlin, without them)"
    else:
        kernel = "vLLM's Marlin FP4 MoE (dequantized to bf16 in the kernel)"
    return Verdict(compatible=True, reason=f"MXFP4 experts through {kernel} on {hw.arch}, bf16 activations")


def _experts_on_rocm(method: Method, hw: HardwareProfile) -> Verdict:
    if "mxfp4" in hw.fp4:
        kernel = "AITER's CK MXFP4 MoE (W4A16)"
    elif hw.arch == "gfx942":
        kernel = "AITER's Triton W4A16 MXFP4 MoE"
    else:
        return Verdict(
            compatible=False, reason=f"vLLM has no MXFP4 MoE kernel for {hw.name} ({hw.arch}), only emulation"
        )
    return Verdict(
        compatible=True, reason=f"MXFP4 experts through {kernel} on {hw.arch}, with AITER enabled (else emulated)"
    )


# gpt-oss's release layout: the experts' MXFP4 blocks and E8M0 scales as stored, nothing else quantized.
MXFP4_EXPERTS = Method(
    Scheme(
        name="mxfp4-experts",
        description="the release's MXFP4 experts (E2M1 in blocks of 32 under E8M0 scales, weight-only, stacked 3-D), "
        "everything else bf16: gpt-oss as OpenAI ships it",
        weights=_MXFP4_WEIGHTS,
        format="mxfp4-pack-quantized",
        method="released",
    ),
    weight_dtype="float4_e2m1",
    activation_dtype="bfloat16",
    gate=LOSSLESS,  # the release's own bytes: KL ~ 0 against the release dequantized, as bf16's
    on_cuda=_experts_on_cuda,
    on_rocm=_experts_on_rocm,
    from_sources={
        "mxfp4": keeps(
            "the release's MXFP4 expert blocks and scales as stored, its quantization_config as released "
            "(quant_method mxfp4): gpt-oss's own layout, a quarter of bf16's expert bytes"
        ),
        "fp8-block": refuses(
            "mxfp4-experts is an MXFP4 release's own layout, kept as stored; an FP8 release has no MXFP4 experts to "
            "keep, and kiln quantizes no stacked experts (fp8-block keeps this release's own bytes)"
        ),
    },
    release_only=True,
)


METHODS = (
    _fp4(
        "nvfp4-w4a4",
        "NVFP4 W4A4: E2M1 weights in groups of 16 under E4M3 scales and a tensor scale; activations the same at "
        "run time, their tensor scale observed on sample text",
        _NVFP4_WEIGHTS,
        _NVFP4_ACTIVATIONS,
        W4A4,
    ),
    _fp4(
        "nvfp4-w4a4-gptq",
        "NVFP4 W4A4 as nvfp4-w4a4, its weights chosen by GPTQ on sample text (the same checkpoint layout)",
        _NVFP4_WEIGHTS,
        _NVFP4_ACTIVATIONS,
        W4A4,
        method="gptq",
    ),
    _fp4(
        "nvfp4-w4a16",
        "NVFP4 weight-only (NVFP4A16): E2M1 weights in groups of 16 under E4M3 scales and a tensor scale, "
        "bf16 activations",
        _NVFP4_WEIGHTS,
        None,
        W4A16,
    ),
    _fp4(
        "mxfp4-w4a4",
        "MXFP4 W4A4 (OCP MX): E2M1 weights in groups of 32 under E8M0 scales; activations the same at run time",
        _MXFP4_WEIGHTS,
        _MXFP4_ACTIVATIONS,
        W4A4,
    ),
    MXFP4_EXPERTS,
)
