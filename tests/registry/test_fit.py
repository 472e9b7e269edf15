"""Replica sizing (`placement.fit`) and the checkpoint footprint it is fed (`quant.footprint`).

The 70B figures of docs/routing.md are recomputed here by hand from the catalog's literal numbers
(core/hardware.yaml), and the footprint estimate is checked against hf-bundles kiln writes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.core.errors import InvalidInput, UnknownName
from kiln.core.hardware import PROFILES, builtin_catalog, parse_profile
from kiln.core.shape import KV_DTYPES, MAX_DIMENSION, ShapeRecord
from kiln.placement.fit import MEMORY_UTILIZATION, matmul_dtype, plan_replica
from kiln.placement.model import kv_cache_bytes, parameters
from kiln.quant.catalog import SCHEMES, get_method
from kiln.quant.footprint import checkpoint_bytes, checkpoint_tensors

ROOT = Path(__file__).resolve().parents[2]
LLAMA_70B = json.loads((ROOT / "examples/llama-3-70b/config.json").read_text())
EXAMPLE_MODEL = ROOT / "examples/tiny-llama/model"
GIB = 2**30
CONTEXT = 32768

# Llama-3-70B by hand: hidden 8192, intermediate 28672, 80 layers, 64 heads of 128, 8 KV heads, vocab 128256.
PARAMS_70B = (
    80
    * (
        8192 * 8192  # q
        + 2 * 8192 * 1024  # k, v
        + 8192 * 8192  # o
        + 3 * 8192 * 28672  # gate, up, down
        + 2 * 8192  # two norms
    )
    + 8192  # final norm
    + 2 * 128256 * 8192  # embeddings, lm_head
)
# fp8: one byte per Linear weight, a bf16 scale per output row, everything else bf16.
FP8_70B = (
    80
    * (
        (2 * 8192 * 8192 + 2 * 1024 * 8192 + 3 * 28672 * 8192)
        + 2 * (8192 + 1024 + 1024 + 8192 + 28672 + 28672 + 8192)
        + 2 * 2 * 8192
    )
    + 2 * 2 * 128256 * 8192
    + 2 * 8192
)
KV_32K = 2 * 80 * 8 * 128 * 32768 * 2  # keys and values, 80 layers, 8 KV heads of 128, bf16: 10 GiB
# 2 × parameters × context for the matmuls, 2 × layers × heads × head_dim × context² for attention.
PREFILL_FLOPS_32K = 2 * PARAMS_70B * 32768 + 2 * 80 * 64 * 128 * 32768**2


def test_the_70b_config_reads_as_llama_3_70b() -> None:
    shape = ShapeRecord.from_untrusted(LLAMA_70B)
    assert shape == ShapeRecord(
        architecture="LlamaForCausalLM",
        num_layers=80,
        num_attention_heads=64,
        num_kv_heads=8,
        head_dim=128,
        hidden_size=8192,
        intermediate_size=28672,
        vocab_size=128256,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
    )
    assert PARAMS_70B == 70_553_706_496 == parameters(shape)
    assert FP8_70B == 72_669_806_592 == checkpoint_bytes(LLAMA_70B, "fp8")
    assert KV_32K == 10 * GIB == kv_cache_bytes(shape, CONTEXT, 1)


def test_fp8_70b_needs_two_h100s_and_one_h200_or_mi300x() -> None:
    """~70 GB of FP8 weights plus a 10 GiB KV cache: fits on one H200 or MI300X, needs two H100s."""
    shape = ShapeRecord.from_untrusted(LLAMA_70B)

    h100 = plan_replica(PROFILES["h100"], shape, FP8_70B, "fp8", CONTEXT, 1)
    usable = 0.9 * 80 * GIB  # 72 GiB of 80
    assert FP8_70B + KV_32K == 83_407_224_832 > usable  # TP 1: 77.7 GiB
    per_device = FP8_70B // 2 + KV_32K // 2  # TP 2: 33.8 + 5.0 GiB
    assert per_device <= usable
    assert (h100.tp, h100.devices, h100.fits) == (2, 2, True)
    assert h100.required_per_device_bytes == per_device == 41_703_612_416
    assert h100.kv_room_per_device_bytes == 77_309_411_328 - FP8_70B // 2
    step = per_device / (3350e9 * 0.85)  # 3,350 GB/s, NVLink 4 keeps 0.85 under TP
    assert h100.decode_tokens_per_s == pytest.approx(1 / step) == pytest.approx(68.28, abs=0.01)
    assert h100.decode_tokens_per_s_per_sequence == pytest.approx(1 / step)
    assert h100.ttft_s == pytest.approx(PREFILL_FLOPS_32K / (2 * 1979e12 * 0.85)) == pytest.approx(1.793, abs=1e-3)
    assert h100.prefill_tokens_per_s == pytest.approx(CONTEXT * 2 * 1979e12 * 0.85 / PREFILL_FLOPS_32K)
    assert h100.matmul_dtype == "fp8" and h100.matmul_tflops == 1979
    assert h100.cost_per_mtok == pytest.approx(2.99 * 2 / (68.279 * 3600) * 1e6, rel=1e-4)  # USD 24.33
    assert h100.explanation == (
        "TP 2 of 8 (NVLink 4): 33.8 GiB weights + 5.0 GiB KV per device ≤ 72.0 GiB usable of 80.0 GiB; "
        "TP 1 needs 77.7 GiB; bounds at data-sheet peaks (spec): 3,350 GB/s, 1,979 TFLOP/s fp8"
    )
    assert (h100.basis.decode, h100.basis.prefill, h100.basis.memory, h100.basis.source) == ("spec",) * 3 + (None,)

    # H200's bounds rest on its measured shares: tests/registry/test_fit_measured.py recomputes them.
    h200 = plan_replica(PROFILES["h200"], shape, FP8_70B, "fp8", CONTEXT, 1)
    assert FP8_70B + KV_32K <= 0.9 * 139.8 * GIB  # 77.7 of 125.8 GiB (of 139.8 allocatable)
    assert (h200.tp, h200.fits) == (1, True)

    mi300x = plan_replica(PROFILES["mi300x"], shape, FP8_70B, "fp8", CONTEXT, 1)
    assert (mi300x.tp, mi300x.fits) == (1, True)
    assert mi300x.decode_tokens_per_s == pytest.approx(5300e9 / (FP8_70B + KV_32K)) == pytest.approx(63.54, abs=0.01)
    assert mi300x.ttft_s == pytest.approx(PREFILL_FLOPS_32K / 2615e12) == pytest.approx(2.306, abs=1e-3)
    assert mi300x.cost_per_mtok == pytest.approx(2.49 / (63.544 * 3600) * 1e6, rel=1e-4)  # USD 10.88


def test_bf16_70b_on_tpu_v5e_does_not_fit_in_eight_chips() -> None:
    bf16 = checkpoint_bytes(LLAMA_70B, "bf16")
    assert bf16 == 2 * PARAMS_70B  # every tensor bf16
    plan = plan_replica(PROFILES["tpu-v5e"], ShapeRecord.from_untrusted(LLAMA_70B), bf16, "bf16", CONTEXT, 1)
    # TP 8: 141.1 GB / 8 = 16.4 GiB of weights alone, over 0.9 × 16 GiB.
    assert bf16 / 8 > 0.9 * 16 * GIB
    assert (plan.fits, plan.tp) == (False, 8)
    assert plan.kv_room_per_device_bytes < 0
    assert plan.explanation.startswith(
        "does not fit in 8 devices: TP 8 (ICI) needs 16.4 GiB weights + 1.2 GiB KV per device > 14.4 GiB usable"
    )


def test_concurrency_16_grows_the_replica() -> None:
    """16 sequences of 32K on H100 in FP8: 160 GiB of KV; TP 2 needs 113.8 GiB a device, TP 4 57.0."""
    plan = plan_replica(PROFILES["h100"], ShapeRecord.from_untrusted(LLAMA_70B), FP8_70B, "fp8", CONTEXT, 16)
    assert plan.kv_cache_bytes == 16 * KV_32K
    assert (plan.tp, plan.kv_per_device_bytes) == (4, 16 * KV_32K // 4)
    step = (FP8_70B / 4 + 16 * KV_32K / 4) / (3350e9 * 0.85)
    assert plan.decode_tokens_per_s == pytest.approx(16 / step)
    assert plan.decode_tokens_per_s_per_sequence == pytest.approx(1 / step)


def _shape(heads: int, kv_heads: int, layers: int = 4, head_dim: int = 64) -> ShapeRecord:
    return ShapeRecord(num_layers=layers, num_attention_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)


def test_tp_divides_the_heads() -> None:
    """6 heads: TP 4 and 8 would split heads unevenly, so never tried; too big for TP 2, nothing fits."""
    weights = 200 * GIB
    plan = plan_replica(PROFILES["h100"], _shape(heads=6, kv_heads=2), weights, "bf16", 1024, 1)
    assert (plan.fits, plan.tp) == (False, 2)
    assert "TP 4, 8 not tried (6 heads, 2 KV heads)" in plan.explanation
    fits = plan_replica(PROFILES["h100"], _shape(heads=6, kv_heads=6), 100 * GIB, "bf16", 1024, 1)
    assert (fits.fits, fits.tp) == (True, 2)


def test_kv_heads_are_replicated_when_tp_exceeds_them() -> None:
    shape = _shape(heads=8, kv_heads=2, layers=10, head_dim=128)
    plan = plan_replica(PROFILES["h100"], shape, 4 * 60 * GIB, "bf16", 4096, 8)
    kv = 2 * 10 * 2 * 128 * 4096 * 8 * 2
    assert plan.tp == 4 and plan.kv_cache_bytes == kv
    assert plan.kv_per_device_bytes == 2 * 10 * 1 * 128 * 4096 * 8 * 2 == kv // 2  # one KV head each, not kv / 4
    assert "KV heads replicated: 2 over TP 4" in plan.explanation


def test_devices_per_node_and_max_devices_limit_tp() -> None:
    shape = ShapeRecord.from_untrusted(LLAMA_70B)
    pair = parse_profile({**PROFILES["h100"].model_dump(), "name": "h100-pair", "devices_per_node": 2})
    bf16 = 2 * PARAMS_70B
    plan = plan_replica(pair, shape, bf16, "bf16", CONTEXT, 16)
    assert (plan.fits, plan.tp, plan.max_tp) == (False, 2, 2)
    assert plan.explanation.startswith("does not fit in 2 devices: TP 2 (NVLink 4) needs")

    one = plan_replica(PROFILES["h100"], shape, FP8_70B, "fp8", CONTEXT, 1, max_devices=1)
    assert (one.fits, one.tp) == (False, 1)
    assert one.explanation.startswith("does not fit in 1 device: TP 1 needs 67.7 GiB weights + 10.0 GiB KV")
    assert plan_replica(PROFILES["h100"], shape, FP8_70B, "fp8", CONTEXT, 1, max_devices=64).tp == 2


def test_fp8_kv_cache_halves_the_kv_bytes() -> None:
    shape = ShapeRecord.from_untrusted(LLAMA_70B)
    bf16 = plan_replica(PROFILES["h200"], shape, FP8_70B, "fp8", CONTEXT, 8)
    fp8 = plan_replica(PROFILES["h200"], shape, FP8_70B, "fp8", CONTEXT, 8, kv_dtype="fp8")
    assert KV_DTYPES == {"bf16": 2, "fp8": 1}
    assert fp8.kv_cache_bytes * 2 == bf16.kv_cache_bytes == 80 * GIB
    # One H200 holds 125.8 GiB (of the 139.8 GiB a process can allocate): 67.7 + 80 GiB does not fit, 67.7 + 40 does.
    assert (bf16.tp, fp8.tp) == (2, 1)


def test_unknown_kv_dtype_and_bad_inputs_are_refused() -> None:
    shape = ShapeRecord.from_untrusted(LLAMA_70B)
    with pytest.raises(UnknownName, match="known: bf16, fp8"):
        plan_replica(PROFILES["h100"], shape, FP8_70B, "fp8", CONTEXT, 1, kv_dtype="int4")
    bad: list[dict[str, Any]] = [
        {"context": 0},
        {"concurrency": -1},
        {"weights_bytes": -1},
        {"context": True},
        {"concurrency": 1.5},
        {"max_devices": 0},
        {"context": MAX_DIMENSION + 1},
        {"weights_bytes": 2**61},
    ]
    for override in bad:
        args: dict[str, Any] = {"weights_bytes": FP8_70B, "context": CONTEXT, "concurrency": 1} | override
        with pytest.raises(InvalidInput) as err:
            plan_replica(PROFILES["h100"], shape, quant="fp8", **args)
        assert err.value.code == "REPLICA_INPUT_INVALID"
        assert err.value.details["field"] in override


@pytest.mark.parametrize(
    ("quant", "dtype"),
    [
        ("fp8", "fp8"),
        ("fp8-block", "fp8"),
        ("int8-w8a8", "int8"),
        ("bf16", "bf16"),
        ("int8-w8a16", "bf16"),
        ("w4a16-gptq", "bf16"),
        ("w4a16-awq", "bf16"),
        ("int4-rtn", "bf16"),
        ("q4_k_m", "bf16"),
        ("q8_0", "bf16"),
        ("f16", "bf16"),
        ("nvfp4-w4a4", "fp4"),
        ("mxfp4-w4a4", "fp4"),
        ("nvfp4-w4a16", "bf16"),
        ("nvfp4", "bf16"),  # GGUF's: llama.cpp dequantizes
    ],
)
def test_matmul_dtype(quant: str, dtype: str) -> None:
    assert matmul_dtype(quant) == dtype


def test_fp4_runs_natively_only_where_the_device_takes_its_block_format() -> None:
    shape = ShapeRecord.from_untrusted(LLAMA_70B)
    nvfp4, mxfp4 = (checkpoint_bytes(LLAMA_70B, q) for q in ("nvfp4-w4a4", "mxfp4-w4a4"))
    b200 = plan_replica(PROFILES["b200"], shape, nvfp4, "nvfp4-w4a4", 4096, 1)
    assert (b200.matmul_dtype, b200.matmul_tflops) == ("fp4", PROFILES["b200"].tflops.fp4)
    # Hopper serves NVFP4 weight-only (Marlin FP4), MI355X takes MXFP4 only: bf16 matmuls.
    assert plan_replica(PROFILES["h100"], shape, nvfp4, "nvfp4-w4a4", 4096, 1).matmul_dtype == "bf16"
    assert plan_replica(PROFILES["mi355x"], shape, nvfp4, "nvfp4-w4a4", 4096, 1).matmul_dtype == "bf16"
    assert plan_replica(PROFILES["mi355x"], shape, mxfp4, "mxfp4-w4a4", 4096, 1).matmul_dtype == "fp4"


def test_decode_is_the_slower_of_reading_and_computing() -> None:
    """A roofline: one sequence is bandwidth-bound; many short ones are FLOP-bound, at the matmul rate."""
    shape = ShapeRecord.from_untrusted(LLAMA_70B)
    params = parameters(shape)
    assert params is not None
    one = plan_replica(PROFILES["h100"], shape, FP8_70B, "fp8", 4096, 1)
    assert one.decode_tokens_per_s == pytest.approx(
        1 / ((FP8_70B + 2 * 80 * 8 * 128 * 4096 * 2) / (PROFILES["h100"].bandwidth_gbs * 1e9))
    )
    many = plan_replica(PROFILES["h100"], shape, FP8_70B, "fp8", 64, 1024, max_devices=8)
    flops_s = 2 * params * 1024 / (many.tp * 1979e12 * PROFILES["h100"].interconnect.tp_efficiency)
    assert many.decode_tokens_per_s == pytest.approx(1024 / flops_s)
    assert "decode FLOP-bound at 1024 sequences (fp8 matmuls" in many.explanation


def test_an_fp8_kv_cache_artifact_is_sized_with_its_own_kv_type() -> None:
    """A checkpoint with calibrated FP8 KV scales is served with an FP8 cache, whatever the caller assumed."""
    from kiln.placement.fit import kv_dtype_of

    h100, cpu = PROFILES["h100"], PROFILES["cpu"]
    assert kv_dtype_of("fp8-kv8", "bf16", h100) == "fp8" and kv_dtype_of("fp8", "bf16", h100) == "bf16"
    assert kv_dtype_of("fp8", "fp8", h100) == "fp8" and kv_dtype_of("q4_k_m", "bf16", h100) == "bf16"
    assert kv_dtype_of("fp8-kv8", "bf16", cpu) == "bf16"  # no FP8 there: the cache stays what was asked


def test_a100_runs_fp8_matmuls_in_bf16() -> None:
    plan = plan_replica(PROFILES["a100"], ShapeRecord.from_untrusted(LLAMA_70B), FP8_70B, "int8-w8a8", 1024, 1)
    assert (plan.matmul_dtype, plan.matmul_tflops) == ("int8", 624)
    plan = plan_replica(PROFILES["a100"], ShapeRecord.from_untrusted(LLAMA_70B), FP8_70B, "fp8", 1024, 1)
    assert (plan.matmul_dtype, plan.matmul_tflops) == ("bf16", 312)


def test_a_new_sku_gets_plans_without_code_changes() -> None:
    entry = {
        "name": "npu-x",
        "vendor": "acme",
        "family": "rocm",
        "arch": "gfx999",
        "memory_gib": 96,
        "bandwidth_gbs": 4000,
        "tflops": {"bf16": 1000},
        "interconnect": {"name": "AcmeLink", "bandwidth_gbs": 400, "tp_efficiency": 0.5},
        "devices_per_node": 4,
    }
    catalog = builtin_catalog().extended([parse_profile(entry)])
    plan = plan_replica(catalog.get("npu-x"), ShapeRecord.from_untrusted(LLAMA_70B), FP8_70B, "fp8", CONTEXT, 1)
    assert FP8_70B + KV_32K <= 0.9 * 96 * GIB  # 77.7 of 86.4 GiB: one device, no price, no FP8 units
    assert (plan.tp, plan.fits, plan.cost_per_mtok, plan.matmul_dtype) == (1, True, None, "bf16")
    assert plan.decode_tokens_per_s == pytest.approx(4000e9 / (FP8_70B + KV_32K))
    big = plan_replica(catalog.get("npu-x"), ShapeRecord.from_untrusted(LLAMA_70B), 2 * PARAMS_70B, "bf16", CONTEXT, 1)
    assert big.tp == 2 and "(AcmeLink)" in big.explanation
    step = (PARAMS_70B + KV_32K / 2) / (4000e9 * 0.5)
    assert big.decode_tokens_per_s == pytest.approx(1 / step)


MALFORMED: list[Any] = [
    {},
    {"num_hidden_layers": "80", "num_key_value_heads": 8, "head_dim": 128},
    {"num_hidden_layers": True, "num_key_value_heads": 8, "head_dim": 128},
    {"num_hidden_layers": -80, "num_key_value_heads": 8, "head_dim": 128},
    {"num_hidden_layers": 80, "num_key_value_heads": 8, "head_dim": MAX_DIMENSION + 1},
    {"num_hidden_layers": 80.0, "num_key_value_heads": None, "head_dim": [128]},
    {"num_hidden_layers": 10**40, "num_attention_heads": {"a": 1}, "hidden_size": 8192},
    {"num_hidden_layers": 80, "num_attention_heads": 0, "hidden_size": 8192},
    {"num_hidden_layers": 80, "num_attention_heads": 3, "hidden_size": 8192},  # head_dim not whole
    ["num_hidden_layers", 80],
    "config",
    None,
]


@pytest.mark.parametrize("config", MALFORMED)
def test_malformed_configs_are_missing_values_never_a_crash(config: Any) -> None:
    shape = ShapeRecord.from_untrusted(config)
    assert isinstance(shape, str) and "KV cache is not counted" in shape
    plan = plan_replica(PROFILES["h100"], shape, 10 * GIB, "bf16", 4096, 4)
    assert plan.fits and plan.kv_cache_bytes == 0 and plan.ttft_s is None
    assert plan.explanation.endswith(shape)


def test_partial_configs_size_the_kv_cache_but_not_prefill() -> None:
    shape = ShapeRecord.from_untrusted(
        {"num_hidden_layers": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": "big"}
    )
    assert isinstance(shape, ShapeRecord) and shape.num_attention_heads is None and parameters(shape) is None
    plan = plan_replica(PROFILES["h100"], shape, 10 * GIB, "bf16", 4096, 1)
    assert plan.kv_cache_bytes == 2 * 32 * 8 * 128 * 4096 * 2
    assert plan.ttft_s is None and plan.prefill_tokens_per_s is None
    missing = ShapeRecord.from_untrusted({"num_hidden_layers": 32})
    assert missing == "the release's model_config lacks num_key_value_heads, head_dim, so the KV cache is not counted"


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
_KEYS = st.sampled_from(
    ["num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
     "intermediate_size", "vocab_size", "tie_word_embeddings", "n_layer", "n_head"]
)  # fmt: skip
_SIZES = st.integers(min_value=-3, max_value=MAX_DIMENSION + 2) | _JSON


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_KEYS, _SIZES, max_size=10), st.sampled_from(sorted(PROFILES)))
def test_any_config_gives_a_plan(config: dict[str, Any], hardware: str) -> None:
    shape = ShapeRecord.from_untrusted(config)
    plan = plan_replica(PROFILES[hardware], shape, 10**9, "fp8", 2048, 2)
    assert plan.tp >= 1 and plan.decode_tokens_per_s > 0 and math.isfinite(plan.decode_tokens_per_s)
    if isinstance(shape, ShapeRecord) and shape.num_attention_heads is not None:
        assert shape.num_attention_heads % plan.tp == 0
    # 90 % of the memory, or of the measured allocatable memory where the catalog entry has one that is smaller.
    held = min(plan.memory_per_device_bytes, plan.basis.allocatable_bytes or plan.memory_per_device_bytes)
    assert MEMORY_UTILIZATION * held == pytest.approx(plan.usable_per_device_bytes, abs=1)
    assert (plan.basis.memory == "measured") == (held < plan.memory_per_device_bytes)


# --- the footprint against the bundles kiln writes -------------------------------------------------

# Every method of the catalog a plain model is built in (a release's own layout is measured from its release, in
# tests/pipeline/test_frontier_builds.py).
SCHEMES_BUILT = [name for name in SCHEMES if not get_method(name).release_only]


def _rtn_calibration(source: Any, scheme: Any) -> Any:
    """What GPTQ/AWQ hand the quantize stage, with round-to-nearest values in place of calibrated ones:
    the stored layout (values, scales, AWQ's smoothed norms) is the same, and no calibration runs."""
    from kiln.quant.calibrated import CalibratedWeights
    from kiln.quant.rtn import quantizes, weight_scale

    linear = [n for n in source.tensors if quantizes(scheme, n)]
    norms = [n for n in source.tensors if n.endswith("layernorm.weight")] if scheme.method == "awq" else []
    return CalibratedWeights(
        weights={n: source.tensor(n) for n in linear},
        scales={n: weight_scale(source.tensor(n), scheme.weights) for n in linear},
        changed={n: source.tensor(n) * 1.01 for n in norms},
    )


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The example model's hf-bundle for every scheme (round-to-nearest quantization: cheap)."""
    from kiln.formats.hf_model import open_source
    from kiln.quant.catalog import get_scheme
    from kiln.quant.schemes import FP4_FORMATS
    from kiln.quant.store import open_quantized, write_quantized
    from kiln.targets.base import ExportRequest
    from kiln.targets.hf_bundle.export import export

    source = open_source(EXAMPLE_MODEL)
    out: dict[str, Path] = {}
    for name in SCHEMES_BUILT:
        scheme = get_scheme(name)
        root = tmp_path_factory.mktemp(name)
        quantized = None
        if scheme.quantized:
            (root / "q").mkdir()
            calibrated = None
            # llm-compressor's own, seconds here: FP4 (min-max or GPTQ) and a calibrated KV cache.
            if scheme.format in FP4_FORMATS.values() or scheme.kv_cache is not None:
                from kiln.quant.calibrated import calibrate, calibration_samples

                text = (EXAMPLE_MODEL.parent / "heldout.txt").read_text(encoding="utf-8")
                samples = calibration_samples(EXAMPLE_MODEL, text, samples=2, seq_len=64) if scheme.calibrated else []
                calibrated = calibrate(source, scheme, samples, offload_dir=root, compute_dtype="float32")
            elif scheme.calibrated:
                calibrated = _rtn_calibration(source, scheme)
            write_quantized(source, scheme, root / "q", calibrated=calibrated)
            quantized = open_quantized(root / "q", name)
        (root / "bundle").mkdir()
        export(source, ExportRequest(quant=name, out_dir=root / "bundle", quantized=quantized))
        out[name] = root / "bundle"
    return out


@pytest.mark.parametrize("scheme", SCHEMES_BUILT)
def test_footprint_is_exactly_the_bundles_tensor_bytes(scheme: str, bundles: dict[str, Path]) -> None:
    """The estimate equals the SafeTensors data bytes exactly (file size less 8 bytes and the JSON header),
    and names every tensor with the dtype and shape written, in file order."""
    from kiln.formats.safetensors import read_header

    config = json.loads((EXAMPLE_MODEL / "config.json").read_text())
    files = sorted(bundles[scheme].glob("*.safetensors"))
    written: list[tuple[str, str, tuple[int, ...]]] = []
    data = 0
    for f in files:
        infos, _ = read_header(f, f.name)
        written += [(t.name, t.dtype, t.shape) for t in sorted(infos, key=lambda t: t.offset)]
        header = int.from_bytes(f.read_bytes()[:8], "little")
        data += f.stat().st_size - 8 - header
    assert list(checkpoint_tensors(config, scheme)) == written
    assert checkpoint_bytes(config, scheme) == data


def test_footprint_of_the_70b_per_scheme() -> None:
    """int4: half a byte per Linear weight, a bf16 scale per 128 of them, a 2-element int64 shape each."""
    linear = 80 * (2 * 8192 * 8192 + 2 * 1024 * 8192 + 3 * 28672 * 8192)
    bf16_rest = 2 * (80 * 2 * 8192 + 8192 + 2 * 128256 * 8192)
    w4 = linear // 2 + 2 * (linear // 128) + 80 * 7 * 2 * 8 + bf16_rest
    assert checkpoint_bytes(LLAMA_70B, "w4a16-awq") == checkpoint_bytes(LLAMA_70B, "int4-rtn") == w4
    blocks = 80 * (2 * 64 * 64 + 2 * 8 * 64 + 2 * 224 * 64 + 64 * 224)  # 128x128 blocks per Linear
    assert checkpoint_bytes(LLAMA_70B, "fp8-block") == linear + 2 * blocks + bf16_rest
