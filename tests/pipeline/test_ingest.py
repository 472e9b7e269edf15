"""Ingest refuses what it must and plans from headers only."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from kiln.core.errors import SourceInvalid, UnsafeCheckpoint
from kiln.core.shape import ShapeRecord
from kiln.formats.hf_model import open_source
from kiln.formats.safetensors import MAX_HEADER_BYTES, read_header
from tests.file_builders import buffer_len, safetensors_bytes, valid_safetensors_header
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
        (lambda h: h.update({"model.extra.weight": h.pop("model.norm.weight")}), "missing"),
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


# --- the SafeTensors header is untrusted: each bad one is SOURCE_INVALID naming the file ---------------------


def _header_error(tmp_path: Path, raw: bytes) -> SourceInvalid:
    path = tmp_path / "x.safetensors"
    path.write_bytes(raw)
    with pytest.raises(SourceInvalid) as e:
        read_header(path, "x.safetensors")
    assert e.value.message.startswith("x.safetensors: ")
    return e.value


def _entry(**kw: object) -> dict:
    return {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], **kw}}


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (safetensors_bytes(b"[" * 100_000), "nests deeper than 64 levels"),
        (safetensors_bytes(b'{"w": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"), "nests deeper than 64 levels"),
        (safetensors_bytes(_entry(shape=[[[[2]]]]), b"\0" * 8), "invalid shape"),
        (safetensors_bytes(_entry(shape=[True, 2]), b"\0" * 8), "invalid shape [True, 2]"),
        (safetensors_bytes(_entry(shape=[2.0]), b"\0" * 8), "invalid shape"),
        (safetensors_bytes(_entry(shape=[-2]), b"\0" * 8), "invalid shape"),
        (safetensors_bytes(_entry(shape=[1] * 17), b"\0" * 8), "invalid shape"),
        (safetensors_bytes(_entry(shape=[2**41]), b"\0" * 8), "invalid shape"),
        (safetensors_bytes(_entry(shape=[2**40, 2**40, 0], data_offsets=[0, 0])), "elements"),
        (
            safetensors_bytes(b'{"w": {"dtype": "F32", "shape": [1' + b"0" * 30 + b'], "data_offsets": [0, 8]}}'),
            "is out of range",
        ),
        (safetensors_bytes(_entry(data_offsets=[False, 8]), b"\0" * 8), "invalid data_offsets"),
        (safetensors_bytes(_entry(data_offsets=[0, True]), b"\0" * 8), "invalid data_offsets"),
        (safetensors_bytes(_entry(data_offsets=[0, 8.0]), b"\0" * 8), "invalid data_offsets"),
        (safetensors_bytes(_entry(data_offsets=[0, 2**64]), b"\0" * 8), "is out of range"),
        (safetensors_bytes(_entry(data_offsets=[8, 0]), b"\0" * 8), "invalid data_offsets"),
        (safetensors_bytes(_entry(dtype=["F32"]), b"\0" * 8), "unsupported dtype"),
        (safetensors_bytes(_entry(dtype={"a": 1}), b"\0" * 8), "unsupported dtype"),
        (safetensors_bytes(b'{"w": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 8]}}'), "NaN is not a number"),
        (safetensors_bytes(_entry(), b"\0" * 12), "bytes [77, 81) of the file belong to no tensor (trailing"),
        (
            safetensors_bytes(
                {
                    "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                    "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
                },  # fmt: skip
                b"\0" * 12,
            ),
            "(a hole before 'b')",
        ),
        (
            safetensors_bytes(
                b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
                b'"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}',
                b"\0" * 8,
            ),
            "key 'w' appears twice",
        ),
        (safetensors_bytes({"__metadata__": {"a": 1}}), "__metadata__ must map strings to strings"),
        (safetensors_bytes({"__metadata__": []}), "__metadata__ must map strings to strings"),
        (safetensors_bytes({"__metadata__": {"a": ["x"]}}), "__metadata__ must map strings to strings"),
        (safetensors_bytes(b'{"w": 1}'), "needs exactly dtype, shape, data_offsets"),
        (safetensors_bytes(b"\xff\xfe{}"), "not UTF-8"),
        (b"\x01\x00\x00", "too small"),
    ],
)
def test_malformed_safetensors_headers_are_refused(tmp_path: Path, raw: bytes, words: str) -> None:
    assert words in _header_error(tmp_path, raw).message


def test_trailing_bytes_after_the_last_tensor_fail_ingest(tmp_path: Path, model_dir: Path) -> None:
    """The safetensors library refuses such a file; ingest must not accept it and fail later."""
    src = _copy(model_dir, tmp_path / "m")
    with open(src / "model.safetensors", "ab") as f:
        f.write(b"hidden payload")
    size = (src / "model.safetensors").stat().st_size
    with pytest.raises(SourceInvalid, match=rf"model.safetensors: bytes \[{size - 14}, {size}\) .* no tensor"):
        open_source(src)


def test_a_valid_hand_built_header_is_read(tmp_path: Path) -> None:
    header = valid_safetensors_header({"a": [2, 3], "b": [0], "c": [4]})
    path = tmp_path / "x.safetensors"
    path.write_bytes(safetensors_bytes({**header, "__metadata__": {"format": "pt"}}, b"\0" * buffer_len(header)))
    tensors, meta = read_header(path, "x.safetensors")
    assert [(t.name, t.shape, t.nbytes) for t in tensors] == [("a", (2, 3), 24), ("b", (0,), 0), ("c", (4,), 16)]
    assert meta == {"format": "pt"}


# A header a scanner that re-reads the rest of the text from every quote takes minutes over: an
# unterminated string of escaped quotes. Its parse is linear: refused in a blink, whatever its size.
def _escaped_quotes(size: int) -> bytes:
    return (b'"' + b'\\"' * size)[:size]


@pytest.mark.parametrize(("size", "seconds"), [(128 * 1024, 0.5), (MAX_HEADER_BYTES, 10.0)])
def test_a_crafted_header_fails_ingest_fast(tmp_path: Path, model_dir: Path, size: int, seconds: float) -> None:
    src = _copy(model_dir, tmp_path / "m")
    (src / "model.safetensors").write_bytes(safetensors_bytes(_escaped_quotes(size)))
    start = time.perf_counter()
    with pytest.raises(SourceInvalid, match="model.safetensors: header is not valid JSON .Unterminated string"):
        open_source(src)
    assert time.perf_counter() - start < seconds


def test_kiln_build_of_a_crafted_header_fails_fast_with_source_invalid(tmp_path: Path, model_dir: Path) -> None:
    src = _copy(model_dir, tmp_path / "model")
    (src / "model.safetensors").write_bytes(safetensors_bytes(_escaped_quotes(128 * 1024)))
    (tmp_path / "heldout.txt").write_text("def f(): pass\n")
    recipe = {
        "model": "m",
        "version": "1",
        "source": "model",
        "eval": {"text": "heldout.txt"},
        "targets": [{"target": "gguf", "quants": ["f16"]}],
    }
    (tmp_path / "kiln.yaml").write_text(json.dumps(recipe))
    start = time.perf_counter()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kiln",
            "build",
            str(tmp_path / "kiln.yaml"),
            "--json",
            "--work-dir",
            str(tmp_path / "w"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    elapsed = time.perf_counter() - start
    assert out.returncode == 2, out.stderr
    error = json.loads(out.stdout)["error"]
    assert error["code"] == "SOURCE_INVALID" and error["details"] == {"file": "model.safetensors"}, error
    assert "Unterminated string" in error["message"]
    # The command's own start (imports) is most of this; the crafted header used to take minutes.
    assert elapsed < 60, elapsed


# --- config.json is read strictly: each bad field is SOURCE_INVALID naming it -------------------------------


@pytest.mark.parametrize(
    ("edit", "field", "words"),
    [
        ({"rope_theta": "ten-thousand"}, "rope_theta", "valid number"),
        ({"rope_theta": True}, "rope_theta", "valid number"),
        ({"rope_theta": -1.0}, "rope_theta", "greater than 0"),
        ({"rope_parameters": {"rope_theta": "x"}}, "rope_parameters.rope_theta", "valid number"),
        ({"rope_parameters": "default"}, "rope_parameters", "valid dictionary"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings", "valid boolean"),
        ({"tie_word_embeddings": 0}, "tie_word_embeddings", "valid boolean"),
        ({"attention_bias": "no"}, "attention_bias", "valid boolean"),
        ({"rms_norm_eps": None}, "rms_norm_eps", "must not be null"),
        ({"rms_norm_eps": 0}, "rms_norm_eps", "greater than 0"),
        ({"bos_token_id": "1"}, "bos_token_id", "valid integer"),
        ({"bos_token_id": 1.0}, "bos_token_id", "valid integer"),
        ({"bos_token_id": -1}, "bos_token_id", "greater than or equal to 0"),
        ({"eos_token_id": [1, "2"]}, "eos_token_id", "token id"),
        ({"eos_token_id": {"id": 1}}, "eos_token_id", "token id"),
        ({"num_hidden_layers": 1_000_000_000}, "num_hidden_layers", "less than or equal to 1024"),
        ({"num_hidden_layers": 2.0}, "num_hidden_layers", "valid integer"),
        ({"num_hidden_layers": True}, "num_hidden_layers", "valid integer"),
        ({"hidden_size": -64}, "hidden_size", "greater than 0"),
        ({"hidden_size": 2**60}, "hidden_size", "less than or equal to"),
        ({"vocab_size": 0}, "vocab_size", "greater than 0"),
        ({"intermediate_size": "256"}, "intermediate_size", "valid integer"),
        ({"num_attention_heads": None}, "num_attention_heads", "valid integer"),
        ({"max_position_embeddings": 10**12}, "max_position_embeddings", "less than or equal to"),
        ({"head_dim": 15.5}, "head_dim", "valid integer"),
        ({"hidden_act": ["silu"]}, "hidden_act", "valid string"),
        ({"sliding_window": "4096"}, "sliding_window", "valid integer"),
        ({"use_sliding_window": "yes"}, "use_sliding_window", "valid boolean"),
        ({"partial_rotary_factor": 2.0}, "partial_rotary_factor", "less than or equal to 1"),
    ],
)
def test_config_values_of_the_wrong_type_or_size_are_refused(
    tmp_path: Path, model_dir: Path, edit: dict, field: str, words: str
) -> None:
    src = _copy(model_dir, tmp_path / "m")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(SourceInvalid) as e:
        open_source(src)
    assert e.value.message.startswith(f"config.json: {field}: "), e.value.message
    assert words in e.value.message
    assert e.value.details["field"] == field


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('"rope_theta": 1e400', "rope_theta: Input should be a finite number"),
        ('"rope_theta": NaN', "NaN is not a number JSON allows"),
        ('"rope_theta": Infinity', "Infinity is not a number JSON allows"),
        ('"vocab_size": 1' + "0" * 5000, "is out of range"),
        ('"x": ' + "[" * 100_000, "nests deeper than 64 levels"),
        ('"vocab_size": 512, "vocab_size": 512', "key 'vocab_size' appears twice"),
    ],
)
def test_config_json_that_python_would_misread_is_refused(
    tmp_path: Path, model_dir: Path, text: str, words: str
) -> None:
    src = _copy(model_dir, tmp_path / "m")
    raw = (src / "config.json").read_text()
    (src / "config.json").write_text(raw.replace("{", "{" + text + ", ", 1))
    with pytest.raises(SourceInvalid, match=re.escape(words)):
        open_source(src)


def test_a_billion_layers_is_refused_up_front(tmp_path: Path, model_dir: Path) -> None:
    import time

    src = _copy(model_dir, tmp_path / "m")
    cfg = json.loads((src / "config.json").read_text())
    started = time.monotonic()
    for layers in (1_000_000_000, 1000):  # over the bound; under it but more than the headers hold
        (src / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": layers}))
        with pytest.raises(SourceInvalid, match="num_hidden_layers|implies"):
            open_source(src)
    assert time.monotonic() - started < 5


def test_the_tensor_count_is_checked_before_the_names(tmp_path: Path, model_dir: Path) -> None:
    src = _copy(model_dir, tmp_path / "m")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(SourceInvalid, match="config.json implies 30 tensors .* headers hold 21"):
        open_source(src)


# --- files: links that leave the source, special files, what is ignored -------------------------------------


def test_a_link_out_of_the_source_is_refused_unless_allowed(tmp_path: Path, model_dir: Path) -> None:
    src = _copy(model_dir, tmp_path / "m")
    secret = tmp_path / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("{{ 'private key' }}")
    (src / "chat_template.jinja").symlink_to(secret)
    with pytest.raises(UnsafeCheckpoint) as e:
        open_source(src)
    assert "chat_template.jinja is a symbolic link to" in e.value.message and str(secret) in e.value.message
    assert e.value.details["link_target"] == str(secret)
    allowed = open_source(src, allowed_roots=[secret.parent])
    assert "chat_template.jinja" in allowed.tokenizer_files
    assert allowed.allowed_roots == (secret.parent.resolve(),)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "model.safetensors", "tokenizer_config.json"])
def test_any_used_file_linking_out_is_refused(tmp_path: Path, model_dir: Path, name: str) -> None:
    src = _copy(model_dir, tmp_path / "m")
    outside = tmp_path / name
    (src / name).rename(outside)
    (src / name).symlink_to(outside)
    with pytest.raises(UnsafeCheckpoint, match=f"{re.escape(name)} is a symbolic link"):
        open_source(src)


def test_links_inside_the_source_are_followed(tmp_path: Path, model_dir: Path) -> None:
    src = _copy(model_dir, tmp_path / "m")
    (src / "blobs").mkdir()
    (src / "model.safetensors").rename(src / "blobs" / "abc123")
    (src / "model.safetensors").symlink_to("blobs/abc123")
    assert len(open_source(src).tensors) == 21


def test_special_and_dangling_files_are_refused(tmp_path: Path, model_dir: Path) -> None:
    src = _copy(model_dir, tmp_path / "m")
    os.mkfifo(src / "chat_template.jinja")  # reading it would block the build forever
    with pytest.raises(SourceInvalid, match="chat_template.jinja is a FIFO, not a regular file"):
        open_source(src)
    (src / "chat_template.jinja").unlink()
    (src / "chat_template.jinja").symlink_to("nowhere")
    with pytest.raises(SourceInvalid, match="symbolic link to 'nowhere', which does not exist"):
        open_source(src)
    (src / "chat_template.jinja").unlink()
    (src / "chat_template.jinja").mkdir()
    with pytest.raises(SourceInvalid, match="chat_template.jinja is a directory"):
        open_source(src)


def test_pickles_beside_safetensors_are_ignored_and_say_so(tmp_path: Path, model_dir: Path) -> None:
    src = _copy(model_dir, tmp_path / "m")
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04never unpickled")
    (src / "consolidated.safetensors").write_bytes(b"not read either")
    source = open_source(src)
    assert source.ignored == [
        ("pytorch_model.bin", "pickle checkpoint: never loaded"),
        ("consolidated.safetensors", "no model.safetensors.index.json, so only model.safetensors is read"),
    ]
    assert "pytorch_model.bin" not in {f.path for f in source.files}


def test_the_ingest_stage_records_what_it_ignored_and_checks_links_again(tmp_path: Path, model_dir: Path) -> None:
    from kiln.pipeline.executors.local import LocalExecutor
    from kiln.pipeline.records import IngestRecord
    from kiln.pipeline.stages import ingest as ingest_stage
    from kiln.pipeline.store import WorkDir

    src = _copy(model_dir, tmp_path / "m")
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04never unpickled")
    (tmp_path / "tpl").mkdir()
    (tmp_path / "tpl" / "chat.jinja").write_text("{{ messages }}")
    (src / "chat_template.jinja").symlink_to(tmp_path / "tpl" / "chat.jinja")
    node = ingest_stage.node(open_source(src, allowed_roots=[tmp_path / "tpl"]), src, tmp_path / "hashes.json")
    out = LocalExecutor(WorkDir(tmp_path / "work")).run([node])["ingest/source"].output
    assert out is not None
    record = out.record(IngestRecord)
    assert [(f.path, f.reason) for f in record.ignored] == [("pytorch_model.bin", "pickle checkpoint: never loaded")]
    # The shape the stage stored, published as JSON (`pipeline.stages.publish`), is what resolve reads back.
    assert record.shape == open_source(src, allowed_roots=[tmp_path / "tpl"]).shape.record()
    assert ShapeRecord.from_untrusted(record.shape.model_dump(mode="json")) == record.shape
    assert (out.files_dir / "chat_template.jinja").read_text() == "{{ messages }}"
    assert not (out.files_dir / "chat_template.jinja").is_symlink()
    # the stage opens the source again with the node's allowed directories, not with none and not with more
    stripped = replace(node, args={**node.args, "allowed_roots": []})
    with pytest.raises(UnsafeCheckpoint):
        LocalExecutor(WorkDir(tmp_path / "work2")).run([stripped])
