"""Quantizers: the tensors compressed-tensors stores, within the error each scheme allows, planned from headers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.formats.architectures.shape import MergedGemm, ModelShape
from kiln.formats.hf_model import open_source
from kiln.formats.safetensors import DTYPES
from kiln.pipeline.build import plan
from kiln.pipeline.recipe import parse_recipe
from kiln.pipeline.store import WorkDir
from kiln.quant.catalog import get_scheme
from kiln.quant.rtn import (
    QuantShapeError,
    check_shapes,
    dequantize,
    planned_tensors,
    quantize_weight,
    quantizes,
    weight_scale,
)
from tests.model_factory import make_model

LAYER = "model.layers.3.mlp.down_proj.weight"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _weight(rows: int = 96, cols: int = 384, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w[5, 7] = 0.5  # an outlier: its channel/group gets a coarse scale, the others must not
    w[6] = 0.0  # an all-zero channel must survive (no division by zero)
    return w.to(torch.bfloat16)


@pytest.mark.parametrize("name", ["int8-w8a16", "int4-rtn"])
def test_int_rtn_error_is_at_most_half_a_step(name: str) -> None:
    import torch

    scheme = get_scheme(name)
    w = _weight()
    stored = dict(quantize_weight(LAYER, w, scheme))
    module = LAYER.removesuffix(".weight")
    assert set(stored) == {f"{module}.weight_packed", f"{module}.weight_scale", f"{module}.weight_shape"}
    assert stored[f"{module}.weight_packed"].dtype == torch.int32
    assert stored[f"{module}.weight_scale"].dtype == torch.bfloat16
    assert stored[f"{module}.weight_shape"].tolist() == [96, 384]
    back = dequantize(scheme, module, stored)
    assert back.shape == w.shape
    scale = stored[f"{module}.weight_scale"].float()
    per_elem = scale.repeat_interleave(384 // scale.shape[1], dim=1)
    err = (back - w.float()).abs()
    assert bool((err <= per_elem * 0.5 + 1e-8).all())
    assert bool((back[6] == 0).all())
    # The outlier's channel (int8) or group (int4) is coarse; a channel without one is fine-grained.
    assert err[7].max() < err[5].max()


def test_fp8_per_channel_scale_and_relative_error() -> None:
    import torch

    scheme = get_scheme("fp8")
    w = _weight()
    stored = dict(quantize_weight(LAYER, w, scheme))
    module = LAYER.removesuffix(".weight")
    q, scale = stored[f"{module}.weight"], stored[f"{module}.weight_scale"]
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (96, 1) and scale.dtype == torch.bfloat16
    absmax = w.float().abs().amax(dim=1, keepdim=True)
    nonzero = absmax[:, 0] > 0
    # absmax / 448 rounded up to bf16 (at most one bf16 step, 2^-7 relative, above it)
    assert bool((scale.float()[nonzero] >= absmax[nonzero] / 448).all())
    assert torch.allclose(scale.float()[nonzero], absmax[nonzero] / 448, rtol=2**-7)
    back = dequantize(scheme, module, stored)
    err = (back - w.float()).abs()
    # 3 mantissa bits: half an ulp is 1/16 of the value; below E4M3's smallest normal (2^-6) the step is fixed.
    bound = torch.maximum(w.float().abs() / 16, scale.float() * 2**-10)
    assert bool((err <= bound * 1.001).all())


def test_only_decoder_linears_are_quantized_and_input_is_untouched() -> None:
    import torch

    scheme = get_scheme("int4-rtn")
    w = _weight(cols=128)
    before = w.clone()
    assert [n for n, _ in quantize_weight(LAYER, w, scheme)]  # quantized into its own tensors...
    assert torch.equal(w, before)  # ...without touching the input
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert not quantizes(scheme, name)
    assert quantizes(scheme, LAYER)
    assert not quantizes(scheme, "lm_head.weight") and not quantizes(scheme, "model.layers.0.self_attn.q_proj.bias")
    assert not quantizes(get_scheme("bf16"), LAYER)


def test_planned_tensors_match_what_is_produced() -> None:
    for name in ("fp8", "fp8-block", "int8-w8a8", "int8-w8a16", "int4-rtn"):
        scheme = get_scheme(name)
        w = _weight(rows=256, cols=384)
        produced = list(quantize_weight(LAYER, w, scheme))
        planned = planned_tensors(scheme, LAYER, (256, 384))
        assert [n for n, _ in produced] == [n for n, _, _ in planned]
        assert [tuple(t.shape) for _, t in produced] == [s for _, _, s in planned]
        assert [str(t.dtype) for _, t in produced] == [f"torch.{DTYPES[d].torch}" for _, d, _ in planned]


def test_group_size_mismatch_names_the_layer() -> None:
    scheme = get_scheme("int4-rtn")
    with pytest.raises(QuantShapeError) as e:
        check_shapes(scheme, {"model.layers.0.mlp.up_proj.weight": (256, 128), LAYER: (128, 200)})
    assert LAYER in e.value.message and "128" in e.value.message and e.value.code == "QUANT_SHAPE"
    check_shapes(get_scheme("int8-w8a16"), {LAYER: (128, 200)})  # per channel: any width that packs
    # A last block of rows may overhang, zero-padded (DeepSeek-V3's kv_a_proj_with_mqa: 576 rows); columns may not.
    check_shapes(get_scheme("fp8-block"), {LAYER: (96, 256)})
    with pytest.raises(QuantShapeError, match="128x128 blocks") as e:
        check_shapes(get_scheme("fp8-block"), {LAYER: (256, 200)})
    assert e.value.details["layer"] == LAYER and "input columns" in e.value.message
    check_shapes(get_scheme("fp8"), {LAYER: (96, 200)})


def test_block_scales_never_straddle_two_parts_of_a_merged_gemm() -> None:
    """vLLM runs q/k/v (and gate/up) as one GEMM: every part but the last must fill whole 128-row blocks."""
    qkv = MergedGemm(
        "self_attn.qkv_proj", (("self_attn.q_proj", 384), ("self_attn.k_proj", 64), ("self_attn.v_proj", 64))
    )
    with pytest.raises(QuantShapeError, match="self_attn.k_proj has 64 output rows") as e:
        check_shapes(get_scheme("fp8-block"), {}, [qkv])
    assert e.value.details == {
        "layer": "self_attn.k_proj",
        "rows": 64,
        "merged": "self_attn.qkv_proj",
        "block_structure": [128, 128],
    }
    check_shapes(get_scheme("fp8"), {}, [qkv])  # per channel: nothing straddles
    # the last part may overhang (DeepSeek-V3's fused q_a / kv_a: 1536 + 576 rows)
    mla = MergedGemm(
        "self_attn.fused_qkv_a_proj", (("self_attn.q_a_proj", 1536), ("self_attn.kv_a_proj_with_mqa", 576))
    )
    check_shapes(get_scheme("fp8-block"), {}, [mla])


@pytest.mark.parametrize(
    ("example", "merged"),
    [
        ("llama-3-70b", {"self_attn.qkv_proj": [8192, 1024, 1024], "mlp.gate_up_proj": [28672, 28672]}),
        (
            "deepseek-v3",
            {
                "self_attn.fused_qkv_a_proj": [1536, 576],
                "mlp.gate_up_proj": [18432, 18432],  # its first three layers are dense
                "mlp.experts.w13": [2048, 2048],
                "mlp.shared_experts.gate_up_proj": [2048, 2048],
            },
        ),
        ("mixtral-8x22b", {"self_attn.qkv_proj": [6144, 1024, 1024], "block_sparse_moe.experts.w13": [16384, 16384]}),
    ],
)
def test_merged_gemms_follow_the_architecture(example: str, merged: dict[str, list[int]]) -> None:
    shape = ModelShape.from_config(json.loads((EXAMPLES / example / "config.json").read_text()))
    assert {g.name: [rows for _, rows in g.parts] for g in shape.merged_gemms()} == merged
    check_shapes(get_scheme("fp8-block"), {}, shape.merged_gemms())  # every release's parts fill whole blocks


def test_scales_never_zero() -> None:
    import torch

    s = weight_scale(torch.zeros(4, 256), get_scheme("int4-rtn").weights)  # type: ignore[arg-type]
    assert bool((s > 0).all())


def test_model_with_unfit_widths_fails_in_planning(tmp_path: Path) -> None:
    from kiln.quant.store import write_quantized

    src = open_source(make_model(tmp_path / "m", hidden_size=64, intermediate_size=192))
    with pytest.raises(QuantShapeError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight"):
        write_quantized(src, get_scheme("int4-rtn"), tmp_path)
    assert not list(tmp_path.glob("*.safetensors*"))


def test_plan_shares_one_quantize_node_per_scheme(tmp_path: Path) -> None:
    model = make_model(tmp_path / "model", hidden_size=128, intermediate_size=256)
    (tmp_path / "text.txt").write_text("def f(x):\n    return x\n" * 50)
    recipe = parse_recipe(
        {
            "model": "m",
            "version": "1",
            "source": str(model),
            "eval": {"text": "text.txt"},
            "targets": [
                {"target": "hf-bundle", "quants": ["bf16", "fp8", "int4-rtn"]},
                {"target": "gguf", "quants": ["q8_0"]},
            ],
        },
        base_dir=tmp_path,
    )
    nodes = {n.id: n for n in plan(recipe, WorkDir(tmp_path / "w"))}
    assert [n for n in nodes if n.startswith("quantize/")] == ["quantize/fp8", "quantize/int4-rtn"]
    assert nodes["export/hf-bundle-fp8"].inputs == {"ingest": "ingest/source", "quantized": "quantize/fp8"}
    assert nodes["export/hf-bundle-bf16"].inputs == {"ingest": "ingest/source"}
    # The gguf exports share their target's prepare stage (the tokenizer, read once per source).
    assert nodes["export/gguf-q8_0"].inputs == {"ingest": "ingest/source", "prepared": "prepare/gguf"}
    assert [n for n in nodes if n.startswith("prepare/")] == ["prepare/gguf"]
