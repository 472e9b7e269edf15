"""How an HF-format checkpoint stores a quantized Linear, per format, as data: the tensors its runtime loads.

Three layouts, read from the artifact itself:

- `dense`: no quantization_config; every Linear a float `weight`.
- compressed-tensors (config.json `quantization_config`, what vLLM and transformers load): each config group
  names its targets (`Linear`, a module name, or `re:<regex>`), the modules it skips (`ignore`), and how the
  weights are stored (`format`). The tensors per format are those vLLM's schemes create
  (`compressed_tensors/schemes/*.py`, `create_weights`) and compressed-tensors 0.19 writes
  (`compressors/*/base.py`, `compression_param_names`; `quant.rtn.planned_tensors` is kiln's writer of them):

  | format               | tensors per Linear                                                            |
  |----------------------|-------------------------------------------------------------------------------|
  | float-quantized      | weight F8_E4M3 [out, in], weight_scale, input_scale if activations are static |
  | int-quantized        | weight I8 [out, in], weight_scale, input_scale if activations are static      |
  | pack-quantized       | weight_packed I32 [out, in * bits / 32], weight_scale, weight_shape I64 [2]  |
  | nvfp4-pack-quantized | weight_packed U8 [out, in / 2], weight_scale F8_E4M3 [out, in / 16],          |
  |                      | weight_global_scale F32 [1], input_global_scale F32 [1] with FP4 activations  |
  | mxfp4-pack-quantized | weight_packed U8 [out, in / 2], weight_scale U8 (E8M0) [out, in / 32]        |

  and a scale's shape follows the strategy: tensor [1], channel [out, 1], group and tensor_group
  [out, ceil(in / group)], block [ceil(out / rows), ceil(in / cols)]; asymmetric weights add a
  `weight_zero_point` of the scale's shape. A `kv_cache_scheme` adds `k_scale` / `v_scale` to every attention.
- ModelOpt (hf_quant_config.json, what TensorRT-LLM's PyTorch backend loads): `targets.trtllm.schema`'s
  `LINEAR_TENSORS` per QuantAlgo, every Linear not matched by `exclude_modules` (fnmatch patterns).
- release: a release's own layout (config.json `quant_method` fp8 or mxfp4, `formats.prequantized`), which trtllm
  writes for the families whose TensorRT-LLM class reads it: every tensor as the release stores it
  (`ModelShape.stored_tensors`).

`parse_layout` turns the artifact's config into one of these, or findings saying why it cannot.
"""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass, field
from typing import Any, Final

from kiln.formats.prequantized import declares_prequantized
from kiln.targets.lint.findings import Finding, finding

FLOATS: Final = ("BF16", "F16", "F32")
FP8_WEIGHTS: Final = ("F8_E4M3", "F8_E4M3FNUZ")  # the ROCm bundle may carry gfx942's own FP8
SCALAR: Final = ((1,), ())
# Local names (after `<module>.`) that hold scales, in every layout; their values are read and judged.
SCALE_NAMES: Final = (
    "weight_scale",
    "weight_global_scale",
    "input_scale",
    "input_global_scale",
    "weight_scale_2",
    "pre_quant_scale",
    "k_scale",
    "v_scale",
    "output_scale",
)
# compressed-tensors `scale_dtype` (a torch dtype's name) -> SafeTensors dtype.
SCALE_DTYPES: Final = {
    "torch.float8_e4m3fn": "F8_E4M3",
    "torch.uint8": "U8",
    "torch.bfloat16": "BF16",
    "torch.float16": "F16",
    "torch.float32": "F32",
}
CT_FORMATS: Final = (
    "float-quantized",
    "int-quantized",
    "naive-quantized",
    "pack-quantized",
    "nvfp4-pack-quantized",
    "mxfp4-pack-quantized",
)


def is_scale(local: str) -> bool:
    return local in SCALE_NAMES


@dataclass(frozen=True)
class Param:
    """One tensor of a quantized Linear: its local name, allowed dtypes and shapes, how to decode it as a
    scale (`codec`: a dtype, or E8M0 for MX exponent bytes), and integer contents it must hold (`value`)."""

    local: str
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    codec: str | None = None
    value: tuple[int, ...] | None = None

    @property
    def scale(self) -> bool:
        return is_scale(self.local)


@dataclass(frozen=True)
class CtGroup:
    """One compressed-tensors config group, as vLLM reads it (`_quantization_scheme_map_from_config`)."""

    name: str
    targets: tuple[str, ...]
    format: str
    weights: dict[str, Any]
    activations: dict[str, Any] | None


@dataclass(frozen=True)
class Layout:
    """How one checkpoint stores its Linears: `kind` dense / compressed-tensors / modelopt, what each quantized
    Linear holds (`params`), which modules are quantized (`quantizes`), and whether the KV cache has scales."""

    kind: str
    describe: str
    groups: tuple[CtGroup, ...] = ()
    ignore: tuple[str, ...] = ()
    kv_scales: bool = False
    algo: str | None = None  # ModelOpt QuantAlgo
    group_size: int = 0
    exclude: tuple[str, ...] = ()
    specs: tuple[Any, ...] = field(default=(), repr=False)  # ModelOpt: targets.trtllm.schema.TensorSpec rows

    @property
    def quantized(self) -> bool:
        return self.kind != "dense"

    def group_for(self, module: str, cls: str = "Linear") -> CtGroup | None:
        """The config group that quantizes `module` (None: left unquantized)."""
        if self.kind == "compressed-tensors":
            if any(_matches(module, cls, ig) for ig in self.ignore):
                return None
            return next((g for g in self.groups if any(_matches(module, cls, t) for t in g.targets)), None)
        return None

    def quantizes(self, module: str) -> bool:
        if self.kind == "compressed-tensors":
            return self.group_for(module) is not None
        if self.kind == "modelopt":
            return not any(fnmatch.fnmatchcase(module, p) for p in self.exclude)
        return False

    def params(self, module: str, out: int, inp: int) -> list[Param]:
        """The tensors quantized Linear `module` of shape [out, in] stores (local names)."""
        if self.kind == "modelopt":
            return [
                Param(s.suffix, tuple(s.dtypes), (tuple(s.shape(out, inp, self.group_size)),), codec=None)
                for s in self.specs
            ]
        group = self.group_for(module)
        assert group is not None
        return ct_params(group, out, inp)


def _matches(module: str, cls: str, target: str) -> bool:
    """compressed-tensors' matching of a target or ignore entry: `re:` a regex from the start of the module's
    name, else the module's name or its class name."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target in (module, cls)


def ct_params(group: CtGroup, out: int, inp: int) -> list[Param]:
    """The tensors one compressed-tensors group stores for a Linear of [out, in] (see the module's table)."""
    w, a, fmt = group.weights, group.activations, group.format
    bits, strategy = w["num_bits"], w["strategy"]
    gs: int = w.get("group_size") or 1  # both checked by `_weight_args_problem` for the strategies using them
    block: list[int] = w.get("block_structure") or [1, 1]
    if strategy in ("group", "tensor_group"):
        scale_shapes: tuple[tuple[int, ...], ...] = ((out, math.ceil(inp / gs)),)
    elif strategy == "block":
        scale_shapes = ((math.ceil(out / block[0]), math.ceil(inp / block[1])),)
    elif strategy == "channel":
        scale_shapes = ((out, 1),)
    else:
        scale_shapes = SCALAR
    if fmt == "mxfp4-pack-quantized":
        scale = Param("weight_scale", ("U8",), scale_shapes, codec="E8M0")
    else:
        narrow = SCALE_DTYPES.get(str(w.get("scale_dtype")))
        want = ("F8_E4M3",) if fmt == "nvfp4-pack-quantized" else (narrow,) if narrow else FLOATS
        scale = Param("weight_scale", want, scale_shapes)
    params: list[Param] = []
    if fmt == "float-quantized":
        params.append(Param("weight", FP8_WEIGHTS, ((out, inp),)))
    elif fmt in ("int-quantized", "naive-quantized"):
        params.append(Param("weight", ("I8",), ((out, inp),)))
    elif fmt == "pack-quantized":
        params += [
            Param("weight_packed", ("I32",), ((out, math.ceil(inp * bits / 32)),)),
            Param("weight_shape", ("I64", "I32"), ((2,),), value=(out, inp)),
        ]
        if w.get("actorder") == "group":  # vLLM's WNA16 loads the column permutation then
            params.append(Param("weight_g_idx", ("I32", "I64"), ((inp,),)))
    else:  # the FP4 formats: two E2M1 values per byte along the input dimension
        params.append(Param("weight_packed", ("U8",), ((out, math.ceil(inp / 2)),)))
        if fmt == "nvfp4-pack-quantized":
            params.append(Param("weight_global_scale", ("F32",), SCALAR))
            if a is not None:
                params.append(Param("input_global_scale", ("F32",), SCALAR))
    params.append(scale)
    if not w.get("symmetric", True):
        params.append(Param("weight_zero_point", ("I8", "I32", "U8", *FLOATS), scale_shapes))
    if a is not None and a.get("dynamic") is False and fmt in ("float-quantized", "int-quantized", "naive-quantized"):
        params.append(Param("input_scale", FLOATS, SCALAR))
        if not a.get("symmetric", True):
            params.append(Param("input_zero_point", ("I8", "I32", *FLOATS), SCALAR))
    return params


def parse_layout(config: dict[str, Any], hf_quant_config: Any | None, file: str) -> tuple[Layout, list[Finding]]:
    """The layout the artifact declares: hf_quant_config.json (ModelOpt) when present, as TensorRT-LLM reads it
    first, else config.json's compressed-tensors `quantization_config`, else dense."""
    if hf_quant_config is not None:
        return _modelopt(hf_quant_config)
    qc = config.get("quantization_config")
    if qc is None:
        return Layout("dense", "unquantized"), []
    if declares_prequantized(config):  # checked with config.json (`targets.lint.config`)
        return Layout("release", f"{qc['quant_method']} as released"), []
    return _compressed_tensors(qc, file)


def _modelopt(doc: Any) -> tuple[Layout, list[Finding]]:
    from kiln.core.errors import KilnError
    from kiln.targets.trtllm.schema import HF_QUANT_CONFIG, LINEAR_TENSORS, parse_hf_quant_config

    try:
        q = parse_hf_quant_config(doc).quantization
    except KilnError as e:
        return Layout("dense", "unreadable"), [
            finding("QUANT_CONFIG_INVALID", HF_QUANT_CONFIG, e.message, HF_QUANT_CONFIG)
        ]
    if q.quant_algo not in LINEAR_TENSORS:
        msg = f"quant_algo {q.quant_algo} has no tensor layout kiln checks"
        return Layout("dense", "unreadable"), [finding("QUANT_CONFIG_INVALID", "quant_algo", msg, HF_QUANT_CONFIG)]
    if q.quant_algo is None:
        return Layout("dense", "unquantized (hf_quant_config.json)"), []
    return Layout(
        "modelopt",
        f"ModelOpt {q.quant_algo}",
        algo=q.quant_algo,
        group_size=q.group_size or 0,
        exclude=tuple(q.exclude_modules),
        specs=LINEAR_TENSORS[q.quant_algo],
    ), []


def _compressed_tensors(qc: Any, file: str) -> tuple[Layout, list[Finding]]:
    def bad(subject: str, message: str) -> tuple[Layout, list[Finding]]:
        return Layout("dense", "unreadable"), [finding("QUANT_CONFIG_INVALID", subject, message, file)]

    if not isinstance(qc, dict):
        return bad("quantization_config", "must be an object")
    if qc.get("quant_method") != "compressed-tensors":
        return bad("quantization_config.quant_method", f"{qc.get('quant_method')!r}: kiln lints compressed-tensors")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        return bad(
            "quantization_config.quantization_status",
            f"{status!r}: the weights are not stored compressed, and vLLM reads compressed checkpoints",
        )
    groups_doc = qc.get("config_groups")
    if not isinstance(groups_doc, dict) or not groups_doc:
        return bad("quantization_config.config_groups", "must name at least one group")
    groups = []
    for name, g in groups_doc.items():
        where = f"quantization_config.config_groups.{name}"
        if not isinstance(g, dict) or not isinstance(g.get("weights"), dict):
            return bad(where, "each group needs its weights' quantization args")
        targets = g.get("targets")
        if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
            return bad(f"{where}.targets", "must be a non-empty list of module names, classes or re: patterns")
        fmt = g.get("format") or qc.get("format")
        if fmt not in CT_FORMATS:
            return bad(
                f"{where}.format", f"{fmt!r} is not a compressed-tensors format vLLM loads: {', '.join(CT_FORMATS)}"
            )
        w = g["weights"]
        problem = _weight_args_problem(w)
        if problem:
            return bad(f"{where}.weights", problem)
        acts = g.get("input_activations")
        groups.append(CtGroup(name, tuple(targets), fmt, w, acts if isinstance(acts, dict) else None))
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        return bad("quantization_config.ignore", "must be a list of module names or re: patterns")
    kinds = sorted({g.format for g in groups})
    return Layout(
        "compressed-tensors",
        f"compressed-tensors {', '.join(kinds)}",
        groups=tuple(groups),
        ignore=tuple(ignore),
        kv_scales=qc.get("kv_cache_scheme") is not None,
    ), []


def _weight_args_problem(w: dict[str, Any]) -> str | None:
    """What makes a group's weight args unusable for a loader (None: nothing)."""
    strategy = w.get("strategy")
    if type(w.get("num_bits")) is not int or not 1 <= w["num_bits"] <= 8:
        return f"num_bits {w.get('num_bits')!r} is not 1..8"
    if strategy not in ("tensor", "channel", "group", "tensor_group", "block"):
        return f"strategy {strategy!r} is not one a Linear's weights use"
    if strategy in ("group", "tensor_group") and (type(w.get("group_size")) is not int or w["group_size"] <= 0):
        return f"strategy {strategy} needs a positive group_size, got {w.get('group_size')!r}"
    block = w.get("block_structure")
    if strategy == "block" and not (
        isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)
    ):
        return f"strategy block needs block_structure [rows, cols], got {block!r}"
    return None
