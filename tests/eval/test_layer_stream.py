"""The layer-streamed reference (eval.runtimes.layer_stream) computes what the whole model computes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from kiln.core.errors import StageFailed
from kiln.core.usage import counting_weights
from kiln.eval.runtimes import TransformersRuntime
from kiln.eval.runtimes.layer_stream import LayerStream, open_transformers
from kiln.eval.runtimes.residency import STREAMED, Residency
from kiln.eval.text import EvalText
from tests.model_factory import make_bundle, make_model


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


# --- bundles: compressed-tensors decompressed one layer at a time -----------------------------------------

RTN_SCHEMES = ("bf16", "fp8", "fp8-block", "int8-w8a8", "int8-w8a16", "int4-rtn")
# llm-compressor's: FP4 (decompressed into bf16, upcast) and an FP8 KV cache (fake-quantized K and V)
LLMCOMPRESSOR_SCHEMES = ("nvfp4-w4a4", "nvfp4-w4a16", "mxfp4-w4a4", "fp8-kv8")


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every round-to-nearest scheme's bundle of a model wide enough for 128x128 blocks (same tokenizer), and
    llm-compressor's."""
    root = tmp_path_factory.mktemp("streamed-bundles")
    model = make_model(root / "model", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)
    made = {s: make_bundle(model, root / s, s) for s in (*RTN_SCHEMES, *LLMCOMPRESSOR_SCHEMES)}
    gfx942 = {"gfx_arch": "gfx942", "vllm": "0.11.2", "rocm": "7.0.2"}  # FP8 stored as float8_e4m3fnuz
    made["rocm-fp8-gfx942"] = make_bundle(model, root / "rocm", "fp8", "rocm-bundle", gfx942)
    return made


@pytest.mark.parametrize("name", [*RTN_SCHEMES, *LLMCOMPRESSOR_SCHEMES, "rocm-fp8-gfx942"])
def test_a_bundle_streamed_one_layer_at_a_time_equals_the_whole_load_bit_for_bit(
    bundles: dict[str, Path], eval_text: EvalText, name: str
) -> None:
    """Each layer decompressed by compressed-tensors as transformers' loader would, activations fake-quantized
    by the same forward: the same logits and continuations as the whole bundle in transformers."""
    whole = TransformersRuntime(bundles[name])
    stream = open_transformers(bundles[name], residency=STREAMED)
    try:
        assert isinstance(stream, LayerStream)
        assert stream.version == whole.version  # the same computation, whichever way it is held
        windows = eval_text.windows[:2]
        for window, logits in zip(windows, stream.logits_many(windows), strict=True):
            assert np.array_equal(logits, whole.logits(window)), name
        assert stream.greedy(eval_text.prompts[:2], 4) == whole.greedy(eval_text.prompts[:2], 4)
    finally:
        stream.close()
        whole.close()
    if name != "bf16":
        assert "compressed-tensors" in stream.version


def test_a_bundle_keeps_one_layer_decompressed_not_the_model(bundles: dict[str, Path], eval_text: EvalText) -> None:
    """What the stream holds between layers is the compressed layout on the meta device (and each packed
    weight's shape, two integers): no weight of any layer stays materialised once the next one is loaded."""
    stream = LayerStream(bundles["int4-rtn"])
    try:
        next(stream.logits_many(eval_text.windows[:1]))
        held = [p for p in stream._base.layers.parameters() if p.device.type != "meta"]
        assert all(p.numel() == 2 and not p.is_floating_point() for p in held)  # packed weights' [out, in]
    finally:
        stream.close()


def test_the_model_is_held_as_the_plan_says_and_only_a_streamed_architecture_streams(
    llama_dir: Path, tmp_path: Path
) -> None:
    assert isinstance(open_transformers(llama_dir), TransformersRuntime)  # whole unless told to stream
    assert isinstance(open_transformers(llama_dir, residency=STREAMED), LayerStream)
    other = tmp_path / "other"
    shutil.copytree(llama_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "gpt2-like"}))
    for path, dtype in ((other, "float32"), (llama_dir, "auto")):
        with pytest.raises(StageFailed) as e:
            open_transformers(path, dtype, residency=STREAMED)
        assert e.value.code == "REFERENCE_ARCHITECTURE_UNSUPPORTED"


def _passes(runtime_dir: Path, residency: Residency, eval_text: EvalText, n: int) -> tuple[float, list[list[int]]]:
    """The passes over the weights of the reference's work (every window's logits, then `n` greedy tokens of
    each prompt) holding the model as `residency` says, and the continuations."""
    with counting_weights() as reads:
        runtime = open_transformers(runtime_dir, residency=residency)
        try:
            for _ in runtime.logits_many(eval_text.windows[:3]):
                pass
            tokens = runtime.greedy(eval_text.prompts[:2], n)
        finally:
            runtime.close()
    return reads.read_bytes / reads.model_bytes, tokens


def test_a_streamed_greedy_reads_again_only_the_layers_it_could_not_keep(llama_dir: Path, eval_text: EvalText) -> None:
    """Whole: one pass. Streamed with nothing kept: one pass for the windows, then one per generated token (the
    prefill and n - 1 steps). Keeping every layer and the head: one pass whatever n. Keeping about half: the
    windows' pass and the half not kept for each token. The continuations are the same every way."""
    n = 6
    whole, want = _passes(llama_dir, Residency(whole=True), eval_text, n)
    assert whole == 1.0
    model = sum(f.stat().st_size for f in llama_dir.glob("*.safetensors"))
    for resident, most in ((0, 1 + n), (4 * model, 1.01), (model, 1 + n * 0.55)):
        passes, tokens = _passes(llama_dir, Residency(whole=False, resident_bytes=resident), eval_text, n)
        assert tokens == want, resident
        assert passes <= most, (resident, passes)
    assert passes >= 1 + n * 0.3  # half the float32 model kept: the other half (and more) read per token


@pytest.mark.parametrize(
    "quantization_config",
    [
        {"quant_method": "no-such-method"},
        {"quant_method": "compressed-tensors", "config_groups": "not a mapping"},
        {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {"num_bits": "eight"}}}},
    ],
)
def test_a_bundle_whose_quantization_config_transformers_refuses_fails_with_its_code(
    bundles: dict[str, Path], tmp_path: Path, quantization_config: dict[str, object]
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(bundles["fp8"], broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    with pytest.raises(StageFailed) as e:
        LayerStream(broken)
    assert e.value.code == "EVAL_RUNTIME_LOAD_FAILED"
    assert (bundles["fp8"] / "config.json").read_text() != (broken / "config.json").read_text()  # the original kept


def test_a_model_directory_without_a_readable_config_fails_with_its_code(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(StageFailed) as e:
        LayerStream(tmp_path)
    assert e.value.code == "EVAL_RUNTIME_LOAD_FAILED"
