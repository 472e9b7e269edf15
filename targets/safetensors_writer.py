"""A streaming SafeTensors writer: plan every tensor from shapes, write the header, then data in order.

States: PLANNING -> WRITING -> CLOSED. Misuse (adding after the header, writing out of order,
a tensor whose size differs from its plan, closing with tensors missing) raises.
"""

from __future__ import annotations

import enum
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from kiln.errors import KilnError

ITEM_SIZES = {
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E4M3FNUZ": 1,
    "I8": 1,
    "U8": 1,
    "I32": 4,
    "I64": 8,
}


class WriterState(enum.Enum):
    PLANNING = "planning"
    WRITING = "writing"
    CLOSED = "closed"


class WriterMisuse(KilnError):
    code = "WRITER_MISUSE"


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
        if dtype not in ITEM_SIZES:
            raise WriterMisuse(f"unsupported dtype {dtype!r} for {name!r}")
        nbytes = math.prod(shape) * ITEM_SIZES[dtype]
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
