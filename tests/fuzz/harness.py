"""Fuzz targets for kiln's parsers of untrusted input, and structure-aware hypothesis strategies for them.

Each target takes the raw bytes of one file (a SafeTensors file, a GGUF file, a recipe, a config.json)
and runs the parser a user's input reaches. It may succeed or raise its documented error; anything
else (another exception, a hang, memory exhaustion) is a crash. The strategies start from valid
files and break them the ways the parsers must survive: wrong types, booleans for integers, huge and
negative numbers, NaN, deep nesting, duplicate keys, lying counts and lengths, truncation, trailing
bytes, random byte flips.

Used by tests/fuzz/test_fuzz.py (a bounded, deterministic run plus the replay of every crash ever
found, kept in tests/fuzz/corpus/<target>/) and by tools/fuzz.py (long runs that add to that corpus).
"""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from kiln.core.errors import InvalidInput, KilnError, RecipeInvalid, SourceInvalid
from kiln.formats.gguf.constants import GGUF_MAGIC, SCALAR_FORMATS, Keys, TensorType, ValueType
from tests.file_builders import gguf_string, gguf_value, safetensors_bytes, valid_safetensors_header

CORPUS = Path(__file__).parent / "corpus"


@dataclass(frozen=True)
class FuzzTarget:
    name: str
    run: Callable[[bytes, Path], None]  # (input, a scratch directory of its own)
    expected: Callable[[BaseException], bool]  # the documented errors
    strategy: st.SearchStrategy[bytes]


# --- shared value strategies --------------------------------------------------------------------------------------

_BIG_INTS = st.sampled_from([-1, 0, 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 2**64 + 1, 10**30])
_U64 = _BIG_INTS.filter(lambda v: 0 <= v < 2**64)
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    _BIG_INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["[/red]", "\x1b[2J", "../..", "/etc/passwd", "", "NaN", "1e400", "\x00"]),
)
JSON_VALUES = st.recursive(
    _SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


def _nested(depth: int, opener: bytes = b"[") -> bytes:
    closer = {b"[": b"]", b"{": b"}"}[opener]
    return opener * depth + closer * depth if opener == b"[" else b'{"a":' * depth + b"1" + b"}" * depth


@st.composite
def _byte_mutations(draw: st.DrawFn, raw: bytes) -> bytes:
    """Truncate, extend, flip or splice the serialised bytes (after the structural mutations)."""
    kind = draw(st.sampled_from(["none", "none", "truncate", "append", "flip", "splice"]))
    if kind == "truncate" and raw:
        return raw[: draw(st.integers(0, len(raw) - 1))]
    if kind == "append":
        return raw + draw(st.binary(min_size=1, max_size=64))
    if kind == "flip" and raw:
        out = bytearray(raw)
        for _ in range(draw(st.integers(1, 4))):
            out[draw(st.integers(0, len(out) - 1))] = draw(st.integers(0, 255))
        return bytes(out)
    if kind == "splice" and raw:
        at = draw(st.integers(0, len(raw)))
        return raw[:at] + draw(st.binary(max_size=32)) + raw[at:]
    return raw


# --- SafeTensors header -------------------------------------------------------------------------------------------

_DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1, "F64": 8}


@st.composite
def safetensors_files(draw: st.DrawFn) -> bytes:
    names = draw(st.lists(st.from_regex(r"[a-z][a-z0-9_.]{0,12}", fullmatch=True), min_size=0, max_size=4, unique=True))
    dtype = draw(st.sampled_from(sorted(_DTYPES)))
    shapes = {n: draw(st.lists(st.integers(0, 5), max_size=3)) for n in names}
    header: dict[str, Any] = valid_safetensors_header(shapes, dtype, _DTYPES[dtype])
    data_len = max((e["data_offsets"][1] for e in header.values()), default=0)
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3))
    for _ in range(draw(st.integers(0, 3))):
        what = draw(st.sampled_from(["field", "entry", "metadata", "drop", "offsets", "shape", "name"]))
        if what == "metadata":
            header["__metadata__"] = draw(JSON_VALUES)
        elif names and what in ("field", "drop", "offsets", "shape"):
            entry = header[draw(st.sampled_from(names))]
            if not isinstance(entry, dict):
                continue
            key = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
            if what == "drop":
                entry.pop(key, None)
            elif what == "offsets":
                entry["data_offsets"] = [
                    draw(st.one_of(_BIG_INTS, st.integers(-5, 200), st.booleans())) for _ in range(2)
                ]
            elif what == "shape":
                entry["shape"] = draw(st.lists(st.one_of(_BIG_INTS, st.integers(-2, 8), st.booleans()), max_size=4))
            else:
                entry[key] = draw(JSON_VALUES)
        elif names and what == "entry":
            header[draw(st.sampled_from(names))] = draw(JSON_VALUES)
        elif what == "name":
            header[draw(st.text(max_size=12))] = {"dtype": dtype, "shape": [0], "data_offsets": [0, 0]}
    try:
        raw_header = json.dumps(header).encode()
    except ValueError:
        raw_header = b"{}"
    special = draw(st.sampled_from(["none", "none", "none", "deep", "duplicate", "nan", "bigint", "notutf8"]))
    if special == "deep":
        raw_header = b'{"w": ' + _nested(draw(st.integers(900, 5000))) + b"}"
    elif special == "duplicate" and names:
        entry = json.dumps({names[0]: header.get(names[0])})[1:-1].encode()
        raw_header = raw_header[:-1] + (b", " if len(raw_header) > 2 else b"") + entry + b"}"
    elif special == "nan":
        raw_header = raw_header.replace(b"0", b"NaN", 1)
    elif special == "bigint":
        raw_header = raw_header.replace(b"0", b"1" + b"0" * draw(st.integers(20, 5000)), 1)
    elif special == "notutf8":
        raw_header = raw_header[:1] + b"\xff" + raw_header[1:]
    data_len += draw(st.sampled_from([0, 0, 0, 1, 7, -1]))
    raw = safetensors_bytes(raw_header, b"\0" * max(data_len, 0))
    if draw(st.integers(0, 9)) == 0:  # the length prefix lies
        raw = struct.pack("<Q", draw(st.one_of(_U64, st.integers(0, len(raw))))) + raw[8:]
    return draw(_byte_mutations(raw))


def _run_safetensors(data: bytes, scratch: Path) -> None:
    from kiln.formats.safetensors import read_header

    path = scratch / "model.safetensors"
    path.write_bytes(data)
    read_header(path, path.name)


# --- GGUF header ------------------------------------------------------------------------------------------------


@st.composite
def _gguf_kv(draw: st.DrawFn) -> bytes:
    key = draw(st.one_of(st.text(min_size=1, max_size=12), st.binary(min_size=1, max_size=6), st.just(Keys.ALIGNMENT)))
    kind = draw(st.sampled_from(["scalar", "string", "array", "nested", "lying_array", "bad_type"]))
    out = gguf_string(key)
    if kind == "scalar":  # any bit pattern of the type's width
        vt = draw(st.sampled_from([v for v in ValueType if v not in (ValueType.STRING, ValueType.ARRAY)]))
        width = struct.calcsize(SCALAR_FORMATS[vt])
        return out + struct.pack("<I", vt) + draw(st.binary(min_size=width, max_size=width))
    if kind == "string":
        return (
            out
            + struct.pack("<I", ValueType.STRING)
            + gguf_string(draw(st.one_of(st.text(max_size=20), st.binary(max_size=8))))
        )
    if kind == "array":
        sub = draw(
            st.sampled_from([ValueType.UINT8, ValueType.INT32, ValueType.FLOAT32, ValueType.STRING, ValueType.BOOL])
        )
        items = draw(st.lists(st.text(max_size=4) if sub == ValueType.STRING else st.integers(0, 1), max_size=5))
        return out + struct.pack("<I", ValueType.ARRAY) + gguf_value(ValueType.ARRAY, (sub, items))
    if kind == "nested":
        depth = draw(st.integers(1, 50))
        return (
            out
            + struct.pack("<I", ValueType.ARRAY)
            + struct.pack("<IQ", ValueType.ARRAY, 1) * depth
            + struct.pack("<IQ", 0, 0)
        )
    if kind == "lying_array":
        sub = draw(st.sampled_from(list(ValueType)))
        return out + struct.pack("<I", ValueType.ARRAY) + struct.pack("<IQ", sub, draw(_U64))
    return out + struct.pack("<I", draw(st.integers(13, 2**32 - 1))) + b"\0" * 8


@st.composite
def gguf_files(draw: st.DrawFn) -> bytes:
    kvs = draw(st.lists(_gguf_kv(), max_size=5))
    if draw(st.booleans()):  # the alignment key, right or wrong
        vt = draw(
            st.sampled_from([ValueType.UINT32, ValueType.UINT32, ValueType.INT32, ValueType.STRING, ValueType.BOOL])
        )
        value: Any = {ValueType.STRING: "32", ValueType.BOOL: True, ValueType.INT32: -32}.get(
            vt, draw(st.sampled_from([0, 1, 3, 32, 48, 64, 2**31]))
        )
        kvs.append(gguf_string(Keys.ALIGNMENT) + struct.pack("<I", vt) + gguf_value(vt, value))
    infos = []
    offset = 0
    for _ in range(draw(st.integers(0, 3))):
        name = draw(
            st.one_of(st.from_regex(r"[a-z.]{1,10}", fullmatch=True), st.text(max_size=70), st.binary(max_size=4))
        )
        dims = draw(
            st.lists(
                st.one_of(st.integers(1, 64), _U64),
                max_size=draw(st.sampled_from([4, 4, 9])),
            )
        )
        type_id = draw(st.sampled_from([int(t) for t in TensorType] + [3, 99, 2**31]))
        off = draw(st.sampled_from([offset, offset, 3, 2**40, 2**64 - 1]))
        infos.append(
            gguf_string(name) + struct.pack(f"<I{len(dims)}Q", len(dims), *dims) + struct.pack("<IQ", type_id, off)
        )
        offset += 256
    n_tensors = draw(st.sampled_from([len(infos)] * 4 + [len(infos) + 1, 2**40, 2**64 - 1]))
    n_kv = draw(st.sampled_from([len(kvs)] * 4 + [len(kvs) + 1, 2**63, 2**64 - 1]))
    raw = struct.pack("<IIQQ", GGUF_MAGIC, draw(st.sampled_from([3, 3, 3, 2, 4])), n_tensors, n_kv)
    raw += b"".join(kvs) + b"".join(infos)
    raw += b"\0" * (-len(raw) % 32) + b"\0" * draw(st.sampled_from([0, 64, 1024]))
    return draw(_byte_mutations(raw))


def _run_gguf(data: bytes, scratch: Path) -> None:
    from kiln.formats.gguf.reader import read_header

    path = scratch / "model.gguf"
    path.write_bytes(data)
    read_header(path)


# --- the recipe -------------------------------------------------------------------------------------------------

GOOD_RECIPE: dict[str, Any] = {
    "model": "tiny",
    "version": "1.0.0",
    "source": "model",
    "eval": {"text": "heldout.txt", "max_tokens": 256},
    "targets": [
        {"target": "gguf", "quants": ["f16", "q8_0"]},
        {"target": "hf-bundle", "quants": ["bf16", "w4a16-gptq"]},
        {"target": "orbax", "quants": ["bf16"], "params": {"mesh": {"data": 2, "model": 4}}},
        {
            "target": "trtllm",
            "quants": ["bf16"],
            "params": {"gpus": {"skus": ["h100"]}},
        },
    ],
}
_RECIPE_PATHS = st.sampled_from(
    ["model", "heldout.txt", "/etc", "/etc/passwd", "..", "../..", "model/../..", "link-out", "link-in", "", "\x00",
     "model\x00x", "a" * 300, "~", "$HOME", "missing"]
)  # fmt: skip


def _set_path(doc: dict[str, Any], path: list[Any], value: Any) -> None:
    node: Any = doc
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value


def _leaves(value: Any, path: list[Any]) -> list[list[Any]]:
    out = [path] if path else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _leaves(v, [*path, k])
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _leaves(v, [*path, i])
    return out


@st.composite
def recipe_files(draw: st.DrawFn) -> bytes:
    doc: dict[str, Any] = json.loads(json.dumps(GOOD_RECIPE))
    for _ in range(draw(st.integers(0, 3))):
        where = draw(st.sampled_from(_leaves(doc, [])))
        what = draw(st.sampled_from(["value", "path", "drop", "extra"]))
        try:
            if what == "value":
                _set_path(doc, where, draw(JSON_VALUES))
            elif what == "path":
                _set_path(
                    doc, draw(st.sampled_from([["source"], ["eval", "text"], ["calibration"]])), draw(_RECIPE_PATHS)
                )
            elif what == "drop" and len(where) == 1:
                doc.pop(where[0], None)
            elif what == "extra":
                doc[draw(st.sampled_from(["allowed_roots", "base_dir", "sorce", "calibration"]))] = draw(JSON_VALUES)
        except (KeyError, IndexError, TypeError):
            pass
    try:
        raw = json.dumps(doc).encode()  # JSON is YAML
    except ValueError:
        raw = b"{}"
    special = draw(st.sampled_from(["none"] * 6 + ["laughs", "deep", "alias_loop", "tag", "notutf8", "tabs"]))
    if special == "laughs":
        lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
        lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, draw(st.integers(2, 9)))]
        raw = ("\n".join(lines) + "\nmodel: tiny\n").encode()
    elif special == "deep":
        raw = b"model: " + _nested(draw(st.integers(100, 3000)))
    elif special == "alias_loop":
        raw = b"a: &a [*a]\nmodel: tiny\n"
    elif special == "tag":
        raw = b"model: !!python/object/apply:os.system ['true']\n"
    elif special == "notutf8":
        raw = b"model: \xff\xfe\n" + raw
    elif special == "tabs":
        raw = raw.replace(b" ", b"\t")
    return draw(_byte_mutations(raw))


def _recipe_scratch(scratch: Path) -> None:
    if (scratch / "model").is_dir():
        return
    (scratch / "model").mkdir()
    (scratch / "heldout.txt").write_text("def f():\n    return 1\n" * 20)
    outside = scratch.parent / f"{scratch.name}-outside"
    outside.mkdir(exist_ok=True)
    (outside / "secret.txt").write_text("secret")
    (scratch / "link-out").symlink_to(outside / "secret.txt")
    (scratch / "link-in").symlink_to(scratch / "heldout.txt")


def _run_recipe(data: bytes, scratch: Path) -> None:
    from kiln.pipeline.recipe import load_recipe

    _recipe_scratch(scratch)
    path = scratch / "kiln.yaml"
    path.write_bytes(data)
    recipe = load_recipe(path)
    for p in (recipe.source_dir, recipe.eval_text, recipe.calibration_text):  # the rule the loader promises
        assert p.is_relative_to(scratch.resolve()), p


# --- config.json through open_source --------------------------------------------------------------------------

# The config.json of the model `fuzz_model_dir` writes: a constant, so the strategy draws from data only.
BASE_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 32,
    "intermediate_size": 64,
    "max_position_embeddings": 512,
    "model_type": "llama",
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "num_key_value_heads": 1,
    "pad_token_id": 0,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "tie_word_embeddings": False,
    "vocab_size": 300,
}
_MODEL_CACHE: dict[str, Path] = {}


def fuzz_model_dir() -> Path:
    """A small generated llama release with BASE_CONFIG, made once per process (seconds: torch, transformers).

    Call it before fuzzing: the model is made with seeded randomness, which must not happen inside a
    hypothesis run.
    """
    if "llama" not in _MODEL_CACHE:
        from tests.model_factory import make_model

        root = Path(tempfile.mkdtemp(prefix="kiln-fuzz-model-"))
        model = make_model(root / "model", hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1,
                           vocab_size=300)  # fmt: skip
        (model / "config.json").write_text(json.dumps(BASE_CONFIG))
        _MODEL_CACHE["llama"] = model
    return _MODEL_CACHE["llama"]


_CONFIG_KEYS = [
    "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rope_theta", "rope_parameters", "rope_scaling", "rms_norm_eps",
    "max_position_embeddings", "tie_word_embeddings", "attention_bias", "hidden_act", "use_sliding_window",
    "sliding_window", "mlp_bias", "partial_rotary_factor", "bos_token_id", "eos_token_id", "pad_token_id",
]  # fmt: skip


@st.composite
def config_files(draw: st.DrawFn) -> bytes:
    cfg = json.loads(json.dumps(BASE_CONFIG))
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from(_CONFIG_KEYS))
        what = draw(st.sampled_from(["value", "value", "int", "drop"]))
        if what == "drop":
            cfg.pop(key, None)
        elif what == "int":
            cfg[key] = draw(st.one_of(_BIG_INTS, st.integers(-3, 3000), st.booleans(), st.floats()))
        else:
            cfg[key] = draw(JSON_VALUES)
    try:
        raw = json.dumps(cfg).encode()
    except ValueError:
        raw = b"{}"
    special = draw(st.sampled_from(["none"] * 6 + ["inf", "nan", "bigint", "deep", "duplicate"]))
    if special == "inf":
        raw = raw.replace(b"10000.0", b"1e400", 1)
    elif special == "nan":
        raw = raw.replace(b"1e-06", b"NaN", 1)
    elif special == "bigint":
        raw = raw.replace(b'"num_hidden_layers": 2', b'"num_hidden_layers": 1' + b"0" * draw(st.integers(9, 5000)), 1)
    elif special == "deep":
        raw = raw[:-1] + b', "x": ' + _nested(draw(st.integers(900, 5000))) + b"}"
    elif special == "duplicate":
        raw = raw[:-1] + b', "vocab_size": 300}'
    return draw(_byte_mutations(raw))


def _run_config(data: bytes, scratch: Path) -> None:
    from kiln.formats.hf_model import open_source

    src = scratch / "model"
    if not src.is_dir():
        shutil.copytree(fuzz_model_dir(), src)
    (src / "config.json").write_bytes(data)
    open_source(src)


def _is(*classes: type[KilnError], code: str | None = None) -> Callable[[BaseException], bool]:
    return lambda e: isinstance(e, classes) and (code is None or getattr(e, "code", None) == code)


TARGETS: dict[str, FuzzTarget] = {
    t.name: t
    for t in (
        FuzzTarget("safetensors_header", _run_safetensors, _is(SourceInvalid), safetensors_files()),
        FuzzTarget("gguf_header", _run_gguf, _is(InvalidInput, code="GGUF_INVALID"), gguf_files()),
        FuzzTarget("recipe", _run_recipe, _is(RecipeInvalid), recipe_files()),
        FuzzTarget("config", _run_config, _is(InvalidInput), config_files()),  # SourceInvalid, UnsafeCheckpoint
    )
}


def corpus(target: str) -> list[Path]:
    """Every input kept for `target`: crashes found once, replayed by the tests forever."""
    return sorted((CORPUS / target).glob("*.bin"))
