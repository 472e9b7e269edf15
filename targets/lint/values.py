"""Scale values, read lazily and judged: pure numpy, no torch, so `kiln lint` starts in a fraction of a second.

A tensor is read by memory-mapping its byte range (the offsets come from a header already validated by
`formats.safetensors.read_header`), decoded to float32, judged, and dropped: memory is one tensor at a time,
and scales are small beside the weights they scale. 8-bit float types are decoded through a 256-entry table
built from their definitions (OCP FP8 E4M3/E5M2, AMD's E4M3FNUZ, OCP MX E8M0 for MXFP4's exponent scales).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Final

from kiln.targets.lint.findings import Finding, finding

if TYPE_CHECKING:
    import numpy as np

# SafeTensors dtype -> numpy dtype, for the types numpy holds natively.
NATIVE: Final = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "i1",
    "U8": "u1",
}
# Codecs for one-byte floats; "E8M0" reads a U8 tensor as MX exponent scales (2^(b - 127), 0xFF NaN).
BYTE_FLOATS: Final = ("F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2", "E8M0")


@cache
def _byte_table(codec: str) -> np.ndarray:
    """float32 value of each of the 256 bit patterns of a one-byte float."""
    import numpy as np

    b = np.arange(256)
    if codec == "E8M0":
        values = np.ldexp(1.0, b - 127).astype(np.float64)
        values[255] = np.nan
        return values.astype(np.float32)
    exp_bits, bias = {"F8_E4M3": (4, 7), "F8_E4M3FNUZ": (4, 8), "F8_E5M2": (5, 15)}[codec]
    man_bits = 7 - exp_bits
    sign = np.where(b >> 7, -1.0, 1.0)
    e = (b >> man_bits) & ((1 << exp_bits) - 1)
    m = b & ((1 << man_bits) - 1)
    normal = (1 + m / (1 << man_bits)) * np.ldexp(1.0, e - bias)
    subnormal = (m / (1 << man_bits)) * np.ldexp(1.0, 1 - bias)
    values = sign * np.where(e == 0, subnormal, normal)
    if codec == "F8_E4M3":  # OCP E4M3FN: no infinities, S.1111.111 is NaN
        values[(e == 15) & (m == 7)] = np.nan
    elif codec == "F8_E4M3FNUZ":  # one NaN, the negative zero's pattern 0x80; no infinities
        values[0x80] = np.nan
    else:  # E5M2 is IEEE-like: all-ones exponent is inf (mantissa 0) or NaN
        values[(e == 31) & (m == 0)] = sign[(e == 31) & (m == 0)] * np.inf
        values[(e == 31) & (m != 0)] = np.nan
    return values.astype(np.float32)


def decode(raw: np.ndarray, dtype: str) -> np.ndarray:
    """The values of a tensor's raw little-endian bytes as float32 (integers exactly where they fit)."""
    import numpy as np

    if dtype in BYTE_FLOATS:
        return _byte_table(dtype)[raw]
    if dtype == "BF16":  # the top half of a float32
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    if dtype in NATIVE:
        return raw.view(NATIVE[dtype]).astype(np.float32)
    raise ValueError(f"no decoder for dtype {dtype}")


def read_bytes(path: Path, offset: int, nbytes: int) -> np.ndarray:
    """`nbytes` bytes of `path` from `offset`, memory-mapped (nothing is read until used) as uint8."""
    import numpy as np

    if nbytes == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(nbytes,))


@dataclass(frozen=True)
class ScaleCounts:
    """How many of a scale tensor's values are bad, by kind."""

    size: int
    nan: int
    inf: int
    zero: int
    negative: int


def count(values: np.ndarray) -> ScaleCounts:
    import numpy as np

    nan = np.isnan(values)
    inf = np.isinf(values)
    return ScaleCounts(
        size=int(values.size),
        nan=int(nan.sum()),
        inf=int(inf.sum()),
        zero=int((values == 0).sum()),
        negative=int((values < 0).sum()),
    )


def judge(
    name: str, c: ScaleCounts, file: str | None, *, signed_ok: bool = False, zero_ok: bool = False
) -> list[Finding]:
    """Findings for one scale tensor's counts: NaN, infinite, zero or negative values, each named.

    compressed-tensors replaces a zero scale by its dtype's eps and a NaN/inf global scale by 1 before
    saving (`calculate_qparams`, `generate_gparam`), so any of these in an artifact is a fault: an expert
    that saw no calibration data, a corrupt copy, a division by an absmax of zero.
    """

    def of(n: int) -> str:
        return f"{n} of {c.size} value(s)" if c.size > 1 else "its value"

    out = []
    if c.nan:
        out.append(finding("SCALE_NAN", name, f"{of(c.nan)} NaN", file))
    if c.inf:
        out.append(finding("SCALE_INF", name, f"{of(c.inf)} infinite", file))
    if c.zero and not zero_ok:
        out.append(finding("SCALE_ZERO", name, f"{of(c.zero)} zero", file))
    if c.negative and not signed_ok:
        out.append(finding("SCALE_NEGATIVE", name, f"{of(c.negative)} negative", file))
    return out
