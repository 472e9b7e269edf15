"""`kiln inspect`: read the header of a SafeTensors or GGUF file without loading its data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.errors import InvalidInput

GGUF_MAGIC = b"GGUF"


def inspect_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise InvalidInput(f"{path} is not a file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == GGUF_MAGIC:
        return _gguf(path)
    if path.suffix == ".safetensors":
        return _safetensors(path)
    raise InvalidInput(f"{path}: neither a GGUF file (magic {magic!r}) nor a .safetensors file")


def _safetensors(path: Path) -> dict[str, Any]:
    from pipeline.safetensors_header import read_header

    tensors, meta = read_header(path, path.name)
    return {
        "format": "safetensors",
        "metadata": meta,
        "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "nbytes": t.nbytes} for t in tensors],
    }


def _gguf(path: Path) -> dict[str, Any]:
    from targets.gguf.reader import read_header, tensor_nbytes

    header = read_header(path)
    meta: dict[str, Any] = {}
    for key, value in header.metadata.items():
        if hasattr(value, "tolist"):  # numeric arrays come back as numpy arrays
            value = value.tolist()
        if isinstance(value, list) and len(value) > 8:
            value = f"[{len(value)} items]"
        meta[key] = value
    return {
        "format": "gguf",
        "metadata": meta,
        "tensors": [
            {"name": t.name, "dtype": t.type_name, "shape": list(t.shape), "nbytes": tensor_nbytes(t)}
            for t in header.tensors
        ],
    }
