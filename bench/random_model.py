"""Random-weight releases of any Llama shape, for the benchmarks that need real-sized weights.

`write_weights(out, config)` writes the tensors config.json implies (`formats.architectures.shape.ModelShape`) in
checkpoint order (embeddings, the layers in turn, the final norm, lm_head) as bf16, N(0, 0.02) with the
norms 1, generated on every core (reproducibly: `_normal`) and written one tensor at a time into
SafeTensors shards of at most `shard_bytes` with `model.safetensors.index.json`: writing Llama-3-8B's
shape holds one tensor (the 1 GB embedding), never the model. The caller writes config.json and the
tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

SHARD_BYTES = 5_000_000_000  # transformers' default max_shard_size ("5GB")


def checkpoint_tensors(config: Mapping[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor `config` implies, in checkpoint order."""
    from kiln.formats.architectures.shape import ModelShape

    def order(name: str) -> tuple[int, int]:
        if name.startswith("model.layers."):
            return 1, int(name.split(".")[2])
        return (0, 0) if name == "model.embed_tokens.weight" else (2, name != "model.norm.weight")

    return sorted(ModelShape.from_config(dict(config)).expected_tensors().items(), key=lambda kv: order(kv[0]))


CHUNK = 1 << 24  # elements drawn by one generator: a tensor's chunks are drawn on several threads


def _normal(shape: tuple[int, ...], seed: int, name: str) -> Any:
    """N(0, 0.02) in bf16, chunk by chunk on every core: chunk i from a generator seeded by (`seed`, the
    tensor's name, i), so the values do not depend on the thread count (one generator thread wrote 16 GB
    in 213 s on a 16-core machine)."""
    import torch

    out = torch.empty(math.prod(shape), dtype=torch.bfloat16)
    base = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:7], "little")

    def fill(i: int) -> None:
        generator = torch.Generator().manual_seed(base + i)
        out[i * CHUNK : (i + 1) * CHUNK].normal_(0.0, 0.02, generator=generator)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(fill, range((out.numel() + CHUNK - 1) // CHUNK)))
    return out.view(shape)


def write_weights(
    out: Path, config: Mapping[str, Any], *, seed: int = 0, shard_bytes: int = SHARD_BYTES, label: str = ""
) -> int:
    """The shards and their index in `out` (an existing directory); returns the weights' bytes. With a
    `label`, each shard written is reported on stderr."""
    import torch

    from kiln.formats.safetensors import SafeTensorsWriter

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
    weight_map: dict[str, str] = {}
    started = time.perf_counter()
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        writer = SafeTensorsWriter(out / fname, metadata={"format": "pt"})
        for name, shape in shard:
            writer.add(name, "BF16", shape)
        writer.begin()
        for name, shape in shard:
            t = torch.ones(shape, dtype=torch.bfloat16) if len(shape) == 1 else _normal(shape, seed, name)
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
