"""Hand-built SafeTensors and GGUF bytes, valid or not, for the parsers' refusal tests and fuzz targets.

The real writers refuse to write malformed files; these do exactly what they are told.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from kiln.formats.gguf.constants import GGUF_MAGIC, SCALAR_FORMATS, ValueType


def safetensors_bytes(header: dict[str, Any] | bytes, data: bytes = b"") -> bytes:
    """8-byte length, the header (a dict is dumped as JSON), then `data`."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def valid_safetensors_header(shapes: dict[str, list[int]], dtype: str = "F32", itemsize: int = 4) -> dict:
    """A header whose tensors cover their buffer exactly, in order."""
    header: dict[str, Any] = {}
    offset = 0
    for name, shape in shapes.items():
        n = itemsize
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    return header


def buffer_len(header: dict[str, Any]) -> int:
    return max((e["data_offsets"][1] for k, e in header.items() if k != "__metadata__"), default=0)


def gguf_string(value: str | bytes) -> bytes:
    raw = value.encode("utf-8") if isinstance(value, str) else value
    return struct.pack("<Q", len(raw)) + raw


def gguf_value(vtype: int, value: Any) -> bytes:
    """A metadata value; ARRAY values are (element type, [elements])."""
    if vtype == ValueType.STRING:
        return gguf_string(value)
    if vtype == ValueType.ARRAY:
        sub, items = value
        return struct.pack("<IQ", sub, len(items)) + b"".join(gguf_value(sub, v) for v in items)
    return struct.pack(SCALAR_FORMATS[ValueType(vtype)], value)


def gguf_bytes(
    kvs: list[tuple[str | bytes, int, Any]] = (),  # type: ignore[assignment]
    tensors: list[tuple[str | bytes, list[int], int, int]] = (),  # type: ignore[assignment]
    *,
    data: bytes = b"",
    alignment: int = 32,
    version: int = 3,
    n_kv: int | None = None,
    n_tensors: int | None = None,
) -> bytes:
    """A GGUF file: header, key-value pairs, tensor infos (name, ggml-order dims, type, offset), padding, data."""
    out = struct.pack(
        "<IIQQ",
        GGUF_MAGIC,
        version,
        len(tensors) if n_tensors is None else n_tensors,
        len(kvs) if n_kv is None else n_kv,
    )
    for key, vtype, value in kvs:
        out += gguf_string(key) + struct.pack("<I", vtype) + gguf_value(vtype, value)
    for name, dims, type_id, offset in tensors:
        out += (
            gguf_string(name) + struct.pack(f"<I{len(dims)}Q", len(dims), *dims) + struct.pack("<IQ", type_id, offset)
        )
    out += b"\0" * (-len(out) % alignment)
    return out + data
