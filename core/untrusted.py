"""Reading data kiln does not trust (model files, recipes, request bodies) without surprises.

`loads_json` is the one JSON parser for anything that crosses a trust boundary. Python's
`json.loads` accepts what a store or a later reader cannot keep: NaN and Infinity, numbers that
overflow to infinity (`1e400`), integers of thousands of digits (quadratic to parse, refused past
4,300), strings with NUL characters (PostgreSQL text refuses them) or unpaired surrogates (not
encodable as UTF-8), duplicate keys (the last one silently wins), and nesting deep enough to exhaust
the interpreter's recursion limit. `loads_json` refuses all of them with one error, `INVALID_JSON`,
saying what, before anything else sees the document. `short_repr` bounds what an error message
quotes from such data.

`check_json_value` holds a value that no parser read (built in code, or read back from storage) to the
same bounds, and `JSONObject` applies it at the model layer: a pydantic field of that type stores only
what `loads_json` could have returned, whichever way the value arrived.

The time it takes is linear in the size of the input, whatever the input holds: the text is read once,
by `json.loads`' C scanner (its hooks refuse numbers and repeated keys as they come; its nesting is
bounded by the interpreter's recursion limit, a RecursionError being one more refusal), and the parsed
value is walked once, without recursion, for depth and strings. No pattern is ever run over the text
(one that cut strings out, `"(?:[^"\\]|\\.)*"`, re-read the rest of an unterminated string from each
of its quotes: 46 KiB of `\\"` took 11 s). tests/core/test_untrusted_timing.py measures it.
"""

from __future__ import annotations

import json
import math
import reprlib
from typing import Annotated, Any

from pydantic import AfterValidator

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput

MAX_DEPTH = 64
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

_short = reprlib.Repr()
_short.maxlevel, _short.maxlist, _short.maxdict, _short.maxstring, _short.maxother = 2, 6, 6, 60, 60


class InvalidJSON(InvalidInput):
    """The text is not JSON kiln accepts; the message says why (callers add which file)."""

    code = Codes.INVALID_JSON


def short_repr(value: object) -> str:
    """A repr of untrusted data for an error message: depth, lengths and size capped."""
    return _short.repr(value)


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
    out = dict(pairs)
    if len(out) != len(pairs):  # a key appears twice: find the first
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise InvalidJSON(f"key {short_repr(key)} appears twice", details={"key": key[:100]})
            seen.add(key)
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


def _check_tree(value: Any, limit: int, *, numbers: bool = False) -> None:
    """Refuse nesting deeper than `limit` and strings that cannot be stored, in one walk of the parsed
    value (no recursion: parallel stacks of containers and their depths, so the walk allocates no
    tracked objects for the collector to chase). With `numbers`, also refuse what `loads_json`'s hooks
    refuse as it parses (non-finite floats, integers out of the 64-bit range) and anything that is not
    a JSON value (a key that is not a string, a tuple, a set, bytes): for a value not parsed from text."""
    items: list[Any] = [[value]]
    depths: list[int] = [0]
    while items:
        item, depth = items.pop(), depths.pop()
        if depth > limit:
            raise InvalidJSON(f"nests deeper than {limit} levels", details={"max_depth": limit})
        if isinstance(item, dict):
            for key in item:
                if not isinstance(key, str):
                    raise InvalidJSON(f"an object key is not a string ({type(key).__name__})")
                check_text(key, "an object key")
        for sub in item.values() if isinstance(item, dict) else item:
            if isinstance(sub, str):
                check_text(sub)
            elif isinstance(sub, (dict, list)):
                items.append(sub)
                depths.append(depth + 1)
            elif numbers:
                _check_scalar(sub)


def _check_scalar(value: Any) -> None:
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int):
        if not INT64_MIN <= value <= INT64_MAX:
            raise InvalidJSON(f"integer {short_repr(value)} is out of the 64-bit range")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidJSON(f"number {value} is out of range")
    else:
        raise InvalidJSON(f"a {type(value).__name__} is not a JSON value")


def check_json_value(value: Any, *, what: str = "value", max_depth: int = MAX_DEPTH) -> Any:
    """`value` itself if it is a value `loads_json` could have returned (nesting at most `max_depth`, numbers
    in range, strings storable, only JSON types); InvalidJSON says what is wrong otherwise. For values built
    in code or read back from storage, which no parser checked."""
    try:
        _check_tree(value, max_depth, numbers=True)
    except InvalidJSON as e:
        raise InvalidJSON(f"{what}: {e.message}", details=e.details) from None
    return value


def _storable(value: Any) -> Any:
    try:
        return check_json_value(value, what="JSON value")
    except InvalidJSON as e:
        raise ValueError(e.message) from None  # pydantic reports a ValueError as a validation error


# A JSON object a request may carry and the registry stores: `check_json_value` at the model layer, so a
# value that did not come through `loads_json` (built in code, or by another route) meets the same bounds.
JSONObject = Annotated[dict[str, Any], AfterValidator(_storable)]


def loads_json(
    data: bytes | str, *, what: str = "JSON", max_depth: int = MAX_DEPTH, finite_numbers: bool = True
) -> Any:
    """Parse `data` strictly (see the module docstring); InvalidJSON says what is wrong.

    `finite_numbers=False` lets a number too large for a float through as infinity, for a caller whose
    own validation then names the field that holds it (config.json's); NaN and Infinity stay refused.
    """
    try:
        text = data if isinstance(data, str) else bytes(data).decode("utf-8")
        value = json.loads(
            text,
            parse_constant=_no_constant,
            parse_float=_finite if finite_numbers else float,
            parse_int=_int,
            object_pairs_hook=_pairs,
        )
        # Only a text with more openers than `max_depth` can nest deeper, and only a \u escape can make a
        # NUL or a lone surrogate (json.loads refuses raw control characters; UTF-8 has no surrogates).
        if text.count("[") + text.count("{") > max_depth or "\\u" in text or isinstance(data, str):
            _check_tree(value, max_depth)
    except InvalidJSON as e:
        raise InvalidJSON(f"{what}: {e.message}", details=e.details) from None
    except UnicodeError as e:
        where = getattr(e, "start", 0)
        raise InvalidJSON(f"{what} is not UTF-8 (byte {where})", details={"offset": where}) from None
    except RecursionError:  # json.loads nests as deep as the interpreter lets it, far past `max_depth`
        raise InvalidJSON(f"{what}: nests deeper than {max_depth} levels", details={"max_depth": max_depth}) from None
    except ValueError as e:  # json.JSONDecodeError
        raise InvalidJSON(f"{what} is not valid JSON ({e})") from None
    return value
