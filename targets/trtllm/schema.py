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
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from core.errors import InvalidInput
from formats.safetensors import TensorInfo, read_header

HF_QUANT_CONFIG = "hf_quant_config.json"

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
        raise InvalidInput(f"{HF_QUANT_CONFIG}: {problems}", code="TRTLLM_QUANT_CONFIG") from None


def compressed_tensors_algo(quantization_config: dict[str, Any]) -> str:
    """The QuantAlgo TensorRT-LLM derives from a single-group compressed-tensors `quantization_config`.

    Mirrors `_quant_config_from_config_group` (quant_config_utils.py), including what it does not
    check: it never looks at `type`, so int8 W8A8 reads as FP8_PER_CHANNEL_PER_TOKEN; a weight-only
    int group (no `input_activations`) fails there, as it fails here.
    """
    groups = quantization_config.get("config_groups") or {}
    if quantization_config.get("quant_method") != "compressed-tensors" or len(groups) != 1:
        raise InvalidInput("expected one compressed-tensors config group", code="TRTLLM_QUANT_CONFIG")
    group = next(iter(groups.values()))
    weights, acts = group["weights"], group.get("input_activations")
    if acts is None:
        raise InvalidInput(
            "TensorRT-LLM reads no weight-only compressed-tensors group (it needs input_activations)",
            code="TRTLLM_QUANT_CONFIG",
        )
    if weights["num_bits"] == 8 and weights["strategy"] == "channel" and acts["strategy"] == "token":
        return "FP8_PER_CHANNEL_PER_TOKEN"
    if weights["num_bits"] == 8 and weights["strategy"] == "block" and acts["strategy"] == "group":
        if acts.get("group_size") != 128:
            raise InvalidInput("FP8_BLOCK_SCALES supports group_size 128 only", code="TRTLLM_QUANT_CONFIG")
        return "FP8_BLOCK_SCALES"
    raise InvalidInput(f"no TensorRT-LLM QuantAlgo for compressed-tensors group {group}", code="TRTLLM_QUANT_CONFIG")


def compressed_tensors_kv_algo(quantization_config: dict[str, Any]) -> str | None:
    """The `kv_cache_quant_algo` TensorRT-LLM derives from a compressed-tensors `kv_cache_scheme` (None: none)."""
    kv = quantization_config.get("kv_cache_scheme")
    if kv is None:
        return None
    if isinstance(kv, dict) and kv.get("num_bits") == 8 and kv.get("type") == "float":
        return "FP8"
    raise InvalidInput(f"TensorRT-LLM reads no kv_cache_scheme {kv}", code="TRTLLM_QUANT_CONFIG")


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


def linear_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(out, in) of every Linear in a Llama-family decoder layer, from config.json."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    return {
        "self_attn.q_proj": (heads * head_dim, hidden),
        "self_attn.k_proj": (kv * head_dim, hidden),
        "self_attn.v_proj": (kv * head_dim, hidden),
        "self_attn.o_proj": (hidden, heads * head_dim),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }


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
    `quantization_config` is resolved as TensorRT-LLM resolves it. Then every decoder Linear must
    carry exactly the tensors `LINEAR_TENSORS` lists for that algo, with those dtypes and shapes.
    """
    config = json.loads((root / "config.json").read_text())
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
            raise InvalidInput("kiln writes symmetric int4 only (has_zero_point false)", code="TRTLLM_CHECKPOINT")
    elif "quantization_config" in config:
        qc = config["quantization_config"]
        algo, source, exclude = compressed_tensors_algo(qc), "config.json", tuple(qc.get("ignore") or ())
        kv_algo = compressed_tensors_kv_algo(qc)
    else:
        algo, source = None, "none"
    if algo not in LINEAR_TENSORS:
        raise InvalidInput(f"kiln has no tensor layout for quant_algo {algo}", code="TRTLLM_CHECKPOINT")
    tensors = _headers(root)
    expected: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (o, i) in linear_shapes(config).items():
            name = f"model.layers.{layer}.{module}"
            for spec in LINEAR_TENSORS[algo]:
                expected[f"{name}.{spec.suffix}"] = (spec.dtypes, spec.shape(o, i, group or 0))
    for name, (dtypes, shape) in expected.items():
        t = tensors.get(name)
        if t is None or t.dtype not in dtypes or t.shape != shape:
            got = "missing" if t is None else f"{t.dtype} {list(t.shape)}"
            raise InvalidInput(
                f"{name}: {algo or 'bf16'} needs {'/'.join(dtypes)} {list(shape)}, got {got}",
                code="TRTLLM_CHECKPOINT",
                details={"tensor": name, "quant_algo": algo},
            )
    linear = {n for n in tensors if n.startswith("model.layers.") and "_proj." in n and not n.endswith(".bias")}
    extra = sorted(linear - set(expected))
    if extra:
        raise InvalidInput(
            f"{algo or 'bf16'}: tensors TensorRT-LLM would not load: {extra[:5]}", code="TRTLLM_CHECKPOINT"
        )
    return CheckedCheckpoint(algo, source, group, exclude, tensors, kv_algo)
