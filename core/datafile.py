"""Data files the command line is given (a hardware entry, a probe run, a performance record, a recipe): one
reader, so each is refused the same way when it is not a regular file, not UTF-8, or not YAML or JSON.

YAML is read as JSON's values only: what `--json` prints reads back as it was printed. A timestamp stays the
string it was written as (the field's own validator decides whether it is a date); `.inf`, `.nan`, integers
past Python's digit limit, nesting past `MAX_DEPTH` and more than `MAX_VALUES` values (an alias counted each
time it is named) are refused, so nothing read here fails later when it is sent as JSON or checked.
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from kiln.core.error_codes import Codes
from kiln.core.errors import DataFileInvalid, InvalidInput

R = TypeVar("R", bound=BaseModel)

MAX_DATA_FILE_BYTES = 1 << 20
MAX_DEPTH = 64  # levels of nesting; every file kiln reads needs a handful
MAX_VALUES = 100_000


class _JsonValuesLoader(yaml.SafeLoader):
    """A SafeLoader without YAML 1.1's timestamps: a date is a string, as in JSON."""


_JsonValuesLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def read_data_bytes(
    path: Path, what: str, max_bytes: int = MAX_DATA_FILE_BYTES, error: type[InvalidInput] = DataFileInvalid
) -> bytes:
    """The bytes of the regular file `path`, at most `max_bytes`; a directory, a FIFO or a device is refused
    without being opened for reading (a FIFO would block), as `error`."""
    where = {"file": str(path)}
    try:
        mode = path.stat().st_mode
    except OSError as e:
        raise error(f"{path}: cannot read {what} ({e.strerror or e})", details=where) from None
    if not stat.S_ISREG(mode):
        raise error(f"{path}: {what} must be a regular file", details=where)
    try:
        # O_NONBLOCK: a file swapped for a FIFO after the check is not waited on.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise error(f"{path}: {what} must be a regular file", details=where)
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise error(f"{path}: cannot read {what} ({e.strerror or e})", details=where) from None
    if len(raw) > max_bytes:
        raise error(f"{path}: {what} is larger than {max_bytes} bytes", details=where)
    return raw


def parse_data(raw: bytes, origin: str, error: type[InvalidInput] = DataFileInvalid) -> Any:
    """YAML (JSON included) `raw` as JSON values; `error` (with `origin` in its message) when it is not."""
    where = {"file": origin}
    try:
        data = yaml.load(raw.decode("utf-8"), Loader=_JsonValuesLoader)  # noqa: S506 - a SafeLoader
    except UnicodeDecodeError as e:
        raise error(f"{origin}: not UTF-8 ({e.reason} at byte {e.start})", details=where) from None
    except yaml.YAMLError as e:
        raise error(f"{origin}: not valid YAML or JSON: {e}", details=where) from None
    except RecursionError:
        raise error(f"{origin}: nested too deeply", details=where) from None
    except ValueError as e:  # an integer past Python's digit limit
        raise error(f"{origin}: a value cannot be read: {e}", details=where) from None
    problem = _not_json(data)
    if problem is not None:
        raise error(f"{origin}: {problem}", details=where)
    return data


def _not_json(data: Any) -> str | None:
    """Why `data` is not JSON's (a float that is not finite, a key that is not a string, too deep, too many
    values), or None."""
    stack: list[tuple[Any, int]] = [(data, 0)]
    seen = 0
    while stack:
        value, depth = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            return f"more than {MAX_VALUES} values"
        if depth > MAX_DEPTH:
            return f"nested deeper than {MAX_DEPTH} levels"
        if isinstance(value, float) and not math.isfinite(value):
            return f"{value} is not a number JSON can hold"
        if isinstance(value, dict):
            if any(not isinstance(k, str) for k in value):
                return f"key {next(k for k in value if not isinstance(k, str))!r} is not a string"
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
        elif not isinstance(value, str | int | float | bool) and value is not None:
            return f"a {type(value).__name__} is not a JSON value"
    return None


def read_data_file(path: Path, what: str) -> Any:
    """The YAML or JSON file `path` as JSON values (see `parse_data`); DATA_FILE_INVALID when it is not."""
    return parse_data(read_data_bytes(path, what), str(path))


def read_mapping(path: Path, what: str) -> dict[str, Any]:
    """The YAML or JSON file `path`, holding one mapping."""
    data = read_data_file(path, what)
    if not isinstance(data, dict):
        raise DataFileInvalid(f"{path}: {what} must be a mapping of fields", details={"file": str(path)})
    return data


def parse_record(record: type[R], data: Mapping[str, Any], where: str, code: str = Codes.INVALID_INPUT) -> R:
    """`data` (a file's, or a request's) as `record`, or InvalidInput with `code` naming each bad field."""
    try:
        return record.model_validate(dict(data))
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'entry'}: {err['msg']}" for err in e.errors())
        raise InvalidInput(f"{where}: {problems}", code=code) from None
