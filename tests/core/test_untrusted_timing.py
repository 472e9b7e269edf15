"""Parsing untrusted bytes takes time linear in their size, whatever they hold.

Each worst case below is built at 16, 64 and 256 KiB and parsed the way kiln parses what it does not
trust: strict JSON (`core.untrusted.loads_json`, which reads request bodies, SafeTensors headers and
config.json), a SafeTensors file's header and a GGUF file's header. The yardstick is a plain
`json.loads` of the same bytes, or of a benign document of the same size where `json.loads` refuses
them (or where they are not JSON): kiln's time over the yardstick's must not grow with the size (at
most `RATIO_GROWTH` times the 16 KiB ratio at 256 KiB), and 256 KiB must parse in well under half a second. Times are
the best of several runs with the cyclic collector held off, so a busy machine or a large test process
slows both sides alike instead of failing the test.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kiln.core.errors import KilnError
from kiln.core.untrusted import MAX_DEPTH, loads_json
from kiln.formats.gguf.constants import ValueType
from kiln.formats.gguf.reader import read_header as read_gguf_header
from kiln.formats.safetensors import read_header as read_safetensors_header
from kiln.registry.ops.logs import redact_urls
from tests.file_builders import gguf_string, safetensors_bytes

pytestmark = pytest.mark.timing
KIB = 1024
SIZES = (16 * KIB, 64 * KIB, 256 * KIB)
SLOWEST_AT_256_KIB = 0.5  # seconds
# Sixteen times the bytes: a quadratic parser's ratio grows 16x. A linear one written in Python against the C
# yardstick grows up to ~2x (caches: 16 KiB of entries stays in L2, 256 KiB does not; CI measured 2.04x on a
# valid 4,282-tensor SafeTensors header), so the bound sits between the two.
RATIO_GROWTH = 4.0
# Two parses over this each are quadratic behaviour showing; stop before waiting minutes for the larger sizes.
ONE_PARSE_BUDGET = 2.0


def _repeat(text: bytes, size: int, head: bytes = b"", tail: bytes = b"") -> bytes:
    """`head`, then `text` repeated to fill `size` bytes, then `tail`."""
    room = size - len(head) - len(tail)
    return head + (text * (room // len(text) + 1))[:room] + tail


def _object(size: int, entry: Callable[[int], bytes]) -> bytes:
    """A JSON object of about `size` bytes whose members are `entry(0)`, `entry(1)`, ..."""
    parts, total, i = [], 2, 0
    while total < size:
        parts.append(entry(i))
        total += len(parts[-1]) + 1
        i += 1
    return b"{" + b",".join(parts) + b"}"


# Strings that make a naive scanner re-read the rest of the text, nesting, numbers and keys.
JSON_WORST_CASES: dict[str, Callable[[int], bytes]] = {
    "escaped quotes in an unterminated string": lambda n: _repeat(b'\\"', n, head=b'"'),
    "escaped quotes in a list, unterminated": lambda n: _repeat(b'\\"', n, head=b'["'),
    "escaped quotes in a closed string": lambda n: _repeat(b'\\"', n, head=b'"', tail=b'"'),
    "quote and backslash pairs": lambda n: _repeat(b'"\\', n),
    "a run of backslashes": lambda n: _repeat(b"\\", n, head=b'"'),
    "a run of quotes": lambda n: _repeat(b'"', n),
    "unterminated strings in a list": lambda n: _repeat(b'"a\\",', n, head=b"["),
    "openers": lambda n: _repeat(b"[", n),
    "object openers": lambda n: _repeat(b'{"a":', n),
    "nesting just under the limit": lambda n: _nested_under_limit(n),
    "a long run of digits": lambda n: _repeat(b"1", n),
    "long digit runs in a list": lambda n: _repeat(b"9" * 400 + b",", n, head=b"[", tail=b"0]"),
    "a long float": lambda n: _repeat(b"1", n, head=b"[0.", tail=b"]"),
    "floats at the limit": lambda n: _repeat(b"1e308,", n, head=b"[", tail=b"0]"),
    "one key many times": lambda n: _object(n, lambda i: b'"a":1'),
    "many tiny keys": lambda n: _object(n, lambda i: b'"%x":0' % i),
    "many empty strings": lambda n: _repeat(b'"",', n, head=b"[", tail=b'""]'),
    "escapes of every kind": lambda n: _repeat(b"\\n\\u00e9\\ud83d\\ude00\\\\\\/", n, head=b'"', tail=b'"'),
}


def _nested_under_limit(size: int) -> bytes:
    one = b"[" * (MAX_DEPTH - 1) + b'"x"' + b"]" * (MAX_DEPTH - 1)
    return b"[" + b",".join([one] * max(1, (size - 2) // (len(one) + 1))) + b"]"


@pytest.fixture(scope="module", autouse=True)
def _frozen_heap() -> Iterator[None]:
    """What the process held before these tests (the whole suite's imports: half a million objects) moved
    out of the collector's reach, so the collection before each timed run walks only what the tests made:
    0.3 s a collection otherwise, a thousand of them in this module."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _best(parse: Callable[[], object], repeat: int) -> float:
    """The best of `repeat` timed runs, the cyclic collector held off during each: what a full collection
    costs depends on every object the test process holds (the whole suite's imports), not on the parser."""
    best = float("inf")
    for attempt in range(repeat):
        gc.collect()
        gc.disable()
        try:
            start = time.perf_counter()
            with contextlib.suppress(KilnError, ValueError, RecursionError):
                parse()
            best = min(best, time.perf_counter() - start)
        finally:
            gc.enable()
        assert best < ONE_PARSE_BUDGET or attempt == 0, f"two parses took {best:.1f} s or more each"
    return best


def _benign_json(size: int) -> bytes:
    """A valid document of about `size` bytes, shaped like a SafeTensors header."""
    return _object(
        size,
        lambda i: (
            b'"model.layers.%d.weight":{"dtype":"BF16","shape":[4096,4096],"data_offsets":[%d,%d]}'
            % (i, i * 32, i * 32 + 32)
        ),
    )


def _yardstick(data: bytes, size: int) -> bytes:
    try:
        json.loads(data)
    except (ValueError, RecursionError):
        return _benign_json(size)
    return data


def _assert_linear(name: str, parse: Callable[[int], Callable[[], object]], yardstick: Callable[[int], bytes]) -> None:
    """`parse(size)` (a parser of that size's input) scales like `json.loads` of `yardstick(size)`."""
    ratios: dict[int, float] = {}
    seconds: dict[int, float] = {}
    for size in SIZES:
        run, plain = parse(size), yardstick(size)
        repeat = 7 if size < SIZES[-1] else 5
        seconds[size] = _best(run, repeat)
        ratios[size] = seconds[size] / _best(functools.partial(json.loads, plain), repeat)
    shown = ", ".join(f"{s // KIB} KiB: {seconds[s] * 1000:.2f} ms ({ratios[s]:.1f}x)" for s in SIZES)
    assert seconds[SIZES[-1]] < SLOWEST_AT_256_KIB, f"{name}: {shown}"
    assert ratios[SIZES[-1]] <= RATIO_GROWTH * max(ratios[SIZES[0]], 1.0), (
        f"{name}: grows faster than its size: {shown}"
    )


@pytest.mark.parametrize("case", JSON_WORST_CASES)
def test_strict_json_parses_worst_cases_in_linear_time(case: str) -> None:
    build = JSON_WORST_CASES[case]

    def parse(size: int) -> Callable[[], object]:
        data = build(size)
        assert abs(len(data) - size) < size // 8, (case, len(data))
        return lambda: loads_json(data)

    _assert_linear(case, parse, lambda size: _yardstick(build(size), size))


def test_worst_cases_are_refused_or_read_as_json_reads_them() -> None:
    """The timing above measures the real parser: what it refuses is refused as INVALID_JSON, and what
    it accepts is what `json.loads` reads."""
    for case, build in JSON_WORST_CASES.items():
        data = build(16 * KIB)
        try:
            value = loads_json(data)
        except KilnError as e:
            assert e.code == "INVALID_JSON", case
        else:
            assert value == json.loads(data), case


@pytest.mark.parametrize("case", ["escaped quotes in an unterminated string", "openers", "many tiny keys"])
def test_safetensors_headers_parse_in_linear_time(tmp_path: Path, case: str) -> None:
    build = JSON_WORST_CASES[case]

    def parse(size: int) -> Callable[[], object]:
        path = tmp_path / f"{size}.safetensors"
        path.write_bytes(safetensors_bytes(build(size)))
        return lambda: read_safetensors_header(path, path.name)

    _assert_linear(case, parse, lambda size: _yardstick(build(size), size))


def test_a_safetensors_header_of_many_tensors_is_read_in_linear_time(tmp_path: Path) -> None:
    """A valid header: every entry is checked and the entries must tile the buffer (a sort)."""

    def header(size: int) -> bytes:
        return _object(
            size,
            lambda i: b'"t%d":{"dtype":"U8","shape":[1],"data_offsets":[%d,%d]}' % (i, i, i + 1),
        )

    def parse(size: int) -> Callable[[], object]:
        raw = header(size)
        path = tmp_path / f"{size}.safetensors"
        path.write_bytes(safetensors_bytes(raw, b"\0" * len(json.loads(raw))))
        tensors, _ = read_safetensors_header(path, path.name)
        assert len(tensors) > size // 64
        return lambda: read_safetensors_header(path, path.name)

    _assert_linear("many tensors", parse, header)


def _gguf(size: int, kvs: int, record: Callable[[int], bytes], n_tensors: int = 0) -> bytes:
    """A GGUF header holding `record(0)`, `record(1)`, ... up to about `size` bytes (`kvs` of them key-value
    pairs, or tensor infos where `n_tensors`)."""
    records: list[bytes] = []
    total = 24
    while total < size:
        records.append(record(len(records)))
        total += len(records[-1])
    counts = (len(records), 0) if n_tensors else (0, len(records) if kvs else 1)
    head = struct.pack("<IIQQ", 0x46554747, 3, *counts)
    if not kvs and not n_tensors:  # one array whose elements are the records
        head += gguf_string("a") + struct.pack("<IIQ", ValueType.ARRAY, ValueType.STRING, len(records))
    return head + b"".join(records) + b"\0" * 32  # the (empty) data section starts at the next 32-byte boundary


GGUF_WORST_CASES: dict[str, Callable[[int], bytes]] = {
    "many key-value pairs": lambda n: _gguf(n, 1, lambda i: gguf_string(b"k%x" % i) + struct.pack("<IB", 0, 1)),
    "an array of many tiny strings": lambda n: _gguf(n, 0, lambda i: gguf_string(b"s")),
    "many tensor infos": lambda n: _gguf(
        n, 0, lambda i: gguf_string(b"t%x" % i) + struct.pack("<IQIQ", 1, 0, 0, 0), n_tensors=1
    ),
    "long keys": lambda n: _gguf(n, 1, lambda i: gguf_string(b"%06x" % i + b"k" * 4000) + struct.pack("<IB", 0, 1)),
}


@pytest.mark.parametrize("case", GGUF_WORST_CASES)
def test_gguf_headers_parse_in_linear_time(tmp_path: Path, case: str) -> None:
    def parse(size: int) -> Callable[[], object]:
        path = tmp_path / f"{size}.gguf"
        path.write_bytes(GGUF_WORST_CASES[case](size))
        read_gguf_header(path)  # a valid header: the whole of it is read
        return lambda: read_gguf_header(path)

    _assert_linear(case, parse, _benign_json)


# Log lines quote request data (paths, headers, URLs); redacting them must not be a way to stall a worker.
LOG_WORST_CASES: dict[str, Callable[[int], str]] = {
    "scheme characters then ://": lambda size: "a." * (size // 2) + " ://",
    "many schemes": lambda size: "a://" * (size // 4),
    "user infos": lambda size: "http://" + "u@" * (size // 2),
    "request lines": lambda size: "GET " * (size // 4) + "/?",
    "long query": lambda size: "GET /x?" + "q" * size,
}


@pytest.mark.parametrize("case", LOG_WORST_CASES)
def test_log_redaction_runs_in_linear_time(case: str) -> None:
    # Against its own time at 16 KiB: a regex pass has no parser of the same text to be measured against
    # (json.loads of a quoted string is a memcpy, too fast to be a stable yardstick on a loaded machine).
    build = LOG_WORST_CASES[case]
    seconds = {size: _best(functools.partial(redact_urls, build(size)), 7) for size in SIZES}
    shown = ", ".join(f"{s // KIB} KiB: {seconds[s] * 1000:.2f} ms" for s in SIZES)
    assert seconds[SIZES[-1]] < SLOWEST_AT_256_KIB, f"{case}: {shown}"
    growth = SIZES[-1] // SIZES[0]
    assert seconds[SIZES[-1]] <= 2 * growth * max(seconds[SIZES[0]], 1e-4), (
        f"{case}: grows faster than its size: {shown}"
    )
