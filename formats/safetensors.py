"""SafeTensors, in one place: the dtype table, the header reader and the streaming writer.

Format: 8-byte little-endian header length N, N bytes of UTF-8 JSON, then the data buffer.
Each tensor entry has dtype, shape and data_offsets [begin, end) relative to the buffer, and the
tensors cover the buffer exactly: no holes, no overlaps, no trailing bytes (the safetensors
library refuses the same files: `SafeTensorError::InvalidOffset`, `MetadataIncompleteBuffer`).
Source: huggingface/safetensors `safetensors/src/tensor.rs` (`Dtype`, `validate`).

Reading: the header is untrusted input: it is parsed with strict JSON (no duplicate keys, no NaN,
bounded integers and nesting) and every value is checked with exact types (`True` is not a
dimension), so a bad file is one `SourceInvalid` naming the file and the field, never another
exception. Writing: `SafeTensorsWriter` plans every tensor from its shape, writes the header, then
the data in order; its states are PLANNING -> WRITING -> CLOSED and misuse (adding after the header,
writing out of order, a tensor whose size differs from its plan, closing with tensors missing) raises.
"""

from __future__ import annotations

import enum
import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from kiln.core.error_codes import Codes
from kiln.core.errors import KilnError, SourceInvalid
from kiln.core.untrusted import InvalidJSON, loads_json, short_repr


@dataclass(frozen=True)
class DType:
    """One SafeTensors dtype: its name in headers, its item size, and torch's name for it (if torch has one)."""

    name: str
    itemsize: int
    torch: str


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("F64", 8, "float64"),
        DType("F32", 4, "float32"),
        DType("F16", 2, "float16"),
        DType("BF16", 2, "bfloat16"),
        DType("F8_E4M3", 1, "float8_e4m3fn"),
        DType("F8_E4M3FNUZ", 1, "float8_e4m3fnuz"),
        DType("F8_E5M2", 1, "float8_e5m2"),
        DType("I64", 8, "int64"),
        DType("I32", 4, "int32"),
        DType("I16", 2, "int16"),
        DType("I8", 1, "int8"),
        DType("U8", 1, "uint8"),
        DType("BOOL", 1, "bool"),
    )
}

MAX_HEADER_BYTES = 100 * 1024 * 1024
# Limits no real checkpoint comes near; they keep arithmetic and error messages small.
MAX_DIMS = 16  # torch allows up to 25; weights have at most 5
MAX_DIM = 2**40  # one dimension; any larger cannot fit in a file anyway
MAX_ELEMENTS = 2**48  # product of the non-zero dimensions (safetensors refuses a product that overflows)
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


def parse_header_json(raw: bytes, rel_name: str) -> dict[str, Any]:
    """The header's JSON object, parsed strictly (`core.untrusted.loads_json`).

    Nesting deeper than `core.untrusted.MAX_DEPTH` is refused there; shallower junk is refused by the
    exact type checks of each entry.
    """
    where = {"file": rel_name}
    try:
        header = loads_json(raw, what=f"{rel_name}: header")
    except InvalidJSON as e:
        raise SourceInvalid(e.message, details=where) from None
    if not isinstance(header, dict):
        raise SourceInvalid(f"{rel_name}: header must be a JSON object", details=where)
    return header


def read_header(path: Path, rel_name: str) -> tuple[list[TensorInfo], dict[str, str]]:
    """Parse and validate one SafeTensors file's header. Returns its tensors and __metadata__."""
    where = {"file": rel_name}
    try:
        with open(path, "rb") as f:
            size = _regular_size(f.fileno(), rel_name)
            if size < 8:
                raise SourceInvalid(f"{rel_name}: too small to be a SafeTensors file ({size} bytes)", details=where)
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER_BYTES:
                raise SourceInvalid(
                    f"{rel_name}: header of {n} bytes exceeds the {MAX_HEADER_BYTES}-byte limit", details=where
                )
            if 8 + n > size:
                raise SourceInvalid(f"{rel_name}: header length {n} runs past the end of the file", details=where)
            raw = f.read(n)
    except OSError as e:
        raise SourceInvalid(f"{rel_name}: cannot read ({e.strerror or e})", details=where) from None
    if len(raw) != n:
        raise SourceInvalid(f"{rel_name}: file shrank while its header was read", details=where)
    header = parse_header_json(raw, rel_name)
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise SourceInvalid(f"{rel_name}: __metadata__ must map strings to strings", details=where)
    buffer_start = 8 + n
    buffer_len = size - buffer_start
    tensors = [_check_entry(rel_name, name, entry, buffer_start, buffer_len) for name, entry in header.items()]
    _check_coverage(rel_name, tensors, buffer_start, buffer_len)
    return tensors, meta


def _regular_size(fd: int, rel_name: str) -> int:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise SourceInvalid(f"{rel_name}: not a regular file", details={"file": rel_name})
    return st.st_size


def _check_coverage(rel_name: str, tensors: list[TensorInfo], buffer_start: int, buffer_len: int) -> None:
    """The tensors must tile the data buffer exactly, as the safetensors library requires."""
    filled = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors if t.nbytes)
    for (_, end_a, name_a), (begin_b, _, name_b) in zip(filled, filled[1:], strict=False):
        if begin_b < end_a:
            raise SourceInvalid(
                f"{rel_name}: tensors {name_a!r} and {name_b!r} overlap",
                details={"file": rel_name, "tensor": name_b},
            )
    cursor = buffer_start  # absolute offsets from here on
    for begin, end, name in sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors):
        if begin < cursor:  # an empty tensor inside another one's bytes
            raise SourceInvalid(
                f"{rel_name}: empty tensor {name!r} at byte {begin} lies inside another tensor's data",
                details={"file": rel_name, "tensor": name},
            )
        if begin > cursor:
            raise SourceInvalid(
                f"{rel_name}: bytes [{cursor}, {begin}) of the file belong to no tensor (a hole before {name!r}); "
                "the data buffer must be covered exactly",
                details={"file": rel_name, "range": [cursor, begin]},
            )
        cursor = end
    if cursor != buffer_start + buffer_len:
        raise SourceInvalid(
            f"{rel_name}: bytes [{cursor}, {buffer_start + buffer_len}) of the file belong to no tensor (trailing "
            "bytes after the last tensor); the data buffer must be covered exactly",
            details={"file": rel_name, "range": [cursor, buffer_start + buffer_len]},
        )


def _is_int(v: object) -> bool:
    return type(v) is int  # exact: bool is an int subclass, and True is not a dimension


def _check_entry(rel_name: str, name: str, entry: object, buffer_start: int, buffer_len: int) -> TensorInfo:
    where = {"file": rel_name, "tensor": name}
    if not _TENSOR_NAME.match(name) or ".." in name:
        raise SourceInvalid(f"{rel_name}: invalid tensor name {short_repr(name)}", details=where)
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise SourceInvalid(f"{rel_name}: tensor {name!r} needs exactly dtype, shape, data_offsets", details=where)
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise SourceInvalid(
            f"{rel_name}: tensor {name!r} has unsupported dtype {short_repr(dtype)}; supported: {', '.join(DTYPES)}",
            details=where,
        )
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_int(d) and 0 <= d <= MAX_DIM for d in shape):
        raise SourceInvalid(
            f"{rel_name}: tensor {name!r} has invalid shape {short_repr(shape)} "
            f"(at most {MAX_DIMS} integer dimensions, each 0..{MAX_DIM})",
            details=where,
        )
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise SourceInvalid(
            f"{rel_name}: tensor {name!r} has invalid data_offsets {short_repr(offsets)} "
            "(two integers, 0 <= begin <= end)",
            details=where,
        )
    if math.prod(d for d in shape if d) > MAX_ELEMENTS:
        raise SourceInvalid(
            f"{rel_name}: tensor {name!r} has shape {shape} with more than {MAX_ELEMENTS} elements", details=where
        )
    begin, end = offsets
    if end > buffer_len:
        raise SourceInvalid(
            f"{rel_name}: tensor {name!r} data [{begin}, {end}) is out of bounds (buffer is {buffer_len} bytes)",
            details=where,
        )
    expected = math.prod(shape) * DTYPES[dtype].itemsize
    if end - begin != expected:
        raise SourceInvalid(
            f"{rel_name}: tensor {name!r} spans {end - begin} bytes but {dtype}{shape} needs {expected}",
            details=where,
        )
    return TensorInfo(name, dtype, tuple(shape), rel_name, buffer_start + begin, end - begin)


# -- writing ----------------------------------------------------------------------------------------


class WriterState(enum.Enum):
    PLANNING = "planning"
    WRITING = "writing"
    CLOSED = "closed"


class WriterMisuse(KilnError):
    code = Codes.WRITER_MISUSE


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class SafeTensorsWriter:
    def __init__(self, path: Path, metadata: dict[str, str] | None = None):
        self.path = path
        self.tmp = path.with_name(path.name + ".partial")
        self.metadata = metadata or {}
        self.state = WriterState.PLANNING
        self.plan: list[PlannedTensor] = []
        self._offset = 0
        self._next = 0
        self._file: BinaryIO | None = None

    def add(self, name: str, dtype: str, shape: tuple[int, ...]) -> None:
        if self.state is not WriterState.PLANNING:
            raise WriterMisuse(f"cannot plan {name!r}: writer is {self.state.value}")
        if dtype not in DTYPES:
            raise WriterMisuse(f"unsupported dtype {dtype!r} for {name!r}")
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        self.plan.append(PlannedTensor(name, dtype, tuple(shape), self._offset, self._offset + nbytes))
        self._offset += nbytes

    def begin(self) -> None:
        if self.state is not WriterState.PLANNING:
            raise WriterMisuse(f"header already written (writer is {self.state.value})")
        header: dict[str, object] = {
            t.name: {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [t.begin, t.end]} for t in self.plan
        }
        if self.metadata:
            header["__metadata__"] = self.metadata
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keep the data buffer 8-byte aligned
        self._file = open(self.tmp, "wb")  # noqa: SIM115 - closed in close()/abort()
        self._file.write(struct.pack("<Q", len(raw)))
        self._file.write(raw)
        self.state = WriterState.WRITING

    def write(self, name: str, data: memoryview | bytes) -> None:
        """Write the next planned tensor's raw little-endian bytes."""
        if self.state is not WriterState.WRITING or self._file is None:
            raise WriterMisuse(f"cannot write {name!r}: writer is {self.state.value}")
        if self._next >= len(self.plan) or self.plan[self._next].name != name:
            want = self.plan[self._next].name if self._next < len(self.plan) else None
            raise WriterMisuse(f"tensor {name!r} written out of order; next planned is {want!r}")
        t = self.plan[self._next]
        size = memoryview(data).nbytes
        if size != t.end - t.begin:
            raise WriterMisuse(f"tensor {name!r} has {size} bytes, planned {t.end - t.begin}")
        self._file.write(data)
        self._next += 1

    def close(self) -> None:
        if self.state is not WriterState.WRITING or self._file is None:
            raise WriterMisuse(f"cannot close: writer is {self.state.value}")
        if self._next != len(self.plan):
            self.abort()
            raise WriterMisuse(f"closed after {self._next} of {len(self.plan)} planned tensors")
        self._file.close()
        os.replace(self.tmp, self.path)
        self.state = WriterState.CLOSED

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
        self.tmp.unlink(missing_ok=True)
        self.state = WriterState.CLOSED
