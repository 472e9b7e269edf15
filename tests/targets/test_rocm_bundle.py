"""rocm-bundle: runtime metadata, architecture-only hardware, and FP8 pre-converted to e4m3fnuz for gfx942."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.core.errors import InvalidInput, RecipeInvalid
from kiln.formats.hf_model import open_source
from kiln.pipeline.recipe import parse_recipe
from kiln.quant.catalog import get_scheme
from kiln.quant.store import open_quantized, write_quantized
from kiln.targets.base import ExportRequest, get_target
from kiln.targets.rocm_bundle.export import export
from kiln.targets.rocm_bundle.fnuz import e4m3fn_to_e4m3fnuz
from tests.model_factory import make_model

GFX942 = {"gfx_arch": "gfx942", "vllm": "0.11.2", "rocm": "7.0.2"}
GFX950 = {**GFX942, "gfx_arch": "gfx950"}


def vllm_load_time_conversion(weight, scale):
    """What vLLM does to an e4m3fn checkpoint on gfx942 (`normalize_e4m3fn_to_e4m3fnuz` in
    vllm/model_executor/layers/quantization/utils/w8a8_utils.py): reinterpret the bits as e4m3fnuz
    after zeroing the pattern 0x80 (e4m3fn's -0, e4m3fnuz's NaN), and double the scale."""
    import torch

    bits = weight.view(torch.int8).clone()
    bits[bits == -128] = 0
    return bits.view(torch.float8_e4m3fnuz), scale * 2.0


def _dequant(weight, scale):
    return weight.float() * scale.float()


def test_every_e4m3fn_value_converts_exactly_as_vllm_does() -> None:
    import torch

    patterns = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    finite = patterns[~torch.isnan(patterns.float())]
    assert finite.numel() == 254  # 0x7F and 0xFF are e4m3fn's NaNs
    for scale in (torch.tensor(1.0, dtype=torch.bfloat16), torch.tensor(3.0517578125e-05, dtype=torch.bfloat16)):
        ours_w, ours_s = e4m3fn_to_e4m3fnuz(finite, scale)
        ref_w, ref_s = vllm_load_time_conversion(finite, scale)
        assert ours_w.dtype == torch.float8_e4m3fnuz and ours_s.dtype == scale.dtype
        assert torch.equal(ours_w.view(torch.uint8), ref_w.view(torch.uint8))  # the same bytes on disk
        assert torch.equal(_dequant(ours_w, ours_s), _dequant(ref_w, ref_s))
        assert torch.equal(_dequant(ours_w, ours_s), _dequant(finite, scale))  # and the checkpoint's own values


def test_conversion_refuses_other_dtypes_and_nan() -> None:
    import torch

    with pytest.raises(InvalidInput) as e:
        e4m3fn_to_e4m3fnuz(torch.zeros(4, dtype=torch.bfloat16), torch.ones(1))
    assert e.value.code == "FP8_DTYPE"
    nan = torch.tensor([0x7F], dtype=torch.uint8).view(torch.float8_e4m3fn)
    with pytest.raises(InvalidInput) as e:
        e4m3fn_to_e4m3fnuz(nan, torch.ones(1))
    assert e.value.code == "FP8_NAN"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("llama128"), hidden_size=128, intermediate_size=256, num_kv_heads=4)


def _bundle(model_dir: Path, tmp_path: Path, scheme: str, params: dict) -> Path:
    source = open_source(model_dir)
    (tmp_path / "q").mkdir(parents=True)
    write_quantized(source, get_scheme(scheme), tmp_path / "q")
    out = tmp_path / "bundle"
    out.mkdir()
    quantized = open_quantized(tmp_path / "q", scheme)
    export(source, ExportRequest(quant=scheme, out_dir=out, params=params, quantized=quantized))
    return out


@pytest.mark.parametrize("scheme", ["fp8", "fp8-block"])
def test_fnuz_bundle_dequantises_to_vllm_load_time_values(scheme: str, model_dir: Path, tmp_path: Path) -> None:
    import torch
    from safetensors import safe_open

    from kiln.formats.architectures import LINEAR_WEIGHT

    fn = _bundle(model_dir, tmp_path / "fn", scheme, GFX942)
    fnuz = _bundle(model_dir, tmp_path / "fnuz", scheme, {**GFX942, "fp8_dtype": "e4m3fnuz"})
    assert (fn / "config.json").read_text() == (fnuz / "config.json").read_text()
    compared = 0
    with safe_open(str(fn / "model.safetensors"), "pt") as a, safe_open(str(fnuz / "model.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for name in a.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
            if not (name.endswith(".weight") and LINEAR_WEIGHT.match(name)):
                if not name.endswith(".weight_scale"):
                    assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name
                continue
            assert str(b.get_slice(name).get_dtype()) == "F8_E4M3FNUZ"
            w_fn, s_fn = a.get_tensor(name), a.get_tensor(name + "_scale")
            w_nuz, s_nuz = b.get_tensor(name), b.get_tensor(name + "_scale")
            ref_w, ref_s = vllm_load_time_conversion(w_fn, s_fn)
            assert torch.equal(w_nuz.view(torch.uint8), ref_w.view(torch.uint8)) and torch.equal(s_nuz, ref_s)
            if scheme == "fp8-block":  # one scale per 128x128 block
                s_nuz = s_nuz.repeat_interleave(128, 0).repeat_interleave(128, 1)
                ref_s = ref_s.repeat_interleave(128, 0).repeat_interleave(128, 1)
                s_fn = s_fn.repeat_interleave(128, 0).repeat_interleave(128, 1)
            assert torch.equal(_dequant(w_nuz, s_nuz), _dequant(ref_w, ref_s))
            assert torch.equal(_dequant(w_nuz, s_nuz), _dequant(w_fn, s_fn))
            compared += 1
    assert compared == 2 * 7  # every Linear of both layers


def test_manifest_records_validated_runtime_and_fp8_flavour(model_dir: Path, tmp_path: Path) -> None:
    source = open_source(model_dir)
    (tmp_path / "q").mkdir()
    write_quantized(source, get_scheme("fp8"), tmp_path / "q")
    quantized = open_quantized(tmp_path / "q", "fp8")
    for params, checkpoint, conversion in [
        (GFX942, "float8_e4m3fn", "vLLM converts"),
        ({**GFX942, "fp8_dtype": "e4m3fnuz"}, "float8_e4m3fnuz", "pre-converted"),
        ({**GFX942, "gfx_arch": "gfx950"}, "float8_e4m3fn", "none"),
    ]:
        out = tmp_path / f"b{len(list(tmp_path.iterdir()))}"
        out.mkdir()
        result = export(source, ExportRequest(quant="fp8", out_dir=out, params=params, quantized=quantized))
        arch = params["gfx_arch"]
        assert result.runtime["validated_for"] == {"vllm": "0.11.2", "rocm": "7.0.2", "gfx_arch": arch}
        fp8 = result.runtime["fp8"]
        assert fp8["checkpoint_dtype"] == checkpoint and conversion in fp8["conversion"]
        assert fp8["compute_dtype"] == ("float8_e4m3fnuz" if arch == "gfx942" else "float8_e4m3fn")
        assert set(result.hardware or {}) == ({"mi300x", "mi325x"} if arch == "gfx942" else {"mi355x"})
        assert "not_run_here" in result.details["validation"]


@pytest.mark.parametrize("scheme", ["fp8", "fp8-block"])
def test_eval_runtime_scores_the_fnuz_bundle_exactly_like_the_fn_bundle(
    scheme: str, model_dir: Path, tmp_path: Path
) -> None:
    import numpy as np

    from kiln.eval.runtimes import TransformersRuntime

    ids = list(range(0, 400, 7))
    fn = TransformersRuntime(_bundle(model_dir, tmp_path / "fn", scheme, GFX942)).logits(ids)
    fnuz = TransformersRuntime(_bundle(model_dir, tmp_path / "fnuz", scheme, {**GFX942, "fp8_dtype": "e4m3fnuz"}))
    assert np.array_equal(fn, fnuz.logits(ids))


def test_inverse_conversion_is_exact_and_refuses_what_e4m3fn_lacks() -> None:
    import torch

    from kiln.targets.rocm_bundle.fnuz import e4m3fnuz_to_e4m3fn

    patterns = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    finite = patterns[~torch.isnan(patterns.float())]
    scale = torch.tensor(0.25, dtype=torch.bfloat16)
    back, back_scale = e4m3fnuz_to_e4m3fn(*e4m3fn_to_e4m3fnuz(finite, scale))
    assert torch.equal(_dequant(back, back_scale), _dequant(finite, scale))
    for bad in (0x80, 0x7F, 0xFF):
        with pytest.raises(InvalidInput):
            e4m3fnuz_to_e4m3fn(torch.tensor([bad], dtype=torch.uint8).view(torch.float8_e4m3fnuz), scale)


def _recipe(tmp_path: Path, model_dir: Path, entry: dict) -> None:
    (tmp_path / "heldout.txt").write_text("text " * 100)
    parse_recipe(
        {
            "model": "m",
            "version": "1",
            "source": str(model_dir),
            "eval": {"text": "heldout.txt"},
            "targets": [entry],
        },
        base_dir=tmp_path,
        allowed_roots=[model_dir],
    )


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        (
            {"target": "rocm-bundle", "quants": ["fp8"], "params": {**GFX950, "fp8_dtype": "e4m3fnuz"}},
            ["fp8_dtype e4m3fnuz is not for gfx950"],
        ),
        ({"target": "rocm-bundle", "quants": ["fp8"], "params": {"gfx_arch": "gfx942"}}, ["vllm", "rocm"]),
        ({"target": "rocm-bundle", "quants": ["fp8"], "params": {**GFX942, "gfx_arch": "gfx90a"}}, ["gfx_arch"]),
        (
            {"target": "rocm-bundle", "quants": ["bf16"], "params": GFX942, "hardware": ["h100"]},
            ["cannot serve h100", "built for gfx942"],
        ),
        (
            {"target": "hf-bundle", "quants": ["bf16", "fp8"], "hardware": ["h100", "a100"]},
            ["hf-bundle-fp8 cannot serve a100", "sm89"],
        ),
        ({"target": "hf-bundle", "quants": ["bf16"], "hardware": ["h1000"]}, ["unknown hardware 'h1000'"]),
    ],
)
def test_recipe_refuses_what_the_target_cannot_serve(
    entry: dict, words: list[str], model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(RecipeInvalid) as e:
        _recipe(tmp_path, model_dir, entry)
    for w in words:
        assert w in e.value.message
    assert e.value.message.startswith("recipe: targets[0]")


def test_recipe_accepts_hardware_the_target_serves(model_dir: Path, tmp_path: Path) -> None:
    _recipe(tmp_path, model_dir, {"target": "hf-bundle", "quants": ["bf16", "fp8"], "hardware": ["h100", "mi300x"]})
    _recipe(tmp_path, model_dir, {"target": "rocm-bundle", "quants": ["fp8"], "params": GFX942, "hardware": ["mi325x"]})
    spec = get_target("rocm-bundle")
    assert spec.compatibility("fp8", GFX942)["mi300x"].compatible
    assert not spec.compatibility("fp8", GFX942)["mi355x"].compatible
