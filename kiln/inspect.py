"""`kiln inspect`: read the header of a SafeTensors or GGUF file without loading its data.

The file is untrusted: a malformed one is an `InvalidInput` (exit 2) naming the problem, and what it
holds is returned as data for the CLI to print through `kiln.console.safe_text`.
"""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from kiln.core.errors import InvalidInput

GGUF_MAGIC = b"GGUF"


class TensorInfo(BaseModel):
    name: str
    dtype: str
    shape: list[int]
    nbytes: int | None  # None: a GGUF tensor type this reader cannot size


class FileInfo(BaseModel):
    """What a weights file's header says: its format, its metadata and its tensors."""

    format: Literal["safetensors", "gguf"]
    # The file's own key/value metadata (SafeTensors' `__metadata__`, GGUF's keys), whatever the writer put there:
    # open by nature, printed as read.
    metadata: dict[str, Any]
    tensors: list[TensorInfo]


def inspect_file(path: Path) -> FileInfo:
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise InvalidInput(f"{path} is {kind}", details={"file": str(path)})
        with open(path, "rb") as f:
            magic = f.read(4)
    except FileNotFoundError:
        raise InvalidInput(f"{path} does not exist", details={"file": str(path)}) from None
    except OSError as e:
        raise InvalidInput(f"{path} cannot be read ({e.strerror or e})", details={"file": str(path)}) from None
    if magic == GGUF_MAGIC:
        return _gguf(path)
    if path.suffix == ".safetensors":
        return _safetensors(path)
    if not magic:
        raise InvalidInput(f"{path} is empty", details={"file": str(path)})
    raise InvalidInput(f"{path}: neither a GGUF file (magic {magic!r}) nor a .safetensors file")


def _safetensors(path: Path) -> FileInfo:
    from kiln.formats.safetensors import read_header

    tensors, meta = read_header(path, path.name)
    return FileInfo(
        format="safetensors",
        metadata=meta,
        tensors=[TensorInfo(name=t.name, dtype=t.dtype, shape=list(t.shape), nbytes=t.nbytes) for t in tensors],
    )


def _json_value(value: Any) -> Any:
    """NaN and infinities as strings: `--json` stays JSON (json.dumps would write a bare NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, list):
        return [_json_value(v) for v in value]
    return value


def _gguf(path: Path) -> FileInfo:
    from kiln.formats.gguf.reader import read_header, tensor_nbytes

    header = read_header(path)
    meta: dict[str, Any] = {}
    for key, value in header.metadata.items():
        if isinstance(value, list) and len(value) > 8:
            value = f"[{len(value)} items]"
        meta[key] = _json_value(value)
    return FileInfo(
        format="gguf",
        metadata=meta,
        tensors=[
            TensorInfo(name=t.name, dtype=t.type_name, shape=list(t.shape), nbytes=tensor_nbytes(t))
            for t in header.tensors
        ],
    )
