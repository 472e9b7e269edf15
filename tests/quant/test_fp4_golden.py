"""FP4 golden test: kiln's NVFP4 / NVFP4A16 / MXFP4 tensors are, byte for byte, what llm-compressor's own
`oneshot` with compressed-tensors' preset of that name writes for the same weights and calibration text.

kiln builds its modifiers from its catalog (`quant.compressed.ct_scheme`), quantizes a disk-offloaded model
and stores through its own streaming writer (`quant.store.write_quantized`); upstream here is the documented
way: the model in memory, `QuantizationModifier(scheme="NVFP4", ...)` (`GPTQModifier` for the GPTQ method),
`save_pretrained(save_compressed=True)`.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from kiln.formats.hf_model import open_source
from kiln.quant.calibrated import calibrate, calibration_dtype, calibration_samples
from kiln.quant.catalog import get_scheme
from kiln.quant.compressed import ct_scheme
from kiln.quant.store import CONFIG_FILE, TENSORS_FILE, write_quantized

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama"
# kiln method -> compressed-tensors preset
PRESETS = {"nvfp4-w4a4": "NVFP4", "nvfp4-w4a4-gptq": "NVFP4", "nvfp4-w4a16": "NVFP4A16", "mxfp4-w4a4": "MXFP4"}


def _samples() -> list[list[int]]:
    text = (EXAMPLE / "heldout.txt").read_text(encoding="utf-8")
    return calibration_samples(EXAMPLE / "model", text, samples=8, seq_len=128, skip_tokens=4096)


@pytest.mark.parametrize("name", PRESETS)
def test_the_catalog_scheme_is_the_compressed_tensors_preset(name: str) -> None:
    from compressed_tensors.quantization import QuantizationArgs, preset_name_to_scheme

    ours = ct_scheme(get_scheme(name))
    preset = preset_name_to_scheme(PRESETS[name], ["Linear"])
    weights = preset.weights
    if get_scheme(name).method == "gptq":  # what GPTQModifier makes of the preset: its default column order
        assert weights is not None
        weights = QuantizationArgs(**{**weights.model_dump(), "actorder": "static"})
    assert ours.weights == weights
    assert ours.input_activations == preset.input_activations
    assert ours.format == get_scheme(name).format


@pytest.mark.parametrize("name", PRESETS)
def test_kiln_fp4_tensors_equal_what_llmcompressor_oneshot_writes(name: str, tmp_path: Path) -> None:
    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from kiln.quant.calibrated import cpu_pin_memory_workaround, oneshot_data

    scheme = get_scheme(name)
    dtype = calibration_dtype()
    samples = _samples() if scheme.calibrated else []
    source = open_source(EXAMPLE / "model")
    calibrated = calibrate(source, scheme, samples, offload_dir=tmp_path, compute_dtype=dtype)
    (tmp_path / "kiln").mkdir()
    write_quantized(source, scheme, tmp_path / "kiln", calibrated=calibrated)
    del calibrated

    model = AutoModelForCausalLM.from_pretrained(str(EXAMPLE / "model"), dtype=getattr(torch, dtype))
    modifier = GPTQModifier if scheme.method == "gptq" else QuantizationModifier
    recipe = modifier(targets="Linear", scheme=PRESETS[name], ignore=["lm_head"])
    with cpu_pin_memory_workaround():
        oneshot(model=model, recipe=recipe, **oneshot_data(samples))
    # oneshot's sequential pipeline leaves the model dispatched with CPU offloading, which save_pretrained
    # warns of (it needs the memory to gather it: a 5M model).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Attempting to save a model with offloaded modules", UserWarning)
        model.save_pretrained(str(tmp_path / "upstream"), save_compressed=True)

    upstream: dict[str, torch.Tensor] = {}
    for shard in sorted((tmp_path / "upstream").glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            upstream.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    with safe_open(str(tmp_path / "kiln" / TENSORS_FILE), framework="pt") as f:
        ours = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118

    quantized = {k for k in upstream if any(k.endswith(s) for s in ("_packed", "_scale", "_global_scale"))}
    assert set(ours) == quantized
    assert len(ours) >= 4 * 7 * 2  # every Linear of the 4 layers, values and scales
    for k, t in ours.items():
        u = upstream[k]
        assert t.dtype == u.dtype and t.shape == u.shape, (k, t.dtype, t.shape, u.dtype, u.shape)
        assert torch.equal(t.view(torch.uint8), u.view(torch.uint8)), k

    config = json.loads((tmp_path / "upstream" / "config.json").read_text())["quantization_config"]
    mine = json.loads((tmp_path / "kiln" / CONFIG_FILE).read_text())
    assert mine["format"] == config["format"] == scheme.format
    assert mine["ignore"] == config["ignore"] == ["lm_head"]
    for part in ("weights", "input_activations"):
        # `observer` is how llm-compressor chose the scales (it fills in its default when it runs); loaders
        # do not read it, and kiln's config keeps compressed-tensors' preset value.
        ours_args, theirs = (_without_observer(c["config_groups"]["group_0"][part]) for c in (mine, config))
        assert ours_args == theirs, part


def _without_observer(args: dict | None) -> dict | None:
    return None if args is None else {k: v for k, v in args.items() if k != "observer"}
