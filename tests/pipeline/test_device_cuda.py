"""The compute stages on a CUDA device: the same code paths as on the CPU, checked against the CPU's numbers.

Every test here needs a GPU (`-m cuda`); without one they are skipped. `bench/gpu_check.py` runs the
whole example on one and records the comparison.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln.core.device import cuda_device_count
from tests.model_factory import make_model

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(cuda_device_count() == 0, reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("cuda") / "model", hidden_size=128, intermediate_size=256, num_kv_heads=4)


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    from kiln.eval.metrics import MetricAccumulator

    acc = MetricAccumulator()
    acc.add(p_logits, q_logits, np.argmax(p_logits, axis=-1))
    return float(acc.result().kl)


def test_the_transformers_runtime_on_cuda_matches_the_cpu(model_dir: Path) -> None:
    from kiln.eval.runtimes import TransformersRuntime

    ids = list(range(3, 200, 3))
    cpu = TransformersRuntime(model_dir, device="cpu")
    gpu = TransformersRuntime(model_dir, device="cuda:0")
    a, b = cpu.logits(ids), gpu.logits(ids)
    assert b.dtype == np.float32 and b.shape == a.shape
    assert _kl(a, b) < 1e-6 and np.abs(a - b).max() < 1e-2
    assert gpu.greedy([ids[:10]], 8) == cpu.greedy([ids[:10]], 8)


def test_gptq_calibrates_on_the_gpu_one_layer_at_a_time(model_dir: Path, tmp_path: Path) -> None:
    import torch

    from kiln.formats.hf_model import open_source
    from kiln.quant.calibrated import calibrate
    from kiln.quant.catalog import get_scheme

    source = open_source(model_dir)
    samples = [list(range(1 + i, 65 + i)) for i in range(4)]
    torch.cuda.reset_peak_memory_stats()
    on_gpu = calibrate(source, get_scheme("w4a16-gptq"), samples, offload_dir=tmp_path, device="cuda:0")
    on_cpu = calibrate(source, get_scheme("w4a16-gptq"), samples, offload_dir=tmp_path, device="cpu")
    assert torch.cuda.max_memory_allocated() > 0  # it computed there
    assert set(on_gpu.scales) == set(on_cpu.scales)
    for name in on_gpu.scales:
        gpu_scale, cpu_scale = on_gpu.scales[name], on_cpu.scales[name]
        assert gpu_scale.device.type == "cpu"  # read back to the host for the store
        assert torch.allclose(gpu_scale.float(), cpu_scale.float(), rtol=0.05, atol=1e-4)


def test_the_jax_runtime_computes_on_the_gpu_it_is_given(tmp_path: Path, model_dir: Path) -> None:
    pytest.importorskip("jax")
    from kiln.formats.hf_model import open_source
    from kiln.targets.base import ExportRequest, get_target

    spec = get_target("orbax")
    art = tmp_path / "orbax"
    art.mkdir()
    spec.export(open_source(model_dir), ExportRequest(quant="bf16", out_dir=art, params={}))
    from kiln.eval.runtimes import JaxRuntime

    ids = list(range(3, 100, 3))
    gpu = JaxRuntime(art, device="cuda:0")
    cpu = JaxRuntime(art, device="cpu")
    assert gpu.platform == "gpu" and "on gpu" in gpu.version and cpu.platform == "cpu"
    assert _kl(cpu.logits(ids), gpu.logits(ids)) < 1e-5


def test_w8a8_bundles_through_tensor_core_kernels_agree_with_the_emulation(model_dir: Path, tmp_path: Path) -> None:
    import torch

    from kiln.eval.native_kernels import KernelUnavailable, check_kernels
    from tests.eval.test_native_kernels import bundle

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need sm89+")
    windows = [list(range(1, 129)), list(range(200, 328))]
    for scheme in ("fp8", "int8-w8a8", "fp8-block"):
        try:
            check = check_kernels(bundle(model_dir, tmp_path / scheme, scheme), windows, "cuda:0", "native")
        except KernelUnavailable:
            assert scheme == "fp8-block"  # block-scaled matmuls need a recent cuBLAS; reported, not failed
            continue
        assert check.kernels == "native" and check.linears == 14, scheme
        assert check.kl < 1e-3 and check.top1 > 0.95, (scheme, check)
