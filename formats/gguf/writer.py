"""A streaming GGUF v3 writer, as an explicit state machine.

Layout: header (magic, version, tensor count, kv count), metadata key/values, tensor infos (name,
dims in ggml order, type, offset into the data section), padding to the alignment, then each
tensor's data padded to the alignment.

Everything about the tensors (names, shapes, types, hence sizes and offsets) is planned before the
first byte is written, so the tensor infos go out before any weight is read; weights are then
written one tensor at a time, each checked against its planned size, and `finish` checks that every
planned tensor was written before renaming the temp file into place. Peak memory is one tensor.

    EMPTY --write_header--> HEADER --write_kv--> KV_DATA --write_tensor_infos--> TENSOR_INFO
          --write_tensor (in plan order)--> WEIGHTS --finish--> DONE      (any state --abort--> CLOSED)

`rewrite_metadata` (TENSOR_INFO or WEIGHTS) replaces the metadata after the fact: in place when the
header keeps its aligned size, else by moving the data section behind the new header. It lets an
exporter start streaming weights on predicted metadata while a slow source of truth (transformers'
tokenizer) loads, and correct the header if the prediction was wrong.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum, auto
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from kiln.core.error_codes import Codes
from kiln.core.errors import KilnError, StageFailed
from kiln.formats.gguf.constants import (
    GGML_MAX_NAME,
    GGUF_ALIGNMENT,
    GGUF_MAGIC,
    GGUF_VERSION,
    SCALAR_FORMATS,
    Keys,
    TensorType,
    ValueType,
    tensor_nbytes,
)


class WriterState(Enum):
    EMPTY = auto()  # planning: metadata and tensors may be added
    HEADER = auto()
    KV_DATA = auto()
    TENSOR_INFO = auto()
    WEIGHTS = auto()
    DONE = auto()  # finished and renamed into place
    CLOSED = auto()  # aborted; the temp file is gone


class WriterMisuse(KilnError):
    """A GGUF writer method was called in the wrong state (a programming error in kiln)."""

    code = Codes.GGUF_WRITER_STATE


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]  # numpy order (rows last); the file stores the reverse (ggml ne order)
    ttype: TensorType
    offset: int  # from the start of the data section
    nbytes: int


@dataclass(frozen=True)
class _KV:
    key: str
    vtype: ValueType
    value: Any
    sub_type: ValueType | None = None


def _pad(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def _pack_string(s: str | bytes) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _pack_value(vtype: ValueType, value: Any, sub_type: ValueType | None) -> bytes:
    if vtype is ValueType.STRING:
        return _pack_string(value)
    if vtype is ValueType.ARRAY:
        if sub_type is None or sub_type is ValueType.ARRAY:
            raise WriterMisuse("a GGUF array needs a scalar or string element type")
        head = struct.pack("<IQ", sub_type, len(value))
        if sub_type is ValueType.STRING:
            return head + b"".join(_pack_string(v) for v in value)
        fmt = SCALAR_FORMATS[sub_type]
        return head + struct.pack(f"<{len(value)}{fmt[1:]}", *value)
    return struct.pack(SCALAR_FORMATS[vtype], value)


class _TypedAdders:
    """Typed shorthands over `add_kv`, shared by `Metadata` and `GGUFWriter`."""

    def add_kv(self, key: str, vtype: ValueType, value: Any, sub_type: ValueType | None = None) -> None:
        raise NotImplementedError

    def add_uint32(self, key: str, value: int) -> None:
        self.add_kv(key, ValueType.UINT32, int(value))

    def add_float32(self, key: str, value: float) -> None:
        self.add_kv(key, ValueType.FLOAT32, float(value))

    def add_bool(self, key: str, value: bool) -> None:
        self.add_kv(key, ValueType.BOOL, bool(value))

    def add_string(self, key: str, value: str) -> None:
        self.add_kv(key, ValueType.STRING, value)

    def add_array(self, key: str, values: Sequence[Any], sub_type: ValueType) -> None:
        self.add_kv(key, ValueType.ARRAY, values, sub_type)


class Metadata(_TypedAdders):
    """An ordered set of GGUF key/values, each key once."""

    def __init__(self) -> None:
        self._kv: dict[str, _KV] = {}

    def add_kv(self, key: str, vtype: ValueType, value: Any, sub_type: ValueType | None = None) -> None:
        if key in self._kv:
            raise WriterMisuse(f"GGUF metadata key {key!r} added twice")
        if vtype is ValueType.ARRAY and not len(value):
            raise WriterMisuse(f"GGUF metadata array {key!r} is empty")
        self._kv[key] = _KV(key, vtype, value, sub_type)

    def entries(self) -> list[_KV]:
        return list(self._kv.values())

    def extend(self, other: Metadata) -> None:
        for kv in other.entries():
            self.add_kv(kv.key, kv.vtype, kv.value, kv.sub_type)

    def __contains__(self, key: str) -> bool:
        return key in self._kv

    def __len__(self) -> int:
        return len(self._kv)

    def to_bytes(self) -> bytes:
        out = bytearray()
        for kv in self._kv.values():
            out += _pack_string(kv.key)
            out += struct.pack("<I", kv.vtype)
            out += _pack_value(kv.vtype, kv.value, kv.sub_type)
        return bytes(out)


class GGUFWriter(_TypedAdders):
    """Writes one GGUF v3 file to `path` through a temp file in the same directory.

    Use as a context manager: leaving the block with an exception (or without `finish`) removes the
    temp file, so a failed export never leaves a file that looks complete.
    """

    def __init__(self, path: str | Path, *, alignment: int = GGUF_ALIGNMENT) -> None:
        if alignment <= 0 or alignment & (alignment - 1) or alignment % 8:
            raise WriterMisuse(f"alignment must be a power of two and a multiple of 8, got {alignment}")
        self.path = Path(path)
        self.temp_path = self.path.with_name(f".{self.path.name}.partial")
        self.alignment = alignment
        self.state = WriterState.EMPTY
        self.metadata = Metadata()
        self._final_metadata = Metadata()  # what the file holds: alignment + metadata
        self._tensors: dict[str, PlannedTensor] = {}
        self._data_size = 0
        self._next = 0  # index of the next tensor to write, in plan order
        self._order: list[str] = []
        self._fh: IO[bytes] | None = None
        self._data_start = 0

    # -- planning (EMPTY) -------------------------------------------------------------------------

    def _expect(self, *states: WriterState, action: str) -> None:
        if self.state not in states:
            want = " or ".join(s.name for s in states)
            raise WriterMisuse(f"GGUF writer: cannot {action} in state {self.state.name} (needs {want})")

    def add_metadata(self, metadata: Metadata) -> None:
        """Add every key/value of `metadata` (before the header is written)."""
        self._expect(WriterState.EMPTY, action="add metadata")
        self.metadata.extend(metadata)

    def add_kv(self, key: str, vtype: ValueType, value: Any, sub_type: ValueType | None = None) -> None:
        """Add one metadata key/value; keys are unique."""
        self._expect(WriterState.EMPTY, action=f"add metadata {key!r}")
        self.metadata.add_kv(key, vtype, value, sub_type)

    def plan_tensor(self, name: str, shape: Sequence[int], ttype: TensorType) -> PlannedTensor:
        """Reserve a tensor: its size and offset are fixed now, before any data exists."""
        self._expect(WriterState.EMPTY, action=f"plan tensor {name!r}")
        if name in self._tensors:
            raise WriterMisuse(f"GGUF tensor {name!r} planned twice")
        if not name or len(name.encode("utf-8")) >= GGML_MAX_NAME:
            raise WriterMisuse(f"GGUF tensor name {name!r} must be 1..{GGML_MAX_NAME - 1} bytes")
        dims = tuple(int(d) for d in shape)
        if not 1 <= len(dims) <= 4 or any(d <= 0 for d in dims):
            raise WriterMisuse(f"GGUF tensor {name!r}: shape {dims} must have 1..4 positive dims")
        try:
            nbytes = tensor_nbytes(dims, ttype)
        except ValueError as e:
            raise WriterMisuse(f"GGUF tensor {name!r}: {e}") from None
        planned = PlannedTensor(name, dims, ttype, self._data_size, nbytes)
        self._tensors[name] = planned
        self._order.append(name)
        self._data_size += _pad(nbytes, self.alignment)
        return planned

    @property
    def planned(self) -> list[PlannedTensor]:
        return [self._tensors[n] for n in self._order]

    @property
    def file_size(self) -> int:
        """The final size of the file, known once the tensor infos are written."""
        self._expect(WriterState.TENSOR_INFO, WriterState.WEIGHTS, WriterState.DONE, action="tell the file size")
        return self._data_start + self._data_size

    # -- writing ----------------------------------------------------------------------------------

    def _with_alignment(self, metadata: Metadata) -> Metadata:
        if Keys.ALIGNMENT in metadata:
            raise WriterMisuse(f"{Keys.ALIGNMENT} is set by the writer (alignment={self.alignment})")
        out = Metadata()
        out.add_uint32(Keys.ALIGNMENT, self.alignment)
        out.extend(metadata)
        return out

    def _prefix_bytes(self, n_kv: int) -> bytes:
        return struct.pack("<IIQQ", GGUF_MAGIC, GGUF_VERSION, len(self._tensors), n_kv)

    def _infos_bytes(self) -> bytes:
        out = bytearray()
        for t in self.planned:
            out += _pack_string(t.name)
            out += struct.pack(f"<I{len(t.shape)}Q", len(t.shape), *reversed(t.shape))
            out += struct.pack("<IQ", t.ttype, t.offset)
        return bytes(out)

    def write_header(self) -> None:
        self._expect(WriterState.EMPTY, action="write the header")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._final_metadata = self._with_alignment(self.metadata)
        self._fh = open(self.temp_path, "w+b")  # noqa: SIM115 - closed by finish/abort; readable for moves
        self._fh.write(self._prefix_bytes(len(self._final_metadata)))
        self.state = WriterState.HEADER

    def write_kv(self) -> None:
        self._expect(WriterState.HEADER, action="write metadata")
        assert self._fh is not None
        self._fh.write(self._final_metadata.to_bytes())
        self.state = WriterState.KV_DATA

    def write_tensor_infos(self) -> None:
        self._expect(WriterState.KV_DATA, action="write tensor infos")
        assert self._fh is not None
        self._fh.write(self._infos_bytes())
        here = self._fh.tell()
        self._data_start = _pad(here, self.alignment)
        self._fh.write(bytes(self._data_start - here))
        self.state = WriterState.TENSOR_INFO

    def rewrite_metadata(self, metadata: Metadata) -> bool:
        """Replace all metadata after the tensor infos (and any weights) are written.

        Returns True when the new header fits the old aligned header size and was rewritten in place;
        otherwise the written weights are moved behind the new header (a kernel-side copy) and False
        is returned.
        """
        self._expect(WriterState.TENSOR_INFO, WriterState.WEIGHTS, action="rewrite metadata")
        assert self._fh is not None
        final = self._with_alignment(metadata)
        head = self._prefix_bytes(len(final)) + final.to_bytes() + self._infos_bytes()
        start = _pad(len(head), self.alignment)
        self._final_metadata = final
        if start == self._data_start:
            end = self._fh.tell()
            self._fh.seek(0)
            self._fh.write(head + bytes(start - len(head)))
            self._fh.seek(end)
            return True
        self._fh.flush()
        written = self._fh.tell() - self._data_start
        moved = self.temp_path.with_name(self.temp_path.name + ".moved")
        try:
            with open(moved, "wb") as out:
                out.write(head + bytes(start - len(head)))
                out.flush()
                _copy_range(self._fh.fileno(), out.fileno(), self._data_start, written)
        except BaseException:
            moved.unlink(missing_ok=True)
            raise
        self._fh.close()
        os.replace(moved, self.temp_path)
        self._fh = open(self.temp_path, "r+b")  # noqa: SIM115 - closed by finish/abort
        self._fh.seek(start + written)
        self._data_start = start
        return False

    def begin(self) -> None:
        """Write header, metadata and tensor infos: everything before the first weight."""
        self.write_header()
        self.write_kv()
        self.write_tensor_infos()

    def write_tensor(self, name: str, data: Any | Iterable[Any]) -> None:
        """Write the next planned tensor's bytes: one buffer, or an iterable of buffers (chunks).

        Tensors must come in plan order; the byte count must equal the planned size.
        """
        self._expect(WriterState.TENSOR_INFO, WriterState.WEIGHTS, action=f"write tensor {name!r}")
        assert self._fh is not None
        if self._next >= len(self._order):
            raise WriterMisuse(f"GGUF tensor {name!r} was not planned (all planned tensors are written)")
        want = self._tensors[self._order[self._next]]
        if name != want.name:
            raise WriterMisuse(f"GGUF tensor {name!r} written out of order: the plan expects {want.name!r} next")
        chunks: Iterable[Any] = [data] if _is_buffer(data) else data
        written = 0
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            written += len(view)
            if written > want.nbytes:
                break
            self._fh.write(view)
        if written != want.nbytes:
            self.state = WriterState.WEIGHTS
            raise StageFailed(
                f"GGUF tensor {name!r}: {written}{'+' if written > want.nbytes else ''} bytes were produced, "
                f"the plan says {want.nbytes} ({want.ttype.name} {list(want.shape)})",
                code=Codes.GGUF_SIZE_MISMATCH,
                details={"tensor": name, "planned": want.nbytes, "written": written},
            )
        pad = _pad(written, self.alignment) - written
        if pad:
            self._fh.write(bytes(pad))
        self._next += 1
        self.state = WriterState.WEIGHTS

    def finish(self) -> Path:
        """Check every planned tensor was written, then move the file into place."""
        self._expect(WriterState.TENSOR_INFO, WriterState.WEIGHTS, action="finish")
        assert self._fh is not None
        missing = self._order[self._next :]
        if missing:
            raise StageFailed(
                f"GGUF file incomplete: {len(missing)} planned tensor(s) never written, e.g. {missing[0]!r}",
                code=Codes.GGUF_SIZE_MISMATCH,
                details={"missing": missing[:20]},
            )
        size = self._fh.tell()
        if size != self._data_start + self._data_size:
            raise StageFailed(
                f"GGUF file is {size} bytes, the plan says {self._data_start + self._data_size}",
                code=Codes.GGUF_SIZE_MISMATCH,
            )
        self._fh.close()
        self._fh = None
        os.replace(self.temp_path, self.path)
        self.state = WriterState.DONE
        return self.path

    def abort(self) -> None:
        """Drop the temp file; the final path is never created. Safe to call in any state."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self.state is not WriterState.DONE:
            self.temp_path.unlink(missing_ok=True)
            self.state = WriterState.CLOSED

    def __enter__(self) -> GGUFWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.state is not WriterState.DONE:
            self.abort()


def _copy_range(src: int, dst: int, offset: int, count: int) -> None:
    """Append `count` bytes of file `src` from `offset` to file `dst`, in the kernel where possible."""
    done = 0
    while done < count:
        try:
            n = os.copy_file_range(src, dst, count - done, offset + done)
        except OSError:  # e.g. across filesystems or unsupported: copy through user space
            n = len(data := os.pread(src, min(1 << 24, count - done), offset + done))
            os.write(dst, data)
        if n <= 0:
            raise StageFailed("GGUF writer: short copy while moving tensor data", code=Codes.GGUF_SIZE_MISMATCH)
        done += n


def _is_buffer(obj: Any) -> bool:
    try:
        memoryview(obj)
    except TypeError:
        return False
    return True
