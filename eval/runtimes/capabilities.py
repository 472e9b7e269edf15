"""What vLLM can run on this machine's CPU, decided from what the CPU and the installed libraries
advertise, never from a timing.

The verdict (`VllmCapabilities`) is computed when a build is planned and goes into the params of each
vLLM eval node, so into its cache key: a machine that decides otherwise (another CPU kind, another or
no vLLM environment, AMX forced off) plans other eval stages and never reuses one made under another
verdict. It is stored with the stage (its params are in `stage.json`), and the reason of a bundle it
rules out is the published eval's reason. The vLLM runtime checks, where it runs, that that machine
decides the same (`EVAL_CAPABILITY_MISMATCH` otherwise).

What decides, with its sources:
- The CPU's flags (`/proc/cpuinfo`, the ones in `DECIDING_FLAGS`).
- Per-channel FP8 W8A8: vLLM runs it through `torch._scaled_mm`. torch's CPU implementation
  (aten/src/ATen/native/Blas.cpp, `_scaled_mm_out_cpu`) hands an FP8 x FP8 matmul to oneDNN only where
  cpuinfo reports AMX-INT8 (`cpuinfo_has_x86_amx_int8`); elsewhere it converts both sides to float32
  and runs its own matmul (`_scaled_mm_out_cpu_emulated`), usable on any CPU. Under the ISA caps the
  vLLM worker sets, oneDNN has no usable FP8 matmul: no primitive at all below AMX
  (AVX512_CORE_BF16), only its reference implementation with AMX (AVX512_CORE_AMX), seen on an Intel
  Xeon with AMX-BF16/INT8 and AVX512-FP16 at 275 ms for a 64x512x512 matmul.
- Int8 W8A8: vLLM's CPU build runs it through oneDNN's int8 GEMM (vllm 0.32.0
  model_executor/kernels/linear/scaled_mm/cpu.py, `CPUInt8ScaledMMLinearKernel`, `onednn_scaled_mm`: s8
  per-token activations x s8 per-channel weights, float32 out), or with AMX in use its AMX kernel
  (`int8_scaled_mm_with_quant`), which accumulates in int32. oneDNN accumulates in int32 with VNNI
  (`vpdpbusd`); without it (seen here as `gemm:jit` on an AMD EPYC with AVX2 only, and at every ISA cap
  down to SSE4.1) it shifts the activations to u8 and multiplies with `vpmaddubsw`, which adds each pair of
  u8 x s8 products in a saturating 16-bit integer (oneDNN's guide, "Nuances of int8 computations"): a pair
  of large same-signed products (above 32,767 together) is clipped. Weights of magnitude 64 or less never
  clip (2 x 255 x 64 = 32,640): measured here, a 64x128x256 GEMM is exact with such weights and 15 % off
  (relative) with full-range ones. Only `avx512_vnni` counts as VNNI; a CPU with AVX-VNNI alone
  (`avx_vnni`) is decided as one without, as whether oneDNN takes those kernels under the worker's
  AVX512_CORE_BF16 cap is unchecked.
- AMX: vLLM picks its AMX kernels by `torch.cpu._is_amx_tile_supported()` (cpuinfo's AMX-tile flag).
  A CPU that advertises AMX but faults on it kills a child that runs AMX code with SIGILL
  (`vllm_worker.probe_amx`): the same answer on a machine whatever its load, since only how the child
  ended counts. `KILN_VLLM_AMX` (auto, off, on) overrides.
- The vLLM environment installed (`eval.runtimes.environments`): its digest, vLLM and torch versions.
"""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput, KilnError
from kiln.eval.runtimes import environments
from kiln.eval.runtimes.vllm_worker import AMX_OVERRIDES, amx_decision, probe_amx

# The CPU flags that decide what vLLM's CPU build runs (its kernels, torch's FP8 dispatch, AMX).
DECIDING_FLAGS = (
    "avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16"
)  # fmt: skip
AMX_ENV = "KILN_VLLM_AMX"
PROBE_TIMEOUT_S = 600.0  # a child that imports torch and runs one matmul; far past it, something hangs


class AmxVerdict(BaseModel):
    """Whether vLLM may use AMX here, and why."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    advertised: bool
    used: bool
    reason: str


class Fp8MatmulVerdict(BaseModel):
    """Whether torch's FP8 matmul (what vLLM runs per-channel FP8 W8A8 with on CPU) is usable here, and why."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    usable: bool
    reason: str


class Int8MatmulVerdict(BaseModel):
    """Whether vLLM's int8 W8A8 GEMM here computes its integer products exactly (int32 sums), and why."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    exact: bool
    reason: str


class VllmCapabilities(BaseModel):
    """What vLLM's CPU build can run on this machine: the facts it was decided from and the verdicts."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    environment: str | None  # digest of the installed vLLM environment; None: not installed
    vllm: str | None
    torch: str | None
    cpu_flags: tuple[str, ...]  # those of DECIDING_FLAGS the CPU advertises
    amx: AmxVerdict
    fp8_matmul: Fp8MatmulVerdict
    int8_matmul: Int8MatmulVerdict


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags, from `cpuinfo` (the text of /proc/cpuinfo; read from there when None)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags |= set(value.split())
    return frozenset(flags)


def fp8_matmul_verdict(flags: frozenset[str], torch_version: str | None, amx_used: bool) -> Fp8MatmulVerdict:
    """Whether `torch._scaled_mm` has a usable FP8 matmul on a CPU with `flags` (see the module's sources)."""
    torch = f"torch {torch_version}" if torch_version else "torch"
    if "amx_int8" not in flags:
        return Fp8MatmulVerdict(
            usable=True,
            reason=f"{torch} computes FP8 matmuls in float32 on a CPU without AMX-INT8 (amx_int8 not advertised)",
        )
    onednn = (
        "only its reference FP8 matmul with AMX (far too slow to evaluate with)"
        if amx_used
        else "no FP8 matmul below AMX (AVX512_CORE_BF16, the cap with AMX off)"
    )
    return Fp8MatmulVerdict(
        usable=False, reason=f"{torch} hands FP8 matmuls to oneDNN on a CPU with AMX-INT8, and oneDNN has {onednn}"
    )


def int8_matmul_verdict(flags: frozenset[str], amx_used: bool) -> Int8MatmulVerdict:
    """Whether vLLM's int8 W8A8 GEMM is exact on a CPU with `flags` (see the module's sources)."""
    if amx_used:
        return Int8MatmulVerdict(exact=True, reason="vLLM's AMX int8 GEMM accumulates in int32")
    if "avx512_vnni" in flags:
        return Int8MatmulVerdict(exact=True, reason="oneDNN's int8 GEMM accumulates in int32 with AVX512-VNNI")
    return Int8MatmulVerdict(
        exact=False,
        reason="oneDNN's int8 GEMM adds u8 x s8 product pairs in saturating 16-bit integers on a CPU without "
        "VNNI (avx512_vnni not advertised)",
    )


def decide(
    flags: frozenset[str],
    installed: environments.Installed | None,
    *,
    override: str = "auto",
    probe: int | None = None,
) -> VllmCapabilities:
    """The verdict for a CPU with `flags` and the vLLM environment `installed` (None: not installed);
    `probe`: how the AMX probe's child ended (None: not run), `override`: KILN_VLLM_AMX."""
    advertised = "amx_tile" in flags
    if installed is None:
        amx = AmxVerdict(advertised=advertised, used=False, reason="not decided: vLLM's environment is not installed")
    else:
        used, why = amx_decision(advertised, probe, override)
        amx = AmxVerdict(advertised=advertised, used=used, reason=why)
    torch = None
    if installed is not None and installed.env.torch:
        torch = installed.env.torch.partition("==")[2] or installed.env.torch
    return VllmCapabilities(
        environment=installed.env.digest() if installed is not None else None,
        vllm=installed.record.version if installed is not None else None,
        torch=torch,
        cpu_flags=tuple(f for f in DECIDING_FLAGS if f in flags),
        amx=amx,
        fp8_matmul=fp8_matmul_verdict(flags, torch, amx.used),
        int8_matmul=int8_matmul_verdict(flags, amx.used),
    )


def amx_override() -> str:
    """KILN_VLLM_AMX (auto, off, on); anything else is an error that lists them."""
    value = os.environ.get(AMX_ENV, "auto")
    if value not in AMX_OVERRIDES:
        raise InvalidInput(
            f"{AMX_ENV}={value!r}; known: {', '.join(AMX_OVERRIDES)}", details={"known": list(AMX_OVERRIDES)}
        )
    return value


def vllm_capabilities() -> VllmCapabilities:
    """This machine's verdict (computed once per process for its CPU, environment and override)."""
    installed = environments.find("vllm")
    python = str(installed.python) if installed is not None else None
    digest = installed.env.digest() if installed is not None else None
    return _capabilities(cpu_flags(), python, digest, amx_override())


@functools.cache
def _capabilities(flags: frozenset[str], python: str | None, digest: str | None, override: str) -> VllmCapabilities:
    installed = environments.find("vllm")
    probe = None
    if installed is not None and "amx_tile" in flags and override == "auto":
        try:
            probe = probe_amx(str(installed.python), timeout=PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise KilnError(
                f"the AMX probe (a bf16 matmul in {installed.python}) did not end in {PROBE_TIMEOUT_S:.0f} s; "
                f"set {AMX_ENV}=on or off to decide without it",
                code=Codes.RUNTIME_PROBE_TIMEOUT,
                details={"probe": "amx", "timeout_s": PROBE_TIMEOUT_S},
            ) from None
    return decide(flags, installed, override=override, probe=probe)
