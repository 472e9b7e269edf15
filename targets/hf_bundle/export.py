"""Write the HF-format bundle: config.json, tokenizer files and SafeTensors shards, tensor by tensor.

For a quantized scheme the Linear weights come from the shared quantize stage's output (already in
compressed-tensors' layout) and config.json gets its `quantization_config`; every other tensor is
the source's, in bf16. A pre-quantized source's quantized tensors that no quantize output replaces are
dequantized into bf16 (gpt-oss's MXFP4 experts, every FP8 weight of a bf16 bundle), and the artifact's record
says so (`dequantized`), as it says which release's bytes the quantize output kept (`passed_through`).
A release-only method (`mxfp4-experts`: `quant.methods.base.Method.release_only`) has no quantize stage: the
bundle is the release's own layout, its quantized tensors' stored values and scales byte for byte (`keep_released`)
and config.json's `quantization_config` as released (`bundle_tensors`).
Tensors keep the source's canonical order (a module's compressed tensors take its weight's place), so shards
are planned from headers before anything is read.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput
from kiln.formats.safetensors import SafeTensorsWriter
from kiln.quant.catalog import METHODS, SCHEMES, compatibility, compatible_hardware, get_scheme
from kiln.quant.schemes import Scheme, Verdict
from kiln.targets.base import ExportRequest, ExportResult

if TYPE_CHECKING:
    import torch

    from kiln.formats.hf_model import SourceModel

CODE_VERSION = "3"  # 3: config.json carries the family's implied_config keys
QUANTS = tuple(SCHEMES)
# The methods the shared quantize stage writes (a release-only one is the release's bytes, kept by the export).
QUANTIZED = tuple(name for name, m in METHODS.items() if m.scheme.quantized and not m.release_only)
# Every hardware profile some scheme runs on; each artifact records its own list (see quant.catalog).
HARDWARE = tuple(dict.fromkeys(hw for s in SCHEMES.values() for hw in compatible_hardware(s)))
DEFAULT_SHARD_BYTES = 2 * 1024**3
INDEX = "model.safetensors.index.json"


def plan_shards(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Greedy in-order sharding, as transformers does: a tensor larger than the limit gets its own shard."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


@dataclass(frozen=True)
class Planned:
    """One tensor of the bundle, known from headers; `read` materialises it when its turn comes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    read: Callable[[], torch.Tensor]
    source_bytes: int  # source bytes consumed once this tensor is written (for progress)
    progress: Callable[[int], None] = lambda n: None


def plan_tensors(source: SourceModel, quantized: Any, on_progress: Callable[[int], None]) -> list[Planned]:
    """Every tensor of the bundle in the source's order: quantized modules from the quantize output, the rest bf16."""
    planned: list[Planned] = []
    for n, info in source.tensors.items():
        if quantized is not None and quantized.replaces(n):
            stored = quantized.module_tensors(n)
            for i, q in enumerate(stored):
                t = quantized.tensors[q]
                consumed = info.nbytes if i == len(stored) - 1 else 0
                planned.append(
                    Planned(q, t.dtype, t.shape, t.nbytes, partial(quantized.tensor, q), consumed, on_progress)
                )
        else:
            planned.append(
                Planned(n, "BF16", info.shape, info.numel * 2, partial(_bf16, source, n), info.nbytes, on_progress)
            )
    for q in quantized.kv_scales() if quantized is not None else []:  # an FP8 KV cache's scales, last
        t = quantized.tensors[q]
        planned.append(Planned(q, t.dtype, t.shape, t.nbytes, partial(quantized.tensor, q), 0, on_progress))
    return planned


def _bf16(source: SourceModel, name: str) -> torch.Tensor:
    """A source tensor in bf16: as stored, or a pre-quantized release's dequantized (float32, then rounded)."""
    import torch

    return source.dequantized(name).to(torch.bfloat16)


@dataclass(frozen=True)
class SourceUse:
    """How a bundle holds a pre-quantized source's quantized tensors: the layout whose stored bytes it keeps,
    and the one it holds tensors of dequantized (in bf16, or quantized again by the quantize stage)."""

    passed_through: str | None = None
    dequantized: str | None = None


def source_use(source: SourceModel, quantized: Any) -> SourceUse:
    """What `plan_tensors` makes of the source's quantized tensors (none for a plain source)."""
    if source.quantized is None:
        return SourceUse()
    layout = source.quantized.quantization.layout.name
    upcast = any(
        quantized is None or not quantized.replaces(n) for n in source.quantized.tensors if n in source.tensors
    )
    dequantized = upcast or (quantized is not None and quantized.dequantized is not None)
    return SourceUse(
        passed_through=quantized.passed_through if quantized is not None else None,
        dequantized=layout if dequantized else None,
    )


def keep_released(source: SourceModel, planned: list[Planned]) -> list[Planned]:
    """The plan with each tensor the source stores quantized as its stored values and scales, as released (their
    bytes, read once for both), in place of its dequantized bf16."""
    if source.quantized is None:
        return planned
    out = []
    for p in planned:
        qt = source.quantized.tensors.get(p.name)
        if qt is None:
            out.append(p)
            continue
        read = _stored_pair(source, p.name, qt.values.name, qt.scale.name)
        for part, consumed in ((qt.values, 0), (qt.scale, p.source_bytes)):
            out.append(Planned(part.name, part.dtype, part.shape, part.nbytes, read[part.name], consumed, p.progress))
    return out


def _stored_pair(source: SourceModel, name: str, values: str, scale: str) -> dict[str, Any]:
    """Readers of one quantized tensor's two stored parts that read the release once: the values first (the plan's
    order), the scales kept until their turn."""
    held: dict[str, torch.Tensor] = {}

    def read_values() -> torch.Tensor:
        stored = source.stored(name)
        held[scale] = stored[scale]
        return stored[values]

    def read_scale() -> torch.Tensor:
        return held.pop(scale) if scale in held else source.stored(name)[scale]

    return {values: read_values, scale: read_scale}


@dataclass(frozen=True)
class BundleTensors:
    """What a bundle of one scheme holds: its tensors in order, config.json's `quantization_config` (None: none) and
    how it holds a pre-quantized source's quantized tensors."""

    planned: list[Planned]
    quantization_config: dict[str, Any] | None
    use: SourceUse


def bundle_tensors(
    source: SourceModel, scheme: Scheme, quantized: Any, on_progress: Callable[[int], None]
) -> BundleTensors:
    """The bundle of `scheme`: the quantize output's tensors and config over the source's bf16 (`plan_tensors`), or,
    for a release-only method, the release's own layout (`keep_released`, its `quantization_config` as released)."""
    if not METHODS[scheme.name].release_only:
        planned = plan_tensors(source, quantized, on_progress)
        return BundleTensors(
            planned, quantized.config if quantized is not None else None, source_use(source, quantized)
        )
    released = source.quantized
    route = METHODS[scheme.name].from_sources.get(released.quantization.layout.name) if released is not None else None
    if released is None or route is None or route.action != "keep":
        layout = released.quantization.layout.name if released is not None else "plain"
        raise InvalidInput(
            f"{scheme.name} is a release's own layout; this source is {layout}",
            code=Codes.QUANT_SOURCE_REFUSED,
            details={"quant": scheme.name, "layout": layout},
        )
    planned = keep_released(source, plan_tensors(source, None, on_progress))
    config = dict(source.config["quantization_config"])
    return BundleTensors(planned, config, SourceUse(passed_through=released.quantization.layout.name))


def checked_inputs(target: str, req: ExportRequest) -> tuple[Scheme, Any]:
    """The scheme for `req.quant` (the preset) and the shared quantize output, checked to belong together."""
    scheme = get_scheme(req.quant) if req.quant in SCHEMES else None
    if scheme is None:
        raise InvalidInput(f"{target} builds {', '.join(QUANTS)}; got {req.quant!r}")
    quantized = req.quantized
    # The quantize output's scheme is the preset, its lm_head kept or quantized as the recipe chose.
    if (req.quant in QUANTIZED) != (quantized is not None) or (
        quantized is not None and quantized.scheme.with_lm_head("kept") != scheme
    ):
        want = f"the quantize stage output for {scheme.name}" if req.quant in QUANTIZED else "no quantized input"
        raise InvalidInput(f"{target}-{scheme.name}: needs {want}")
    return scheme, quantized


def write_bundle(
    source: SourceModel, out: Path, planned: list[Planned], quantization_config: dict[str, Any] | None, max_shard: int
) -> list[str]:
    """Write shards (+ index), config.json, generation config and tokenizer into `out`; returns the files."""
    import torch

    if max_shard <= 0:
        raise InvalidInput("hf-bundle: params.max_shard_bytes must be positive")
    by_name = {p.name: p for p in planned}
    shards = plan_shards([(p.name, p.nbytes) for p in planned], max_shard)
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map: dict[str, str] = {}
    for fname, members in zip(files, shards, strict=True):
        writer = SafeTensorsWriter(out / fname, metadata={"format": "pt"})
        for n in members:
            writer.add(n, by_name[n].dtype, by_name[n].shape)
        writer.begin()
        try:
            for n in members:
                t = by_name[n].read().contiguous()
                writer.write(n, t.reshape(-1).view(torch.uint8).numpy().tobytes())  # a scalar too
                by_name[n].progress(by_name[n].source_bytes)
                weight_map[n] = fname
            writer.close()
        except BaseException:
            writer.abort()
            raise
    if len(files) > 1:
        total = sum(p.nbytes for p in planned)
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))

    config = dict(source.config)
    for key in ("torch_dtype", "dtype"):
        if key in config:
            config[key] = "bfloat16"
    if "torch_dtype" not in config and "dtype" not in config:
        config["dtype"] = "bfloat16"
    config.pop("quantization_config", None)
    for key, value in source.shape.arch.implied_config:
        config.setdefault(key, value)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    for name in ["generation_config.json", *source.tokenizer_files]:
        src: Path = source.root / name
        if src.is_file():
            shutil.copyfile(src, out / name)
    return sorted(p.name for p in out.iterdir())


def bundle_runtime(source: SourceModel, scheme: Scheme) -> dict[str, Any]:
    """The runtime requirements a bundle of `scheme` records in its manifest."""
    runtime: dict[str, Any] = {
        "dtype": "bfloat16",
        "loaders": {"vllm": ">=0.9", "transformers": ">=4.45"},
        "architecture": source.shape.architecture,
    }
    if METHODS[scheme.name].release_only:
        # The release's own layout, read by the loaders that read the release (gpt-oss: vLLM 0.10.1, transformers 4.55).
        runtime["quantization"] = {
            "method": source.config["quantization_config"]["quant_method"],
            "scheme": scheme.name,
        }
        runtime["loaders"] = {"vllm": ">=0.10.1", "transformers": ">=4.55"}
    elif scheme.quantized:
        runtime["quantization"] = {
            "method": "compressed-tensors",
            "format": scheme.format,
            "scheme": scheme.name,
            **({"lm_head": "quantized"} if scheme.lm_head == "quantized" else {}),
        }
        runtime["loaders"] = {"vllm": ">=0.9", "transformers": ">=5.0", "compressed-tensors": ">=0.19"}
    return runtime


def export(source: SourceModel, req: ExportRequest) -> ExportResult:
    scheme, quantized = checked_inputs("hf-bundle", req)
    scheme = quantized.scheme if quantized is not None else scheme
    max_shard = int(req.params.get("max_shard_bytes", DEFAULT_SHARD_BYTES))
    made = bundle_tensors(source, scheme, quantized, req.on_progress)
    files = write_bundle(source, req.out_dir, made.planned, made.quantization_config, max_shard)
    use = made.use
    return ExportResult(
        files=files,
        runtime=bundle_runtime(source, scheme),
        details={
            "shards": sum(f.endswith(".safetensors") for f in files),
            "hardware": {hw: v.model_dump() for hw, v in compatibility(scheme).items()},
        },
        hardware=compatible_hardware(scheme),
        passed_through=use.passed_through,
        dequantized=use.dequantized,
    )


def scheme_compatibility(quant: str, params: dict[str, Any]) -> dict[str, Verdict]:
    """`TargetSpec.compatibility_fn` of hf-bundle: the scheme's own hardware verdicts."""
    return compatibility(get_scheme(quant))
