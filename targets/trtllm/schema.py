"""What TensorRT-LLM's PyTorch backend reads from a HF-format checkpoint, as data, and a checker for it.

Sources (NVIDIA/TensorRT-LLM, main branch as of 2026):

- `tensorrt_llm/quantization/mode.py`: the `QuantAlgo` names and `KV_CACHE_QUANT_ALGO_LIST`.
- `tensorrt_llm/_torch/model_config.py` (`ModelConfig.from_pretrained`, `_build_modelopt_quant_config`):
  `hf_quant_config.json` is read when present and is authoritative; from its `quantization` block it
  takes `quant_algo`, `kv_cache_quant_algo`, `group_size`, `exclude_modules`, `has_zero_point`,
  `pre_quant_scale` (and `quantized_layers` for MIXED_PRECISION). Without it, config.json's
  `quantization_config` is read (`load_hf_quant_config`), compressed-tensors included.
- `tensorrt_llm/models/quant_config_utils.py` (`update_quant_config_from_compressed_tensors`): an 8-bit float
  `kv_cache_scheme` is `kv_cache_quant_algo` FP8, any other is refused (mirrored by `compressed_tensors_kv_algo`).
- `tensorrt_llm/_torch/modules/attention.py` and `attention_backend/trtllm.py`: the calibrated `k_scale` /
  `v_scale` reach the attention kernel only for an FP4 KV cache; an FP8 cache runs with a unit scale.
- `tensorrt_llm/quantization/modelopt_config.py`: the legacy (nested `quantization`) shape is read
  whenever that key is present, whoever the producer is; the flat shape needs a modelopt marker.
- `tensorrt_llm/models/quant_config_utils.py` (`_quant_config_from_config_group`): how one
  compressed-tensors config group becomes a `QuantAlgo` (mirrored by `compressed_tensors_algo`).
- `tensorrt_llm/_torch/modules/linear.py` (`get_quant_method` and the `*LinearMethod` classes): the
  tensor names, dtypes and shapes each algo's Linear loads (`LINEAR_TENSORS`).
- The Qwen3.5 HF weight-mapper unit test (`_pack_int4_rows`): W4A16 weights are int4 pairs of
  consecutive output rows in one byte, row 2j in the low nibble.
- Per family, `tensorrt_llm/_torch/models/modeling_{llama,mistral,qwen,qwen3,qwen3_moe,mixtral,gemma3,phi3}.py`
  (each `@register_auto_model` name; `_arch_index.py` lists them) and `checkpoints/hf/*_weight_mapper.py`: q/k/v
  and gate/up load into fused Linears from their separate tensors, Phi-3's fused ones are split by rows; experts
  load as `<block>.experts.<e>.w1/w3/w2` (Qwen3-MoE's gate_proj/up_proj/down_proj renamed so); the router is
  never quantized. Which tensors a model has is its architecture record's (`ModelShape.tensors`), so the checker
  covers every family; what the backend cannot load per family is `model_refusal`'s.
"""

from __future__ import annotations

import fnmatch
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput
from kiln.formats.architectures.record import TensorKind, TrtllmAssumption
from kiln.formats.architectures.shape import ModelShape
from kiln.formats.safetensors import TensorInfo, read_header
from kiln.targets.trtllm.formats import FORMATS, MOE_REFUSED, RELEASE_ALGOS

HF_QUANT_CONFIG = "hf_quant_config.json"
# A layer's KV-cache scales, beside its attention's projections (compressed-tensors' kv_cache_scheme).
KV_SCALES = ("k_scale", "v_scale")

# tensorrt_llm/quantization/mode.py: QuantAlgo. INT8 is a KV-cache algo only (QUANT_ALGO_LIST excludes it).
QuantAlgoName = Literal[
    "W8A16",
    "W4A16",
    "W4A16_AWQ",
    "W4A8_AWQ",
    "W8A16_GPTQ",
    "W4A16_GPTQ",
    "W8A8_SQ_PER_CHANNEL",
    "W8A8_SQ_PER_TENSOR_PLUGIN",
    "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN",
    "W8A8_SQ_PER_CHANNEL_PER_TENSOR_PLUGIN",
    "W8A8_SQ_PER_TENSOR_PER_TOKEN_PLUGIN",
    "W4A8_QSERVE_PER_GROUP",
    "W4A8_QSERVE_PER_CHANNEL",
    "FP8",
    "FP8_PER_CHANNEL_PER_TOKEN",
    "FP8_BLOCK_SCALES",
    "MIXED_PRECISION",
    "NVFP4",
    "W4A8_NVFP4_FP8",
    "W4A8_MXFP4_FP8",
    "W4A8_MXFP4_MXFP8",
    "W4A16_MXFP4",
    "NO_QUANT",
]
# tensorrt_llm/quantization/mode.py: KV_CACHE_QUANT_ALGO_LIST.
KvCacheQuantAlgo = Literal["FP8", "INT8", "NVFP4"]
# Algos with one scale per group of input columns; the group size some readers fix.
GROUPED_ALGOS = ("W4A16_AWQ", "W4A8_AWQ", "W4A16_GPTQ", "W8A16_GPTQ", "W4A16_MXFP4", "NVFP4", "FP8_BLOCK_SCALES")
FIXED_GROUP = {"NVFP4": 16, "FP8_BLOCK_SCALES": 128, "W4A16_MXFP4": 32}  # model_config.py / quant_config_utils.py


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Producer(_Strict):
    name: str = Field(min_length=1)
    version: str = Field(min_length=1)


class ModelOptQuantization(_Strict):
    """The `quantization` block of hf_quant_config.json (ModelOpt's legacy shape), as TensorRT-LLM reads it."""

    quant_algo: QuantAlgoName | None = None
    kv_cache_quant_algo: KvCacheQuantAlgo | None = None
    group_size: int | None = Field(default=None, gt=0)
    has_zero_point: bool = False
    pre_quant_scale: bool = False
    exclude_modules: list[str] = Field(default_factory=list)
    quantized_layers: dict[str, dict[str, Any]] | None = None  # MIXED_PRECISION only

    @model_validator(mode="after")
    def _consistent(self) -> ModelOptQuantization:
        algo = self.quant_algo
        if algo in GROUPED_ALGOS and algo not in FIXED_GROUP and self.group_size is None:
            raise ValueError(f"quant_algo {algo} needs group_size")
        if algo in FIXED_GROUP and self.group_size not in (None, FIXED_GROUP[algo]):
            raise ValueError(f"quant_algo {algo} supports group_size {FIXED_GROUP[algo]} only; got {self.group_size}")
        if (algo == "MIXED_PRECISION") != (self.quantized_layers is not None):
            raise ValueError("quantized_layers is given exactly for quant_algo MIXED_PRECISION")
        return self


class HfQuantConfig(_Strict):
    """hf_quant_config.json: the producer and the quantization TensorRT-LLM applies to the checkpoint."""

    producer: Producer
    quantization: ModelOptQuantization


def parse_hf_quant_config(data: Any) -> HfQuantConfig:
    """Validate an hf_quant_config.json document; every problem is named in one InvalidInput."""
    try:
        return HfQuantConfig.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'document'}: {err['msg']}" for err in e.errors())
        raise InvalidInput(f"{HF_QUANT_CONFIG}: {problems}", code=Codes.TRTLLM_QUANT_CONFIG) from None


def compressed_tensors_algo(quantization_config: dict[str, Any]) -> str:
    """The QuantAlgo TensorRT-LLM derives from a single-group compressed-tensors `quantization_config`.

    Mirrors `_quant_config_from_config_group` (quant_config_utils.py), including what it does not
    check: it never looks at `type`, so int8 W8A8 reads as FP8_PER_CHANNEL_PER_TOKEN; a weight-only
    int group (no `input_activations`) fails there, as it fails here.
    """
    groups = quantization_config.get("config_groups") or {}
    if quantization_config.get("quant_method") != "compressed-tensors" or len(groups) != 1:
        raise InvalidInput("expected one compressed-tensors config group", code=Codes.TRTLLM_QUANT_CONFIG)
    group = next(iter(groups.values()))
    weights, acts = group["weights"], group.get("input_activations")
    if acts is None:
        raise InvalidInput(
            "TensorRT-LLM reads no weight-only compressed-tensors group (it needs input_activations)",
            code=Codes.TRTLLM_QUANT_CONFIG,
        )
    if weights["num_bits"] == 8 and weights["strategy"] == "channel" and acts["strategy"] == "token":
        return "FP8_PER_CHANNEL_PER_TOKEN"
    if weights["num_bits"] == 8 and weights["strategy"] == "block" and acts["strategy"] == "group":
        if acts.get("group_size") != 128:
            raise InvalidInput("FP8_BLOCK_SCALES supports group_size 128 only", code=Codes.TRTLLM_QUANT_CONFIG)
        return "FP8_BLOCK_SCALES"
    raise InvalidInput(
        f"no TensorRT-LLM QuantAlgo for compressed-tensors group {group}", code=Codes.TRTLLM_QUANT_CONFIG
    )


def compressed_tensors_kv_algo(quantization_config: dict[str, Any]) -> str | None:
    """The `kv_cache_quant_algo` TensorRT-LLM derives from a compressed-tensors `kv_cache_scheme` (None: none)."""
    kv = quantization_config.get("kv_cache_scheme")
    if kv is None:
        return None
    if isinstance(kv, dict) and kv.get("num_bits") == 8 and kv.get("type") == "float":
        return "FP8"
    raise InvalidInput(f"TensorRT-LLM reads no kv_cache_scheme {kv}", code=Codes.TRTLLM_QUANT_CONFIG)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor a quantized Linear loads: name suffix, allowed SafeTensors dtypes, shape from (out, in, group)."""

    suffix: str
    dtypes: tuple[str, ...]
    shape: Callable[[int, int, int], tuple[int, ...]]


_FLOAT_SCALES = ("BF16", "F16", "F32")
# tensorrt_llm/_torch/modules/linear.py, per QuantAlgo (None: unquantized). Scales are cast to the
# parameter's dtype by copy_weight, so any float dtype loads; the FP8 rowwise scale keeps
# compressed-tensors' [out, 1] shape (the Qwen3.5 mapper test loads RedHatAI FP8-dynamic that way).
LINEAR_TENSORS: dict[str | None, tuple[TensorSpec, ...]] = {
    None: (TensorSpec("weight", ("BF16",), lambda o, i, g: (o, i)),),
    "FP8_PER_CHANNEL_PER_TOKEN": (
        TensorSpec("weight", ("F8_E4M3",), lambda o, i, g: (o, i)),
        TensorSpec("weight_scale", _FLOAT_SCALES, lambda o, i, g: (o, 1)),
    ),
    "FP8_BLOCK_SCALES": (
        TensorSpec("weight", ("F8_E4M3",), lambda o, i, g: (o, i)),
        TensorSpec("weight_scale", _FLOAT_SCALES, lambda o, i, g: (math.ceil(o / 128), math.ceil(i / 128))),
    ),
    # W4A16_AWQ_LinearMethod: weight [out/2, in] bytes (transposed at load into its (in, out/2) int8
    # parameter), weight_scale [out, in/group] (transposed at load), pre_quant_scale [in], which
    # load_weights_vanilla reads unconditionally for o_proj and down_proj.
    "W4A16_AWQ": (
        TensorSpec("weight", ("U8", "I8"), lambda o, i, g: (o // 2, i)),
        TensorSpec("weight_scale", ("BF16", "F16"), lambda o, i, g: (o, i // g)),
        TensorSpec("pre_quant_scale", ("BF16", "F16"), lambda o, i, g: (i,)),
    ),
    # NVFP4LinearMethod: E2M1 pairs along the input dimension (low nibble first) [out, in/2], E4M3 block scales
    # [out, in/16] row-major (it pads and swizzles them at load), float32 scalars weight_scale_2 and
    # input_scale (ModelOpt writes shape []; [1] broadcasts the same), alpha = input_scale * weight_scale_2.
    "NVFP4": (
        TensorSpec("weight", ("U8",), lambda o, i, g: (o, i // 2)),
        TensorSpec("weight_scale", ("F8_E4M3",), lambda o, i, g: (o, i // 16)),
        TensorSpec("weight_scale_2", ("F32",), lambda o, i, g: ()),
        TensorSpec("input_scale", ("F32",), lambda o, i, g: ()),
    ),
}


def _excluded(module: str, patterns: tuple[str, ...]) -> bool:
    """Whether TensorRT-LLM leaves `module` unquantized for these exclude_modules / ignore entries: a glob on the
    name (`QuantConfig.is_module_excluded_from_quantization`, fnmatch), or compressed-tensors' name suffix."""
    return any(fnmatch.fnmatchcase(module, p) or module.endswith("." + p) or module == p for p in patterns)


# FP8 block scales' block: TensorRT-LLM reads 128 x 128 only (`load_hf_quant_config` asserts it).
FP8_BLOCK = 128

# tensorrt_llm/_torch/models/modeling_gpt_oss.py, `AttentionBlock.__init__`: the YaRN rope it builds from the HF
# config, `rope_theta` as an attribute and these from `rope_scaling` by key (a KeyError where one is missing; it
# never reads transformers 5's `rope_parameters`). Its scale_type is yarn whatever `rope_type` says.
YARN_SCALING_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")


def _yarn(shape: ModelShape) -> dict[str, Any] | str:
    """The one YaRN rope every layer of this model has (`ModelShape.rope`, parsed from `rope_scaling` or
    `rope_parameters`) as {theta, factor, its other parameters}, or what keeps it from being that."""
    specs = {spec for _, spec in shape.rope}
    if len(specs) != 1:
        return f"this config gives {len(specs)} ropes, not one for every layer"
    (spec,) = specs
    if spec.scaling != "yarn":
        return f"this config's rope is {spec.scaling!r}, not 'yarn'"
    params = {"factor": spec.factor, **dict(spec.params)}
    missing = [k for k in YARN_SCALING_KEYS if params.get(k) is None]
    if missing:
        return f"this config's rope gives no {', '.join(missing)}"
    return {"theta": spec.theta, **params}


def rope_scaling_config(shape: ModelShape) -> dict[str, Any]:
    """config.json's keys for a family whose TensorRT-LLM class reads its YaRN rope as `rope_scaling[...]`
    (`TrtllmAssumption` "yarn_rope_scaling"; `YARN_SCALING_KEYS`, from modeling_gpt_oss.py `AttentionBlock`):
    `rope_theta` and `rope_scaling` (rope_type yarn, the factor, and every other parameter the source gives),
    from the model's parsed rope, which a transformers 5 source writes as `rope_parameters` only. Empty for every
    other family."""
    assumed = dict(shape.arch.target("trtllm").trtllm_assumes)
    if "yarn_rope_scaling" not in assumed:
        return {}
    yarn = _yarn(shape)
    if isinstance(yarn, str):
        raise InvalidInput(
            f"{shape.architecture}: {assumed['yarn_rope_scaling']}; {yarn}", code=Codes.TRTLLM_CHECKPOINT
        )
    theta = yarn.pop("theta")
    return {"rope_theta": theta, "rope_scaling": {"rope_type": "yarn", **yarn}}


def _check_rope_scaling(shape: ModelShape, config: dict[str, Any]) -> None:
    """Refuse a config.json that lacks a key a "yarn_rope_scaling" class reads (`rope_scaling_config`), naming it."""
    why = dict(shape.arch.target("trtllm").trtllm_assumes).get("yarn_rope_scaling")
    if why is None:
        return
    scaling = config.get("rope_scaling")
    present = {"rope_theta": config.get("rope_theta")}
    present.update({f"rope_scaling.{k}": (scaling or {}).get(k) for k in YARN_SCALING_KEYS})
    missing = [k for k, v in present.items() if not isinstance(v, int | float) or isinstance(v, bool)]
    if missing:
        raise InvalidInput(
            f"config.json: {shape.architecture} needs {', '.join(missing)}: {why}",
            code=Codes.TRTLLM_CHECKPOINT,
            details={"missing": missing},
        )


def _broken(shape: ModelShape, assumption: TrtllmAssumption, algo: str | None) -> str | None:
    """What in this config breaks one of a TensorRT-LLM model class's assumptions, for a checkpoint of `algo`
    (None: nothing)."""
    moe = shape.moe
    if assumption == "even_layers_slide":
        kinds = [shape.layer_type(i) for i in range(shape.num_layers)]
        odd = [i for i, kind in enumerate(kinds) if (kind == "sliding_attention") != (i % 2 == 0)]
        if odd and shape.layer_types:
            return f"this config's layer_types make layers {odd[:8]} the other kind"
    if assumption == "blocks_of_128" and algo == "FP8_BLOCK_SCALES":
        widths = {"intermediate_size": shape.intermediate_size}
        if moe is not None:
            widths["moe_intermediate_size"] = moe.intermediate_size
            if moe.shared_intermediate_size:
                widths["the shared experts' width"] = moe.shared_intermediate_size
        if shape.mla is not None and shape.mla.q_lora_rank is not None:
            widths["q_lora_rank"] = shape.mla.q_lora_rank
        cut = {k: v for k, v in widths.items() if v % FP8_BLOCK}
        if cut:
            return (
                "this config has " + ", ".join(f"{k}={v}" for k, v in cut.items()) + f", not a multiple of {FP8_BLOCK}"
            )
    if assumption == "yarn_rope_scaling":
        yarn = _yarn(shape)
        if isinstance(yarn, str):
            return yarn
    if assumption == "every_layer_sparse" and moe is not None and len(moe.sparse_layers) < shape.num_layers:
        dense = sorted(set(range(shape.num_layers)) - set(moe.sparse_layers))
        return f"this config makes layers {dense[:8]} dense"
    if assumption == "norm_topk_prob" and moe is not None and not moe.norm_topk_prob:
        return "this config has norm_topk_prob false"
    if assumption == "no_softcapping":
        caps = {"attn_logit_softcapping": shape.attn_logit_softcapping}
        caps["final_logit_softcapping"] = shape.final_logit_softcapping
        set_caps = {k: v for k, v in caps.items() if v is not None}
        if set_caps:
            return "this config sets " + ", ".join(f"{k}={v}" for k, v in set_caps.items())
    window = shape.sliding_window
    sliding = "sliding_attention" in shape.layer_types
    if assumption == "no_binding_window" and sliding and window is not None and window < shape.max_position_embeddings:
        return f"this config slides over {window} of its {shape.max_position_embeddings} positions"
    return None


def model_refusal(shape: ModelShape, algo: str | None) -> tuple[str, str] | None:
    """Why TensorRT-LLM's PyTorch backend cannot serve this model as a checkpoint of QuantAlgo `algo` (None: bf16),
    as (error code, reason); None when it can. From the family's record (`TargetMapping`: `refused`,
    `trtllm_assumes`, `trtllm_refused`), then, for a family with experts, the fused MoE's limits (`MOE_REFUSED`)."""
    arch = shape.arch
    mapping = arch.target("trtllm")
    if mapping.refused is not None:
        return Codes.TARGET_ARCHITECTURE_UNSUPPORTED, mapping.refused
    for assumption, why in mapping.trtllm_assumes:
        broken = _broken(shape, assumption, algo)
        if broken is not None:
            code = Codes.QUANT_UNSUPPORTED if assumption == "blocks_of_128" else Codes.TARGET_ARCHITECTURE_UNSUPPORTED
            return code, f"{why}; {broken}"
    if algo is None:
        return None
    refused = dict(mapping.trtllm_refused).get(algo)
    if refused is not None:
        return Codes.QUANT_UNSUPPORTED, refused
    # The fused MoE's limits as kiln writes other families; a release layout the family's class reads is not them.
    released = {RELEASE_ALGOS[layout] for layout in mapping.trtllm_release_layouts}
    if shape.moe is not None and algo in MOE_REFUSED and algo not in released:
        return Codes.QUANT_UNSUPPORTED, MOE_REFUSED[algo]
    return None


def release_layout(shape: ModelShape, scheme: str) -> str | None:
    """The release layout (`formats.prequantized.LAYOUTS` name) a trtllm checkpoint of `scheme` is written in, for this
    model as its source stores it (None: kiln's own spelling, plain or compressed-tensors / ModelOpt): the fp8-block
    scheme in DeepSeek's spelling where the family's class reads that (`TargetMapping.trtllm_release_layouts`), and
    mxfp4-experts (the release's own layout, `formats.FORMATS`) where the class reads its MXFP4 experts as released."""
    layouts = shape.arch.target("trtllm").trtllm_release_layouts
    if scheme == "fp8-block" and "fp8-block" in layouts:
        return "fp8-block"
    source = shape.source_quant
    if FORMATS[scheme].layout == "release" and source is not None and source.layout.name in layouts:
        return source.layout.name
    return None


def release_tensors(shape: ModelShape) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """Every tensor of a checkpoint written in its release's layout (config.json's `quantization_config`, read into
    `shape.source_quant`), with its allowed dtypes and shape: the architecture record's tensors as the release stores
    them (`ModelShape.stored_tensors`: each quantized one as its values and scales, the rest bf16)."""
    q = shape.source_quant
    assert q is not None
    layout = q.layout
    out: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = {}
    for s in shape.stored_tensors():
        if s.dtype is None:
            dtypes: tuple[str, ...] = ("BF16",)
        elif s.name.endswith(layout.scale_suffix):
            dtypes = layout.scale_dtypes
        else:
            dtypes = layout.values_dtypes
        out[s.name] = (dtypes, s.shape)
    return out


def expected_tensors(
    shape: ModelShape, algo: str | None, group: int | None, exclude: tuple[str, ...]
) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """Every tensor TensorRT-LLM loads from a checkpoint of this model and algo, with its allowed dtypes and shape:
    the architecture record's tensors (`ModelShape.tensors`), each quantizable Linear (attention, MLP, fused qkv or
    gate_up, every expert's) as `LINEAR_TENSORS[algo]` unless excluded, everything else (norms, embeddings, the
    router, biases) bf16."""
    out: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = {}
    for t in shape.tensors():
        module = t.name.removesuffix(".weight")
        if algo is None or not t.quantizable or _excluded(module, exclude):
            out[t.name] = (("BF16",), t.shape)
            continue
        o, i = t.shape
        for spec in LINEAR_TENSORS[algo]:
            out[f"{module}.{spec.suffix}"] = (spec.dtypes, spec.shape(o, i, group or 0))
    return out


# Linear kinds TensorRT-LLM runs as one GEMM: q/k/v and gate/up as fused Linears, each expert's gate and up as its
# w3_w1. NVFP4 needs each group to share weight_scale_2 and input_scale (`NVFP4LinearMethod.load_weight_scales`,
# the fused MoE's `load_expert_fc31_alpha_nvfp4` and `load_expert_fc31_input_scale_nvfp4` assert it).
FUSED_KINDS: tuple[frozenset[TensorKind], ...] = (
    frozenset({TensorKind.ATTN_Q, TensorKind.ATTN_K, TensorKind.ATTN_V}),
    frozenset({TensorKind.FFN_GATE, TensorKind.FFN_UP}),
    frozenset({TensorKind.FFN_GATE_EXPS, TensorKind.FFN_UP_EXPS}),
    frozenset({TensorKind.FFN_GATE_SHEXP, TensorKind.FFN_UP_SHEXP}),
)


def fused_groups(shape: ModelShape) -> dict[str, tuple[str, ...]]:
    """Module -> the modules TensorRT-LLM runs it with as one GEMM (`FUSED_KINDS`), in checkpoint order; a module
    that runs alone has no entry."""
    groups: dict[tuple[int | None, int | None, int], list[str]] = {}
    for t in shape.tensors():
        for i, kinds in enumerate(FUSED_KINDS):
            if t.quantizable and t.kind in kinds:
                groups.setdefault((t.layer, t.expert, i), []).append(t.name.removesuffix(".weight"))
    return {m: tuple(g) for g in groups.values() if len(g) > 1 for m in g}


def router_modules(shape: ModelShape) -> list[str]:
    """The router (gate) of every sparse layer, by module name: never quantized, listed in exclude_modules."""
    return [t.name.removesuffix(".weight") for t in shape.tensors() if t.kind == TensorKind.FFN_GATE_INP]


@dataclass(frozen=True)
class CheckedCheckpoint:
    """What TensorRT-LLM would load: the algo, where it was read from, and every tensor checked."""

    quant_algo: str | None
    source: Literal["none", "hf_quant_config.json", "config.json"]
    group_size: int | None
    exclude_modules: tuple[str, ...]
    tensors: dict[str, TensorInfo]
    kv_cache_quant_algo: str | None = None


def _headers(root: Path) -> dict[str, TensorInfo]:
    files = sorted(p.name for p in root.glob("*.safetensors"))
    index = root / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    tensors: dict[str, TensorInfo] = {}
    for name in files:
        infos, _ = read_header(root / name, name)
        tensors.update({t.name: t for t in infos})
    return tensors


def check_checkpoint(root: Path) -> CheckedCheckpoint:
    """Check a checkpoint directory against what TensorRT-LLM's PyTorch backend reads (headers only).

    hf_quant_config.json, when present, is validated against `HfQuantConfig`; otherwise config.json's
    `quantization_config` is resolved as TensorRT-LLM resolves it. The model's family must be one the backend
    serves with that algo (`model_refusal`), and the checkpoint must hold exactly the tensors `expected_tensors`
    lists (each quantized Linear, every expert's included, with the tensors its algo loads), with those dtypes and
    shapes, plus a KV-cache scale pair per layer where a KV-cache algo is set; a ModelOpt checkpoint of a model with
    experts lists every router in exclude_modules; a family whose class reads its YaRN rope by key has those keys in
    config.json (`rope_scaling_config`).
    """
    config = json.loads((root / "config.json").read_text())
    shape = ModelShape.from_config(config)
    _check_rope_scaling(shape, config)
    algo: str | None
    source: Literal["none", "hf_quant_config.json", "config.json"]
    group: int | None = None
    exclude: tuple[str, ...] = ()
    kv_algo: str | None = None
    if (root / HF_QUANT_CONFIG).is_file():
        q = parse_hf_quant_config(json.loads((root / HF_QUANT_CONFIG).read_text())).quantization
        algo, group, exclude, source = q.quant_algo, q.group_size, tuple(q.exclude_modules), "hf_quant_config.json"
        kv_algo = q.kv_cache_quant_algo
        if q.has_zero_point:
            raise InvalidInput("kiln writes symmetric int4 only (has_zero_point false)", code=Codes.TRTLLM_CHECKPOINT)
    elif shape.source_quant is not None:  # a release's own layout (`quant_method` fp8 or mxfp4)
        release, source = shape.source_quant, "config.json"
        algo, group = RELEASE_ALGOS[release.layout.name], release.block[0]
        if release.layout.name not in shape.arch.target("trtllm").trtllm_release_layouts:
            raise InvalidInput(
                f"{shape.architecture}: kiln writes no {release.layout.name} release layout for TensorRT-LLM "
                f"(quantization_config.quant_method {release.layout.quant_method})",
                code=Codes.TRTLLM_CHECKPOINT,
            )
        if release.layout.name == "fp8-block" and release.block != (FP8_BLOCK, FP8_BLOCK):
            raise InvalidInput(
                f"config.json: weight_block_size {list(release.block)}; TensorRT-LLM reads FP8_BLOCK_SCALES in "
                f"{FP8_BLOCK} x {FP8_BLOCK} blocks only (load_hf_quant_config)",
                code=Codes.TRTLLM_CHECKPOINT,
            )
    elif "quantization_config" in config:
        qc = config["quantization_config"]
        algo, source, exclude = compressed_tensors_algo(qc), "config.json", tuple(qc.get("ignore") or ())
        kv_algo = compressed_tensors_kv_algo(qc)
    else:
        algo, source = None, "none"
    released = shape.source_quant is not None and source == "config.json"
    if algo not in LINEAR_TENSORS and not released:
        raise InvalidInput(f"kiln has no tensor layout for quant_algo {algo}", code=Codes.TRTLLM_CHECKPOINT)
    refusal = model_refusal(shape, algo)
    if refusal is not None:
        raise InvalidInput(
            f"{shape.architecture} as {algo or 'bf16'}: {refusal[1]}",
            code=Codes.TRTLLM_CHECKPOINT,
            details={"architecture": shape.architecture, "quant_algo": algo, "reason": refusal[1]},
        )
    if algo is not None and source == HF_QUANT_CONFIG:
        kept = [m for m in router_modules(shape) if not _excluded(m, exclude)]
        if kept:
            raise InvalidInput(
                f"{HF_QUANT_CONFIG}: exclude_modules must list every router, which TensorRT-LLM keeps in bf16; "
                f"missing {kept[:3]}",
                code=Codes.TRTLLM_CHECKPOINT,
                details={"missing": kept},
            )
    tensors = _headers(root)
    expected = release_tensors(shape) if released else expected_tensors(shape, algo, group, exclude)
    for name, (dtypes, dims) in expected.items():
        t = tensors.get(name)
        if t is None or t.dtype not in dtypes or t.shape != dims:
            got = "missing" if t is None else f"{t.dtype} {list(t.shape)}"
            raise InvalidInput(
                f"{name}: {algo or 'bf16'} needs {'/'.join(dtypes)} {list(dims)}, got {got}",
                code=Codes.TRTLLM_CHECKPOINT,
                details={"tensor": name, "quant_algo": algo},
            )
    kv_scales: set[str] = set()
    if kv_algo is not None:
        attention = shape.arch.attention.prefix
        kv_scales = {f"model.layers.{i}.{attention}.{kv}" for i in range(shape.num_layers) for kv in KV_SCALES}
        for name in sorted(kv_scales):
            t = tensors.get(name)
            if t is None or t.dtype not in _FLOAT_SCALES or math.prod(t.shape) != 1:
                got = "missing" if t is None else f"{t.dtype} {list(t.shape)}"
                raise InvalidInput(
                    f"{name}: KV cache {kv_algo} needs a float scalar, got {got}",
                    code=Codes.TRTLLM_CHECKPOINT,
                    details={"tensor": name, "kv_cache_quant_algo": kv_algo},
                )
    extra = sorted(set(tensors) - set(expected) - kv_scales)
    if extra:
        raise InvalidInput(
            f"{algo or 'bf16'}: tensors TensorRT-LLM would not load: {extra[:5]}",
            code=Codes.TRTLLM_CHECKPOINT,
            details={"tensors": extra[:20]},
        )
    return CheckedCheckpoint(algo, source, group, exclude, tensors, kv_algo)
