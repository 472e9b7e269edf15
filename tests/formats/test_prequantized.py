"""Pre-quantized releases (`formats.prequantized`): FP8 block and MXFP4 sources are recognised from config.json,
checked from their headers and one tensor at a time, and dequantized bit for bit as transformers dequantizes
them (and as DeepSeek's kernel does where a block overhangs the matrix, which transformers does not)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.formats.hf_model import open_source
from kiln.formats.prequantized import (
    FP8_BLOCK,
    MXFP4,
    QuantizedSourceInvalid,
    StoredQuantized,
    dequantize,
    dequantize_stream,
    plan_quantized,
    read_quantization,
)
from kiln.formats.safetensors import TensorInfo, read_header
from tests.quantized_sources import (
    FP8_CONFIG,
    MXFP4_CONFIG,
    make_fp8_block_source,
    make_mxfp4_source,
    quantize_fp8_block,
    quantize_mxfp4,
)

K_PROJ = "model.layers.0.self_attn.k_proj.weight"  # [64, 128]: one block, overhanging by 64 rows
UP_PROJ = "model.layers.0.mlp.up_proj.weight"  # [320, 128]: three row blocks, the last overhanging
GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_fp8_block_source(tmp_path_factory.mktemp("fp8") / "m")


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_mxfp4_source(tmp_path_factory.mktemp("mxfp4") / "m")


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def _edit_tensors(model_dir: Path, edit: Any) -> None:
    tensors = load_file(model_dir / "model.safetensors")
    edit(tensors)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})


def _edit_config(model_dir: Path, edit: Any) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    edit(config)
    (model_dir / "config.json").write_text(json.dumps(config))


def _plan(model_dir: Path) -> Any:
    """The quantized plan of a source from its config.json's quantization_config and its headers alone."""
    infos, _ = read_header(model_dir / "model.safetensors", "model.safetensors")
    quantization = read_quantization(json.loads((model_dir / "config.json").read_text()))
    assert quantization is not None
    return quantization, plan_quantized(quantization, {t.name: t for t in infos})


def _info(name: str, t: torch.Tensor, dtype: str) -> TensorInfo:
    return TensorInfo(name, dtype, tuple(t.shape), "model.safetensors", 0, t.nbytes)


# --- the layouts, decoded as their publishers decode them --------------------------------------------------


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_fp8_block_dequantizes_as_transformers_does_on_whole_blocks(scale_dtype: torch.dtype) -> None:
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    torch.manual_seed(0)
    w = torch.randn(256, 384) * torch.logspace(-3, 1, 384)  # columns of very different sizes
    q, s = quantize_fp8_block(w, scale_dtype=scale_dtype)
    quantization = read_quantization({"quantization_config": FP8_CONFIG})
    assert quantization is not None
    qt = plan_quantized(
        quantization,
        {
            "x.weight": _info("x.weight", q, "F8_E4M3"),
            "x.weight_scale_inv": _info("x.weight_scale_inv", s, "F32" if scale_dtype == torch.float32 else "BF16"),
        },
    ).tensors["x.weight"]
    theirs = Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=torch.float32)
    ours = dequantize(quantization, qt, q, s)
    assert ours.dtype == torch.float32 and torch.equal(ours, theirs)
    # In bfloat16, as transformers loads it into a bf16 model (and DeepSeek's fp8_cast_bf16 writes it).
    bf16 = Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=torch.bfloat16)
    assert torch.equal(dequantize(quantization, qt, q, s, torch.bfloat16), bf16)


def test_fp8_block_overhanging_the_matrix_dequantizes_as_deepseeks_padded_blocks() -> None:
    """DeepSeek pads a partial block with zeros to 128 (README_WEIGHTS.md): the result is transformers' own on
    the padded matrix, cut back. transformers 5.17 on the unpadded matrix cuts 200 rows under 2 row scales into
    blocks of 100, and refuses 129 rows: not the release's arithmetic."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    torch.manual_seed(1)
    quantization = read_quantization({"quantization_config": FP8_CONFIG})
    assert quantization is not None
    for rows, cols in [(200, 300), (64, 128), (129, 130)]:
        w = torch.randn(rows, cols)
        q, s = quantize_fp8_block(w)
        assert s.shape == (-(-rows // 128), -(-cols // 128))
        qt = plan_quantized(
            quantization,
            {"x.weight": _info("x.weight", q, "F8_E4M3"), "x.weight_scale_inv": _info("x.weight_scale_inv", s, "F32")},
        ).tensors["x.weight"]
        padded = torch.zeros(s.shape[0] * 128, s.shape[1] * 128, dtype=torch.float8_e4m3fn)
        padded[:rows, :cols] = q
        expected = Fp8Dequantize(None)._dequantize_one(padded, s)[:rows, :cols]
        ours = dequantize(quantization, qt, q, s)
        assert torch.equal(ours, expected)
        # The round trip: within e4m3's half step (2^-4 relative) or half its smallest subnormal step (2^-10 x s).
        scale = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
        assert bool(((ours - w).abs() <= w.abs() * 2**-4 + scale * 2**-10).all())
    direct = Fp8Dequantize(None)._dequantize_one(*quantize_fp8_block(torch.randn(200, 300)))
    assert direct.shape == (200, 300)  # computed, with blocks of 100 rows and 100 columns
    with pytest.raises(ValueError, match="not divisible"):
        Fp8Dequantize(None)._dequantize_one(*quantize_fp8_block(torch.randn(129, 128)))


def test_mxfp4_decodes_as_transformers_and_gpt_oss_do() -> None:
    """Every nibble and a range of exponents: transformers' `convert_moe_packed_tensors` (gpt-oss's own decode,
    then transposed to [E, cols, rows]) bit for bit, in bfloat16 as it computes, and exactly in float32."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(2)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8)
    scales = torch.randint(100, 150, (3, 40, 4), dtype=torch.uint8)
    quantization = read_quantization({"quantization_config": MXFP4_CONFIG})
    assert quantization is not None
    qt = plan_quantized(
        quantization,
        {
            "e.gate_up_proj_blocks": _info("e.gate_up_proj_blocks", blocks, "U8"),
            "e.gate_up_proj_scales": _info("e.gate_up_proj_scales", scales, "U8"),
        },
    ).tensors["e.gate_up_proj"]
    assert qt.shape == (3, 128, 40)
    theirs = convert_moe_packed_tensors(blocks.clone(), scales.clone())
    ours = dequantize(quantization, qt, blocks, scales)
    assert theirs.dtype == torch.bfloat16 and ours.dtype == torch.float32
    assert torch.equal(ours.to(torch.bfloat16), theirs)
    assert torch.equal(dequantize(quantization, qt, blocks, scales, torch.bfloat16), theirs)
    # Low nibble first: byte 0x21 of the first block is values 0.5 (nibble 1) then 1.0 (nibble 2), times 2^0.
    one = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
    one[0, 0, 0, 0] = 0x21
    unit = torch.full((1, 1, 1), 127, dtype=torch.uint8)
    single = plan_quantized(
        quantization, {"p_blocks": _info("p_blocks", one, "U8"), "p_scales": _info("p_scales", unit, "U8")}
    )
    decoded = dequantize(quantization, single.tensors["p"], one, unit)
    assert decoded[0, :2, 0].tolist() == [0.5, 1.0]


def test_mxfp4_round_trip_is_within_half_a_step_of_its_block() -> None:
    torch.manual_seed(3)
    w = torch.randn(2, 16, 64) * 3
    blocks, scales = quantize_mxfp4(w)
    quantization = read_quantization({"quantization_config": MXFP4_CONFIG})
    assert quantization is not None
    qt = plan_quantized(
        quantization,
        {"p_blocks": _info("p_blocks", blocks, "U8"), "p_scales": _info("p_scales", scales, "U8")},
    ).tensors["p"]
    ours = dequantize(quantization, qt, blocks, scales).transpose(1, 2)  # back to [E, rows, cols]
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)  # the block's 2^exponent
    # E2M1's steps are 0.5, 1 and 2 units; above 6 units (up to 8) a value saturates at 6.
    assert bool(((ours - w).abs() <= 2 * step).all())
    inside = w.abs() <= 6 * step
    assert bool(((ours - w).abs()[inside] <= step[inside]).all())


# --- a source, as ingest reads it ----------------------------------------------------------------------------


def test_fp8_source_plans_by_its_released_tensors(fp8_dir: Path) -> None:
    src = open_source(fp8_dir)
    record = src.quantization
    assert record is not None
    assert (record.layout, record.block_size, record.scale_dtype, record.tensors) == (
        "fp8-block",
        [128, 128],
        "F32",
        14,
    )
    assert src.quantized is not None
    assert record.parameters == sum(src.tensors[n].numel for n in src.quantized.tensors)
    # Released names and shapes, the scales paired away: exactly what config.json implies.
    assert list(src.tensors) == list(src.shape.expected_tensors())
    assert src.tensors[K_PROJ].dtype == "F8_E4M3" and src.tensors[K_PROJ].shape == (64, 128)
    with pytest.raises(StoredQuantized, match="fp8-block"):
        src.tensor(K_PROJ)
    assert set(src.stored(K_PROJ)) == {K_PROJ, K_PROJ.replace(".weight", ".weight_scale_inv")}
    assert src.tensor("model.norm.weight").dtype == torch.bfloat16  # a plain tensor reads as before
    released = dict(src.iter_dequantized())
    assert list(released) == list(src.tensors)
    assert released[UP_PROJ].dtype == torch.float32 and released[UP_PROJ].shape == (320, 128)
    assert released["model.embed_tokens.weight"].dtype == torch.bfloat16  # passed through, not cast


def test_fp8_dequantized_weights_are_the_bf16_models_within_e4m3s_step(fp8_dir: Path, tmp_path: Path) -> None:
    from tests.model_factory import make_model

    plain = open_source(make_model(tmp_path / "plain", hidden_size=128, intermediate_size=320))
    src = open_source(fp8_dir)
    for name in src.quantized.tensors:  # type: ignore[union-attr]
        w, ours = plain.tensor(name).float(), src.dequantized(name)
        assert bool(((ours - w).abs() <= w.abs() * 2**-4 + w.abs().max() / 448 * 2**-9).all()), name


def test_a_qwen3_fp8_source_with_bf16_scales_ingests(tmp_path: Path) -> None:
    """Qwen3's -FP8 releases keep their weight_scale_inv in bfloat16."""
    src = open_source(make_fp8_block_source(tmp_path / "q", "qwen3", scale_dtype="bfloat16"))
    assert src.quantization is not None and src.quantization.scale_dtype == "BF16"
    assert src.dequantized(K_PROJ).shape == (64, 128)


def test_mxfp4_plan_pairs_the_experts_and_streams_them_released(mxfp4_dir: Path) -> None:
    quantization, plan = _plan(mxfp4_dir)
    assert plan.record().model_dump() == {
        "layout": "mxfp4",
        "quant_method": "mxfp4",
        "block_size": [32],
        "scale_dtype": "U8",
        "scale_fmt": "e8m0",
        "tensors": 4,
        "parameters": 4 * 2 * (64 * 128 + 64 * 64),
        "stored_bytes": 4 * 2 * (64 * 128 + 64 * 64) * 17 // 32,
        "modules_to_not_convert": MXFP4_CONFIG["modules_to_not_convert"],
    }
    assert plan.tensors[GATE_UP].shape == (4, 64, 128)  # gpt-oss's gate_up_proj [E, hidden, 2I]
    stored = load_file(mxfp4_dir / "model.safetensors")
    released = dict(dequantize_stream(plan, sorted(stored.items()), torch.bfloat16))
    assert GATE_UP in released and GATE_UP + "_blocks" not in released
    assert "model.layers.0.mlp.router.weight" in released
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    assert torch.equal(
        released[GATE_UP], convert_moe_packed_tensors(stored[GATE_UP + "_blocks"], stored[GATE_UP + "_scales"])
    )


def test_a_stream_missing_a_part_is_refused(mxfp4_dir: Path) -> None:
    _, plan = _plan(mxfp4_dir)
    stored = load_file(mxfp4_dir / "model.safetensors")
    del stored[GATE_UP + "_scales"]
    with pytest.raises(QuantizedSourceInvalid, match="never came"):
        list(dequantize_stream(plan, stored.items()))


# --- each corruption is one SOURCE_QUANTIZATION_INVALID naming what is wrong --------------------------------

SCALE = K_PROJ.replace(".weight", ".weight_scale_inv")


def _nan_scale(t: dict[str, torch.Tensor]) -> None:
    t[SCALE] = t[SCALE].clone()
    t[SCALE][0, 0] = float("nan")


def _zero_scale(t: dict[str, torch.Tensor]) -> None:
    t[SCALE] = torch.zeros_like(t[SCALE])


def _nan_value(t: dict[str, torch.Tensor]) -> None:
    raw = t[K_PROJ].view(torch.uint8).clone()
    raw[3, 5] = 0x7F
    t[K_PROJ] = raw.view(torch.float8_e4m3fn)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.update({SCALE: torch.ones(2, 1)}), r"has shape \[2, 1\]; weight \[64, 128\] in 128 x 128 blocks"),
        (lambda t: t.pop(SCALE), "its scales .* are missing"),
        (lambda t: t.update({"lm_head.weight_scale_inv": torch.ones(4, 1)}), "scale nothing.*lm_head.weight' is BF16"),
        (lambda t: t.update({SCALE: t[SCALE].to(torch.int32)}), "has dtype I32"),
        (lambda t: t.update({K_PROJ: t[K_PROJ].to(torch.float8_e5m2)}), "fmt e4m3 declares float8_e4m3fn"),
    ],
)
def test_header_corruptions_are_refused_at_plan(fp8_dir: Path, tmp_path: Path, edit: Any, message: str) -> None:
    src = _copy(fp8_dir, tmp_path / "m")
    _edit_tensors(src, edit)
    with pytest.raises(QuantizedSourceInvalid, match=message) as e:
        open_source(src)
    assert e.value.code == "SOURCE_QUANTIZATION_INVALID" and e.value.details["file"] == "model.safetensors"


@pytest.mark.parametrize(
    ("edit", "field", "message"),
    [
        # Scales written for 128 x 128 blocks under a config that says 64 x 64.
        (lambda c: c["quantization_config"].update(weight_block_size=[64, 64]), None, "in 64 x 64 blocks"),
        (lambda c: c["quantization_config"].update(quant_method="gptq"), "quant_method", "not a layout kiln reads"),
        (
            lambda c: c["quantization_config"].update(quant_method="compressed-tensors"),
            "quant_method",
            "compressed-tensors",
        ),
        (lambda c: c["quantization_config"].update(fmt="e5m2"), "fmt", "e4m3"),
        (lambda c: c["quantization_config"].update(activation_scheme="static"), "activation_scheme", "dynamic"),
        (lambda c: c["quantization_config"].update(weight_block_size=[128]), "weight_block_size", "at least 2"),
        (lambda c: c["quantization_config"].update(weight_block_size=[0, 128]), "weight_block_size", "1..4096"),
        (lambda c: c["quantization_config"].update(dequantize_everything=True), "dequantize_everything", "not a key"),
        (
            lambda c: c["quantization_config"].update(modules_to_not_convert=["re:.*"]),
            "modules_to_not_convert",
            "not a module name",
        ),
        (lambda c: c.update(quantization_config="fp8"), "", "must be an object"),
        # The config keeps attention unquantized, the weights say otherwise.
        (
            lambda c: c["quantization_config"].update(modules_to_not_convert=["model.layers.*.self_attn"]),
            None,
            "keeps 'model.layers.0.self_attn.[kqvo]_proj' unquantized",
        ),
    ],
)
def test_config_corruptions_are_refused_at_plan(
    fp8_dir: Path, tmp_path: Path, edit: Any, field: str | None, message: str
) -> None:
    src = _copy(fp8_dir, tmp_path / "m")
    _edit_config(src, edit)
    with pytest.raises(QuantizedSourceInvalid, match=message) as e:
        open_source(src)
    if field is not None:
        assert e.value.details["field"] == f"quantization_config{'.' if field else ''}{field}"


def test_a_declared_quantization_with_nothing_quantized_is_refused(tmp_path: Path) -> None:
    from tests.model_factory import make_model

    src = make_model(tmp_path / "m")
    _edit_config(src, lambda c: c.update(quantization_config=FP8_CONFIG))
    with pytest.raises(QuantizedSourceInvalid, match="no tensor is stored that way"):
        open_source(src)


def test_quantized_tensors_without_a_declared_quantization_are_refused_naming_it(fp8_dir: Path, tmp_path: Path) -> None:
    src = _copy(fp8_dir, tmp_path / "m")
    _edit_config(src, lambda c: c.pop("quantization_config"))
    with pytest.raises(QuantizedSourceInvalid, match="stored as fp8-block .* declares no quantization_config"):
        open_source(src)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_nan_scale, r"at \[0, 0\]: nan is not a finite scale > 0"),
        (_zero_scale, "1 value.*0.0 is not a finite scale > 0"),
        (_nan_value, r"at \[3, 5\]: nan is NaN"),
    ],
)
def test_value_corruptions_are_refused_when_read(fp8_dir: Path, tmp_path: Path, edit: Any, message: str) -> None:
    src_dir = _copy(fp8_dir, tmp_path / "m")
    _edit_tensors(src_dir, edit)
    src = open_source(src_dir)  # the headers are right
    with pytest.raises(QuantizedSourceInvalid, match=message) as e:
        src.dequantized(K_PROJ)
    assert e.value.details["tensor"] in (K_PROJ, SCALE)


def test_ue8m0_scales_must_be_powers_of_two(fp8_dir: Path, tmp_path: Path) -> None:
    src_dir = _copy(fp8_dir, tmp_path / "m")
    _edit_config(src_dir, lambda c: c["quantization_config"].update(scale_fmt="ue8m0"))
    with pytest.raises(QuantizedSourceInvalid, match="not a power of two"):
        open_source(src_dir).dequantized(K_PROJ)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t[GATE_UP + "_scales"].__setitem__((0, 0, 0), 0xFF), "255 is 0xFF, E8M0's NaN"),
        # 6 x 2^(254 - 127) overflows every float.
        (lambda t: (t[GATE_UP + "_scales"].fill_(254), t[GATE_UP + "_blocks"].fill_(0x77)), "non-finite"),
    ],
)
def test_mxfp4_value_corruptions_are_refused(mxfp4_dir: Path, tmp_path: Path, edit: Any, message: str) -> None:
    src = _copy(mxfp4_dir, tmp_path / "m")
    _edit_tensors(src, edit)
    quantization, plan = _plan(src)
    stored = load_file(src / "model.safetensors")
    qt = plan.tensors[GATE_UP]
    with pytest.raises(QuantizedSourceInvalid, match=message):
        dequantize(quantization, qt, stored[qt.values.name], stored[qt.scale.name])


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop(GATE_UP + "_scales"), "its scales .* are missing"),
        (lambda t: t.pop(GATE_UP + "_blocks"), "scale nothing"),
        # 16 values in 8 bytes: not MXFP4's 32-value block.
        (lambda t: t.update({GATE_UP + "_blocks": t[GATE_UP + "_blocks"].reshape(4, 128, 4, 8)}), "must be 16"),
        (
            lambda t: t.update({GATE_UP + "_scales": t[GATE_UP + "_scales"][:, :, :1].contiguous()}),
            r"need one scale each",
        ),
        (lambda t: t.update({"model.layers.0.self_attn.q_proj_blocks": t[GATE_UP + "_blocks"].clone()}), "missing"),
    ],
)
def test_mxfp4_header_corruptions_are_refused(mxfp4_dir: Path, tmp_path: Path, edit: Any, message: str) -> None:
    src = _copy(mxfp4_dir, tmp_path / "m")
    _edit_tensors(src, edit)
    with pytest.raises(QuantizedSourceInvalid, match=message):
        _plan(src)


def test_mxfp4_in_a_module_kept_unquantized_is_refused(mxfp4_dir: Path, tmp_path: Path) -> None:
    src = _copy(mxfp4_dir, tmp_path / "m")
    _edit_config(src, lambda c: c["quantization_config"]["modules_to_not_convert"].append("model.layers.*.mlp.experts"))
    with pytest.raises(QuantizedSourceInvalid, match="keeps 'model.layers.0.mlp.experts' unquantized"):
        _plan(src)


def test_layouts_are_data() -> None:
    assert FP8_BLOCK.scale_name("m.q_proj.weight") == "m.q_proj.weight_scale_inv"
    assert MXFP4.released_name("m.experts.down_proj_blocks") == "m.experts.down_proj"
    assert read_quantization({}) is None


@pytest.mark.parametrize("layout", ["fp8", "mxfp4"])
def test_the_tensors_config_json_implies_are_the_headers_a_release_writes(
    fp8_dir: Path, mxfp4_dir: Path, layout: str
) -> None:
    """`ModelShape.stored_tensors`, from config.json alone, names, types and shapes every stored tensor as the
    release's headers hold it (the rest in its own float type, bf16 here), by the layout rules `plan_quantized`
    checks the headers by; and sizing from config.json alone (`placement.weights.source_bytes`) is their bytes."""
    from kiln.formats.architectures.shape import ModelShape
    from kiln.placement.weights import source_bytes

    src = fp8_dir if layout == "fp8" else mxfp4_dir
    shape = ModelShape.from_config(json.loads((src / "config.json").read_text()))
    infos, _ = read_header(src / "model.safetensors", "model.safetensors")
    assert shape.source_quant is not None and shape.source_quant == _plan(src)[0]
    implied = {s.name: (s.dtype or "BF16", s.shape) for s in shape.stored_tensors()}
    assert implied == {t.name: (t.dtype, t.shape) for t in infos}
    assert source_bytes(shape, 2) == sum(t.nbytes for t in infos)
