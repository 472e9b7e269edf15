"""Lint an HF-format checkpoint directory (hf-bundle, rocm-bundle, trtllm): what vLLM, transformers and
TensorRT-LLM's PyTorch backend load from it.

Planned from headers, then one scale at a time: every shard's header is validated and the index checked
against them; config.json is checked (`targets.lint.config`); the layout (`targets.lint.layouts`) and the
architecture record (`ModelShape.tensors()`: every Linear, norm, router and expert the family has) give every
tensor the runtime loads, with its dtype and shape; then each scale tensor is read (memory-mapped, decoded,
judged) and dropped. Memory is the largest scale tensor; time is the headers plus the scales' bytes.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from kiln.core.errors import KilnError
from kiln.core.untrusted import loads_json
from kiln.formats.architectures.record import LINEAR_KINDS, TensorKind, TensorSpec
from kiln.formats.architectures.shape import ModelShape
from kiln.formats.safetensors import TensorInfo, read_header
from kiln.targets.lint.config import check_config, compare_shapes
from kiln.targets.lint.findings import LintReport, LintRequest, finding
from kiln.targets.lint.layouts import FLOATS, SCALAR, Layout, Param, is_scale, parse_layout
from kiln.targets.lint.values import count, decode, judge, read_bytes

CONFIG: Final = "config.json"
INDEX: Final = "model.safetensors.index.json"
SINGLE: Final = "model.safetensors"
HF_QUANT_CONFIG: Final = "hf_quant_config.json"
MAX_JSON_BYTES: Final = 64 * 1024 * 1024
# Kinds whose module a compressed-tensors target `Linear` matches at load: the quantizable Linears and the head.
# Routers and a shared expert's gate are built without a quant config by vLLM (`ReplicatedLinear(...,
# quant_config=None)` in its MoE models) and are not nn.Linear in transformers 5: always unquantized.
RUNTIME_LINEAR: Final = LINEAR_KINDS | {TensorKind.OUTPUT}
# Buffers some exporters leave in a checkpoint and every loader skips.
HARMLESS: Final = re.compile(r"\.rotary_emb\.inv_freq$")


@dataclass(frozen=True)
class Expected:
    """One tensor the runtime loads: its dtypes, shapes, the module it belongs to, and how to read it."""

    name: str
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    module: str
    param: Param | None = None  # for a quantized Linear's tensors

    @property
    def scale(self) -> bool:
        return self.param is not None and self.param.scale


def read_json(root: Path, name: str, report: LintReport, *, required: bool = True) -> Any | None:
    """A JSON file of the artifact, strictly parsed; None with a finding when absent or malformed."""
    path = root / name
    if not path.is_file():
        if required:
            report.add(finding("FILE_MISSING", name, "the runtime reads it and it is absent", name))
        return None
    raw = path.read_bytes()[: MAX_JSON_BYTES + 1]
    if len(raw) > MAX_JSON_BYTES:
        report.add(finding("JSON_INVALID", name, f"larger than {MAX_JSON_BYTES} bytes", name))
        return None
    try:
        return loads_json(raw, what=name)
    except KilnError as e:
        report.add(finding("JSON_INVALID", name, e.message, name))
        return None


def read_shards(root: Path, report: LintReport) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint by name, from the shards the index names (or model.safetensors)."""
    present = sorted(p.name for p in root.glob("*.safetensors"))
    index = read_json(root, INDEX, report, required=False) if (root / INDEX).exists() else None
    weight_map: dict[str, str] = {}
    if index is not None:
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            report.add(finding("SAFETENSORS_INDEX", "weight_map", "must map tensor names to shard files", INDEX))
        else:
            weight_map = wm
        files = sorted(set(weight_map.values()))
        for f in present:
            if f not in files:
                report.add(
                    finding("SAFETENSORS_INDEX", f, f"a shard {INDEX} does not name: no loader reads it", f, warn=True)
                )
    elif SINGLE in present:
        files = [SINGLE]
        for f in present:
            if f != SINGLE:
                report.add(finding("SAFETENSORS_INDEX", f, f"a shard beside {SINGLE} without {INDEX}: never read", f))
    else:
        report.add(finding("FILE_MISSING", SINGLE, f"neither {SINGLE} nor {INDEX}", None))
        return {}
    tensors: dict[str, TensorInfo] = {}
    for f in files:
        if "/" in f or not (root / f).is_file():
            report.add(finding("FILE_MISSING", f, f"{INDEX} names it and it is absent", INDEX))
            continue
        try:
            infos, _ = read_header(root / f, f)
        except KilnError as e:
            report.add(finding("SAFETENSORS_HEADER", f, e.message, f))
            continue
        for t in infos:
            if t.name in tensors:
                report.add(finding("SAFETENSORS_INDEX", t.name, f"in both {tensors[t.name].file} and {f}", f))
            tensors[t.name] = t
    for name, f in weight_map.items():
        held = tensors.get(name)
        if held is None and (root / f).is_file():
            report.add(finding("SAFETENSORS_INDEX", name, f"{INDEX} places it in {f}, which does not hold it", INDEX))
        elif held is not None and held.file != f:
            report.add(finding("SAFETENSORS_INDEX", name, f"{INDEX} places it in {f}, it is in {held.file}", INDEX))
    if weight_map:
        for name in sorted(set(tensors) - set(weight_map)):
            report.add(finding("SAFETENSORS_INDEX", name, f"in {tensors[name].file} but not in {INDEX}", INDEX))
    return tensors


def lint_bundle(req: LintRequest) -> LintReport:
    """Every check of an HF-format checkpoint directory (see the module doc)."""
    root = req.root
    report = LintReport(str(root), "safetensors")
    config = read_json(root, CONFIG, report)
    shape, found = check_config(config, CONFIG) if config is not None else (None, [])
    report.extend(found)
    if shape is not None and req.shape is not None:
        report.extend(compare_shapes(shape, req.shape, CONFIG))
    before = len(report.findings)
    tensors = read_shards(root, report)
    # A shard whose header cannot be read hides its tensors: listing each as missing would bury the cause.
    unreadable = any(f.code in ("SAFETENSORS_HEADER", "FILE_MISSING") for f in report.findings[before:])
    hf_quant = read_json(root, HF_QUANT_CONFIG, report, required=False) if (root / HF_QUANT_CONFIG).exists() else None
    layout, found = parse_layout(config if isinstance(config, dict) else {}, hf_quant, CONFIG)
    report.extend(found)
    if req.quant is not None:
        report.extend(_quant_findings(layout, req.quant))
    expected: dict[str, Expected] = {}
    if shape is not None and not found and not unreadable:
        expected = _check_tensors(shape, layout, tensors, report)
    report.tensors = len(tensors)
    _check_values(root, tensors, expected, report)
    return report


def _modules(shape: ModelShape) -> Iterator[tuple[str, list[TensorSpec]]]:
    """Each module of the model (its name without `.weight` / `.bias`) with its tensors, in order."""
    by_module: dict[str, list[TensorSpec]] = {}
    for spec in shape.tensors():
        by_module.setdefault(spec.name.rsplit(".", 1)[0], []).append(spec)
    if shape.tie_word_embeddings is False and "lm_head" not in by_module:  # pragma: no cover - tensors() lists it
        raise AssertionError("an untied model's tensors() lacks lm_head")
    yield from by_module.items()


def _stored_quantized(module: str, tensors: dict[str, TensorInfo]) -> bool:
    """Whether the checkpoint stores `module` quantized: tensors beside its weight and bias, or a weight that
    is not a float."""
    w = tensors.get(module + ".weight")
    if w is not None and w.dtype not in FLOATS:
        return True
    prefix = module + "."
    return any(
        n.startswith(prefix) and n[len(prefix) :] not in ("weight", "bias") and "." not in n[len(prefix) :]
        for n in tensors
    )


def _check_tensors(
    shape: ModelShape, layout: Layout, tensors: dict[str, TensorInfo], report: LintReport
) -> dict[str, Expected]:
    """Every tensor the runtime loads against the checkpoint's: present, dtype, shape; nothing else there."""
    expected: dict[str, Expected] = {}
    settled: set[str] = set()  # tensors a module-level finding already covers
    for module, specs in [] if layout.kind == "release" else _modules(shape):
        weight = next((s for s in specs if not s.bias), None)
        linear = weight is not None and weight.kind in RUNTIME_LINEAR and len(weight.shape) == 2
        want = linear and layout.quantizes(module)
        if linear:
            have = _stored_quantized(module, tensors)
            head = weight is not None and weight.kind is TensorKind.OUTPUT
            if head and have and layout.kind == "compressed-tensors":
                _module_finding(
                    report, settled, tensors, module, "LM_HEAD_QUANT",
                    "is stored quantized; vLLM loads the head unquantized (ParallelLMHead has no compressed-tensors "
                    "method) and refuses its quantized tensors" + ("" if want else ", and quantization_config.ignore "
                    "lists it"),
                )  # fmt: skip
                continue
            if want != have:
                code = "LM_HEAD_QUANT" if head else "QUANT_TARGET_MISMATCH"
                said = _declared(layout, module)
                if have:
                    msg = f"is stored quantized, but {said} leaves it unquantized: the runtime loads a float weight"
                else:
                    msg = f"is stored unquantized, but {said} quantizes it: the runtime loads its quantized tensors"
                _module_finding(report, settled, tensors, module, code, msg)
                continue
        for spec in specs:
            if spec.bias or not want:
                expected[spec.name] = Expected(spec.name, FLOATS, (spec.shape,), module)
                continue
            out, inp = spec.shape
            for p in layout.params(module, out, inp):
                name = f"{module}.{p.local}"
                expected[name] = Expected(name, p.dtypes, p.shapes, module, p)
    if layout.kind == "release":
        expected = _released(shape)
    if layout.kv_scales:
        for i in range(shape.num_layers):
            for kv in ("k_scale", "v_scale"):
                name = f"model.layers.{i}.{shape.arch.attention.prefix}.{kv}"
                expected[name] = Expected(
                    name, ("F32", *FLOATS), SCALAR, name.rsplit(".", 1)[0], Param(kv, FLOATS, SCALAR)
                )
    stacked = _stacked_experts(shape, tensors, report)
    settled |= stacked.keys()
    for name, e in expected.items():
        t = tensors.get(name)
        if t is None:
            if name in settled or any(_covers(p, r, name) for p, r in stacked.values()):
                continue
            code = "SCALE_MISSING" if e.scale else "TENSOR_MISSING"
            report.add(finding(code, name, f"the runtime loads it ({_want(e)}) and it is absent", None))
            continue
        if t.dtype not in e.dtypes:
            report.add(finding("TENSOR_DTYPE", name, f"is {t.dtype}; {_want(e)} expected", t.file))
        if t.shape not in e.shapes:
            code = "SCALE_SHAPE" if e.scale else "TENSOR_SHAPE"
            why = f" for {layout.describe}" if e.param is not None else ""
            report.add(finding(code, name, f"has shape {list(t.shape)}; {_shapes(e)} expected{why}", t.file))
    for name in sorted(set(tensors) - set(expected) - settled):
        t = tensors[name]
        if HARMLESS.search(name) or (name == "lm_head.weight" and shape.tie_word_embeddings):
            why = "a tied head's copy" if name.startswith("lm_head") else "a buffer loaders skip"
            report.add(finding("TENSOR_UNEXPECTED", name, f"{why}; not loaded", t.file, warn=True))
        else:
            local = name.rsplit(".", 1)[-1]
            what = "a scale" if is_scale(local) else "a tensor"
            report.add(
                finding(
                    "TENSOR_UNEXPECTED", name, f"{what} no {shape.architecture} {layout.describe} module loads", t.file
                )
            )
    return expected


def _released(shape: ModelShape) -> dict[str, Expected]:
    """Every tensor of a checkpoint in its release's layout (`shape.source_quant`, from config.json), as the release
    stores it: each quantized one as its values and scales in the layout's dtypes, the rest in a float type."""
    q = shape.source_quant
    assert q is not None
    out = {}
    for s in shape.stored_tensors():
        module = s.of.name.rsplit(".", 1)[0]
        dtypes: tuple[str, ...]
        if s.dtype is None:
            dtypes = FLOATS
        else:
            dtypes = q.layout.scale_dtypes if s.name.endswith(q.layout.scale_suffix) else q.layout.values_dtypes
        out[s.name] = Expected(s.name, dtypes, (s.shape,), module)
    return out


def _declared(layout: Layout, module: str) -> str:
    if layout.kind == "compressed-tensors":
        group = layout.group_for(module)
        return (
            f"quantization_config ({group.name}: {', '.join(group.targets)})" if group else "quantization_config.ignore"
        )
    if layout.kind == "modelopt":
        return f"{HF_QUANT_CONFIG} (exclude_modules)"
    return "config.json (no quantization_config)"


def _module_finding(
    report: LintReport, settled: set[str], tensors: dict[str, TensorInfo], module: str, code: str, message: str
) -> None:
    mine = [n for n in tensors if n.startswith(module + ".") and "." not in n[len(module) + 1 :]]
    settled.update(mine)
    file = tensors[mine[0]].file if mine else None
    report.add(finding(code, module, message, file))


def _stacked_experts(
    shape: ModelShape, tensors: dict[str, TensorInfo], report: LintReport
) -> dict[str, tuple[str, str]]:
    """Tensors of an expert block in a stacked layout (`<block>.<experts>.<rest>`, rest not starting with an
    expert index), each a finding: SCALE_LAYOUT where the layer also holds per-expert tensors (the runtime
    loads a layer's experts one way), TENSOR_UNEXPECTED where the whole layer is stacked (the family's
    checkpoints are per expert). Returns {name: (the layer's expert prefix, rest)}."""
    experts = shape.arch.mlp.experts
    if shape.moe is None or experts is None or experts.layout == "fused":
        return {}  # a family whose checkpoints stack their experts (gpt-oss): `shape.tensors()` names the stacks
    found: dict[str, tuple[str, str]] = {}
    for layer in shape.moe.sparse_layers:
        prefix = f"model.layers.{layer}.{experts.block}.{experts.experts}."
        mine = [n for n in tensors if n.startswith(prefix)]
        per_expert = [n for n in mine if n[len(prefix) :].split(".")[0].isdigit()]
        for n in mine:
            rest = n[len(prefix) :]
            if rest.split(".")[0].isdigit():
                continue
            found[n] = (prefix, rest)
            if per_expert:
                msg = (
                    f"a stacked tensor beside per-expert ones (e.g. {per_expert[0]}): vLLM's FusedMoE loads "
                    f"{prefix}<e>.<proj>.* one expert at a time, so the layer mixes two layouts"
                )
                report.add(finding("SCALE_LAYOUT", n, msg, tensors[n].file))
            else:
                msg = f"a stacked expert tensor; {shape.architecture} checkpoints hold {prefix}<e>.<proj>.*"
                report.add(finding("TENSOR_UNEXPECTED", n, msg, tensors[n].file))
    return found


def _covers(prefix: str, rest: str, name: str) -> bool:
    """Whether a stacked tensor (`gate_proj.weight_scale`, `weight_scale`, `gate_up_proj`) stands for the
    per-expert tensor `name` (`<prefix>3.gate_proj.weight_scale`): same layer, same local parameter, and the
    projection where it names one."""
    m = re.fullmatch(r"\d+\.([^.]+)\.([^.]+)", name[len(prefix) :]) if name.startswith(prefix) else None
    if m is None:
        return False
    proj, local = m.groups()
    parts = rest.split(".")
    names_proj = proj.removesuffix("_proj") in parts[0].removesuffix("_proj").split("_")
    if len(parts) == 1:  # `weight_scale` of every projection, or the stacked weights `gate_up_proj`
        return parts[0] == local or (local in ("weight", "weight_packed") and names_proj)
    return parts[-1] == local and names_proj


def _want(e: Expected) -> str:
    return f"{'/'.join(e.dtypes)} {_shapes(e)}"


def _shapes(e: Expected) -> str:
    return " or ".join(str(list(s)) for s in e.shapes)


def _quant_findings(layout: Layout, quant: str) -> list[Any]:
    """The artifact's quantization against the recipe's scheme (compressed-tensors only; ModelOpt and a release's
    own layout are the trtllm target's own mapping of a scheme)."""
    from kiln.quant.catalog import SCHEMES

    scheme = SCHEMES.get(quant)
    if scheme is None or layout.kind in ("modelopt", "release"):
        return []
    if scheme.weights is None:
        if layout.quantized:
            return [finding("QUANT_CONFIG_INVALID", "quantization_config", f"present in a {quant} artifact", CONFIG)]
        return []
    if layout.kind != "compressed-tensors":
        return [finding("QUANT_CONFIG_INVALID", "quantization_config", f"absent from a {quant} artifact", CONFIG)]
    out = []
    want = scheme.weights.model_dump()
    for g in layout.groups:
        if g.format != scheme.format:
            msg = f"{g.name} is {g.format}; the {quant} scheme writes {scheme.format}"
            out.append(finding("QUANT_CONFIG_INVALID", "quantization_config.format", msg, CONFIG))
        for key in ("num_bits", "type", "strategy", "group_size"):
            if g.weights.get(key) != want[key]:
                msg = f"{g.name}.weights.{key} is {g.weights.get(key)!r}; the {quant} scheme's is {want[key]!r}"
                out.append(finding("QUANT_CONFIG_INVALID", f"quantization_config.{g.name}.weights.{key}", msg, CONFIG))
    return out


def _check_values(
    root: Path, tensors: dict[str, TensorInfo], expected: dict[str, Expected], report: LintReport
) -> None:
    """Read every scale tensor (and compressed-tensors' `weight_shape`), one at a time, and judge it."""
    for name, t in tensors.items():
        e = expected.get(name)
        local = name.rsplit(".", 1)[-1]
        if e is not None and e.param is not None and e.param.value is not None:
            if t.dtype in e.dtypes and t.shape in e.shapes:
                got = tuple(int(v) for v in decode(read_bytes(root / t.file, t.offset, t.nbytes), t.dtype))
                if got != e.param.value:
                    msg = f"holds {list(got)}; the packed weight is {list(e.param.value)}"
                    report.add(finding("TENSOR_SHAPE", name, msg, t.file))
            continue
        if not is_scale(local):
            continue
        codec = e.param.codec if e is not None and e.param is not None and e.param.codec else t.dtype
        if codec == "U8" and local == "weight_scale":
            codec = "E8M0"  # MX scales are exponent bytes wherever they are
        if codec not in ("E8M0", "F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2", "BF16", "F16", "F32", "F64"):
            continue  # an integer "scale" is a dtype finding already
        raw = read_bytes(root / t.file, t.offset, t.nbytes)
        report.extend(judge(name, count(decode(raw, codec)), t.file))
        report.scales += 1
        report.scale_bytes += t.nbytes
        del raw
