"""Sizes and stored numbers as the pages show them; shared by the views and the plot, which import nothing else here."""

from __future__ import annotations

from typing import Any

BINARY_UNITS: tuple[tuple[str, int], ...] = (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


def human_size(n: int) -> str:
    """Bytes in binary units, as the CLI prints them."""
    for unit, scale in BINARY_UNITS:
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def json_number(value: Any) -> float | None:
    """A number read from free-form stored JSON (a provenance's `duration_s`) as a float, NaN and ±inf
    included, or None when it is not a number.

    kiln writes non-finite numbers as the strings "NaN"/"Infinity" (pydantic's JSON form); a bool
    is not a measurement, whatever Python thinks.
    """
    if isinstance(value, bool) or value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
