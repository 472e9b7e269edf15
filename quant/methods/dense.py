"""bf16: the checkpoint's own weights, unquantized; runs wherever vLLM or transformers does."""

from __future__ import annotations

from kiln.core.hardware import HardwareProfile
from kiln.quant.methods.base import GateDefaults, Method, dequantizes
from kiln.quant.schemes import Scheme, Verdict

# Lossless up to the runtime's arithmetic order.
LOSSLESS = GateDefaults(max_kl=1e-3, min_top1=0.99, max_ppl_increase=0.005)


def _anywhere(method: Method, hw: HardwareProfile) -> Verdict:
    return Verdict(compatible=True, reason=f"bf16 on {hw.arch}")


BF16 = Method(
    Scheme(name="bf16", description="the checkpoint's bf16 weights, unquantized", format="dense", method="none"),
    weight_dtype="bfloat16",
    activation_dtype="bfloat16",
    gate=LOSSLESS,
    on_cuda=_anywhere,
    on_rocm=_anywhere,
    from_sources={
        "fp8-block": dequantizes(
            "for hardware without FP8 units (NVIDIA before sm89, CPUs): the release's weights dequantized into bf16, "
            "twice its bytes"
        ),
        "mxfp4": dequantizes(
            "for runtimes without MXFP4 expert kernels: the experts dequantized into bf16, about four times their "
            "released bytes"
        ),
    },
)

METHODS = (BF16,)
