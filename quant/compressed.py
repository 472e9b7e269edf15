"""The bridge to compressed-tensors: our `Scheme` as its `QuantizationScheme`, compression, config.json.

compressed-tensors' compressor classes are used as pure per-module functions (`compress(state_dict,
scheme)` on local names `weight`, `weight_scale`), so the stored tensors are exactly what vLLM and
transformers read back, and packing (int32 words, offsets) is never re-implemented here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from quant.schemes import Scheme

if TYPE_CHECKING:
    import torch
    from compressed_tensors.quantization import QuantizationScheme


def ct_scheme(scheme: Scheme) -> QuantizationScheme:
    """compressed-tensors' `QuantizationScheme` for `scheme` (which must quantize something)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    if scheme.weights is None:
        raise ValueError(f"scheme {scheme.name!r} does not quantize; it has no compressed-tensors scheme")
    acts = scheme.input_activations
    return QuantizationScheme(
        targets=list(scheme.targets),
        weights=QuantizationArgs(**scheme.weights.model_dump(), dynamic=False),
        input_activations=QuantizationArgs(**acts.model_dump(), observer=None) if acts is not None else None,
        format=scheme.format,
    )


def quantization_config(scheme: Scheme) -> dict[str, Any]:
    """The `quantization_config` block of config.json, serialised by compressed-tensors itself."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    config = QuantizationConfig(
        config_groups={"group_0": ct_scheme(scheme)},
        format=scheme.format,
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=list(scheme.ignore),
    )
    dumped: dict[str, Any] = config.model_dump(mode="json")
    return dumped


def _compressor(scheme: Scheme) -> Any:
    from compressed_tensors.compressors import BaseCompressor

    return BaseCompressor.get_value_from_registry(scheme.format)


def compress(scheme: Scheme, weight: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """One Linear weight and its scales -> the module's stored tensors (local names)."""
    import torch

    sd = {"weight": weight, "weight_scale": scale, "weight_zero_point": torch.zeros_like(scale, dtype=torch.int8)}
    out: dict[str, torch.Tensor] = dict(_compressor(scheme).compress(sd, ct_scheme(scheme)))
    return out


def decompress(scheme: Scheme, stored: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """One module's stored tensors (local names) -> its float32 weight, as compressed-tensors computes it."""
    sd = {k: v.float() if k == "weight_scale" else v for k, v in stored.items()}
    weight: torch.Tensor = _compressor(scheme).decompress(sd, ct_scheme(scheme))["weight"]
    return weight.float()
