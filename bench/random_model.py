"""Random-weight releases of any Llama shape, for the benchmarks that need real-sized weights.

`write_weights(out, config)` writes the tensors config.json implies (`formats.hf_model.ModelShape`) in
checkpoint order (embeddings, the layers in turn, the final norm, lm_head) as bf16, N(0, 0.02) with the
norms 1, generated and written one tensor at a time into SafeTensors shards of at most `shard_bytes`
with `model.safetensors.index.json`: writing Llama-3-8B's shape holds one tensor (the 1 GB embedding),
never the model. The caller writes config.json and the tokenizer.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SHARD_BYTES = 5_000_000_000  # transformers' default max_shard_size ("5GB")


def checkpoint_tensors(config: Mapping[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor `config` implies, in checkpoint order."""
    from formats.hf_model import ModelShape

    def order(name: str) -> tuple[int, int]:
        if name.startswith("model.layers."):
            return 1, int(name.split(".")[2])
        return (0, 0) if name == "model.embed_tokens.weight" else (2, name != "model.norm.weight")

    return sorted(ModelShape.from_config(dict(config)).expected_tensors().items(), key=lambda kv: order(kv[0]))


def write_weights(
    out: Path, config: Mapping[str, Any], *, seed: int = 0, shard_bytes: int = SHARD_BYTES, label: str = ""
) -> int:
    """The shards and their index in `out` (an existing directory); returns the weights' bytes. With a
    `label`, each shard written is reported on stderr."""
    import torch

    from formats.safetensors import SafeTensorsWriter

    tensors = checkpoint_tensors(config)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    filled = 0
    for name, shape in tensors:
        nbytes = 2 * math.prod(shape)
        if shards[-1] and filled + nbytes > shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append((name, shape))
        filled += nbytes
    generator = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    started = time.perf_counter()
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        writer = SafeTensorsWriter(out / fname, metadata={"format": "pt"})
        for name, shape in shard:
            writer.add(name, "BF16", shape)
        writer.begin()
        for name, shape in shard:
            if len(shape) == 1:
                t = torch.ones(shape, dtype=torch.bfloat16)
            else:
                t = torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=generator)
            writer.write(name, t.view(torch.uint8).numpy().data)
            weight_map[name] = fname
            del t
        writer.close()
        if label:
            print(f"  {label}: wrote {fname} ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    total = sum(2 * math.prod(shape) for _, shape in tensors)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return total
