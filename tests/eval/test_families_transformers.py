"""Qwen3, Qwen3-MoE, Mixtral, Gemma 3 and Phi-3 in transformers: the layer-streamed forward (the reference, and
large hf-bundle evals) computes what the whole model computes, one layer at a time, and a quantized bundle's
experts load as quantized Linears in both.

Each tiny model is made to exercise what its family adds: Qwen3-MoE a dense layer among sparse ones
(`mlp_only_layers`) and more experts than a short text routes to; Mixtral a sliding window shorter than a
window; Gemma 3 two sliding layers and a global one (each type with its own rope base), a hidden size whose
sqrt(hidden) embedding scale is inexact, and both soft-caps; Phi-3 its fused qkv and gate_up. The
logits are compared bit for bit: the stream runs the same modules on the same shapes, with the embedding
gathered by row (exact) and the head in one block (the vocabulary is below `HEAD_BLOCK`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.eval.runtimes import TransformersRuntime
from kiln.eval.runtimes.layer_stream import STREAMED_MODEL_TYPES, LayerStream, open_transformers
from kiln.eval.runtimes.residency import STREAMED
from kiln.eval.text import EvalText
from kiln.formats.architectures import FAMILIES
from tests.model_factory import NEW_FAMILIES, make_bundle, make_model

# What each tiny model sets beyond the factory's defaults (see the module docstring).
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3": {},
    "qwen3_moe": {"num_layers": 3, "mlp_only_layers": [1]},
    "mixtral": {"sliding_window": 16},
    "gemma3": {
        "hidden_size": 96,
        "num_layers": 3,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
    },
    "phi3": {},
}
MOE_FAMILIES = ("qwen3_moe", "mixtral")
# An MoE model wide enough for int4's 128-column groups and FP8's 128x128 blocks in every Linear (the experts'
# down_proj and the 4 KV heads' k_proj and v_proj included).
MOE_WIDE: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 128, "mlp_only_layers": [1]},
    "mixtral": {"hidden_size": 128, "intermediate_size": 128},
}
MOE_HEADS: dict[str, Any] = {"num_heads": 4, "num_kv_heads": 4}
# bf16 (fused experts), FP8 W8A8 (dynamic per-token activations) and W4A16 (int4 RTN, packed); INT8 W8A8
# (stored unpacked, which transformers' own expert loader cannot read) and block-wise FP8 run as slow tests.
MOE_SCHEMES = ("bf16", "fp8", "int4-rtn")
MOE_SLOW_SCHEMES = ("int8-w8a8", "fp8-block")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: make_model(root / f, f, **SHAPES[f]) for f in NEW_FAMILIES}


def _windows(eval_text: EvalText) -> list[list[int]]:
    return [list(w[:64]) for w in eval_text.windows[:2]]


class _LayersHeld:
    """Counts, before each decoder layer runs, how many layers hold materialised floating-point weights."""

    def __init__(self, stream: LayerStream) -> None:
        self.stream = stream
        self.counts: list[int] = []
        self.hooks = [layer.register_forward_pre_hook(self._count) for layer in stream._base.layers]

    def _count(self, *_: Any) -> None:
        self.counts.append(
            sum(
                any(p.is_floating_point() and not p.is_meta for p in layer.parameters())
                for layer in self.stream._base.layers
            )
        )


@contextmanager
def _opened(path: Path) -> Iterator[tuple[LayerStream, TransformersRuntime]]:
    """The model streamed, and whole."""
    whole, stream = TransformersRuntime(path), LayerStream(path)
    try:
        yield stream, whole
    finally:
        stream.close()
        whole.close()


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_each_family_streams_the_whole_models_logits_and_continuations_one_layer_at_a_time(
    models: dict[str, Path], eval_text: EvalText, family: str
) -> None:
    with _opened(models[family]) as (stream, whole):
        held = _LayersHeld(stream)
        windows = _windows(eval_text)
        for window, logits in zip(windows, stream.logits_many(windows), strict=True):
            assert np.array_equal(logits, whole.logits(window)), family
        prompts = [*eval_text.prompts[:2], eval_text.prompts[0][:5]]  # two lengths: two batches
        assert stream.greedy(prompts, 5) == whole.greedy(prompts, 5)
        assert held.counts and set(held.counts) == {1}  # one layer's weights at a time, whatever runs
        assert not [n for n, p in stream._model.named_parameters() if not p.is_meta]  # none left after


def test_every_family_whose_record_streams_opens_layer_by_layer(models: dict[str, Path]) -> None:
    assert {t for a in FAMILIES.values() if a.streams for t in a.model_types} == STREAMED_MODEL_TYPES
    for family in NEW_FAMILIES:
        assert FAMILIES[family].streams
        assert isinstance(open_transformers(models[family], residency=STREAMED), LayerStream), family


def test_a_missing_expert_is_named(models: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    from kiln.core.errors import StageFailed

    broken = tmp_path / "broken"
    shutil.copytree(models["mixtral"], broken)
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    stream = LayerStream(broken)
    with pytest.raises(StageFailed) as e:
        stream.logits([1, 2, 3])
    assert e.value.code == "SOURCE_INVALID"
    assert "model.layers.1.mlp.experts.gate_up_proj" in e.value.message


# --- mixture-of-experts bundles ---------------------------------------------------------------------------


Bundles = Callable[[str, str], Path]


@pytest.fixture(scope="module")
def moe_bundles(tmp_path_factory: pytest.TempPathFactory) -> Bundles:
    """A family's bundle of a scheme, built on first use (a slow scheme's only when its test runs)."""
    root = tmp_path_factory.mktemp("moe-bundles")
    made: dict[tuple[str, str], Path] = {}

    def bundle(family: str, scheme: str) -> Path:
        if (family, scheme) not in made:
            source = root / family / "model"
            if not source.exists():
                make_model(source, family, **MOE_WIDE[family], **MOE_HEADS)
            made[family, scheme] = make_bundle(source, root / family / scheme, scheme)
        return made[family, scheme]

    return bundle


def _bundle_streams_the_whole_load(path: Path, eval_text: EvalText, scheme: str) -> None:
    with _opened(path) as (stream, whole):
        windows = _windows(eval_text)
        for window, logits in zip(windows, stream.logits_many(windows), strict=True):
            assert np.array_equal(logits, whole.logits(window)), scheme
        assert stream.greedy(eval_text.prompts[:2], 4) == whole.greedy(eval_text.prompts[:2], 4)
        experts = whole._model.model.layers[0].mlp.experts
        if scheme == "bf16":  # transformers' fused experts, converted from the checkpoint's per-expert tensors
            assert experts.gate_up_proj.dim() == 3
        else:  # one quantized Linear per expert projection, its activations quantized as the scheme says
            linears = [m for m in experts.modules() if hasattr(m, "quantization_scheme")]
            assert len(linears) == 3 * experts.num_experts
            assert all(p.dtype == whole._torch.float32 for p in whole._model.model.layers[0].mlp.gate.parameters())


@pytest.mark.parametrize("scheme", MOE_SCHEMES)
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_an_moe_bundle_streams_what_the_whole_load_computes(
    moe_bundles: Bundles, eval_text: EvalText, family: str, scheme: str
) -> None:
    _bundle_streams_the_whole_load(moe_bundles(family, scheme), eval_text, scheme)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", MOE_SLOW_SCHEMES)
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_an_moe_bundle_of_the_other_schemes_streams_what_the_whole_load_computes(
    moe_bundles: Bundles, eval_text: EvalText, family: str, scheme: str
) -> None:
    _bundle_streams_the_whole_load(moe_bundles(family, scheme), eval_text, scheme)


def test_a_quantized_moe_bundle_scores_near_its_source(moe_bundles: Bundles, eval_text: EvalText) -> None:
    """The experts hold the bundle's weights (a load that left them initialised at random would not be near)."""
    window = _windows(eval_text)[0]
    source = TransformersRuntime(moe_bundles("mixtral", "bf16"))
    fp8 = TransformersRuntime(moe_bundles("mixtral", "fp8"))
    try:
        want, got = source.logits(window), fp8.logits(window)
    finally:
        source.close()
        fp8.close()
    assert np.abs(got - want).max() < 0.1 * np.abs(want).max()
    assert np.mean(np.argmax(got, -1) == np.argmax(want, -1)) > 0.9
