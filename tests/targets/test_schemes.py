"""Quantization schemes: validated presets, compressed-tensors' own format names, hardware with reasons."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kiln.core.errors import UnknownName
from kiln.core.hardware import PROFILES
from kiln.quant.catalog import SCHEMES, compatibility, compatible_hardware, get_scheme
from kiln.quant.schemes import Scheme, WeightQuant


def test_presets_are_the_issue_schemes() -> None:
    assert list(SCHEMES) == [
        "bf16",
        "fp8",
        "fp8-block",
        "fp8-kv8",
        "int8-w8a8",
        "int8-w8a16",
        "int4-rtn",
        "w4a16-gptq",
        "w4a16-awq",
        "nvfp4-w4a4",
        "nvfp4-w4a4-gptq",
        "nvfp4-w4a16",
        "mxfp4-w4a4",
        "mxfp4-experts",
    ]
    fp8, int8, int4 = get_scheme("fp8"), get_scheme("int8-w8a16"), get_scheme("int4-rtn")
    assert fp8.weights is not None and fp8.weights.type == "float" and fp8.weights.strategy == "channel"
    assert fp8.input_activations is not None and fp8.input_activations.strategy == "token"
    assert int8.weights is not None and int8.weights.num_bits == 8 and int8.input_activations is None
    w8a8 = get_scheme("int8-w8a8")
    assert w8a8.weights == int8.weights and w8a8.format == "int-quantized"
    assert w8a8.input_activations is not None and w8a8.input_activations.type == "int"
    block = get_scheme("fp8-block")
    assert block.weights is not None and block.weights.block_structure == (128, 128)
    assert block.input_activations is not None and block.input_activations.group_size == 128
    assert int4.weights is not None and (int4.weights.num_bits, int4.weights.group_size) == (4, 128)
    assert all(s.ignore == ("lm_head",) and s.targets == ("Linear",) for s in SCHEMES.values())


def test_unknown_scheme_lists_known() -> None:
    with pytest.raises(UnknownName) as e:
        get_scheme("int3")
    assert (
        "int3" in e.value.message
        and "bf16, fp8, fp8-block, fp8-kv8, int8-w8a8, int8-w8a16, int4-rtn" in e.value.message
    )


def test_schemes_are_frozen() -> None:
    with pytest.raises(ValidationError):
        get_scheme("fp8").name = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_bits": 4, "type": "int", "strategy": "group"},  # group without a size
        {"num_bits": 4, "type": "int", "strategy": "channel", "group_size": 128},  # size without groups
        {"num_bits": 4, "type": "float", "strategy": "channel"},  # fp4 is not fp8
        {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": False},
        {"num_bits": 8, "type": "int", "strategy": "group", "group_size": 0},
        {"num_bits": 8, "type": "float", "strategy": "block"},  # block without a structure
        {"num_bits": 8, "type": "float", "strategy": "channel", "block_structure": [128, 128]},
        {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [0, 128]},
    ],
)
def test_weight_args_are_rejected_not_rewritten(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        WeightQuant.model_validate(kwargs)


def test_format_must_be_compressed_tensors_choice() -> None:
    int8 = get_scheme("int8-w8a16").model_dump()
    with pytest.raises(ValidationError, match="pack-quantized"):
        Scheme.model_validate({**int8, "format": "int-quantized"})
    w8a8 = get_scheme("int8-w8a8").model_dump()
    with pytest.raises(ValidationError, match="int-quantized"):
        Scheme.model_validate({**w8a8, "format": "pack-quantized"})


def test_calibrated_schemes_share_int4_rtn_layout_and_hardware() -> None:
    rtn = get_scheme("int4-rtn")
    for name, method in (("w4a16-gptq", "gptq"), ("w4a16-awq", "awq")):
        s = get_scheme(name)
        assert s.method == method and s.calibrated and not rtn.calibrated
        assert (s.weights, s.input_activations, s.format, s.ignore) == (rtn.weights, None, rtn.format, rtn.ignore)
        assert set(compatible_hardware(s)) == set(compatible_hardware(rtn))
    awq = compatible_hardware(get_scheme("w4a16-awq"))
    assert "Triton" in awq["mi300x"] and "AWQ" in awq["mi300x"] and "Marlin" in awq["h100"]


@pytest.mark.parametrize(
    ("base", "method"),
    [("fp8", "gptq"), ("bf16", "rtn"), ("int4-rtn", "none")],  # calibrated fp8; quantizing bf16; unquantized int4
)
def test_method_must_fit_the_quantization(base: str, method: str) -> None:
    with pytest.raises(ValidationError, match="method|calibrates"):
        Scheme.model_validate({**get_scheme(base).model_dump(), "method": method})


def test_format_names_are_what_compressed_tensors_infers() -> None:
    import torch
    from compressed_tensors.compressors.format import infer_module_format

    from kiln.quant.compressed import ct_scheme

    for scheme in SCHEMES.values():
        if scheme.quantized:
            ct = ct_scheme(scheme).model_copy(update={"format": None})
            assert infer_module_format(torch.nn.Linear, ct).value == scheme.format, scheme.name


def test_hardware_with_reasons() -> None:
    fp8 = compatibility(get_scheme("fp8"))
    assert set(fp8) == set(PROFILES)
    assert not fp8["a100"].compatible and "sm89" in fp8["a100"].reason
    assert fp8["h100"].compatible and fp8["l40s"].compatible
    assert fp8["mi300x"].compatible and "e4m3fnuz" in fp8["mi300x"].reason
    assert fp8["mi355x"].compatible and "e4m3fn" in fp8["mi355x"].reason
    assert not fp8["tpu-v5e"].compatible
    block = compatibility(get_scheme("fp8-block"))
    assert not block["a100"].compatible and "Triton" in block["l40s"].reason and "CUTLASS" in block["h100"].reason
    w8a8 = compatible_hardware(get_scheme("int8-w8a8"))
    assert "CUTLASS int8" in w8a8["a100"] and "Triton int8" in w8a8["mi300x"]
    for name in ("int8-w8a8", "int8-w8a16", "int4-rtn"):
        hw = compatible_hardware(get_scheme(name))
        assert {"a100", "h100", "mi300x", "mi355x", "cpu"} <= set(hw)
        assert "sm80" in hw["a100"] or "CUTLASS" in hw["a100"]
        assert "ROCm" in hw["mi300x"]
    assert all(compatible_hardware(s)["cpu"] for s in SCHEMES.values())


def test_bf16_runs_on_every_gpu_vllm_serves_and_this_cpu_kind() -> None:
    assert list(compatible_hardware(get_scheme("bf16"))) == [
        "cpu",
        "a100",
        "l40s",
        "h100",
        "h200",
        "b200",
        "b300",
        "gb200",
        "rtx-pro-6000",
        "mi300x",
        "mi325x",
        "mi355x",
    ]
