"""The model-shape record (`core.shape.ShapeRecord`): strict as a record, lenient from untrusted configs, and the
same record whichever way it is read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from kiln.core.errors import UnknownName
from kiln.core.shape import KV_DTYPES, MAX_DIMENSION, ShapeRecord
from kiln.placement.model import kv_cache_bytes, parameters

ROOT = Path(__file__).resolve().parents[2]
LLAMA_70B = json.loads((ROOT / "examples/llama-3-70b/config.json").read_text())

# What the pipeline published for Llama-3-70B before the record existed (`ModelShape.summary()`): stored
# releases hold exactly this JSON, so it must keep reading as the record.
STORED_70B: dict[str, Any] = {
    "architecture": "LlamaForCausalLM",
    "num_layers": 80,
    "num_attention_heads": 64,
    "num_kv_heads": 8,
    "head_dim": 128,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "max_position_embeddings": 131072,
}
RECORD_70B = ShapeRecord(**STORED_70B)
KV = {"num_hidden_layers": 32, "num_key_value_heads": 8, "head_dim": 128}


def test_the_record_writes_the_keys_stored_releases_hold() -> None:
    assert RECORD_70B.model_dump(mode="json") == STORED_70B
    assert list(RECORD_70B.model_dump(mode="json")) == list(STORED_70B)
    assert ShapeRecord.model_validate(STORED_70B) == RECORD_70B
    assert ShapeRecord.model_validate_json(json.dumps(STORED_70B)) == RECORD_70B


def test_round_trip_through_json_and_through_the_lenient_reader() -> None:
    sparse = ShapeRecord(num_layers=2, num_kv_heads=1, head_dim=64)
    for record in (RECORD_70B, sparse):
        text = record.model_dump_json()
        assert ShapeRecord.model_validate_json(text) == record
        assert ShapeRecord.from_untrusted(json.loads(text)) == record


def test_a_hugging_face_config_reads_as_the_same_record() -> None:
    assert ShapeRecord.from_untrusted(LLAMA_70B) == RECORD_70B


@pytest.mark.parametrize(
    "change",
    [
        {"num_layers": "80"},
        {"num_layers": 80.0},
        {"num_layers": True},
        {"num_layers": 0},
        {"num_kv_heads": -8},
        {"head_dim": MAX_DIMENSION + 1},
        {"vocab_size": 10**40},
        {"tie_word_embeddings": "false"},
        {"tie_word_embeddings": 0},
        {"architecture": ""},
        {"architecture": "A" * 129},
        {"rope_theta": 500000.0},  # not a field of the record: refused, not carried along
    ],
)
def test_the_record_refuses_what_is_not_a_shape(change: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        ShapeRecord.model_validate({**STORED_70B, **change})


@pytest.mark.parametrize("bad", ["32", 32.0, True, False, 0, -1, MAX_DIMENSION + 1, None, [32], {"n": 32}])
def test_the_lenient_reader_counts_a_bad_size_as_missing(bad: Any) -> None:
    for key in KV:
        shape = ShapeRecord.from_untrusted({**KV, key: bad})
        assert isinstance(shape, str), (key, bad)
        assert shape.startswith("the release's model_config lacks ") and shape.endswith("KV cache is not counted")
    for key in ("num_attention_heads", "hidden_size", "intermediate_size", "vocab_size", "max_position_embeddings"):
        shape = ShapeRecord.from_untrusted({**KV, key: bad})
        assert isinstance(shape, ShapeRecord) and getattr(shape, key) is None and parameters(shape) is None


def test_the_lenient_reader_names_what_is_missing() -> None:
    assert ShapeRecord.from_untrusted({"num_hidden_layers": 32}) == (
        "the release's model_config lacks num_key_value_heads, head_dim, so the KV cache is not counted"
    )
    not_objects: list[Any] = [[], "config", None, 80]
    for not_an_object in not_objects:
        assert ShapeRecord.from_untrusted(not_an_object) == (
            "the release's model_config is not an object, so the KV cache is not counted"
        )


def test_the_lenient_reader_fills_what_transformers_would() -> None:
    shape = ShapeRecord.from_untrusted({"n_layer": 12, "n_head": 12, "n_embd": 768, "architectures": ["GPT2"]})
    assert shape == ShapeRecord(
        architecture="GPT2", num_layers=12, num_attention_heads=12, num_kv_heads=12, head_dim=64, hidden_size=768
    )
    # Anything but a bool is "not tied"; an architecture that is not one short string is unknown.
    odd = ShapeRecord.from_untrusted({**KV, "tie_word_embeddings": "yes", "architectures": ["A", "B"]})
    assert isinstance(odd, ShapeRecord) and odd.tie_word_embeddings is False and odd.architecture is None


def test_sizing() -> None:
    assert parameters(RECORD_70B) == 70_553_706_496
    assert kv_cache_bytes(RECORD_70B, 32768, 1) == 2 * 80 * 8 * 128 * 32768 * KV_DTYPES["bf16"] == 10 * 2**30
    assert kv_cache_bytes(RECORD_70B, 32768, 2, "fp8") == kv_cache_bytes(RECORD_70B, 32768, 1)
    tied = RECORD_70B.model_copy(update={"tie_word_embeddings": True})
    assert (parameters(RECORD_70B) or 0) - (parameters(tied) or 0) == 128256 * 8192
    with pytest.raises(UnknownName, match="known: bf16, fp8"):
        kv_cache_bytes(RECORD_70B, 1, 1, "int4")


def test_the_record_is_frozen() -> None:
    with pytest.raises(ValidationError):
        RECORD_70B.num_layers = 1  # type: ignore[misc]
