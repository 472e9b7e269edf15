"""Ingest refuses what it must and plans from headers only."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from kiln.errors import SourceInvalid, UnsafeCheckpoint
from pipeline.ingest import open_source
from tests.model_factory import make_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("llama"))


def _copy(model_dir: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in model_dir.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def _rewrite_header(path: Path, mutate) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    mutate(header)
    new = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def test_plans_every_tensor_and_hashes_every_file(model_dir: Path) -> None:
    src = open_source(model_dir)
    assert len(src.tensors) == 2 + 1 + 2 * 9  # embed, norm, lm_head, 9 per layer
    assert {f.path for f in src.files} >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert all(len(f.sha256) == 64 for f in src.files)
    t = src.tensor("model.layers.0.self_attn.k_proj.weight")
    assert tuple(t.shape) == (32, 64)


def test_sharded_source_matches_single_file(tmp_path: Path, model_dir: Path) -> None:
    sharded = open_source(make_model(tmp_path / "sharded", shards=3))
    single = open_source(model_dir)
    assert len(sharded.weight_files) > 1
    assert list(sharded.tensors) == list(single.tensors)
    for name in single.tensors:
        assert sharded.tensor(name).equal(single.tensor(name))


def test_pickle_only_checkpoint_is_refused_with_reason(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")
    with pytest.raises(UnsafeCheckpoint, match="arbitrary code"):
        open_source(tmp_path)


def test_index_pointing_outside_the_source_is_refused(tmp_path: Path, model_dir: Path) -> None:
    src = _copy(model_dir, tmp_path / "m")
    (src / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "../../etc/passwd.safetensors"}})
    )
    with pytest.raises(UnsafeCheckpoint):
        open_source(src)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda h: h["model.norm.weight"].update(dtype="Q4"), "unsupported dtype"),
        (lambda h: h["model.norm.weight"].update(data_offsets=[0, 10**12]), "out of bounds"),
        (lambda h: h["model.norm.weight"].update(shape=[65]), "needs"),
        (lambda h: h["lm_head.weight"].update(data_offsets=h["model.embed_tokens.weight"]["data_offsets"]), "overlap"),
        (lambda h: h.update({"../evil": h.pop("model.norm.weight")}), "invalid tensor name"),
        (lambda h: h.pop("model.norm.weight"), "missing"),
    ],
)
def test_malformed_headers_are_refused(tmp_path: Path, model_dir: Path, mutate, message: str) -> None:
    src = _copy(model_dir, tmp_path / "m")
    _rewrite_header(src / "model.safetensors", mutate)
    with pytest.raises(SourceInvalid, match=message):
        open_source(src)


def test_shapes_are_checked_against_config(tmp_path: Path, model_dir: Path) -> None:
    src = _copy(model_dir, tmp_path / "m")
    cfg = json.loads((src / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SourceInvalid, match="config.json implies"):
        open_source(src)


def test_oversized_header_is_refused(tmp_path: Path, model_dir: Path) -> None:
    src = _copy(model_dir, tmp_path / "m")
    raw = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(struct.pack("<Q", 2**40) + raw[8:])
    with pytest.raises(SourceInvalid, match="exceeds"):
        open_source(src)


def test_unsupported_architecture_names_the_supported_ones(tmp_path: Path, model_dir: Path) -> None:
    src = _copy(model_dir, tmp_path / "m")
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SourceInvalid, match="LlamaForCausalLM"):
        open_source(src)
