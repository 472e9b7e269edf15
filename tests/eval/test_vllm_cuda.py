"""vLLM's CUDA build per GPU generation: what it cannot run (not evaluated, with the reason) and what it runs
through a stand-in kernel (evaluated, the stand-in named), as data read at vLLM 0.32.0's source, checked
against the hardware catalog's own facts. No GPU here: the worker on GPUs is stood in for where a test
needs one; its real `hello` is asked on this CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kiln.core.device import Device
from kiln.core.errors import Deferred
from kiln.core.evals import RUNTIME_VERSION_MAX_LENGTH, RUNTIME_VERSION_PATTERN
from kiln.core.hardware import builtin_catalog
from kiln.eval.runtimes import environments, vllm_runtime
from kiln.eval.runtimes.environments import find, get_environment
from kiln.eval.runtimes.vllm_runtime import VllmRuntime, cuda_version, shared_worker
from kiln.eval.runtimes.vllm_support import CUDA_KERNELS, WeightScheme, cuda_verdict
from tests.eval.conftest import installed

FP8 = WeightScheme("float", 8, "channel", True)
FP8_BLOCK = WeightScheme("float", 8, "block", True)
FP8_A16 = WeightScheme("float", 8, "channel", False)
INT8 = WeightScheme("int", 8, "channel", True)
INT4 = WeightScheme("int", 4, "group", False, 128)
NVFP4 = WeightScheme("float", 4, "tensor_group", True, 16)
NVFP4_A16 = WeightScheme("float", 4, "tensor_group", False, 16)
MXFP4 = WeightScheme("float", 4, "group", True, 32)
ALL = (FP8, FP8_BLOCK, FP8_A16, INT8, INT4, NVFP4, NVFP4_A16, MXFP4)
HELLO = {"vllm": "0.32.0", "build": "vllm", "torch": "2.13.0+cu130", "prompt_logprobs": "engine arrays"}


def test_every_scheme_a_bundle_holds_has_its_cuda_row() -> None:
    """Every quantized method of the catalog, as a bundle's config states it, and the schemes above."""
    from kiln.quant.catalog import METHODS
    from kiln.quant.compressed import quantization_config

    stated = [
        WeightScheme.from_group(group)
        for method in METHODS.values()
        if method.scheme.quantized
        for group in quantization_config(method.scheme)["config_groups"].values()
    ]
    assert len(stated) >= 10
    for scheme in (*stated, *ALL):
        assert any(k.matches(scheme) for k in CUDA_KERNELS), scheme


@pytest.mark.parametrize(
    ("scheme", "sm", "cannot", "fallback"),
    [
        (FP8, 90, None, None),
        (FP8, 89, None, None),
        (FP8, 86, None, "FP8 weight-only"),
        (FP8_BLOCK, 80, None, "FP8 weight-only"),
        (FP8_A16, 80, None, None),
        (INT8, 80, None, None),
        (INT4, 80, None, None),
        (NVFP4, 100, None, None),
        (NVFP4, 120, None, None),
        (NVFP4, 90, None, "NVFP4 weight-only"),
        (NVFP4_A16, 90, None, None),
        (MXFP4, 100, None, None),
        (MXFP4, 90, None, "MXFP4 weight-only"),
        (FP8, 75, "bfloat16", None),
        (INT4, 70, "bfloat16", None),
    ],
)
def test_a_scheme_on_a_gpu_generation_runs_natively_through_a_stand_in_or_not(
    scheme: WeightScheme, sm: int, cannot: str | None, fallback: str | None
) -> None:
    verdict = cuda_verdict([scheme], sm)
    if cannot is None:
        assert verdict.cannot is None
    else:
        assert verdict.cannot is not None and cannot in verdict.cannot and f"sm{sm}" in verdict.cannot
    if fallback is None:
        assert verdict.fallbacks == ()
    else:
        assert len(verdict.fallbacks) == 1 and verdict.fallbacks[0].startswith(fallback)


def test_an_fp8_kv_cache_needs_sm89() -> None:
    assert cuda_verdict([FP8], 90, fp8_kv_cache=True).cannot is None
    assert cuda_verdict([FP8], 89, fp8_kv_cache=True).cannot is None
    why = cuda_verdict([FP8], 86, fp8_kv_cache=True).cannot
    assert why is not None and "FP8 KV cache" in why and "sm86" in why


def test_the_cuda_table_agrees_with_the_hardware_catalog() -> None:
    """Where the catalog says a GPU has NVFP4 or FP8 matmul units, vLLM runs those bundles natively there, and
    where it says it has none, vLLM runs them through a stand-in (or not at all): one set of facts."""
    nvidia = [p for p in builtin_catalog().profiles.values() if p.family == "cuda"]
    assert nvidia
    for profile in nvidia:
        sm = profile.compute_capability
        assert sm is not None
        fp4_native = cuda_verdict([NVFP4], sm).fallbacks == () and cuda_verdict([NVFP4], sm).cannot is None
        assert fp4_native == ("nvfp4" in profile.fp4), profile.name
        fp8_native = cuda_verdict([FP8], sm).fallbacks == () and cuda_verdict([FP8], sm).cannot is None
        assert fp8_native == (profile.fp8 is not None), profile.name


def test_the_runtime_version_stays_within_the_registrys_column_with_eight_gpus_and_a_stand_in() -> None:
    version = cuda_version(HELLO, 8, ["NVIDIA A100-SXM4-80GB"] * 8, 80, cuda_verdict([FP8], 80).fallbacks)
    assert version.endswith(
        "tensor parallel 8 on 8 x NVIDIA A100-SXM4-80GB (sm80), FP8 weight-only (Marlin W8A16, below sm89)"
    )
    assert len(version) <= RUNTIME_VERSION_MAX_LENGTH
    import re

    assert re.fullmatch(RUNTIME_VERSION_PATTERN, version)
    for kernels in CUDA_KERNELS:
        assert not kernels.fallback or re.fullmatch(RUNTIME_VERSION_PATTERN, kernels.fallback)


class _GpuWorker:
    """vLLM's worker on GPUs of one compute capability, as its replies read (no GPU here)."""

    def __init__(self, sm: int | None) -> None:
        self.hello = {**HELLO, "cuda_sm": sm}
        self.loads: list[dict[str, Any]] = []

    def request(self, req: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        self.loads.append(req)
        return {"ok": True, "vocab": 512, "load_s": 1.0, "gpus": ["NVIDIA A100-SXM4-80GB"]}, b""


@pytest.fixture
def on_gpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    monkeypatch.setattr(vllm_runtime, "resolve_device", lambda device: Device("cuda"))
    monkeypatch.setattr(vllm_runtime, "visible_gpus", lambda device: ["0"])
    env = get_environment("vllm-cuda")
    monkeypatch.setattr(environments, "find", lambda name: installed(env, tmp_path / "env"))

    def with_worker(sm: int | None) -> _GpuWorker:
        worker = _GpuWorker(sm)
        monkeypatch.setattr(vllm_runtime, "shared_worker", lambda *a, **k: worker)
        return worker

    return with_worker


def _bundle(tmp_path: Path, group: dict[str, Any], kv: bool = False) -> Path:
    import json

    quant: dict[str, Any] = {"config_groups": {"group_0": group}}
    if kv:
        quant["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor"}
    out = tmp_path / "bundle"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"num_attention_heads": 4, "quantization_config": quant}))
    return out


FP8_GROUP = {
    "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
}


def test_on_an_ampere_gpu_an_fp8_bundle_is_evaluated_weight_only_and_says_so(on_gpus: Any, tmp_path: Path) -> None:
    worker = on_gpus(80)
    rt = VllmRuntime(_bundle(tmp_path, FP8_GROUP), device="cuda")
    assert worker.loads and worker.loads[0]["dtype"] == "bfloat16"
    assert rt.version.endswith("(sm80), FP8 weight-only (Marlin W8A16, below sm89)")


def test_on_an_ampere_gpu_an_fp8_kv_cache_is_not_evaluated_with_the_reason(on_gpus: Any, tmp_path: Path) -> None:
    worker = on_gpus(80)
    with pytest.raises(Deferred) as e:
        VllmRuntime(_bundle(tmp_path, FP8_GROUP, kv=True), device="cuda")
    assert "FP8 KV cache" in e.value.message and "sm80" in e.value.message
    assert e.value.details["runtime_needed"] == "vllm-cuda"
    assert worker.loads == []  # refused before vLLM loads anything


def test_a_worker_that_sees_no_cuda_gpu_is_an_error_not_a_cpu_eval(on_gpus: Any, tmp_path: Path) -> None:
    on_gpus(None)
    from kiln.core.errors import StageFailed

    with pytest.raises(StageFailed) as e:
        VllmRuntime(_bundle(tmp_path, FP8_GROUP), device="cuda")
    assert e.value.code == "EVAL_RUNTIME_LOAD_FAILED"


def test_the_real_worker_on_this_cpu_reports_no_cuda_capability() -> None:
    installed = find("vllm")
    if installed is None:
        pytest.fail("vLLM's environment is not installed: `kiln runtime install vllm` (make test runs it)")
    from kiln.eval.runtimes.capabilities import vllm_capabilities

    assert shared_worker(installed.python, amx=vllm_capabilities().amx.used).hello["cuda_sm"] is None
