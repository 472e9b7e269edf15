"""int8 weights per output channel: W8A8 (dynamic per-token int8 activations) and weight-only W8A16.

- int8 W8A8 runs through vLLM's CUTLASS int8 scaled-mm on NVIDIA sm75+ and its Triton int8 scaled-mm on ROCm.
- Weight-only W8A16 (compressed-tensors `pack-quantized`) runs through vLLM's WNA16 kernels (Marlin, Machete)
  on NVIDIA sm80+ and through its Triton kernels on ROCm.
"""

from __future__ import annotations

from kiln.core.hardware import HardwareProfile
from kiln.quant.methods.base import ANOTHER_8BIT, EXPERTS_LEFT_BF16, GateDefaults, Method
from kiln.quant.schemes import ActivationQuant, Scheme, Verdict, WeightQuant

GATE = GateDefaults(max_kl=0.015, min_top1=0.93, max_ppl_increase=0.02)
_PER_CHANNEL = WeightQuant(num_bits=8, type="int", strategy="channel")
_FROM_SOURCES = {"fp8-block": ANOTHER_8BIT, "mxfp4": EXPERTS_LEFT_BF16}


def weight_only_on_cuda(method: Method, hw: HardwareProfile) -> Verdict:
    """Weight-only WnA16, int4 and int8 alike: vLLM's Marlin/Machete kernels."""
    bits = method.scheme.weights.num_bits if method.scheme.weights is not None else 16
    return Verdict(compatible=True, reason=f"W{bits}A16 through vLLM's Marlin/Machete kernels on sm80+")


def weight_only_on_rocm(method: Method, hw: HardwareProfile) -> Verdict:
    bits = method.scheme.weights.num_bits if method.scheme.weights is not None else 16
    return Verdict(compatible=True, reason=f"W{bits}A16 through vLLM's Triton kernels on ROCm ({hw.arch})")


INT8_W8A8 = Method(
    Scheme(
        name="int8-w8a8",
        description="W8A8: symmetric int8 weights per output channel, dynamic per-token int8 activations",
        weights=_PER_CHANNEL,
        input_activations=ActivationQuant(num_bits=8, type="int"),
        format="int-quantized",
        method="rtn",
    ),
    weight_dtype="int8",
    activation_dtype="int8",
    gate=GATE,
    on_cuda=lambda m, hw: Verdict(
        compatible=True, reason=f"int8 W8A8 through vLLM's CUTLASS int8 scaled-mm on {hw.arch}"
    ),
    on_rocm=lambda m, hw: Verdict(
        compatible=True, reason=f"int8 W8A8 through vLLM's Triton int8 scaled-mm on ROCm ({hw.arch})"
    ),
    from_sources=_FROM_SOURCES,
)
INT8_W8A16 = Method(
    Scheme(
        name="int8-w8a16",
        description="W8A16: symmetric int8 weights per output channel, bf16 activations",
        weights=_PER_CHANNEL,
        format="pack-quantized",
        method="rtn",
    ),
    weight_dtype="int8",
    activation_dtype="bfloat16",
    gate=GATE,
    on_cuda=weight_only_on_cuda,
    on_rocm=weight_only_on_rocm,
    from_sources=_FROM_SOURCES,
)

METHODS = (INT8_W8A8, INT8_W8A16)
