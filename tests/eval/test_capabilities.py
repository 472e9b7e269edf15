"""What vLLM can run on this CPU is decided from the CPU's flags and the installed libraries, never from a
timing: the same on a loaded machine as on a quiet one, planned into the eval stage's key, and checked
where the eval runs."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kiln.core.errors import InvalidInput, StageFailed
from kiln.eval.runtimes import capabilities
from kiln.eval.runtimes.capabilities import VllmCapabilities, cpu_flags, decide, vllm_capabilities
from kiln.eval.runtimes.environments import get_environment
from kiln.eval.runtimes.vllm_runtime import VllmRuntime
from kiln.eval.runtimes.vllm_support import WeightScheme, cpu_limitation
from kiln.pipeline.build import plan
from kiln.pipeline.recipe import load_recipe
from kiln.pipeline.stage import Node
from kiln.pipeline.store import WorkDir
from tests.eval.conftest import installed
from tests.model_factory import make_model

# The flags lines of the machine kinds the builds run on (trimmed to what matters, order as the kernel prints).
EPYC_AVX2 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx f16c avx2 fma bmi2\n"
EPYC_AVX512 = "flags\t\t: fpu sse2 avx avx2 fma avx512f avx512dq avx512_bf16 avx512_vnni\n"
XEON_AMX = "flags\t\t: fpu sse2 avx avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8 avx512_vnni\n"
INSTALLED = installed(get_environment("vllm"), Path("/opt/vllm-env"))
FP8 = [WeightScheme("float", 8, "channel", True)]
BLOCK_FP8 = [WeightScheme("float", 8, "block", True)]
HELLO = {"vllm": "0.32.0", "kernels": {"cpu_gemm_wna16": True}}


@contextlib.contextmanager
def busy_cpus(n: int = 3) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`n` processes spinning on the CPUs for the length of the block: a shared build machine under load."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(1.0)  # running, not starting
        yield spinners
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def test_cpu_flags_are_read_from_cpuinfo() -> None:
    assert {"avx2", "fma"} <= cpu_flags(EPYC_AVX2) and "avx512f" not in cpu_flags(EPYC_AVX2)
    assert cpu_flags("Features\t: fp asimd bf16\n") == {"fp", "asimd", "bf16"}  # Arm spells it Features
    assert "flags" not in cpu_flags(XEON_AMX) and "amx_int8" in cpu_flags(XEON_AMX)


def test_the_verdict_per_cpu_kind() -> None:
    # AMD EPYC, AVX2 only and AVX-512: torch computes FP8 matmuls in float32 (no AMX-INT8): usable.
    for kind in (EPYC_AVX2, EPYC_AVX512):
        verdict = decide(cpu_flags(kind), INSTALLED)
        assert verdict.fp8_matmul.usable and "amx_int8 not advertised" in verdict.fp8_matmul.reason
        assert verdict.amx.used is False and verdict.amx.reason == "this CPU does not advertise AMX tiles"
        assert cpu_limitation(FP8, verdict, HELLO) is None
        assert "AMX" in (cpu_limitation(BLOCK_FP8, verdict, HELLO) or "")
    assert decide(cpu_flags(EPYC_AVX2), INSTALLED).cpu_flags == ("avx2",)
    # Int8 W8A8: oneDNN's int8 GEMM clips 16-bit pair sums without VNNI (the AVX2 EPYC), not with it.
    epyc_avx2 = decide(cpu_flags(EPYC_AVX2), INSTALLED).int8_matmul
    assert not epyc_avx2.exact and "saturating 16-bit" in epyc_avx2.reason and "avx512_vnni" in epyc_avx2.reason
    assert decide(cpu_flags(EPYC_AVX512), INSTALLED).int8_matmul.exact
    assert "avx512_vnni" in decide(cpu_flags(EPYC_AVX512), INSTALLED).cpu_flags
    # Intel Xeon whose AMX runs: block FP8 runs (AMX), per-channel FP8 does not (oneDNN's reference matmul).
    xeon = decide(cpu_flags(XEON_AMX), INSTALLED, probe=0)
    assert xeon.amx.used and cpu_limitation(BLOCK_FP8, xeon, HELLO) is None
    assert xeon.int8_matmul.exact and "AMX" in xeon.int8_matmul.reason
    why = cpu_limitation(FP8, xeon, HELLO)
    assert why is not None and "FP8 W8A8" in why and "torch 2.13.0 hands FP8 matmuls to oneDNN" in why
    assert "reference FP8 matmul" in why
    # One that advertises AMX but faults on it: neither.
    faulting = decide(cpu_flags(XEON_AMX), INSTALLED, probe=-signal.SIGILL)
    assert not faulting.amx.used and "SIGILL" in faulting.amx.reason
    assert not faulting.fp8_matmul.usable and "no FP8 matmul below AMX" in faulting.fp8_matmul.reason
    assert cpu_limitation(BLOCK_FP8, faulting, HELLO) is not None
    # Forced off: decided without the probe.
    assert not decide(cpu_flags(XEON_AMX), INSTALLED, override="off").amx.used
    # No vLLM environment: nothing about it is decided, and the verdict says so (another key).
    absent = decide(cpu_flags(EPYC_AVX2), None)
    assert absent.environment is None and absent != decide(cpu_flags(EPYC_AVX2), INSTALLED)


def test_an_unknown_amx_override_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_VLLM_AMX", "maybe")
    with pytest.raises(InvalidInput, match="auto, off, on"):
        vllm_capabilities()


def test_the_verdict_is_the_same_on_a_loaded_machine() -> None:
    capabilities._capabilities.cache_clear()
    quiet = vllm_capabilities()
    with busy_cpus() as spinners:
        for _ in range(3):
            capabilities._capabilities.cache_clear()
            assert vllm_capabilities() == quiet
        assert all(p.poll() is None for p in spinners)  # the load was there throughout


# --- the verdict in the plan: the eval stage's key -------------------------------------------------------


def _recipe(tmp_path: Path) -> Path:
    make_model(tmp_path / "model", hidden_size=128, num_kv_heads=4)
    (tmp_path / "heldout.txt").write_text(Path(capabilities.__file__).read_text())
    recipe = {
        "model": "m",
        "version": "1",
        "source": "model",
        "eval": {"text": "heldout.txt"},
        "targets": [
            {"target": "hf-bundle", "quants": ["bf16", "fp8"]},
            {
                "target": "rocm-bundle",
                "quants": ["fp8"],
                "params": {"gfx_arch": "gfx942", "fp8_dtype": "e4m3fnuz", "vllm": "0.11.2", "rocm": "7.0.2"},
            },
            {"target": "trtllm", "quants": ["fp8"]},
        ],
    }
    (tmp_path / "kiln.yaml").write_text(yaml.safe_dump(recipe))
    return tmp_path / "kiln.yaml"


def _evals(recipe: Path, work: Path) -> dict[str, Node]:
    return {n.id: n for n in plan(load_recipe(recipe), WorkDir(work)) if n.stage.name == "eval"}


def _keys(nodes: dict[str, Node]) -> dict[str, str]:
    inputs = sorted({i for node in nodes.values() for i in node.inputs.values()})
    digests = {node_id: f"{n:064x}" for n, node_id in enumerate(inputs)}
    return {nid: node.cache_key(digests) for nid, node in nodes.items()}


def test_the_verdict_is_in_the_vllm_evals_keys_and_the_same_under_load(tmp_path: Path) -> None:
    recipe = _recipe(tmp_path)
    capabilities._capabilities.cache_clear()
    quiet = _evals(recipe, tmp_path / "work")
    vllm = [nid for nid, n in quiet.items() if n.params["runtime"] == "vllm"]
    assert {"eval/hf-bundle-fp8@vllm", "eval/rocm-bundle-fp8@vllm", "eval/trtllm-fp8@vllm"} <= set(vllm)
    for nid in vllm:  # the verdict the eval is keyed by, recorded in its params (so in its stage.json)
        assert VllmCapabilities.model_validate(quiet[nid].params["capabilities"]) == vllm_capabilities()
    assert all("capabilities" not in n.params for nid, n in quiet.items() if nid not in vllm)
    with busy_cpus():
        capabilities._capabilities.cache_clear()
        loaded = _evals(recipe, tmp_path / "work")
    assert _keys(loaded) == _keys(quiet)


def test_another_verdict_is_another_eval_stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without vLLM's environment its evals are other stages: installing it later evaluates them."""
    recipe = _recipe(tmp_path)
    here = _keys(_evals(recipe, tmp_path / "work"))
    monkeypatch.setenv("KILN_RUNTIMES", str(tmp_path / "no-runtimes"))
    without = _keys(_evals(recipe, tmp_path / "work"))
    for nid in here:
        assert (here[nid] != without[nid]) == nid.endswith("@vllm"), nid


def test_an_eval_planned_under_another_verdict_fails_where_it_runs(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text("{}")
    here = vllm_capabilities()
    other = here.model_copy(update={"cpu_flags": ("avx2", "avx512f", "amx_tile", "amx_int8")})
    with pytest.raises(StageFailed) as e:
        VllmRuntime(bundle, capabilities=other)
    assert e.value.code == "EVAL_CAPABILITY_MISMATCH"
    assert "cpu_flags" in e.value.message and "plan it on the kind of machine that runs it" in e.value.message
