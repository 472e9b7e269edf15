"""Reading data kiln does not trust (model files, recipes, request bodies) without surprises.

`loads_json` is the one JSON parser for anything that crosses a trust boundary. Python's
`json.loads` accepts what a store or a later reader cannot keep: NaN and Infinity, numbers that
overflow to infinity (`1e400`), integers of thousands of digits (quadratic to parse, refused past
4,300), strings with NUL characters (PostgreSQL text refuses them) or unpaired surrogates (not
encodable as UTF-8), duplicate keys (the last one silently wins), and nesting deep enough to exhaust
the interpreter's recursion limit. `loads_json` refuses all of them with one error, `INVALID_JSON`,
saying what, before anything else sees the document. `short_repr` bounds what an error message
quotes from such data.
"""

from __future__ import annotations

import json
import math
import re
import reprlib
from typing import Any

from core.errors import InvalidInput

MAX_DEPTH = 64
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_OPENERS = frozenset(b"[{")

_short = reprlib.Repr()
_short.maxlevel, _short.maxlist, _short.maxdict, _short.maxstring, _short.maxother = 2, 6, 6, 60, 60


class InvalidJSON(InvalidInput):
    """The text is not JSON kiln accepts; the message says why (callers add which file)."""

    code = "INVALID_JSON"


def short_repr(value: object) -> str:
    """A repr of untrusted data for an error message: depth, lengths and size capped."""
    return _short.repr(value)


def _check_depth(data: bytes, limit: int) -> None:
    """Refuse nesting deeper than `limit` without recursing: strings are cut out and the brackets left
    are counted (the regex and translate run in C, so a 100 MB header is checked in a blink)."""
    depth = 0
    for byte in _STRING.sub(b"", data).translate(None, _NOT_BRACKETS):
        depth += 1 if byte in _OPENERS else -1
        if depth > limit:
            raise InvalidJSON(f"nests deeper than {limit} levels", details={"max_depth": limit})


def _no_constant(name: str) -> Any:
    raise InvalidJSON(f"{name} is not a number JSON allows")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise InvalidJSON(f"number {text[:40]} is out of range")
    return value


def _int(text: str) -> int:
    if len(text.lstrip("-")) > 19:
        raise InvalidJSON(f"integer {text[:24]}{'…' if len(text) > 24 else ''} is out of range")
    value = int(text)
    if not INT64_MIN <= value <= INT64_MAX:
        raise InvalidJSON(f"integer {value} is out of the 64-bit range")
    return value


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise InvalidJSON(f"key {short_repr(key)} appears twice", details={"key": key[:100]})
        out[key] = value
    return out


def check_text(value: str, where: str = "a string") -> str:
    """`value` itself unless it holds NUL or an unpaired surrogate (neither can be stored)."""
    if "\x00" in value:
        raise InvalidJSON(f"{where} contains a NUL character", details={"value": value[:100]})
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidJSON(f"{where} contains an unpaired surrogate", details={"value": value[:100]}) from None
    return value


def _check_strings(value: Any) -> None:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            check_text(item)
        elif isinstance(item, dict):
            for key, sub in item.items():
                check_text(key, "an object key")
                stack.append(sub)
        elif isinstance(item, list):
            stack.extend(item)


def loads_json(
    data: bytes | str, *, what: str = "JSON", max_depth: int = MAX_DEPTH, finite_numbers: bool = True
) -> Any:
    """Parse `data` strictly (see the module docstring); InvalidJSON says what is wrong.

    `finite_numbers=False` lets a number too large for a float through as infinity, for a caller whose
    own validation then names the field that holds it (config.json's); NaN and Infinity stay refused.
    """
    try:
        raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        _check_depth(raw, max_depth)
        text = raw.decode("utf-8")
        value = json.loads(
            text,
            parse_constant=_no_constant,
            parse_float=_finite if finite_numbers else float,
            parse_int=_int,
            object_pairs_hook=_pairs,
        )
        _check_strings(value)
    except InvalidJSON as e:
        raise InvalidJSON(f"{what}: {e.message}", details=e.details) from None
    except UnicodeError as e:
        where = getattr(e, "start", 0)
        raise InvalidJSON(f"{what} is not UTF-8 (byte {where})", details={"offset": where}) from None
    except (ValueError, RecursionError) as e:  # json.JSONDecodeError
        raise InvalidJSON(f"{what} is not valid JSON ({e})") from None
    return value
