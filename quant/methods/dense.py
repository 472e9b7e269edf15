"""bf16: the checkpoint's own weights, unquantized; runs wherever vLLM or transformers does."""

from __future__ import annotations

from core.hardware import HardwareProfile
from quant.methods.base import GateDefaults, Method
from quant.schemes import Scheme, Verdict

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
)

METHODS = (BF16,)
