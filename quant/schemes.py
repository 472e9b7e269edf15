"""Quantization schemes as frozen, validated data: how a method stores and computes a model's Linear layers.

A `Scheme` says how the Linear layers of a model are stored (weights) and computed (activations);
embeddings, norms and `lm_head` stay bf16. Its field names follow compressed-tensors'
`QuantizationArgs` so that `quant.compressed` can hand it over unchanged, and `format` is
compressed-tensors' own name for how the weights lie on disk (its `CompressionFormat`), chosen
exactly as compressed-tensors 0.19 `infer_module_format` would choose it:

- float weights with activation quantization -> `float-quantized` (fp8 W8A8-dynamic, per channel or
  in 128x128 blocks)
- int weights, no activation quantization    -> `pack-quantized`  (W4A16 and W8A16 alike: 32 / bits
  values per int32)
- int weights with int activations           -> `int-quantized`   (int8 W8A8: one int8 per weight)
- no quantization                            -> `dense`

This module is plain data (no torch): the registry imports `targets`. The methods built from these types
(their presets, dtypes, gates and hardware verdicts) are in `quant.methods`, gathered by `quant.catalog`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

QuantType = Literal["int", "float"]
CompressionFormat = Literal["dense", "pack-quantized", "float-quantized", "int-quantized"]
# How the quantized values are chosen: `none` (unquantized), round-to-nearest from the weights alone,
# or calibrated on sample text by llm-compressor (GPTQ: Hessian-based error feedback; AWQ:
# activation-aware per-channel smoothing, then round-to-nearest).
QuantMethod = Literal["none", "rtn", "gptq", "awq"]
CALIBRATED_METHODS: tuple[QuantMethod, ...] = ("gptq", "awq")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class WeightQuant(_Frozen):
    """How a Linear weight is quantized (compressed-tensors `QuantizationArgs` for `weights`)."""

    num_bits: Literal[4, 8]
    type: QuantType
    strategy: Literal["channel", "group", "block"]
    group_size: int | None = Field(default=None, gt=0, description="input columns per scale (group strategy only)")
    block_structure: tuple[int, int] | None = Field(
        default=None, description="(rows, columns) of weight per scale (block strategy only)"
    )
    symmetric: bool = True

    @model_validator(mode="after")
    def _consistent(self) -> WeightQuant:
        if (self.strategy == "group") != (self.group_size is not None):
            raise ValueError(f"group_size is set exactly when strategy is 'group'; got {self.strategy!r}")
        if (self.strategy == "block") != (self.block_structure is not None):
            raise ValueError(f"block_structure is set exactly when strategy is 'block'; got {self.strategy!r}")
        if self.block_structure is not None and min(self.block_structure) <= 0:
            raise ValueError(f"block_structure must be positive; got {list(self.block_structure)}")
        if self.type == "float" and self.num_bits != 8:
            raise ValueError("float weights are 8-bit (FP8 E4M3)")
        if not self.symmetric:
            raise ValueError("only symmetric weight quantization is supported (no zero points)")
        return self


class ActivationQuant(_Frozen):
    """Dynamic activation quantization, computed at run time (no calibration): one scale per token, or
    per token and group of `group_size` input columns."""

    num_bits: Literal[8]
    type: QuantType
    strategy: Literal["token", "group"] = "token"
    group_size: int | None = Field(default=None, gt=0)
    dynamic: Literal[True] = True
    symmetric: Literal[True] = True

    @model_validator(mode="after")
    def _consistent(self) -> ActivationQuant:
        if (self.strategy == "group") != (self.group_size is not None):
            raise ValueError(f"group_size is set exactly when strategy is 'group'; got {self.strategy!r}")
        return self


class Scheme(_Frozen):
    """A named quantization scheme for the Linear layers of a model."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,31}$")
    description: str
    weights: WeightQuant | None = None  # None: the checkpoint's bf16 weights, unquantized
    input_activations: ActivationQuant | None = None
    format: CompressionFormat
    method: QuantMethod
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ("lm_head",)

    @model_validator(mode="after")
    def _format_matches(self) -> Scheme:
        want = _expected_format(self.weights, self.input_activations)
        if self.format != want:
            raise ValueError(f"scheme {self.name!r}: format {self.format!r} does not match its quantization; {want!r}")
        if (self.method == "none") != (self.weights is None):
            raise ValueError(f"scheme {self.name!r}: method 'none' is exactly for unquantized schemes")
        if self.method in CALIBRATED_METHODS and (
            self.weights is None or self.weights.type != "int" or self.input_activations is not None
        ):
            raise ValueError(f"scheme {self.name!r}: {self.method} calibrates int weights only (weight-only WnA16)")
        return self

    @property
    def quantized(self) -> bool:
        return self.weights is not None

    @property
    def calibrated(self) -> bool:
        """Whether quantizing needs calibration text (GPTQ, AWQ)."""
        return self.method in CALIBRATED_METHODS


def _expected_format(w: WeightQuant | None, a: ActivationQuant | None) -> CompressionFormat:
    """compressed-tensors 0.19's choice (`compressors.format.infer_module_format`) for our schemes."""
    if w is None:
        if a is not None:
            raise ValueError("activation quantization without weight quantization is not supported")
        return "dense"
    if w.type == "float":
        if a is None or a.type != "float":
            raise ValueError("fp8 weights need fp8 activations here (W8A8-FP8); weight-only fp8 is not a preset")
        return "float-quantized"
    if a is None:
        return "pack-quantized"
    if a.type != "int":
        raise ValueError("int weights with float activations are not supported")
    return "int-quantized"


class Verdict(_Frozen):
    """Whether a scheme runs on one hardware profile, and why."""

    compatible: bool
    reason: str
