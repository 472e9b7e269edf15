"""int4 weight-only W4A16, one scale per 128 input columns: round-to-nearest, GPTQ and AWQ.

GPTQ and AWQ only choose the int4 values and scales, from calibration data; the checkpoint is the same
`pack-quantized` W4A16 layout as round-to-nearest, so it runs wherever int4-rtn runs: vLLM's WNA16 kernels
(Marlin, Machete) on NVIDIA sm80+, its Triton/ExLlama kernels on ROCm, where it runs AWQ through its Triton
AWQ kernels (no Marlin there).
"""

from __future__ import annotations

from kiln.core.hardware import HardwareProfile
from kiln.quant.methods.base import EXPERTS_LEFT_BF16, GateDefaults, Method, dequantizes
from kiln.quant.methods.int8 import weight_only_on_cuda, weight_only_on_rocm
from kiln.quant.schemes import QuantMethod, Scheme, Verdict, WeightQuant

CALIBRATED = GateDefaults(max_kl=0.06, min_top1=0.85, max_ppl_increase=0.08)
ROUNDED = GateDefaults(max_kl=0.15, min_top1=0.80, max_ppl_increase=0.15)

# The int4 weight layout shared by round-to-nearest, GPTQ and AWQ: only how scales are chosen differs.
_W4_GROUPED = WeightQuant(num_bits=4, type="int", strategy="group", group_size=128)


# An FP8 release for GPUs without FP8 tensor cores (Ampere, sm80): int4 weights through Marlin, half its bytes.
_W4A16_FROM_FP8 = dequantizes(
    "W4A16 for Ampere (sm80, no FP8 tensor cores): the release dequantized, then int4 weights through vLLM's Marlin "
    "kernels at half its bytes"
)


def _awq_on_rocm(method: Method, hw: HardwareProfile) -> Verdict:
    return Verdict(compatible=True, reason=f"AWQ W4A16 through vLLM's Triton AWQ kernels on ROCm ({hw.arch})")


def _w4a16(name: str, description: str, how: QuantMethod, gate: GateDefaults) -> Method:
    return Method(
        Scheme(name=name, description=description, weights=_W4_GROUPED, format="pack-quantized", method=how),
        weight_dtype="int4",
        activation_dtype="bfloat16",
        gate=gate,
        on_cuda=weight_only_on_cuda,
        on_rocm=_awq_on_rocm if how == "awq" else weight_only_on_rocm,
        from_sources={
            "fp8-block": _W4A16_FROM_FP8,
            "mxfp4": EXPERTS_LEFT_BF16,
        },
    )


METHODS = (
    _w4a16(
        "int4-rtn",
        "W4A16: symmetric int4 weights, round-to-nearest, one scale per 128 input columns",
        "rtn",
        ROUNDED,
    ),
    _w4a16(
        "w4a16-gptq",
        "W4A16: symmetric int4 weights, one scale per 128 input columns, chosen by GPTQ on sample text",
        "gptq",
        CALIBRATED,
    ),
    _w4a16(
        "w4a16-awq",
        "W4A16: symmetric int4 weights, one scale per 128 input columns, AWQ-smoothed on sample text",
        "awq",
        CALIBRATED,
    ),
)
