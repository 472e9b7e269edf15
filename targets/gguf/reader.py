"""Read a GGUF file's header (metadata and tensor infos) without touching its tensor data.

Used to report what llama.cpp's quantizer wrote, and by `kiln inspect`. Numeric arrays are decoded
with numpy and strings with one `struct` call each, so a 150k-token vocabulary parses in well under a
second (gguf-py's GGUFReader builds a Python object per array element).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.errors import InvalidInput

from .constants import GGUF_ALIGNMENT, GGUF_MAGIC, SCALAR_FORMATS, TYPE_TRAITS, Keys, TensorType, ValueType

_NUMPY_DTYPES = {
    ValueType.UINT8: "<u1",
    ValueType.INT8: "<i1",
    ValueType.UINT16: "<u2",
    ValueType.INT16: "<i2",
    ValueType.UINT32: "<u4",
    ValueType.INT32: "<i4",
    ValueType.FLOAT32: "<f4",
    ValueType.BOOL: "?",
    ValueType.UINT64: "<u8",
    ValueType.INT64: "<i8",
    ValueType.FLOAT64: "<f8",
}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]  # numpy order (rows last)
    type_id: int  # ggml type id; `type_name` maps the ones kiln knows
    offset: int  # from the start of the data section

    @property
    def type_name(self) -> str:
        try:
            return TensorType(self.type_id).name
        except ValueError:
            return f"type{self.type_id}"


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorEntry]
    data_offset: int  # absolute offset of the data section

    def tensor_types(self) -> dict[str, str]:
        return {t.name: t.type_name for t in self.tensors}


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise InvalidInput("GGUF header is truncated", code="GGUF_INVALID")
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return out

    def string(self) -> str:
        (n,) = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise InvalidInput("GGUF header is truncated", code="GGUF_INVALID")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        vt = _value_type(vtype)
        if vt is ValueType.STRING:
            return self.string()
        if vt is ValueType.ARRAY:
            sub, n = self.unpack("<IQ")
            st = _value_type(sub)
            if st is ValueType.STRING:
                return [self.string() for _ in range(n)]
            if st is ValueType.ARRAY:
                return [self.value(sub) for _ in range(n)]
            import numpy as np

            dt = np.dtype(_NUMPY_DTYPES[st])
            end = self.pos + n * dt.itemsize
            if end > len(self.buf):
                raise InvalidInput("GGUF header is truncated", code="GGUF_INVALID")
            arr = np.frombuffer(self.buf[self.pos : end], dtype=dt)
            self.pos = end
            return arr.tolist()
        return self.unpack(SCALAR_FORMATS[vt])[0]


def _value_type(v: int) -> ValueType:
    try:
        return ValueType(v)
    except ValueError:
        raise InvalidInput(f"GGUF metadata has unknown value type {v}", code="GGUF_INVALID") from None


def read_header(path: str | Path) -> GGUFHeader:
    """Parse the header of the GGUF file at `path` (memory-mapped; tensor data is not read)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        try:
            cur = _Cursor(view)
            magic, version = cur.unpack("<II")
            if magic != GGUF_MAGIC:
                raise InvalidInput(f"{path}: not a GGUF file (magic {magic:#x})", code="GGUF_INVALID")
            if version != 3:
                raise InvalidInput(f"{path}: GGUF version {version} is not supported (3 is)", code="GGUF_INVALID")
            n_tensors, n_kv = cur.unpack("<QQ")
            metadata: dict[str, Any] = {}
            for _ in range(n_kv):
                key = cur.string()
                (vtype,) = cur.unpack("<I")
                metadata[key] = cur.value(vtype)
            tensors = []
            for _ in range(n_tensors):
                name = cur.string()
                (n_dims,) = cur.unpack("<I")
                dims = cur.unpack(f"<{n_dims}Q")
                type_id, offset = cur.unpack("<IQ")
                tensors.append(TensorEntry(name, tuple(reversed(dims)), type_id, offset))
            align = int(metadata.get(Keys.ALIGNMENT, GGUF_ALIGNMENT))
            data_offset = (cur.pos + align - 1) // align * align
        finally:
            view.release()
    return GGUFHeader(version, metadata, tensors, data_offset)


def tensor_nbytes(entry: TensorEntry) -> int | None:
    """Bytes of a tensor whose type kiln knows, else None."""
    try:
        traits = TYPE_TRAITS[TensorType(entry.type_id)]
    except ValueError:
        return None
    n = 1
    for d in entry.shape:
        n *= d
    return n // traits.block_size * traits.type_size
