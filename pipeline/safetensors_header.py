"""Reading and checking SafeTensors headers without loading any tensor data.

Format: 8-byte little-endian header length N, N bytes of UTF-8 JSON, then the data buffer.
Each tensor entry has dtype, shape and data_offsets [begin, end) relative to the buffer.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import SourceInvalid

# dtype name -> item size in bytes (the dtypes safetensors defines that kiln accepts as weights)
DTYPE_SIZES: dict[str, int] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
MAX_HEADER_BYTES = 100 * 1024 * 1024
_TENSOR_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}$")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str  # file name relative to the source directory
    offset: int  # absolute byte offset of the data in the file
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: Path, rel_name: str) -> tuple[list[TensorInfo], dict[str, str]]:
    """Parse and validate one SafeTensors file's header. Returns its tensors and __metadata__."""
    size = path.stat().st_size
    where = {"file": rel_name}
    if size < 8:
        raise SourceInvalid(f"{rel_name}: too small to be a SafeTensors file ({size} bytes)", details=where)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_HEADER_BYTES:
            raise SourceInvalid(
                f"{rel_name}: header of {n} bytes exceeds the {MAX_HEADER_BYTES}-byte limit", details=where
            )
        if 8 + n > size:
            raise SourceInvalid(f"{rel_name}: header length {n} runs past the end of the file", details=where)
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SourceInvalid(f"{rel_name}: header is not valid UTF-8 JSON ({e})", details=where) from None
    if not isinstance(header, dict):
        raise SourceInvalid(f"{rel_name}: header must be a JSON object", details=where)
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise SourceInvalid(f"{rel_name}: __metadata__ must map strings to strings", details=where)
    buffer_start = 8 + n
    buffer_len = size - buffer_start
    tensors: list[TensorInfo] = []
    for name, entry in header.items():
        tensors.append(_check_entry(rel_name, name, entry, buffer_start, buffer_len))
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors if t.nbytes)
    for (_, end_a, name_a), (begin_b, _, name_b) in zip(spans, spans[1:], strict=False):
        if begin_b < end_a:
            raise SourceInvalid(
                f"{rel_name}: tensors {name_a!r} and {name_b!r} overlap", details={**where, "tensor": name_b}
            )
    return tensors, meta


def _check_entry(rel_name: str, name: str, entry: object, buffer_start: int, buffer_len: int) -> TensorInfo:
    where = {"file": rel_name, "tensor": name}
    if not _TENSOR_NAME.match(name) or ".." in name:
        raise SourceInvalid(f"{rel_name}: invalid tensor name {name!r}", details=where)
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise SourceInvalid(f"{rel_name}: tensor {name!r} needs exactly dtype, shape, data_offsets", details=where)
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPE_SIZES:
        raise SourceInvalid(
            f"{rel_name}: tensor {name!r} has unsupported dtype {dtype!r}; supported: {', '.join(DTYPE_SIZES)}",
            details=where,
        )
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise SourceInvalid(f"{rel_name}: tensor {name!r} has invalid shape {shape!r}", details=where)
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise SourceInvalid(f"{rel_name}: tensor {name!r} has invalid data_offsets {offsets!r}", details=where)
    begin, end = offsets
    if end > buffer_len:
        raise SourceInvalid(
            f"{rel_name}: tensor {name!r} data [{begin}, {end}) is out of bounds (buffer is {buffer_len} bytes)",
            details=where,
        )
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if end - begin != expected:
        raise SourceInvalid(
            f"{rel_name}: tensor {name!r} spans {end - begin} bytes but {dtype}{shape} needs {expected}",
            details=where,
        )
    return TensorInfo(name, dtype, tuple(shape), rel_name, buffer_start + begin, end - begin)
