"""The layer-streamed reference (eval.runtimes.layer_stream) computes what the whole model computes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from core.errors import StageFailed
from eval.runtimes import TransformersRuntime
from eval.runtimes.layer_stream import LayerStream
from eval.text import EvalText


@pytest.fixture(scope="module")
def whole(llama_dir: Path):  # type: ignore[no-untyped-def]
    rt = TransformersRuntime(llama_dir)
    yield rt
    rt.close()


def test_logits_of_every_window_equal_the_whole_models(llama_dir: Path, whole, eval_text: EvalText) -> None:  # type: ignore[no-untyped-def]
    stream = LayerStream(llama_dir)
    windows = eval_text.windows[:3]
    try:
        got = list(stream.logits_many(windows))
    finally:
        stream.close()
    assert len(got) == len(windows)
    for window, logits in zip(windows, got, strict=True):
        want = whole.logits(window)
        assert logits.shape == want.shape and logits.dtype == np.float32
        np.testing.assert_allclose(logits, want, rtol=0, atol=2e-4 * float(np.abs(want).max()))
        assert np.array_equal(np.argmax(logits, -1), np.argmax(want, -1))


def test_greedy_continuations_equal_the_whole_models(llama_dir: Path, whole, eval_text: EvalText) -> None:  # type: ignore[no-untyped-def]
    stream = LayerStream(llama_dir)
    prompts = [*eval_text.prompts, eval_text.prompts[0][:5]]  # two lengths: two batches
    try:
        assert stream.greedy(prompts, 6) == whole.greedy(prompts, 6)
    finally:
        stream.close()


def test_a_sharded_checkpoint_with_an_index_streams_the_same(
    llama_dir: Path, tmp_path: Path, eval_text: EvalText
) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(llama_dir / "model.safetensors")
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    sharded = tmp_path / "sharded"
    shutil.copytree(llama_dir, sharded, ignore=shutil.ignore_patterns("model.safetensors"))
    for file, part in halves.items():
        save_file({n: weights[n] for n in part}, sharded / file, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, part in halves.items() for n in part}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    window = eval_text.windows[0]
    one, two = LayerStream(llama_dir), LayerStream(sharded)
    try:
        assert np.array_equal(one.logits(window), two.logits(window))
    finally:
        one.close()
        two.close()


def test_a_missing_tensor_is_a_clear_error(llama_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(llama_dir, broken)
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    stream = LayerStream(broken)
    with pytest.raises(StageFailed) as e:
        stream.logits([1, 2, 3])
    assert e.value.code == "SOURCE_INVALID"
    assert "model.layers.1.mlp.down_proj.weight" in e.value.message


def test_an_architecture_it_does_not_stream_is_named(llama_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(llama_dir, other)
    config = json.loads((other / "config.json").read_text())
    config.update({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(StageFailed) as e:
        LayerStream(other)
    assert e.value.code == "REFERENCE_ARCHITECTURE_UNSUPPORTED"
