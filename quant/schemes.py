"""Quantization schemes as frozen, validated data: how a method stores and computes a model's Linear layers.

A `Scheme` says how the Linear layers of a model are stored (weights) and computed (activations);
embeddings, norms and routers stay bf16, and `lm_head` too unless the recipe quantizes it
(`Scheme.with_lm_head`). Its field names follow compressed-tensors'
`QuantizationArgs` so that `quant.compressed` can hand it over unchanged, and `format` is
compressed-tensors' own name for how the weights lie on disk (its `CompressionFormat`), chosen
exactly as compressed-tensors 0.19 `infer_module_format` would choose it:

- float weights with activation quantization -> `float-quantized` (fp8 W8A8-dynamic, per channel or
  in 128x128 blocks)
- int weights, no activation quantization    -> `pack-quantized`  (W4A16 and W8A16 alike: 32 / bits
  values per int32)
- int weights with int activations           -> `int-quantized`   (int8 W8A8: one int8 per weight)
- 4-bit float (E2M1) weights in groups of 16 with E4M3 scales and a float32 tensor scale
                                             -> `nvfp4-pack-quantized` (NVFP4: two values per uint8)
- 4-bit float weights in groups of 32 with E8M0 (power-of-two) scales
                                             -> `mxfp4-pack-quantized` (OCP MXFP4)
- no quantization                            -> `dense`

This module is plain data (no torch): the registry imports `quant.catalog`. The methods built from these types
(their presets, dtypes, gates and hardware verdicts) are in `quant.methods`, gathered by `quant.catalog`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

QuantType = Literal["int", "float"]
CompressionFormat = Literal[
    "dense", "pack-quantized", "float-quantized", "int-quantized", "nvfp4-pack-quantized", "mxfp4-pack-quantized"
]
# How the quantized values are chosen: `none` (unquantized), round-to-nearest from the weights alone
# (`rtn`: kiln's `quant.rtn`), or by llm-compressor (`quant.calibrated`): calibrated on sample text (GPTQ:
# Hessian-based error feedback, for int4 and NVFP4 weights; AWQ: activation-aware per-channel smoothing,
# then round-to-nearest), or
# `minmax`, its `QuantizationModifier`'s min-max observers (round-to-nearest for the weights, with the
# tensor scales NVFP4 shares across fused q/k/v and gate/up; static activation scales observed on sample text);
# or `released`: a pre-quantized release's own values, kept as stored (kiln chooses none of them).
QuantMethod = Literal["none", "rtn", "gptq", "awq", "minmax", "released"]
CALIBRATED_METHODS: tuple[QuantMethod, ...] = ("gptq", "awq")
LLMCOMPRESSOR_METHODS: tuple[QuantMethod, ...] = ("gptq", "awq", "minmax")
# A 4-bit float group size -> its format: NVFP4 (E4M3 block scales times a tensor scale), or MXFP4 (E8M0).
FP4_FORMATS: dict[int, CompressionFormat] = {16: "nvfp4-pack-quantized", 32: "mxfp4-pack-quantized"}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class WeightQuant(_Frozen):
    """How a Linear weight is quantized (compressed-tensors `QuantizationArgs` for `weights`)."""

    num_bits: Literal[4, 8]
    type: QuantType
    # tensor_group: per group of `group_size` columns, times one float32 scale per tensor (NVFP4)
    strategy: Literal["channel", "group", "block", "tensor_group"]
    group_size: int | None = Field(
        default=None, gt=0, description="input columns per scale (group and tensor_group strategies only)"
    )
    block_structure: tuple[int, int] | None = Field(
        default=None, description="(rows, columns) of weight per scale (block strategy only)"
    )
    symmetric: bool = True

    @model_validator(mode="after")
    def _consistent(self) -> WeightQuant:
        if (self.strategy in ("group", "tensor_group")) != (self.group_size is not None):
            raise ValueError(
                f"group_size is set exactly when strategy is 'group' or 'tensor_group'; got {self.strategy!r}"
            )
        if (self.strategy == "block") != (self.block_structure is not None):
            raise ValueError(f"block_structure is set exactly when strategy is 'block'; got {self.strategy!r}")
        if self.block_structure is not None and min(self.block_structure) <= 0:
            raise ValueError(f"block_structure must be positive; got {list(self.block_structure)}")
        if self.type == "float" and self.num_bits == 4:
            want = {16: "tensor_group", 32: "group"}.get(self.group_size or 0)
            if self.strategy != want:
                raise ValueError(
                    "4-bit float weights are NVFP4 (tensor_group of 16) or MXFP4 (group of 32); "
                    f"got {self.strategy!r} with group_size {self.group_size}"
                )
        elif self.strategy == "tensor_group":
            raise ValueError("the tensor_group strategy is NVFP4's (4-bit float weights in groups of 16)")
        if not self.symmetric:
            raise ValueError("only symmetric weight quantization is supported (no zero points)")
        return self


class ActivationQuant(_Frozen):
    """Dynamic activation quantization, computed at run time: one scale per token, or per token and group of
    `group_size` input columns; `local` (NVFP4): per group at run time, times a static per-tensor scale
    observed on calibration text."""

    num_bits: Literal[4, 8]
    type: QuantType
    strategy: Literal["token", "group", "tensor_group"] = "token"
    group_size: int | None = Field(default=None, gt=0)
    dynamic: Literal[True, "local"] = True
    symmetric: Literal[True] = True

    @model_validator(mode="after")
    def _consistent(self) -> ActivationQuant:
        if (self.strategy in ("group", "tensor_group")) != (self.group_size is not None):
            raise ValueError(
                f"group_size is set exactly when strategy is 'group' or 'tensor_group'; got {self.strategy!r}"
            )
        if (self.strategy == "tensor_group") != (self.dynamic == "local"):
            raise ValueError("activations in tensor groups (NVFP4) are exactly the locally dynamic ones")
        if self.num_bits == 4 and self.type != "float":
            raise ValueError("4-bit activations are FP4 (NVFP4, MXFP4)")
        return self


class KvCacheQuant(_Frozen):
    """The KV cache in FP8 E4M3 with one static scale per layer for the keys and one for the values, calibrated
    on sample text (compressed-tensors `kv_cache_scheme`; the tensors `<layer>.self_attn.k_scale` / `v_scale`)."""

    num_bits: Literal[8] = 8
    type: Literal["float"] = "float"
    strategy: Literal["tensor"] = "tensor"
    dynamic: Literal[False] = False
    symmetric: Literal[True] = True


# The output projection's module name, and what a scheme does with it: kept in bf16 (every preset, as llm-compressor's
# own recipes do) or quantized like the decoder's Linears (a recipe's `quantize.<quant>.lm_head: quantized`).
HEAD = "lm_head"
HeadChoice = Literal["kept", "quantized"]
HEAD_CHOICES: tuple[HeadChoice, ...] = ("kept", "quantized")


class Scheme(_Frozen):
    """A named quantization scheme for the Linear layers of a model (and, with `kv_cache`, its KV cache).

    `lm_head` is either in `ignore` (kept in bf16) or named in `targets` (quantized as the Linears are; by name, as
    vLLM's compressed-tensors loader matches its `ParallelLMHead`, which is no Linear there): `with_lm_head`."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,31}$")
    description: str
    weights: WeightQuant | None = None  # None: the checkpoint's bf16 weights, unquantized
    input_activations: ActivationQuant | None = None
    format: CompressionFormat
    method: QuantMethod
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ("lm_head",)
    kv_cache: KvCacheQuant | None = None

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> Any:
        """Without `kv_cache` when there is none: a scheme's dump (in stage keys and records) stays what it was
        before the field existed."""
        data = handler(self)
        if self.kv_cache is None and isinstance(data, dict):
            data.pop("kv_cache", None)
        return data

    @model_validator(mode="after")
    def _head(self) -> Scheme:
        if (HEAD in self.ignore) == (HEAD in self.targets):
            raise ValueError(f"scheme {self.name!r}: {HEAD} is either ignored (kept in bf16) or a target, not both")
        if HEAD in self.targets and self.weights is None:
            raise ValueError(f"scheme {self.name!r} quantizes nothing; it cannot quantize {HEAD}")
        return self

    @property
    def lm_head(self) -> HeadChoice:
        """Whether the output projection is kept in bf16 or quantized as the decoder's Linears."""
        return "quantized" if HEAD in self.targets else "kept"

    def with_lm_head(self, choice: HeadChoice) -> Scheme:
        """This scheme with `lm_head` kept in bf16 or quantized (a scheme that quantizes nothing refuses the latter)."""
        if choice == self.lm_head:
            return self
        targets = tuple(t for t in self.targets if t != HEAD)
        ignore = tuple(i for i in self.ignore if i != HEAD)
        if choice == "quantized":
            targets = (*targets, HEAD)
        else:
            ignore = (HEAD, *ignore)
        return Scheme.model_validate({**self.model_dump(), "targets": targets, "ignore": ignore})

    @model_validator(mode="after")
    def _format_matches(self) -> Scheme:
        want = _expected_format(self.weights, self.input_activations)
        if self.format != want:
            raise ValueError(f"scheme {self.name!r}: format {self.format!r} does not match its quantization; {want!r}")
        if (self.method == "none") != (self.weights is None):
            raise ValueError(f"scheme {self.name!r}: method 'none' is exactly for unquantized schemes")
        int_weight_only = self.weights is not None and self.weights.type == "int" and self.input_activations is None
        if self.method == "awq" and not int_weight_only:
            raise ValueError(f"scheme {self.name!r}: awq calibrates int weights only (weight-only WnA16)")
        if self.method == "gptq" and not (int_weight_only or self.format == FP4_FORMATS[16]):
            raise ValueError(f"scheme {self.name!r}: gptq calibrates int weight-only (WnA16) or NVFP4 weights")
        if self.method == "minmax" and self.format not in FP4_FORMATS.values():
            raise ValueError(f"scheme {self.name!r}: llm-compressor's min-max quantization is for FP4 only")
        if self.format in FP4_FORMATS.values() and self.method not in ("minmax", "gptq", "released"):
            raise ValueError(
                f"scheme {self.name!r}: FP4 weights are chosen by llm-compressor (minmax or gptq) or kept as released"
            )
        if self.method == "released" and self.lm_head == "quantized":
            raise ValueError(f"scheme {self.name!r} keeps a release's own tensors; it cannot quantize {HEAD}")
        return self

    @property
    def quantized(self) -> bool:
        return self.weights is not None

    @property
    def calibrated(self) -> bool:
        """Whether quantizing needs calibration text (GPTQ, AWQ, static activation or KV-cache scales)."""
        a = self.input_activations
        return (
            self.method in CALIBRATED_METHODS or (a is not None and a.dynamic == "local") or self.kv_cache is not None
        )

    @property
    def by_llmcompressor(self) -> bool:
        """Whether llm-compressor runs for it (`quant.calibrated`): it quantizes the weights (GPTQ, AWQ, FP4), or
        calibrates the KV-cache scales (the weights then stay kiln's round-to-nearest)."""
        return self.method in LLMCOMPRESSOR_METHODS or self.kv_cache is not None


def _expected_format(w: WeightQuant | None, a: ActivationQuant | None) -> CompressionFormat:
    """compressed-tensors 0.19's choice (`compressors.format.infer_module_format`) for our schemes."""
    if w is None:
        if a is not None:
            raise ValueError("activation quantization without weight quantization is not supported")
        return "dense"
    if w.type == "float" and w.num_bits == 4:
        if a is not None and (a.type, a.num_bits, a.group_size) != ("float", 4, w.group_size):
            raise ValueError("FP4 weights take FP4 activations in the same groups, or none (weight-only)")
        return FP4_FORMATS[w.group_size or 0]
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
