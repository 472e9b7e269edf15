"""A pre-quantized source through the ingest stage: its scales are checked, and its quantization is recorded as
part of what identifies it, so every stage after it is keyed by it; a plain source's record is what it was."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from kiln.core.digest import HashCache
from kiln.core.errors import StageFailed
from kiln.formats.hf_model import open_source
from kiln.formats.prequantized import QuantizedSourceInvalid
from kiln.pipeline import build
from kiln.pipeline.executors.local import LocalExecutor
from kiln.pipeline.executors.node import NodeOutcome
from kiln.pipeline.recipe import load_recipe
from kiln.pipeline.records import IngestRecord, ReferenceRecord
from kiln.pipeline.stages import ingest as ingest_stage
from kiln.pipeline.stages.reference import stored_reference, stored_text
from kiln.pipeline.store import WorkDir
from tests.model_factory import make_model
from tests.quantized_sources import make_fp8_block_source

SCALE = "model.layers.1.mlp.down_proj.weight_scale_inv"


def _ingest(src: Path, work: Path) -> NodeOutcome:
    hashes = HashCache(work / build.HASH_CACHE)
    node = ingest_stage.node(open_source(src, hasher=hashes.sha256), src, work / build.HASH_CACHE)
    hashes.save()
    return LocalExecutor(WorkDir(work)).run([node])["ingest/source"]


def test_the_quantization_is_recorded_and_keys_what_follows(tmp_path: Path) -> None:
    fp8 = _ingest(make_fp8_block_source(tmp_path / "fp8"), tmp_path / "work")
    qwen_style = _ingest(make_fp8_block_source(tmp_path / "bf16-scales", scale_dtype="bfloat16"), tmp_path / "work")
    assert fp8.output is not None and qwen_style.output is not None
    record = fp8.output.record(IngestRecord)
    assert record.quantization is not None
    assert record.quantization.model_dump() == {
        "layout": "fp8-block",
        "quant_method": "fp8",
        "block_size": [128, 128],
        "scale_dtype": "F32",
        "scale_fmt": "float",
        "tensors": 14,  # 7 Linears in each of 2 layers
        "parameters": 2 * (128 * 128 * 2 + 64 * 128 * 2 + 320 * 128 * 3),
        "stored_bytes": 2 * (128 * 128 * 2 + 64 * 128 * 2 + 320 * 128 * 3) + 2 * 4 * (1 + 1 + 1 + 1 + 3 + 3 + 3),
        "modules_to_not_convert": [],
    }
    assert record.parameters == sum(t.numel for t in open_source(tmp_path / "fp8").tensors.values())
    # The same model with its scales kept in bfloat16: another quantization, another source, another key after.
    other = qwen_style.output.record(IngestRecord).quantization
    assert other is not None and other.scale_dtype == "BF16"
    assert qwen_style.output.digest != fp8.output.digest
    stored = json.loads((fp8.output.path / "stage.json").read_text())
    assert stored["result"]["quantization"]["layout"] == "fp8-block"


def test_a_plain_sources_record_has_no_quantization_key(tmp_path: Path) -> None:
    """Sources ingested before quantized ones could be keep their outputs' digests, and every key after them."""
    out = _ingest(make_model(tmp_path / "plain"), tmp_path / "work").output
    assert out is not None
    assert out.record(IngestRecord).quantization is None
    assert "quantization" not in json.loads((out.path / "stage.json").read_text())["result"]
    assert "quantization" not in out.record(IngestRecord).model_dump(mode="json")


@pytest.mark.parametrize(("bad", "what"), [(float("nan"), "nan is not a finite scale"), (-1.0, "-1.0 is not")])
def test_a_bad_scale_fails_the_ingest_naming_it(tmp_path: Path, bad: float, what: str) -> None:
    src = make_fp8_block_source(tmp_path / "m")
    tensors = load_file(src / "model.safetensors")
    tensors[SCALE] = tensors[SCALE].clone()
    tensors[SCALE][0, 2] = bad
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(QuantizedSourceInvalid) as e:
        _ingest(src, tmp_path / "work")
    assert e.value.code == "SOURCE_QUANTIZATION_INVALID"
    found = {k: v for k, v in e.value.details.items() if k not in ("log", "log_tail")}  # where its traceback is
    assert found == {
        "file": "model.safetensors",
        "tensor": SCALE,
        "index": [0, 2],
        "count": 1,
        "stage": "ingest/source",
    }
    assert what in e.value.message
    assert not list((tmp_path / "work" / "ingest").glob("*/stage.json"))  # nothing that looks done


def test_a_prequantized_source_is_sized_by_its_layout_and_its_plain_weights_dtype(tmp_path: Path) -> None:
    """DeepSeek-V3 as released: FP8 Linears with float32 scales, bf16 weights beside them and its routers'
    correction biases in float32. A weight is sized as bf16, the dtype most of its plain weights are in (not the
    widest the headers hold), and the source's bytes as its layout stores them."""
    from kiln.formats.safetensors import read_header
    from kiln.pipeline.requirements import Sizing
    from kiln.placement.weights import source_bytes

    src = make_fp8_block_source(tmp_path / "m", "deepseek_v3")
    tensors = load_file(src / "model.safetensors")
    biases = [n for n in tensors if n.endswith("e_score_correction_bias")]
    assert biases
    tensors.update({n: tensors[n].float() for n in biases})
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})

    sizing = Sizing.of_source(open_source(src), max_tokens=64, window=32, greedy_tokens=4)
    assert sizing.weight_bytes == 2
    infos, _ = read_header(src / "model.safetensors", "model.safetensors")
    stored = sum(t.nbytes for t in infos)
    as_bf16 = sum(t.nbytes // 2 for t in infos if t.name in biases)  # the one thing sized narrower than stored
    assert source_bytes(sizing.shape, sizing.weight_bytes, extras=False) == stored - as_bf16


# --- the reference: the source as released, computed from its dequantized weights ---------------------------


def _plain_copy(src: Path, out: Path) -> Path:
    """The source with every quantized weight replaced by its float32 dequantization and no quantization_config:
    the model a reference of the release must compute."""
    out.mkdir(parents=True)
    source = open_source(src)
    save_file(
        {name: t.contiguous() for name, t in source.iter_dequantized()},
        out / "model.safetensors",
        metadata={"format": "pt"},
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        if (src / name).is_file():
            (out / name).write_bytes((src / name).read_bytes())
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return out


def _reference(root: Path, work: Path) -> Any:
    """The recipe's ingest and reference stages, planned as a build plans them (the export is not run)."""
    (root / "heldout.txt").write_text((Path(__file__).parents[1] / "model_factory.py").read_text())
    spec = {
        "model": "m",
        "version": "1",
        "source": "model",
        "eval": {"text": "heldout.txt", "max_tokens": 192, "window": 64},
        "targets": [{"target": "hf-bundle", "quants": ["bf16"]}],
    }
    (root / "kiln.yaml").write_text(json.dumps(spec))
    recipe = load_recipe(root / "kiln.yaml")
    nodes = build.plan(recipe, WorkDir(work))
    build.stage_externals(recipe, WorkDir(work))
    assert [n.id for n in nodes[:2]] == ["ingest/source", "reference/source"]
    return LocalExecutor(WorkDir(work)).run(nodes[:2])["reference/source"].output


def test_the_reference_of_an_fp8_source_is_its_dequantized_weights(tmp_path: Path) -> None:
    src = make_fp8_block_source(tmp_path / "fp8" / "model")
    _plain_copy(src, tmp_path / "plain" / "model")
    fp8_ref, plain_ref = (
        _reference(tmp_path / "fp8", tmp_path / "work"),
        _reference(tmp_path / "plain", tmp_path / "work"),
    )
    assert fp8_ref.record(ReferenceRecord).dequantized == "fp8-block"
    assert plain_ref.record(ReferenceRecord).dequantized is None
    assert "dequantized" not in json.loads((plain_ref.path / "stage.json").read_text())["result"]
    text = stored_text(fp8_ref)
    assert text.windows == stored_text(plain_ref).windows and len(text.windows) >= 2
    ours, theirs = stored_reference(fp8_ref), stored_reference(plain_ref)
    for window in text.windows:  # the same float32 forward on the same weights: the same rows, bit for bit
        a, b = ours.rows(window), theirs.rows(window)
        assert a.to_bytes() == b.to_bytes()
    assert ours.greedy(text.prompts, text.greedy_tokens) == theirs.greedy(text.prompts, text.greedy_tokens)


def test_an_fp8_source_streamed_by_layer_computes_what_it_does_whole(tmp_path: Path) -> None:
    from kiln.eval.runtimes.layer_stream import LayerStream, open_transformers
    from kiln.eval.runtimes.residency import STREAMED, WHOLE
    from kiln.eval.runtimes.transformers_runtime import TransformersRuntime

    src = make_fp8_block_source(tmp_path / "fp8")
    plain = _plain_copy(src, tmp_path / "plain")
    ids = list(range(1, 40))
    whole, streamed = open_transformers(src, residency=WHOLE), open_transformers(src, residency=STREAMED)
    assert isinstance(whole, LayerStream) and isinstance(streamed, LayerStream)  # never transformers' FP8 loading
    assert whole.dequantized == streamed.dequantized == "fp8-block"
    expected = TransformersRuntime(plain).logits(ids)
    assert (whole.logits(ids) == expected).all() and (streamed.logits(ids) == expected).all()


@pytest.mark.parametrize("layout", ["fp8-block", "mxfp4"])
def test_a_family_that_does_not_stream_is_held_whole_and_dequantized(layout: str, tmp_path: Path) -> None:
    """DeepSeek-V3 in FP8 blocks and gpt-oss with MXFP4 experts: the whole model, loaded by transformers' loader
    from the released tensors dequantized one at a time, computes what a plain float32 copy of them does."""
    from kiln.eval.runtimes.layer_stream import open_transformers
    from kiln.eval.runtimes.residency import STREAMED, WHOLE
    from kiln.eval.runtimes.transformers_runtime import TransformersRuntime
    from tests.quantized_sources import make_mxfp4_source

    if layout == "fp8-block":
        src = make_fp8_block_source(tmp_path / "release", "deepseek_v3")
    else:
        src = make_mxfp4_source(tmp_path / "release")
    plain = _plain_copy(src, tmp_path / "plain")
    ids = list(range(1, 40))
    whole = open_transformers(src, residency=WHOLE)
    assert isinstance(whole, TransformersRuntime) and whole.dequantized == layout
    assert (whole.logits(ids) == TransformersRuntime(plain).logits(ids)).all()
    assert whole.greedy([ids[:8]], 4) == TransformersRuntime(plain).greedy([ids[:8]], 4)
    with pytest.raises(StageFailed) as e:  # neither family streams by layer: a plan never asks it to
        open_transformers(src, residency=STREAMED)
    assert e.value.code == "REFERENCE_ARCHITECTURE_UNSUPPORTED"
