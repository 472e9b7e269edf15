"""Every scheme hf-bundle offers, on every family of 2025-26 (Qwen3, Qwen3-MoE, Mixtral, Gemma 3, Phi-3): bundles that
transformers loads whole (`TransformersRuntime`) with logits close to the source's on held-out text, weights laid
out as the checkpoint names them (experts one by one, Phi-3's fused projections as one Linear), routers and
norms in bf16, and exactly the bytes `quant.footprint` plans. Round-to-nearest and data-free FP4 run here; the
schemes llm-compressor calibrates are `slow` (tests/quant/test_moe_calibration.py calibrates a mixture quickly).

Models of width 128 (every Linear whole 128x128 blocks and int4 groups, so fp8-block fits each family); a model
whose widths do not fit is refused before anything is read (QUANT_SHAPE).
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.eval.metrics import kl_divergence, log_softmax
from kiln.eval.runtimes.transformers_runtime import TransformersRuntime
from kiln.formats.architectures.record import TensorKind
from kiln.quant.catalog import SCHEMES, get_method, get_scheme
from kiln.quant.footprint import checkpoint_bytes
from kiln.quant.rtn import QuantShapeError, dequantize
from tests.model_factory import NEW_FAMILIES, make_bundle, make_model
from tests.quant.test_moe_calibration import routing_kept

# Every scheme kiln quantizes a plain source into (a release's own layout, mxfp4-experts, is only kept from one).
QUANTIZED = [name for name, s in SCHEMES.items() if s.quantized and not get_method(name).release_only]
CALIBRATED = [name for name in QUANTIZED if SCHEMES[name].calibrated]
MOE = ("qwen3_moe", "mixtral")
# transformers 5.17 alone misreads several of a mixture's bundles (its `DecompressExperts` merges per-expert tensors
# into fused experts knowing FP8 `weight` and packed `weight_packed` pairs only: no int8, no FP8 block scales, no
# NVFP4 global scales; and a renamed router stays bf16). kiln's transformers runtime loads a quantized mixture's
# experts as one compressed-tensors Linear per expert projection, as the checkpoint stores them and vLLM reads them
# (eval/runtimes/experts.py), so every scheme is checked here in float32.
# Relative error of the logits to the source's (float32, the held-out window): 8-bit weights, then 4-bit. Measured:
# 0.01-0.13 and 0.13-0.52 (Gemma 3 the widest); transformers' misread NVFP4 experts gave 1.3-1.4.
BOUND = {8: 0.16, 4: 0.6}


def _sizes(family: str) -> dict[str, Any]:
    extra: dict[str, Any] = {"moe_intermediate_size": 256} if family == "qwen3_moe" else {}
    return {"hidden_size": 128, "intermediate_size": 256, "num_kv_heads": 4, "vocab_size": 384, **extra}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families128")
    return {f: make_model(root / f, f, **_sizes(f)) for f in NEW_FAMILIES}


@pytest.fixture(scope="module")
def held_out(models: dict[str, Path]) -> list[int]:
    """128 tokens of text calibration never sees (the stdlib's heapq.py; every family shares the tokenizer)."""
    from kiln.eval.text import tokenize_text

    text = (Path(sysconfig.get_paths()["stdlib"]) / "heapq.py").read_text(encoding="utf-8")
    return list(tokenize_text(models["qwen3"], text, window=128, max_tokens=128, prompts=0).windows[0])


@pytest.fixture(scope="module")
def references(models: dict[str, Path], held_out: list[int]) -> dict[str, np.ndarray]:
    return {f: TransformersRuntime(path).logits(held_out) for f, path in models.items()}


@pytest.fixture(scope="module")
def bundles(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """make_bundle, once per (family, scheme) in this module."""
    made: dict[tuple[str, str], Path] = {}

    def get(family: str, scheme: str) -> Path:
        if (family, scheme) not in made:
            made[family, scheme] = make_bundle(models[family], tmp_path_factory.mktemp(f"{family}-{scheme}"), scheme)
        return made[family, scheme]

    return get


def _tensors(bundle: Path) -> dict[str, Any]:
    from safetensors import safe_open

    with safe_open(str(bundle / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (a safetensors handle, not a dict)


def _cases() -> list[Any]:
    cases = []
    for family in NEW_FAMILIES:
        for scheme in QUANTIZED:
            marks = [pytest.mark.slow] if scheme in CALIBRATED else []
            cases.append(pytest.param(family, scheme, marks=marks, id=f"{family}-{scheme}"))
    return cases


@pytest.mark.parametrize(("family", "scheme"), _cases())
def test_every_scheme_of_every_family_loads_in_transformers_close_to_the_source(
    family: str, scheme: str, bundles: Any, references: dict[str, np.ndarray], held_out: list[int]
) -> None:
    bundle = bundles(family, scheme)
    logits = TransformersRuntime(bundle, "float32").logits(held_out)
    ref = references[family]
    rel = float(np.linalg.norm(logits - ref) / np.linalg.norm(ref))
    kl = float(kl_divergence(log_softmax(ref), log_softmax(logits)).mean())
    w = get_scheme(scheme).weights
    assert w is not None and np.isfinite(logits).all()
    assert rel < BOUND[w.num_bits], (family, scheme, rel, kl)
    assert kl < get_method(scheme).gate.max_kl, (family, scheme, rel, kl)  # the scheme's default gate


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_the_checkpoint_layout_is_the_familys_own(family: str, bundles: Any, models: dict[str, Path]) -> None:
    """int4: every quantized Linear as the checkpoint names it (each expert's, Phi-3's fused qkv and gate_up as
    one Linear each); routers, norms, embeddings and lm_head bf16; the routers listed in `ignore` by their
    checkpoint names, as vLLM reads them."""
    from kiln.formats.hf_model import open_source

    bundle = bundles(family, "int4-rtn")
    stored = _tensors(bundle)
    shape = open_source(models[family]).shape
    routers = []
    for t in shape.tensors():
        module = t.name.removesuffix(".weight")
        if t.quantizable:
            rows, cols = t.shape
            assert tuple(stored[f"{module}.weight_packed"].shape) == (rows, cols // 8), t.name
            assert t.name not in stored
        else:
            assert str(stored[t.name].dtype) == "torch.bfloat16", t.name
        if t.kind == TensorKind.FFN_GATE_INP:
            routers.append(module)
    config = json.loads((bundle / "config.json").read_text())["quantization_config"]
    assert config["ignore"] == ["lm_head", *routers]
    assert bool(routers) == (family in MOE)
    if family == "mixtral":
        assert routers[0] == "model.layers.0.block_sparse_moe.gate"
        assert "model.layers.0.block_sparse_moe.experts.3.w2.weight_packed" in stored
    if family == "phi3":
        assert "model.layers.0.self_attn.qkv_proj.weight_packed" in stored
        assert "model.layers.0.mlp.gate_up_proj.weight_packed" in stored


@pytest.mark.parametrize(("family", "scheme"), [(f, s) for f in MOE for s in ("int4-rtn", "fp8-block", "nvfp4-w4a16")])
def test_the_footprint_is_the_bytes_written(family: str, scheme: str, bundles: Any, models: dict[str, Path]) -> None:
    """quant.footprint, from config.json alone, counts every expert's tensors as written."""
    bundle = bundles(family, scheme)
    written = 0
    for f in bundle.glob("*.safetensors"):
        header = int.from_bytes(f.read_bytes()[:8], "little")
        written += f.stat().st_size - 8 - header
    config = json.loads((models[family] / "config.json").read_text())
    assert checkpoint_bytes(config, scheme) == written


@pytest.mark.parametrize(("family", "scheme"), [(f, s) for f in MOE for s in ("int8-w8a8", "fp8-block", "nvfp4-w4a16")])
def test_what_transformers_misreads_is_right_in_the_bundle(
    family: str, scheme: str, bundles: Any, models: dict[str, Path]
) -> None:
    """The expert tensors of the bundles transformers 5.17 cannot load by itself decompress, by compressed-tensors,
    to the source's weights, each with its own scales: the checkpoint vLLM reads is right."""
    import torch

    stored, source = _tensors(bundles(family, scheme)), _tensors(models[family])
    experts = [n.removesuffix(".weight") for n in source if ".experts." in n]
    assert experts
    for module in experts:
        weight = dequantize(get_scheme(scheme), module, stored)
        ref = source[f"{module}.weight"].float()
        assert (
            float(torch.linalg.norm(weight - ref) / torch.linalg.norm(ref))
            < {8: 0.04, 4: 0.15}[
                get_scheme(scheme).weights.num_bits  # type: ignore[union-attr]
            ]
        ), module


@pytest.mark.parametrize("family", ["qwen3_moe", "phi3"])
def test_fp8_block_refuses_widths_that_are_not_whole_blocks(family: str, tmp_path: Path) -> None:
    """The factory's default widths (hidden 64): not whole 128x128 blocks, refused before any tensor is read."""
    source = make_model(tmp_path / family, family, vocab_size=384)
    with pytest.raises(QuantShapeError) as e:
        make_bundle(source, tmp_path / "out", "fp8-block")
    assert e.value.code == "QUANT_SHAPE"
    config = json.loads((source / "config.json").read_text())
    with pytest.raises(QuantShapeError):
        checkpoint_bytes(config, "fp8-block")


@pytest.mark.slow
@pytest.mark.parametrize("family", MOE)
def test_awq_smooths_the_router_with_the_experts(family: str, bundles: Any, models: dict[str, Path]) -> None:
    """AWQ's smoothing of post_attention_layernorm is folded into every module reading it, the router included, so
    tokens go to the experts they went to. llm-compressor has no AWQ groups for Mixtral and would fall back to
    Llama's (the experts' gate and up, not the router); kiln gives it the MoE groups (`moe_awq_mappings`)."""
    from kiln.formats.architectures import FAMILIES

    stored, source = _tensors(bundles(family, "w4a16-awq")), _tensors(models[family])
    experts = FAMILIES[family].mlp.experts
    assert experts is not None
    for layer in range(2):
        assert routing_kept(stored, source, f"model.layers.{layer}", f"{experts.block}.{experts.router}")


@pytest.mark.slow
def test_awq_folds_gemma3_smoothing_into_its_offset_norm(bundles: Any, models: dict[str, Path]) -> None:
    """Gemma 3's MLP reads pre_feedforward_layernorm, which scales by (1 + w): AWQ's smoothing divides it and
    multiplies gate_proj's columns by the same scales, so (1 + w) times each column's norm is what it was, up to
    int4 rounding (0.007-0.008 measured; 0.036-0.064 with the norm left unsmoothed, as a disk-offloaded
    calibration without `offset_norm_restore_workaround` stored it)."""
    stored, source = _tensors(bundles("gemma3", "w4a16-awq")), _tensors(models["gemma3"])
    scheme = get_scheme("w4a16-awq")
    for layer in range(2):
        norm, gate = f"model.layers.{layer}.pre_feedforward_layernorm.weight", f"model.layers.{layer}.mlp.gate_proj"
        before = (1 + source[norm].float()) * source[f"{gate}.weight"].float().norm(dim=0)
        after = (1 + stored[norm].float()) * dequantize(scheme, gate, stored).norm(dim=0)
        assert float((after / before).log().std()) < 0.02, layer


@pytest.mark.parametrize("scheme", ["fp8", "fp8-block", "int8-w8a8", "int4-rtn"])
@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_every_familys_bundle_passes_the_lint(family: str, scheme: str, bundles: Any, models: dict[str, Path]) -> None:
    """What hf-bundle writes, the lint (which the export stage runs) passes: every expert's scales, the routers in
    `ignore`, fused Linears as one."""
    from kiln.formats.hf_model import open_source
    from kiln.targets.lint import lint_artifact

    report = lint_artifact(bundles(family, scheme), shape=open_source(models[family]).shape, quant=scheme)
    assert report.errors == [], [(f.code, f.subject, f.message) for f in report.errors]
