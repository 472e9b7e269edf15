"""W8A8 bundles through the matmul kernels a GPU serves them with (`eval.native_kernels`), against kiln's
emulation of them. Here, on the CPU, the same path runs with the float32 stand-in kernels; the CUDA
kernels are checked by tests/pipeline/test_device_cuda.py and bench/gpu_check.py on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from eval.native_kernels import NATIVE_SCHEMES, KernelUnavailable, check_kernels, load_native
from formats.hf_model import open_source
from quant.schemes import get_scheme
from quant.store import open_quantized, write_quantized
from targets.base import ExportRequest
from targets.hf_bundle.export import export
from tests.model_factory import make_model

WINDOWS = [list(range(1, 97)), list(range(300, 396))]


def bundle(model_dir: Path, out: Path, scheme: str) -> Path:
    """An hf-bundle of `scheme` written by kiln's quantize stage and export."""
    source = open_source(model_dir)
    (out / "q").mkdir(parents=True)
    write_quantized(source, get_scheme(scheme), out / "q")
    (out / "bundle").mkdir()
    quantized = open_quantized(out / "q", scheme)
    export(source, ExportRequest(quant=scheme, out_dir=out / "bundle", params={}, quantized=quantized))
    return out / "bundle"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Every Linear is whole 128x128 blocks (fp8-block).
    return make_model(tmp_path_factory.mktemp("w8a8") / "model", hidden_size=128, intermediate_size=256, num_kv_heads=4)


@pytest.mark.parametrize("scheme", NATIVE_SCHEMES)
def test_the_stand_in_kernels_reproduce_kiln_s_eval_of_the_bundle(model_dir: Path, tmp_path: Path, scheme: str) -> None:
    check = check_kernels(bundle(model_dir, tmp_path, scheme), WINDOWS, "cpu", "emulated")
    assert check.scheme == scheme and check.kernels == "emulated" and check.kernel == "float32 emulation"
    assert check.linears == 2 * 7  # every quantized Linear of both layers runs the kernel's path
    assert check.windows == 2 and check.tokens == 2 * 95
    # The same quantized weights and activation rounding as compressed-tensors' emulation: bf16 noise only.
    assert check.kl < 1e-3 and check.top1 > 0.9, check


def test_a_kernel_that_runs_wrong_would_show(model_dir: Path, tmp_path: Path) -> None:
    """The check is not vacuous: the same model with one Linear's weights scrambled is far off."""
    import torch

    path = bundle(model_dir, tmp_path, "int8-w8a8")
    model, scheme, _, _ = load_native(path, "cpu", "emulated")
    good = model(input_ids=torch.tensor([WINDOWS[0]])).logits
    layer = model.get_submodule("model.layers.0.mlp.down_proj")
    layer.weight_q.copy_(layer.weight_q.flip(0))
    bad = model(input_ids=torch.tensor([WINDOWS[0]])).logits
    assert scheme == "int8-w8a8" and (good - bad).abs().max() > 0.1


def test_native_kernels_need_cuda_and_other_schemes_are_refused(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(KernelUnavailable, match="CUDA"):
        load_native(bundle(model_dir, tmp_path / "fp8", "fp8"), "cpu", "native")
    with pytest.raises(Exception, match="none of fp8, fp8-block, int8-w8a8"):
        load_native(bundle(model_dir, tmp_path / "w4", "int4-rtn"), "cpu", "emulated")
