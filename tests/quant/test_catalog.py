"""The catalog is the one table of quantization methods: every quant-keyed table elsewhere is derived from it
or checked here, so a method missing from a target's table (or a table naming a method that is not one)
fails this file, and a method cannot state dtypes its scheme does not store."""

from __future__ import annotations

import pytest

from core.hardware import PROFILES
from eval.gates import DEFAULT_GATES, Gate
from eval.native_kernels import NATIVE_SCHEMES
from eval.runtimes.vllm_runtime import CPU_LIMITS, WeightScheme, compute_dtype
from quant.catalog import FAMILIES, METHODS, SCHEMES, compatibility, get_method
from quant.compressed import quantization_config
from quant.methods.base import FLOAT_FORMATS, Method
from quant.methods.fp8 import FP8
from quant.rtn import planned_tensors
from quant.schemes import Scheme
from registry.resolve.fit import matmul_dtype
from targets.hf_bundle.export import QUANTS as HF_BUNDLE_QUANTS
from targets.orbax.layout import QUANTS as ORBAX_QUANTS
from targets.rocm_bundle.export import QUANTS as ROCM_BUNDLE_QUANTS
from targets.trtllm.engines import LEGACY_QFORMATS, LEGACY_REFUSED
from targets.trtllm.formats import FORMATS, REFUSED


def test_one_table_gathered_from_one_module_per_family() -> None:
    assert [f.__name__.rsplit(".", 1)[1] for f in FAMILIES] == ["dense", "fp8", "int8", "int4"]
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
    # Eval: a default gate (the method's own), a native kernel exactly for 8-bit matmuls.
    gate = method.gate
    assert DEFAULT_GATES[name] == Gate(
        max_kl=gate.max_kl, min_top1=gate.min_top1, max_ppl_increase=gate.max_ppl_increase
    )
    assert (name in NATIVE_SCHEMES) == (method.matmul_dtype != "bf16")
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
        weight = planned_tensors(method.scheme, "model.layers.0.mlp.up_proj.weight", (256, 256))[0]
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
