"""Read a GGUF file's header (metadata and tensor infos) without touching its tensor data.

Used to report what llama.cpp's quantizer wrote, and by `kiln inspect`. Numeric arrays are decoded
with numpy and strings with one `struct` call each, so a 150k-token vocabulary parses in well under a
second (gguf-py's GGUFReader builds a Python object per array element).

The file is untrusted: every count and length is checked against the bytes that remain before
anything is allocated or looped over, and the rules llama.cpp's `gguf_init_from_file_impl`
(ggml/src/gguf.cpp) applies are applied here too (no nested arrays, no duplicate keys or tensor
names, `general.alignment` a u32 power of two, names under 64 bytes, at most 4 dimensions, aligned
tensor offsets inside the file). Any violation is `InvalidInput` with code `GGUF_INVALID`.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput
from kiln.formats.gguf.constants import (
    GGML_MAX_DIMS,
    GGML_MAX_NAME,
    GGUF_ALIGNMENT,
    GGUF_MAGIC,
    SCALAR_FORMATS,
    TYPE_TRAITS,
    Keys,
    TensorType,
    ValueType,
)

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
# Limits far above any real file (a 256k-token vocabulary, a few thousand tensors), so that a header
# that claims more is refused before Python builds millions of objects for it.
MAX_KV = 1 << 16
MAX_TENSORS = 1 << 20
MAX_ARRAY_LEN = 1 << 24
MAX_KEY_BYTES = 1 << 16
# The fewest bytes each record can take: a key-value pair (key length, one key byte, type, one value
# byte), a tensor info (name length, n_dims, type, offset), an array element of each kind.
_MIN_KV_BYTES = 8 + 1 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8
_MIN_STRING_BYTES = 8
_HEADER_BYTES = 24  # magic, version, n_tensors, n_kv


def _invalid(message: str, **details: Any) -> InvalidInput:
    return InvalidInput(message, code=Codes.GGUF_INVALID, details=details)


def _q(text: str) -> str:
    """A name from the file, quoted and cut short for a message."""
    return repr(text[:80]) + ("..." if len(text) > 80 else "")


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

    @property
    def remaining(self) -> int:
        return len(self.buf) - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.remaining:
            raise _invalid(f"GGUF header is truncated: {what} needs {n} bytes, {self.remaining} remain", at=self.pos)

    def unpack(self, fmt: str, what: str) -> tuple[Any, ...]:
        size = struct.calcsize(fmt)
        self.need(size, what)
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return out

    def count(self, what: str, limit: int, min_item_bytes: int) -> int:
        """A u64 element count, refused when it exceeds `limit` or cannot fit in the remaining bytes."""
        (n,) = self.unpack("<Q", what)
        if n > limit or n * min_item_bytes > self.remaining:
            raise _invalid(
                f"GGUF {what} is {n}: more than {'the limit of ' + str(limit) if n > limit else 'the file can hold'}",
                at=self.pos - 8,
            )
        return int(n)

    def string(self, what: str) -> str:
        (n,) = self.unpack("<Q", f"the length of {what}")
        self.need(n, what)
        raw = bytes(self.buf[self.pos : self.pos + n])
        try:
            s = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _invalid(f"GGUF {what} is not valid UTF-8 (byte {e.start})", at=self.pos) from None
        self.pos += n
        return s

    def value(self, vtype: int, key: str) -> Any:
        vt = _value_type(vtype, key)
        if vt is ValueType.STRING:
            return self.string(f"the value of {_q(key)}")
        if vt is not ValueType.ARRAY:
            return self.unpack(SCALAR_FORMATS[vt], f"the value of {_q(key)}")[0]
        (sub,) = self.unpack("<I", f"the element type of {_q(key)}")
        st = _value_type(sub, key)
        if st is ValueType.ARRAY:
            # gguf.cpp refuses them too ("has invalid GGUF type"); no nesting, no recursion
            raise _invalid(f"GGUF metadata {_q(key)} is an array of arrays, which GGUF readers do not support", key=key)
        if st is ValueType.STRING:
            n = self.count(f"length of the array {_q(key)}", MAX_ARRAY_LEN, _MIN_STRING_BYTES)
            return [self.string(f"element {i} of {_q(key)}") for i in range(n)]
        import numpy as np

        dt = np.dtype(_NUMPY_DTYPES[st])
        n = self.count(f"length of the array {_q(key)}", MAX_ARRAY_LEN, dt.itemsize)
        end = self.pos + n * dt.itemsize
        arr = np.frombuffer(self.buf[self.pos : end], dtype=dt)
        self.pos = end
        return arr.tolist()


def _value_type(v: int, key: str) -> ValueType:
    try:
        return ValueType(v)
    except ValueError:
        raise _invalid(f"GGUF metadata {_q(key)} has unknown value type {v}", key=key) from None


def read_header(path: str | Path) -> GGUFHeader:
    """Parse the header of the GGUF file at `path` (memory-mapped; tensor data is not read)."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise InvalidInput("not a regular file")
            if st.st_size < _HEADER_BYTES:
                raise _invalid(f"{st.st_size} bytes is too small to be a GGUF file")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                view = memoryview(mm)
                try:
                    return _parse(view)
                finally:
                    view.release()
    except OSError as e:
        raise InvalidInput(f"{path}: cannot read ({e.strerror or e})") from None
    except InvalidInput as e:  # every message names the file
        raise InvalidInput(f"{path}: {e.message}", code=e.code, details=e.details) from None


def _parse(view: memoryview) -> GGUFHeader:
    cur = _Cursor(view)
    magic, version = cur.unpack("<II", "the magic and version")
    if magic != GGUF_MAGIC:
        raise _invalid(f"not a GGUF file (magic {magic:#x})")
    if version != 3:
        raise _invalid(f"GGUF version {version} is not supported (3 is)")
    (n_tensors,) = cur.unpack("<Q", "the tensor count")
    if n_tensors > MAX_TENSORS or n_tensors * _MIN_TENSOR_INFO_BYTES > cur.remaining:
        raise _invalid(f"GGUF tensor count {n_tensors} is more than the file can hold")
    n_kv = cur.count("metadata count", MAX_KV, _MIN_KV_BYTES)
    metadata: dict[str, Any] = {}
    types: dict[str, ValueType] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key {i}")
        if key in metadata:
            raise _invalid(f"GGUF metadata key {_q(key)} appears twice", key=key)
        if not key or len(key) > MAX_KEY_BYTES:
            raise _invalid(f"GGUF metadata key {i} is empty or longer than {MAX_KEY_BYTES} bytes")
        (vtype,) = cur.unpack("<I", f"the type of {_q(key)}")
        metadata[key] = cur.value(vtype, key)
        types[key] = ValueType(vtype)
    align = _alignment(metadata, types)
    tensors: list[TensorEntry] = []
    names: set[str] = set()
    for i in range(n_tensors):
        tensors.append(_tensor_info(cur, i, names, align))
    data_offset = (cur.pos + align - 1) // align * align
    _check_tensor_extents(tensors, data_offset, len(view))
    return GGUFHeader(version, metadata, tensors, data_offset)


def _alignment(metadata: dict[str, Any], types: dict[str, ValueType]) -> int:
    if Keys.ALIGNMENT not in metadata:
        return GGUF_ALIGNMENT
    value, vtype = metadata[Keys.ALIGNMENT], types[Keys.ALIGNMENT]
    if vtype is not ValueType.UINT32:
        raise _invalid(f"{Keys.ALIGNMENT} must be a UINT32, not {vtype.name} ({value!r:.60})")
    if value == 0 or value & (value - 1):
        raise _invalid(f"{Keys.ALIGNMENT} {value} is not a power of two")
    return int(value)


def _tensor_info(cur: _Cursor, i: int, names: set[str], align: int) -> TensorEntry:
    name = cur.string(f"the name of tensor {i}")
    if len(name.encode("utf-8")) >= GGML_MAX_NAME:
        raise _invalid(f"tensor {i} name {_q(name)} is {GGML_MAX_NAME} bytes or longer")
    if name in names:
        raise _invalid(f"tensor name {_q(name)} appears twice", tensor=name)
    names.add(name)
    (n_dims,) = cur.unpack("<I", f"the dimension count of {_q(name)}")
    if n_dims > GGML_MAX_DIMS:
        raise _invalid(f"tensor {_q(name)} has {n_dims} dimensions; ggml allows at most {GGML_MAX_DIMS}")
    dims = cur.unpack(f"<{n_dims}Q", f"the dimensions of {_q(name)}")
    numel = 1
    for d in dims:
        numel *= d
    if any(d >= 2**63 for d in dims) or numel >= 2**63:
        raise _invalid(
            f"tensor {_q(name)} has dimensions {list(dims)}: more elements than ggml's int64 holds", tensor=name
        )
    type_id, offset = cur.unpack("<IQ", f"the type and offset of {_q(name)}")
    if offset % align:
        raise _invalid(f"tensor {_q(name)} offset {offset} is not a multiple of the alignment {align}")
    return TensorEntry(name, tuple(reversed(dims)), type_id, offset)


def _check_tensor_extents(tensors: list[TensorEntry], data_offset: int, size: int) -> None:
    data_size = size - data_offset
    if data_size < 0 and tensors:
        raise _invalid(f"the data section starts at byte {data_offset}, past the end of the file ({size})")
    for t in tensors:
        nbytes = tensor_nbytes(t) or 0
        if t.offset + nbytes > data_size:
            raise _invalid(
                f"tensor {_q(t.name)} data [{t.offset}, {t.offset + nbytes}) runs past the end of the "
                f"data section ({data_size} bytes)",
                tensor=t.name,
            )


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
