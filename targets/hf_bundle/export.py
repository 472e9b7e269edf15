"""Write the HF-format bundle: config.json, tokenizer files and SafeTensors shards, tensor by tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from kiln.errors import InvalidInput
from targets.base import ExportRequest, ExportResult
from targets.safetensors_writer import SafeTensorsWriter

if TYPE_CHECKING:
    from pipeline.ingest import SourceModel

CODE_VERSION = "1"
QUANTS = ("bf16",)
# bf16 runs everywhere vLLM or transformers does: NVIDIA sm80+, AMD gfx942/gfx950, and CPUs.
HARDWARE = ("cpu", "a100", "l40s", "h100", "h200", "b200", "mi300x", "mi325x", "mi355x")
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


def export(source: SourceModel, req: ExportRequest) -> ExportResult:
    import torch

    if req.quant != "bf16":
        raise InvalidInput(f"hf-bundle builds {', '.join(QUANTS)}; got {req.quant!r}")
    max_shard = int(req.params.get("max_shard_bytes", DEFAULT_SHARD_BYTES))
    if max_shard <= 0:
        raise InvalidInput("hf-bundle: params.max_shard_bytes must be positive")
    out = req.out_dir
    names = list(source.tensors)
    shards = plan_shards([(n, source.tensors[n].numel * 2) for n in names], max_shard)
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map: dict[str, str] = {}
    for fname, members in zip(files, shards, strict=True):
        writer = SafeTensorsWriter(out / fname, metadata={"format": "pt"})
        for n in members:
            writer.add(n, "BF16", source.tensors[n].shape)
        writer.begin()
        try:
            for n in members:
                t = source.tensor(n).to(torch.bfloat16).contiguous()
                writer.write(n, t.view(torch.int16).numpy().tobytes())
                req.on_progress(source.tensors[n].nbytes)
                weight_map[n] = fname
            writer.close()
        except BaseException:
            writer.abort()
            raise
    if len(files) > 1:
        total = sum(source.tensors[n].numel * 2 for n in names)
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))

    config = dict(source.config)
    for key in ("torch_dtype", "dtype"):
        if key in config:
            config[key] = "bfloat16"
    if "torch_dtype" not in config and "dtype" not in config:
        config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    copied = ["generation_config.json", *source.tokenizer_files]
    for name in copied:
        src: Path = source.root / name
        if src.is_file():
            shutil.copyfile(src, out / name)
    return ExportResult(
        files=sorted(p.name for p in out.iterdir()),
        runtime={
            "dtype": "bfloat16",
            "loaders": {"vllm": ">=0.9", "transformers": ">=4.45"},
            "architecture": source.shape.architecture,
        },
        details={"shards": len(files)},
    )
