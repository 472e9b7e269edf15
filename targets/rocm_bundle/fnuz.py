"""FP8 E4M3 for AMD gfx942: OCP float8_e4m3fn weights re-expressed in float8_e4m3fnuz, same dequantised values.

MI300X/MI325X (gfx942) compute in float8_e4m3fnuz: exponent bias 8 instead of 7, no negative zero,
and the bit pattern 0x80 (-128 as int8) is its only NaN. The same bits therefore mean half the
e4m3fn value. vLLM converts an e4m3fn checkpoint when it loads it on gfx942 by reinterpreting the
bits, turning 0x80 (e4m3fn's -0.0) into 0, and doubling the scales. `e4m3fn_to_e4m3fnuz` produces
the same result by value instead, so a bundle can carry the weights gfx942 computes with:
every finite e4m3fn value v has an exact e4m3fnuz value v / 2, and the scale doubles.
The test suite checks, for all 256 bit patterns and for real quantized layers, that this equals
vLLM's load-time conversion after dequantisation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput

if TYPE_CHECKING:
    import torch


def e4m3fn_to_e4m3fnuz(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3fnuz weight, doubled scale) with `fnuz * scale'` equal to `fn * scale` for every element."""
    return fnuz_weight(weight), fnuz_scale(scale)


def fnuz_weight(weight: torch.Tensor) -> torch.Tensor:
    """The e4m3fnuz tensor holding half of each e4m3fn value (exact); pair it with `fnuz_scale`."""
    import torch

    if weight.dtype != torch.float8_e4m3fn:
        raise InvalidInput(f"expected float8_e4m3fn weights, got {weight.dtype}", code=Codes.FP8_DTYPE)
    values = weight.float()
    if torch.isnan(values).any():
        raise InvalidInput("float8_e4m3fn weights contain NaN; there is no value to convert", code=Codes.FP8_NAN)
    # Halving is exact (only the exponent changes) and every half of an e4m3fn value is an e4m3fnuz value.
    return (values / 2).to(torch.float8_e4m3fnuz)


def fnuz_scale(scale: torch.Tensor) -> torch.Tensor:
    """The scale for `fnuz_weight`'s output: doubled, in the scale's own dtype (exact for bf16 and fp32)."""
    return scale * 2


def e4m3fnuz_to_e4m3fn(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `e4m3fn_to_e4m3fnuz`, exact: the same bits read as e4m3fn (twice the value), scale halved.

    For runtimes that only compute in e4m3fn (transformers on CPU): copying e4m3fnuz into e4m3fn by
    value would round e4m3fnuz's smallest subnormals, which e4m3fn lacks. e4m3fnuz's NaN (0x80) and
    +-240 (0x7F, 0xFF: 480 has no e4m3fn encoding) are refused.
    """
    import torch

    if weight.dtype != torch.float8_e4m3fnuz:
        raise InvalidInput(f"expected float8_e4m3fnuz weights, got {weight.dtype}", code=Codes.FP8_DTYPE)
    bits = weight.view(torch.uint8)
    if bool(((bits == 0x80) | (bits == 0x7F) | (bits == 0xFF)).any()):
        raise InvalidInput("float8_e4m3fnuz weights hold NaN or +-240, which e4m3fn cannot express", code=Codes.FP8_NAN)
    return bits.view(torch.float8_e4m3fn), scale / 2
