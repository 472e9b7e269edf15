"""FP8 KV cache (`fp8-kv8`): the `fp8` weights unchanged, per-layer K and V scales calibrated by llm-compressor,
`kv_cache_scheme` in the config, and an eval that computes with the FP8-quantized cache."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kiln.eval.runtimes.capabilities import VllmCapabilities
from kiln.eval.runtimes.transformers_runtime import TransformersRuntime
from kiln.eval.runtimes.vllm_support import bundle_schemes, cpu_limitation
from kiln.quant.catalog import get_method
from kiln.quant.rtn import kv_scale_names
from tests.model_factory import make_bundle

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama" / "model"


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kv")
    return {q: make_bundle(EXAMPLE, root / q, q) for q in ("fp8", "fp8-kv8")}


def test_the_method_says_fp8_kv_and_its_scheme_carries_it() -> None:
    method = get_method("fp8-kv8")
    assert method.kv_cache_dtype == "fp8" and method.scheme.kv_cache is not None and method.scheme.calibrated
    assert get_method("fp8").scheme.kv_cache is None
    assert "kv_cache" not in get_method("fp8").scheme.model_dump(mode="json")  # older dumps unchanged


def test_the_bundle_is_fp8_plus_calibrated_kv_scales(bundles: dict[str, Path]) -> None:
    import torch
    from safetensors import safe_open

    def tensors(path: Path) -> dict:
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118

    plain, kv = tensors(bundles["fp8"]), tensors(bundles["fp8-kv8"])
    scales = kv_scale_names(plain)
    assert len(scales) == 2 * 4 and set(kv) == set(plain) | set(scales)
    for name, t in plain.items():  # round-to-nearest weights: byte for byte the fp8 bundle's
        assert t.dtype == kv[name].dtype and bytes(t.view(-1).view(torch.uint8).numpy()) == bytes(
            kv[name].view(-1).view(torch.uint8).numpy()
        ), name
    for name in scales:
        assert kv[name].shape == (1,) and float(kv[name]) > 0, name
    config = json.loads((bundles["fp8-kv8"] / "config.json").read_text())["quantization_config"]
    assert config["kv_cache_scheme"]["num_bits"] == 8 and config["kv_cache_scheme"]["type"] == "float"
    assert config["kv_cache_scheme"]["strategy"] == "tensor" and config["kv_cache_scheme"]["dynamic"] is False


def test_transformers_computes_with_the_fp8_cache(bundles: dict[str, Path]) -> None:
    """Same weights, so what differs is the cache: K and V rounded to FP8 against the calibrated scales."""
    ids = list(range(1, 400, 3))
    plain, kv = TransformersRuntime(bundles["fp8"]).logits(ids), TransformersRuntime(bundles["fp8-kv8"]).logits(ids)
    diff = float(np.abs(plain - kv).max())
    assert 0 < diff < 2.0, diff


def test_vllm_on_a_cpu_without_avx512_says_why_it_cannot(bundles: dict[str, Path]) -> None:
    config = json.loads((bundles["fp8-kv8"] / "config.json").read_text())
    caps = VllmCapabilities.model_validate(
        {
            "environment": None,
            "vllm": "0.32.0",
            "torch": "2.13.0",
            "cpu_flags": ["avx2"],
            "amx": {"advertised": False, "used": False, "reason": "no AMX"},
            "fp8_matmul": {"usable": True, "reason": "emulated"},
            "int8_matmul": {"exact": True, "reason": "VNNI"},
        }
    )
    hello = {"kernels": {}, "head_sizes": None}
    why = cpu_limitation(bundle_schemes(config), caps, hello, None, fp8_kv_cache=True)
    assert why is not None and "FP8 KV cache" in why and "AVX-512" in why
    with_avx512 = caps.model_copy(update={"cpu_flags": ("avx2", "avx512f")})
    assert cpu_limitation(bundle_schemes(config), with_avx512, hello, None, fp8_kv_cache=True) is None
