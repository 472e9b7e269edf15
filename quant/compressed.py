"""The bridge to compressed-tensors: our `Scheme` as its `QuantizationScheme`, compression, config.json.

compressed-tensors' compressor classes are used as pure per-module functions (`compress(state_dict,
scheme)` on local names `weight`, `weight_scale`), so the stored tensors are exactly what vLLM and
transformers read back, and packing (int32 words, offsets) is never re-implemented here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kiln.quant.schemes import Scheme

if TYPE_CHECKING:
    import torch
    from compressed_tensors.quantization import QuantizationScheme


FP4_SCALE_DTYPES = {"nvfp4-pack-quantized": "float8_e4m3fn", "mxfp4-pack-quantized": "uint8"}


def ct_scheme(scheme: Scheme) -> QuantizationScheme:
    """compressed-tensors' `QuantizationScheme` for `scheme` (which must quantize something)."""
    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    if scheme.weights is None:
        raise ValueError(f"scheme {scheme.name!r} does not quantize; it has no compressed-tensors scheme")
    acts = scheme.input_activations
    # FP4 scales are stored narrow: E4M3 (NVFP4) or E8M0 exponents in a uint8 (MXFP4), as in compressed-tensors'
    # own NVFP4 / MXFP4 presets; every other scheme's are the checkpoint's float type.
    narrow = FP4_SCALE_DTYPES.get(scheme.format)
    scales = {} if narrow is None else {"scale_dtype": getattr(torch, narrow), "zp_dtype": getattr(torch, narrow)}
    # A locally dynamic activation (NVFP4) has a static tensor scale, observed on calibration text.
    observer = "static_minmax" if acts is not None and acts.dynamic == "local" else None
    # GPTQ quantizes the columns in the order of their Hessian's diagonal (llm-compressor's default "static"),
    # and its checkpoints say so, as llm-compressor's own do; the stored weights keep their column order.
    order = {"actorder": "static"} if scheme.method == "gptq" else {}
    return QuantizationScheme(
        targets=list(scheme.targets),
        weights=QuantizationArgs(**scheme.weights.model_dump(), dynamic=False, **scales, **order),
        input_activations=QuantizationArgs(**acts.model_dump(), observer=observer, **scales)
        if acts is not None
        else None,
        format=scheme.format,
    )


def quantization_config(scheme: Scheme, kept: Sequence[str] = ()) -> dict[str, Any]:
    """The `quantization_config` block of config.json, serialised by compressed-tensors itself.

    `kept`: modules besides the scheme's own `ignore` that stay unquantized although a loader might take them
    for Linears: a mixture's routers, listed by their checkpoint names one by one as llm-compressor writes them
    (`model.layers.0.mlp.gate`; Mixtral's `model.layers.0.block_sparse_moe.gate`), so vLLM, which builds the
    router as a Linear, loads it in bf16 whatever its model code passes it."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationStatus

    kv = scheme.kv_cache
    config = QuantizationConfig(
        config_groups={"group_0": ct_scheme(scheme)},
        format=scheme.format,
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=[*scheme.ignore, *kept],
        kv_cache_scheme=QuantizationArgs(**kv.model_dump()) if kv is not None else None,
    )
    dumped: dict[str, Any] = config.model_dump(mode="json")
    return dumped


def _compressor(scheme: Scheme) -> Any:
    from compressed_tensors.compressors import BaseCompressor

    return BaseCompressor.get_value_from_registry(scheme.format)


def compress(
    scheme: Scheme, weight: torch.Tensor, scale: torch.Tensor, qparams: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """One Linear weight and its scales -> the module's stored tensors (local names).

    `qparams`: the module's other quantization parameters, stored as given (NVFP4's `weight_global_scale`
    and `input_global_scale`)."""
    import torch

    sd = {
        "weight": weight,
        "weight_scale": scale,
        "weight_zero_point": torch.zeros_like(scale, dtype=torch.int8),
        **(qparams or {}),
    }
    out: dict[str, torch.Tensor] = dict(_compressor(scheme).compress(sd, ct_scheme(scheme)))
    return out


def decompress(scheme: Scheme, stored: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """One module's stored tensors (local names) -> its float32 weight, as compressed-tensors computes it."""
    narrow = scheme.format in FP4_SCALE_DTYPES  # FP4 scales are decoded from their own type by the compressor
    sd = {k: v.float() if k == "weight_scale" and not narrow else v for k, v in stored.items()}
    weight: torch.Tensor = _compressor(scheme).decompress(sd, ct_scheme(scheme))["weight"]
    return weight.float()
