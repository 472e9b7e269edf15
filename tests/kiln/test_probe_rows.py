"""The probe on a device slower than its sizes expect: large-M GEMMs cut to fit a step's bound, and a type with
no fast kernel (a share under 0.001 of the peak) recorded as measured, not refused."""

from __future__ import annotations

from kiln.core.device import resolve_device
from kiln.core.hardware import FRACTION, builtin_catalog
from kiln.probe import MIB, ProbeReading, ProbeRun, Sizes, efficiency, measure

TINY = dict(read_bytes=8 * MIB, decode_bytes=4 * MIB, decode_dim=256, large_m=256, small_m=16,
            shapes=((256, 256),), warmup=1, repeats=3)  # fmt: skip


def _readings(sizes: Sizes) -> dict[str, ProbeReading]:
    run = measure(resolve_device("cpu"), builtin_catalog().get("cpu"), sizes)
    return {r.key: r for r in run.readings}


def test_a_step_past_the_bound_is_measured_at_fewer_rows() -> None:
    # A bound no step meets: every large-M GEMM is cut to the small M, and its rate counts the rows it ran.
    cut = _readings(Sizes(**TINY, step_s=1e-9))  # type: ignore[arg-type]
    for key in ("matmul.bf16", "matmul.int8"):
        assert "M=16 (cut from 256: a step at 256 passes 1e-09 s)" in cut[key].what, cut[key].what
    assert "cut" not in cut["matmul_small_m.bf16"].what and "M=16," in cut["matmul_small_m.bf16"].what
    # No bound (as on CUDA), or one every step meets: the rows asked for.
    for bound in (None, 60.0):
        whole = _readings(Sizes(**TINY, step_s=bound))  # type: ignore[arg-type]
        assert "M=256, K×N 256×256" in whole["matmul.int8"].what and "cut" not in whole["matmul.bf16"].what


def _run(**medians: float) -> ProbeRun:
    units = {"memory_read": "GB/s", "matmul.int8": "TOP/s"}
    return ProbeRun(
        device="cpu", device_name="x", runtime="torch", timer="wall clock", measured_on="2026-11-27", seconds=1,
        readings=tuple(ProbeReading(key=k, what="w", unit=units.get(k, "TFLOP/s"), median=v, best=v, repeats=3)
                       for k, v in medians.items()),
    )  # fmt: skip


def test_a_type_with_no_fast_kernel_is_a_measured_share() -> None:
    cpu = builtin_catalog().get("cpu")  # 50 GB/s, 2 TFLOP/s bf16, 4 TOP/s int8
    # INT8 through a scalar fallback: 3.3 GOP/s, 0.000825 of the socket's peak, beside a bf16 GEMM at its usual share.
    record, _, problems = efficiency(_run(memory_read=20, **{"matmul.bf16": 0.4, "matmul.int8": 0.0033}), cpu)
    assert problems == [] and record is not None
    assert record.matmul.int8 == 0.000825 and record.matmul.bf16 == 0.2
    # Out of any device's range, below or above: left out and named, so the run is not published as a whole.
    for int8 in (FRACTION[0] * 4 / 10, FRACTION[1] * 4 * 10):
        record, _, problems = efficiency(_run(memory_read=20, **{"matmul.int8": int8}), cpu)
        assert record is not None and record.matmul.int8 is None
        [problem] = problems
        assert problem.startswith("matmul.int8: ") and "correct the entry's peak" in problem
