"""FP8 E4M3 W8A8: weights per output channel or in 128x128 blocks, activations quantized per token at run time.

- NVIDIA FP8 tensor cores start at Ada/Hopper (sm89+), so fp8 does not run natively on an A100 (sm80);
  vLLM's compressed-tensors W8A8-FP8 path needs capability 89. Block-scaled fp8 (128x128 weight blocks,
  activations per token in groups of 128) runs through CUTLASS/DeepGEMM on sm90+ and vLLM's Triton block
  kernel on sm89.
- AMD MI300X/MI325X (gfx942) compute in float8_e4m3fnuz, MI350/MI355X (gfx950) in OCP e4m3fn. vLLM
  converts an e4m3fn checkpoint on gfx942 at load (the -128 bit pattern becomes 0, scales double), so fp8
  bundles list mi300x/mi325x with that note.
"""

from __future__ import annotations

from kiln.core.hardware import HardwareProfile
from kiln.quant.methods.base import ANOTHER_8BIT, EXPERTS_LEFT_BF16, GateDefaults, Method, SourceRoute, keeps
from kiln.quant.schemes import ActivationQuant, KvCacheQuant, Scheme, Verdict, WeightQuant

GATE = GateDefaults(max_kl=0.02, min_top1=0.92, max_ppl_increase=0.03)


def _on_cuda(method: Method, hw: HardwareProfile) -> Verdict:
    if hw.fp8 != "e4m3fn":  # the catalog's fact: FP8 tensor cores, Ada (sm89) on
        return Verdict(compatible=False, reason=f"FP8 tensor cores need sm89+ (Ada/Hopper); {hw.name} is {hw.arch}")
    w = method.scheme.weights
    if w is not None and w.strategy == "block":
        kernel = "CUTLASS/DeepGEMM block-scaled" if (hw.compute_capability or 0) >= 90 else "Triton block-scaled"
        return Verdict(compatible=True, reason=f"FP8 (e4m3fn) 128x128-block matmuls via {kernel} on {hw.arch}")
    return Verdict(compatible=True, reason=f"native FP8 (e4m3fn) matmuls on {hw.arch}")


def fnuz_note(arch: str) -> str:
    return (
        f"{arch} computes in float8_e4m3fnuz; vLLM converts this e4m3fn checkpoint at load "
        "(the -128 bit pattern becomes 0, scales double)"
    )


def _on_rocm(method: Method, hw: HardwareProfile) -> Verdict:
    if hw.fp8 == "e4m3fnuz":
        return Verdict(compatible=True, reason=fnuz_note(hw.arch))
    if hw.fp8 == "e4m3fn":
        return Verdict(compatible=True, reason=f"{hw.arch} computes in OCP float8_e4m3fn, the checkpoint's own type")
    return Verdict(compatible=False, reason=f"{hw.name} ({hw.arch}) has no FP8 units")


def _w8a8(
    name: str,
    description: str,
    weights: WeightQuant,
    activations: ActivationQuant,
    kv_cache: bool = False,
    from_fp8_block: SourceRoute = ANOTHER_8BIT,
) -> Method:
    """An FP8 W8A8 method: E4M3 weights and dynamic E4M3 activations, how they are scaled is the scheme's;
    `kv_cache`: and an FP8 KV cache with calibrated per-layer K and V scales; `from_fp8_block`: what it does with
    an FP8-block release (by default refuses it: FP8 requantized into FP8)."""
    return Method(
        Scheme(
            name=name,
            description=description,
            weights=weights,
            input_activations=activations,
            format="float-quantized",
            method="rtn",
            kv_cache=KvCacheQuant() if kv_cache else None,
        ),
        weight_dtype="float8_e4m3fn",
        activation_dtype="float8_e4m3fn",
        gate=GATE,
        on_cuda=_on_cuda,
        on_rocm=_on_rocm,
        kv_cache_dtype="fp8" if kv_cache else "bf16",
        from_sources={"fp8-block": from_fp8_block, "mxfp4": EXPERTS_LEFT_BF16},
    )


FP8 = _w8a8(
    "fp8",
    "FP8 E4M3 weights per output channel (scale = absmax / 448), dynamic per-token FP8 activations",
    WeightQuant(num_bits=8, type="float", strategy="channel"),
    ActivationQuant(num_bits=8, type="float"),
)
FP8_BLOCK = _w8a8(
    "fp8-block",
    "FP8 E4M3 weights with one scale per 128x128 block, dynamic FP8 activations per token and 128 columns",
    WeightQuant(num_bits=8, type="float", strategy="block", block_structure=(128, 128)),
    ActivationQuant(num_bits=8, type="float", strategy="group", group_size=128),
    # DeepSeek-V3's own format: compressed-tensors' block strategy is the release's, the scale a multiplier in both
    # (`weight_scale_inv` is `weight_scale`), so the release's FP8 values and scales are the bundle's.
    from_fp8_block=keeps(
        "the release's FP8 values and 128x128 block scales as they are stored (its `weight_scale_inv` is "
        "compressed-tensors' `weight_scale`, a multiplier in both): DeepSeek-V3's own format, for Hopper and later"
    ),
)

# FP8 with an FP8 KV cache: the same weights as `fp8` (round-to-nearest), and one static scale per layer for K
# and for V, calibrated on sample text by llm-compressor; vLLM then keeps the cache in FP8 (half the bytes).
FP8_KV8 = _w8a8(
    "fp8-kv8",
    "FP8 E4M3 weights per output channel, dynamic per-token FP8 activations, and an FP8 KV cache with "
    "calibrated per-layer K and V scales",
    WeightQuant(num_bits=8, type="float", strategy="channel"),
    ActivationQuant(num_bits=8, type="float"),
    kv_cache=True,
)

METHODS = (FP8, FP8_BLOCK, FP8_KV8)
