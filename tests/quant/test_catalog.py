"""The catalog is the one table of quantization methods: every quant-keyed table elsewhere is derived from it
or checked here, so a method missing from a target's table (or a table naming a method that is not one)
fails this file, and a method cannot state dtypes its scheme does not store."""

from __future__ import annotations

import pytest

from kiln.core.hardware import PROFILES
from kiln.eval.gates import DEFAULT_GATES, Gate
from kiln.eval.native_kernels import NATIVE_SCHEMES
from kiln.eval.runtimes.vllm_support import CPU_LIMITS, WeightScheme, compute_dtype
from kiln.placement.fit import matmul_dtype
from kiln.quant.catalog import FAMILIES, METHODS, SCHEMES, compatibility, get_method
from kiln.quant.compressed import quantization_config
from kiln.quant.methods.base import FLOAT_FORMATS, Method
from kiln.quant.methods.fp8 import FP8
from kiln.quant.rtn import planned_tensors
from kiln.quant.schemes import Scheme
from kiln.targets.hf_bundle.export import QUANTIZED as HF_BUNDLE_QUANTIZED
from kiln.targets.hf_bundle.export import QUANTS as HF_BUNDLE_QUANTS
from kiln.targets.orbax.layout import QUANTS as ORBAX_QUANTS
from kiln.targets.rocm_bundle.export import QUANTS as ROCM_BUNDLE_QUANTS
from kiln.targets.trtllm.engines import LEGACY_QFORMATS, LEGACY_REFUSED
from kiln.targets.trtllm.export import QUANTIZED as TRTLLM_QUANTIZED
from kiln.targets.trtllm.formats import FORMATS, REFUSED


def test_one_table_gathered_from_one_module_per_family() -> None:
    assert [f.__name__.rsplit(".", 1)[1] for f in FAMILIES] == ["dense", "fp8", "int8", "int4", "fp4"]
    names = [m.name for f in FAMILIES for m in f.METHODS]
    assert len(names) == len(set(names)) == len(METHODS)
    assert {n: m.scheme for n, m in METHODS.items()} == SCHEMES
    assert all(get_method(n) is m for n, m in METHODS.items())


@pytest.mark.parametrize("name", list(METHODS))
def test_every_quant_keyed_table_covers_every_method(name: str) -> None:
    method = METHODS[name]
    # Targets that build every method, and those that say why they do not.
    assert name in HF_BUNDLE_QUANTS and name in ROCM_BUNDLE_QUANTS
    assert (name in FORMATS) != (name in REFUSED), "trtllm: written or refused, never both or neither"
    if name in FORMATS:
        assert (name in LEGACY_QFORMATS) != (name in LEGACY_REFUSED), "trtllm engines: built or refused"
    # Eval: a default gate (the method's own), a native kernel check exactly for 8-bit matmuls.
    gate = method.gate
    assert DEFAULT_GATES[name] == Gate(
        max_kl=gate.max_kl, min_top1=gate.min_top1, max_ppl_increase=gate.max_ppl_increase
    )
    assert (name in NATIVE_SCHEMES) == (method.matmul_dtype in ("fp8", "int8") and method.kv_cache_dtype == "bf16")
    # Routing sizes its matmuls at the method's own rate.
    assert matmul_dtype(name) == method.matmul_dtype
    # A verdict for every hardware profile of the catalog.
    assert set(compatibility(method.scheme)) == set(PROFILES)


@pytest.mark.parametrize("name", [n for n, m in METHODS.items() if m.scheme.quantized])
def test_vllm_reads_every_quantized_method_as_its_catalog_row(name: str) -> None:
    """vLLM's CPU limits and compute dtype classify the method's own compressed-tensors config: FP8 rules
    match exactly the FP8 methods (an FP4 float group would be another bit width)."""
    method = METHODS[name]
    [group] = quantization_config(method.scheme)["config_groups"].values()
    read = WeightScheme.from_group(group)
    fp8_limits = {lim.scheme for lim in CPU_LIMITS if "FP8" in lim.scheme and lim.matches(read)}
    assert bool(fp8_limits) == (method.weight_dtype == "float8_e4m3fn"), fp8_limits
    assert compute_dtype([read]) in ("float32", "bfloat16")


def test_stored_dtypes_come_from_the_method() -> None:
    for name, method in METHODS.items():
        if not method.scheme.quantized:
            continue
        planned = planned_tensors(method.scheme, "model.layers.0.mlp.up_proj.weight", (256, 256))
        [weight] = [p for p in planned if p[0].endswith((".weight", ".weight_packed"))]
        fmt = method.float_format
        assert (weight[1] == fmt.safetensors) if fmt is not None else weight[1] in ("I8", "I32"), name
    assert FP8.float_format == FLOAT_FORMATS["float8_e4m3fn"] and FP8.float_format.max == 448.0


def test_orbax_builds_a_subset_of_the_catalog() -> None:
    assert set(ORBAX_QUANTS) <= set(METHODS)


def test_a_method_cannot_state_dtypes_its_scheme_does_not_store() -> None:
    with pytest.raises(ValueError, match="its scheme stores float8_e4m3fn"):
        Method(FP8.scheme, "int8", "int8", FP8.gate, FP8.on_cuda, FP8.on_rocm)
    with pytest.raises(ValueError, match="computes in float8_e4m3fn"):
        Method(FP8.scheme, "float8_e4m3fn", "bfloat16", FP8.gate, FP8.on_cuda, FP8.on_rocm)
    bf16 = Scheme(name="x", description="x", format="dense", method="none")
    with pytest.raises(ValueError, match="stores bfloat16"):
        Method(bf16, "int4", "bfloat16", FP8.gate, FP8.on_cuda, FP8.on_rocm)


def test_no_method_shares_a_name_with_a_gguf_type() -> None:
    """GGUF's `nvfp4` / `mxfp4` are llama.cpp types; the compressed-tensors methods are named apart (only the
    unquantized `bf16` is the same thing in both)."""
    from kiln.formats.gguf.constants import QUANTS as GGUF_QUANTS

    assert set(METHODS) & set(GGUF_QUANTS) == {"bf16"}


# FP4 verdicts (issue): NVFP4 W4A4 natively on sm100+, weight-only on Hopper; MXFP4 natively on gfx950 and
# sm100+; nothing FP4 on MI300X.
@pytest.mark.parametrize(
    ("name", "hardware", "compatible", "says"),
    [
        ("nvfp4-w4a4", "b200", True, "native NVFP4 W4A4"),
        ("nvfp4-w4a4", "gb200", True, "native NVFP4 W4A4"),
        ("nvfp4-w4a4", "b300", True, "native NVFP4 W4A4"),
        ("nvfp4-w4a4", "rtx-pro-6000", True, "native NVFP4 W4A4"),
        ("nvfp4-w4a4", "h100", True, "no FP4 tensor cores: NVFP4 weights through vLLM's Marlin"),
        ("nvfp4-w4a4", "a100", True, "Marlin"),
        ("nvfp4-w4a4", "mi355x", False, "no NVFP4 kernels on ROCm"),
        ("nvfp4-w4a4", "mi300x", False, "no NVFP4 kernels on ROCm"),
        ("nvfp4-w4a4-gptq", "b200", True, "native NVFP4 W4A4"),
        ("nvfp4-w4a4-gptq", "h100", True, "no FP4 tensor cores: NVFP4 weights through vLLM's Marlin"),
        ("nvfp4-w4a4-gptq", "mi355x", False, "no NVFP4 kernels on ROCm"),
        ("nvfp4-w4a16", "b200", True, "weight-only"),
        ("nvfp4-w4a16", "h100", True, "weight-only"),
        ("mxfp4-w4a4", "mi355x", True, "native MXFP4 W4A4 matmuls on gfx950"),
        ("mxfp4-w4a4", "b200", True, "native MXFP4 W4A4"),
        ("mxfp4-w4a4", "h100", True, "Marlin"),
        ("mxfp4-w4a4", "mi300x", False, "only emulates"),
        ("mxfp4-w4a4", "mi325x", False, "only emulates"),
        ("mxfp4-w4a4", "tpu-v5e", False, "does not run"),
    ],
)
def test_fp4_verdicts_follow_the_hardware_facts(name: str, hardware: str, compatible: bool, says: str) -> None:
    verdict = compatibility(METHODS[name].scheme)[hardware]
    assert verdict.compatible is compatible and says in verdict.reason, verdict


def test_fp4_matmul_rates() -> None:
    assert METHODS["nvfp4-w4a4"].matmul_dtype == METHODS["mxfp4-w4a4"].matmul_dtype == "fp4"
    assert METHODS["nvfp4-w4a4-gptq"].matmul_dtype == "fp4"
    assert METHODS["nvfp4-w4a16"].matmul_dtype == "bf16"
    b200, h100 = PROFILES["b200"], PROFILES["h100"]
    assert b200.matmul_tflops("fp4") == (b200.tflops.fp4, "fp4")
    assert h100.matmul_tflops("fp4")[1] == "bf16"  # no FP4 units: weight-only, at the bf16 rate


def test_every_method_says_what_it_does_with_each_released_layout() -> None:
    """FP8-block releases: fp8-block keeps their bytes; bf16, W4A16 (Ampere) and the FP4 methods (Blackwell, gfx950)
    dequantize first; the other 8-bit methods and mxfp4-experts are refused. MXFP4 experts: mxfp4-experts keeps
    them, bf16 dequantizes them, every other scheme is refused (it would leave them bf16)."""
    from kiln.formats.prequantized import FP8_BLOCK, LAYOUTS, SourceQuantization
    from kiln.quant.catalog import QuantSourceRefused, source_route
    from kiln.quant.methods.base import SourceRoute

    layouts = {layout.name: layout for layout in LAYOUTS.values()}
    routes = {name: {layout: m.from_sources[layout].action for layout in layouts} for name, m in METHODS.items()}
    assert all(set(METHODS[name].from_sources) == set(layouts) for name in METHODS)
    assert {n for n, r in routes.items() if r["fp8-block"] == "keep"} == {"fp8-block"}
    assert {n for n, r in routes.items() if r["fp8-block"] == "refuse"} == {
        "fp8",
        "fp8-kv8",
        "int8-w8a8",
        "int8-w8a16",
        "mxfp4-experts",
    }
    assert {n for n, r in routes.items() if r["mxfp4"] == "keep"} == {"mxfp4-experts"}
    assert {n for n, r in routes.items() if r["mxfp4"] == "dequantize"} == {"bf16"}
    declared = [m.from_sources[layout] for m in METHODS.values() for layout in layouts]
    assert all(isinstance(route, SourceRoute) and route.reason for route in declared)

    release = SourceQuantization(FP8_BLOCK, (128, 128), "float")
    assert source_route(get_method("fp8-block"), release).action == "keep"
    with pytest.raises(QuantSourceRefused, match="blocks are 64x128"):
        source_route(get_method("fp8-block"), SourceQuantization(FP8_BLOCK, (64, 128), "float"))
    with pytest.raises(QuantSourceRefused) as e:
        source_route(get_method("int8-w8a16"), release)
    assert e.value.code == "QUANT_SOURCE_REFUSED" and e.value.details["layout"] == "fp8-block"


def test_a_release_only_method_is_kept_from_its_release_and_refused_elsewhere() -> None:
    """mxfp4-experts is gpt-oss's release layout: kept from an MXFP4 release (its 32-value blocks), refused for a plain
    source with its own code and for an FP8 release; it has no quantize stage and cannot quantize lm_head."""
    from kiln.core.errors import InvalidInput
    from kiln.formats.prequantized import FP8_BLOCK, MXFP4, SourceQuantization
    from kiln.quant.catalog import QuantReleaseOnly, QuantSourceRefused, check_source, get_scheme

    method = get_method("mxfp4-experts")
    assert method.release_only and method.scheme.method == "released" and method.matmul_dtype == "bf16"
    assert [n for n, m in METHODS.items() if m.release_only] == ["mxfp4-experts"]
    assert check_source(method, SourceQuantization(MXFP4, (32,), "e8m0")).action == "keep"  # type: ignore[union-attr]
    assert check_source(get_method("int4-rtn"), None) is None
    with pytest.raises(QuantReleaseOnly) as e:
        check_source(method, None)
    assert e.value.code == "QUANT_RELEASE_ONLY" and e.value.details["layouts"] == ["mxfp4"]
    assert "kiln quantizes no stacked experts" in e.value.message
    with pytest.raises(QuantSourceRefused, match="an FP8 release has no MXFP4 experts"):
        check_source(method, SourceQuantization(FP8_BLOCK, (128, 128), "float"))
    with pytest.raises(InvalidInput, match="cannot quantize it"):
        get_scheme("mxfp4-experts", "quantized")
    assert "mxfp4-experts" not in HF_BUNDLE_QUANTIZED and "mxfp4-experts" in HF_BUNDLE_QUANTS
    assert "mxfp4-experts" in FORMATS and "mxfp4-experts" not in TRTLLM_QUANTIZED


# mxfp4-experts as vLLM 0.32 serves gpt-oss's release (quant.methods.fp4's sources): every NVIDIA GPU from sm80, the
# kernel by generation; AITER on both AMD generations.
@pytest.mark.parametrize(
    ("hardware", "says"),
    [
        ("a100", "Marlin"),
        ("l40s", "Marlin"),
        ("h100", "OpenAI Triton"),
        ("b200", "FlashInfer's TRT-LLM MXFP4 MoE"),
        ("b300", "FlashInfer's TRT-LLM MXFP4 MoE"),
        ("rtx-pro-6000", "Marlin"),
        ("mi355x", "AITER's CK"),
        ("mi300x", "AITER's Triton W4A16"),
        ("cpu", "transformers dequantizes"),
    ],
)
def test_mxfp4_experts_verdicts(hardware: str, says: str) -> None:
    verdict = compatibility(METHODS["mxfp4-experts"].scheme)[hardware]
    assert verdict.compatible and says in verdict.reason, verdict
