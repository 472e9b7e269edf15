"""W8A8 bundles through the matmul kernels a GPU serves them with (`eval.native_kernels`), against kiln's
emulation of them and the float32 reference. Here, on the CPU, the same path runs with the float32
stand-in kernels, and the block-FP8 scale layout is checked against torch's own shape checks for
`scaled_mm` (its meta kernel); the CUDA kernels are checked by bench/gpu_check.py on a GPU."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from kiln.eval.metrics import MetricAccumulator
from kiln.eval.native_kernels import (
    BLOCK,
    E4M3_MAX,
    NATIVE_SCHEMES,
    KernelUnavailable,
    _blocks_emulated,
    _quantize_rows,
    block_scales,
    check_kernels,
    load_native,
)
from kiln.eval.runtimes.transformers_runtime import TransformersRuntime
from kiln.formats.hf_model import open_source
from kiln.quant.catalog import get_scheme
from kiln.quant.store import open_quantized, write_quantized
from kiln.targets.base import ExportRequest
from kiln.targets.hf_bundle.export import export
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


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> TransformersRuntime:
    """As the reference stage computes it: the source model in float32."""
    return TransformersRuntime(model_dir, dtype="float32", device="cpu")


@pytest.mark.parametrize("scheme", NATIVE_SCHEMES)
def test_the_stand_in_kernels_measure_what_kiln_s_eval_of_the_bundle_measures(
    model_dir: Path, tmp_path: Path, reference: TransformersRuntime, scheme: str
) -> None:
    path = bundle(model_dir, tmp_path, scheme)
    check = check_kernels(path, WINDOWS, "cpu", reference, "emulated")
    assert check.scheme == scheme and check.kernels == "emulated" and check.kernel == "float32 emulation"
    assert check.out_dtype == "float32"
    assert check.linears == 2 * 7  # every quantized Linear of both layers runs the kernel's path
    assert check.windows == 2 and check.tokens == 2 * 95
    # kernels="emulated": the candidate is the emulation, so the kernels' own difference is nil.
    assert check.kl_native_vs_emulated == 0 and check.top1_native_vs_emulated == 1 and check.max_abs_diff == 0
    assert check.kl_native_vs_reference == check.kl_emulated_vs_reference > 0 and check.kl_relative_difference == 0
    # The emulation is the bundle as kiln's eval runtime (transformers + compressed-tensors, float32) scores it:
    # logits apart by a small fraction of the quantization's own KL (float32 summation order; int8
    # activations a rounding step apart at a few ties), and the same KL against the reference.
    evaluated = TransformersRuntime(path, device="cpu")
    model, _, _, _ = load_native(path, "cpu", "emulated")
    eval_acc, direct = MetricAccumulator(), MetricAccumulator()
    try:
        for ids in WINDOWS:
            import torch

            ours = model(input_ids=torch.tensor([ids])).logits[0].detach().numpy()
            theirs = evaluated.logits(ids)
            eval_acc.add(reference.logits(ids)[:-1], theirs[:-1], ids[1:])
            direct.add(theirs[:-1], ours[:-1], ids[1:])
    finally:
        evaluated.close()
    measured = eval_acc.result().kl
    # int8: compressed-tensors scales activations by absmax / 127.5, the kernels (vLLM's too) by absmax / 127.
    # The two roundings differ about as much as either differs from the reference: the same order only.
    tolerance = 1.0 if scheme == "int8-w8a8" else 0.02
    assert direct.result().kl < tolerance * measured and direct.result().top1 > 0.95, (direct.result(), measured)
    assert abs(check.kl_emulated_vs_reference - measured) < tolerance * measured, (check, measured)


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


@pytest.mark.parametrize(("m", "k", "n"), [(32, 128, 128), (48, 256, 384), (32, 384, 256), (64, 640, 128)])
def test_block_scales_have_the_layout_torch_s_scaled_mm_checks_for(m: int, k: int, n: int) -> None:
    """The prepared BlockWise1x128 x BlockWise128x128 scales pass torch's own shape and stride checks
    (the meta kernel of `scaled_mm`, which checks as for CUDA), where the scales as stored do not; and the
    emulation that reads them computes the block-dequantized product."""
    import torch
    from torch.nn.functional import ScalingType, scaled_mm  # type: ignore[attr-defined]

    g = torch.Generator().manual_seed(k + n)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / 16
    xq, xs = _quantize_rows(x, k // BLOCK, E4M3_MAX, torch.float8_e4m3fn)
    ws = (w.abs().unflatten(1, (-1, BLOCK)).unflatten(0, (-1, BLOCK)).amax(dim=(1, 3)) / E4M3_MAX).float()
    full = ws.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    wq = (w / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    sa, sb = block_scales(xs, ws, k)

    def meta(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    a, b = meta(xq), meta(wq).t()
    out = scaled_mm(a, b, meta(sa), ScalingType.BlockWise1x128, meta(sb), ScalingType.BlockWise128x128)
    assert out.shape == (m, n)
    assert sb.shape == (-(-k // BLOCK // 4) * 4, n // BLOCK) and sa.shape == (m, k // BLOCK)
    with pytest.raises(RuntimeError, match="blockwise scaling"):  # as stored: [N/128, K/128], row-major
        scaled_mm(a, b, meta(sa), ScalingType.BlockWise1x128, meta(ws), ScalingType.BlockWise128x128)

    want = (xq.float() * xs.repeat_interleave(BLOCK, 1)) @ (wq.float() * full).t()
    got = _blocks_emulated(xq, sa, wq, sb)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_native_kernels_need_cuda_and_other_schemes_are_refused(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(KernelUnavailable, match="CUDA"):
        load_native(bundle(model_dir, tmp_path / "fp8", "fp8"), "cpu", "native")
    with pytest.raises(Exception, match="none of fp8, fp8-block, int8-w8a8"):
        load_native(bundle(model_dir, tmp_path / "w4", "int4-rtn"), "cpu", "emulated")


def test_logits_sources_are_read_as_float32(model_dir: Path, tmp_path: Path) -> None:
    """A reference that hands back float64 or memory-mapped arrays is scored the same."""

    class Stored:
        def __init__(self, inner: TransformersRuntime) -> None:
            self.inner = inner

        def logits(self, token_ids: Sequence[int]) -> np.ndarray:
            return np.asarray(self.inner.logits(token_ids), dtype=np.float64)

    inner = TransformersRuntime(model_dir, dtype="float32", device="cpu")
    path = bundle(model_dir, tmp_path, "fp8")
    a = check_kernels(path, WINDOWS[:1], "cpu", inner, "emulated")
    b = check_kernels(path, WINDOWS[:1], "cpu", Stored(inner), "emulated")
    assert a.kl_emulated_vs_reference == pytest.approx(b.kl_emulated_vs_reference, rel=1e-6)
