"""`kiln hardware probe`: the shares of an SKU's data-sheet peaks this node's device reaches.

The same code measures a CUDA device through torch (timed by CUDA events) or the CPU (timed by the wall clock):

- `memory_read`: a sum over a buffer far larger than any cache (4 GiB on a GPU, 512 MiB on the CPU);
- `decode.<type>`: a decode-like chain, one token (M=1) through square matmuls whose weights are far larger
  than any cache, in bf16 and, on a CUDA device with FP8 units, with FP8 weights through `torch._scaled_mm`
  (row-wise scales): weight bytes read per second;
- `matmul.<type>` and `matmul_small_m.<type>`: GEMMs at large and small M in each type torch runs on the device
  (bf16; INT8 through `torch._int_mm` where it runs; on CUDA FP8 through `torch._scaled_mm`), at Llama-3-70B's
  layer shapes on a GPU and smaller ones on the CPU: FLOP/s;
- `allocatable_gib`: on CUDA the largest single allocation it gets (from `torch.cuda.mem_get_info`'s free
  memory, stepping down), on the CPU /proc/meminfo's MemAvailable.

Each is warmed up, then timed `repeats` times; the share recorded is the median's of the catalog's peak for
the SKU (the best is printed beside). A run is a `ProbeRun` (raw readings, no catalog); `efficiency` turns it
into a catalog entry's `measured` record against that entry's peaks, so a run saved with `--json` can be
published later against a registry's entry. torch is imported only when measuring.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime
from functools import partial
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kiln.core.device import Device, cpu_model
from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput
from kiln.core.hardware import (
    FRACTION,
    MEMORY_GIB,
    DtypeFractions,
    HardwareCatalog,
    HardwareProfile,
    MeasuredEfficiency,
)

GIB = 1024**3
MIB = 1024**2
Unit = Literal["GB/s", "TFLOP/s", "TOP/s"]  # TOP/s: INT8, as the catalog gives its rate
# The keys of a reading, as the catalog's `measured` record names its shares.
READING_KEY = re.compile(r"^(memory_read|(decode|matmul|matmul_small_m)\.(bf16|fp8|int8|fp4))$")


@dataclass(frozen=True)
class Sizes:
    """What one probe moves and multiplies: far past the caches, and within seconds on the device."""

    read_bytes: int  # the buffer the memory read sums
    decode_bytes: int  # the weights of the decode chain, per type
    decode_dim: int  # its square matrices' side
    large_m: int
    small_m: int
    shapes: tuple[tuple[int, int], ...]  # (K, N) of the GEMMs, each run at large and at small M
    warmup: int
    repeats: int
    step_s: float | None = None  # the most one timed GEMM step may take: large M is cut to fit a slow kernel


# On a GPU: Llama-3-70B's layer shapes (q/o 8192², gate/up 8192 × 28672, down 28672 × 8192) at M=8192 (8.8 TFLOP a
# step: about 12 ms on an H200 in bf16) and a decode chain over 2 GiB of weights (under a millisecond a step); the
# tensors' creation and CUDA's start take longer than the timed work. On the CPU: sizes that take seconds on two cores,
# and a second a GEMM step at most: a type the CPU has no fast kernel for (INT8 without VNNI runs at a few GOP/s,
# ten seconds a step at M=1024) is measured at fewer rows, where a kernel that slow runs at the same rate.
CUDA_SIZES = Sizes(4 * GIB, 2 * GIB, 8192, 8192, 64, ((8192, 8192), (8192, 28672), (28672, 8192)), 3, 10)
CPU_SIZES = Sizes(512 * MIB, 256 * MIB, 4096, 1024, 16, ((4096, 4096),), 1, 5, step_s=1.0)


class ProbeReading(BaseModel):
    """One measured rate: its `key` (as the catalog's record names it), how it was taken, its median and best."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str = Field(pattern=READING_KEY.pattern)
    what: str = Field(max_length=200)
    unit: Unit
    median: float = Field(gt=0, allow_inf_nan=False)
    best: float = Field(gt=0, allow_inf_nan=False)
    repeats: int = Field(ge=1)


class ProbeRun(BaseModel):
    """What one probe measured on one device, before any catalog: the readings, what it could not measure and why."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: str = Field(description="cpu or cuda:N")
    device_name: str = Field(max_length=200, description="the GPU's name as torch reports it, or the CPU's model")
    runtime: str = Field(max_length=200, description="torch and CUDA versions, threads on the CPU")
    timer: str
    readings: tuple[ProbeReading, ...]
    skipped: dict[str, str] = Field(default_factory=dict, description="reading key -> why it was not measured")
    allocatable_gib: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    measured_on: str = Field(pattern=r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$")
    seconds: float = Field(ge=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _readable(self) -> ProbeRun:
        # What becomes the catalog record's `source` is printable text (MeasuredEfficiency requires it).
        for field in ("device", "device_name", "runtime", "timer"):
            if not getattr(self, field).isprintable():
                raise ValueError(f"{field} holds a control character")
        try:
            date.fromisoformat(self.measured_on)
        except ValueError:
            raise ValueError(f"measured_on {self.measured_on!r} is not a date (YYYY-MM-DD)") from None
        return self

    def source(self) -> str:
        """The catalog record's `source`: where and how."""
        return (
            f"kiln hardware probe on {self.device_name} ({self.runtime}), median of repeats after warm-up, {self.timer}"
        )


# --- measuring ---------------------------------------------------------------------------------------------


class _Timer:
    """Times a callable on the device: CUDA events on a GPU (queued, then waited for), the wall clock on the CPU."""

    def __init__(self, torch: Any, device: str) -> None:
        self.torch = torch
        self.cuda = device.startswith("cuda")

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def seconds(self, fn: Callable[[], object], warmup: int, repeats: int) -> list[float]:
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(repeats):
            if self.cuda:
                start = self.torch.cuda.Event(enable_timing=True)
                end = self.torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1000)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return times


def _reading(key: str, what: str, unit: Unit, amount: float, times: list[float]) -> ProbeReading:
    """`amount` (bytes or FLOPs) per second at the median and the best of `times`."""
    scale = 1e9 if unit == "GB/s" else 1e12
    return ProbeReading(
        key=key,
        what=what,
        unit=unit,
        median=amount / statistics.median(times) / scale,
        best=amount / min(times) / scale,
        repeats=len(times),
    )


def _fp8_dtype(torch: Any, flavour: str | None) -> Any:
    return torch.float8_e4m3fnuz if flavour == "e4m3fnuz" else torch.float8_e4m3fn


def _scaled(torch: Any, a: Any, b_t: Any, out: Any) -> Any:
    """An FP8 matmul with row-wise scales (one per row of `a`, one per column of `b_t`): what FP8 W8A8 runs."""
    scale_a = torch.ones((a.shape[0], 1), dtype=torch.float32, device=a.device)
    scale_b = torch.ones((1, b_t.shape[1]), dtype=torch.float32, device=a.device)
    return torch._scaled_mm(a, b_t, scale_a=scale_a, scale_b=scale_b, out_dtype=out)


def _mem_available_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GIB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _allocatable_cuda_gib(torch: Any, index: int) -> float:
    """The largest block one allocation gets: the free memory the driver reports, less 256 MiB at a time."""
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(index)
    size = free // (2 * MIB) * (2 * MIB)
    for _ in range(32):
        try:
            block = torch.empty(size, dtype=torch.uint8, device=f"cuda:{index}")
        except torch.OutOfMemoryError:
            size -= 256 * MIB
            continue
        del block
        torch.cuda.empty_cache()
        return float(size / GIB)
    raise RuntimeError(f"no allocation of {size / GIB:.1f} GiB or up to 8 GiB more succeeded")


def device_name(device: Device) -> str:
    """The device's name: the GPU's as torch reports it (what `identify` matches), or the CPU's model."""
    if not device.is_cuda:
        return cpu_model()
    import torch

    return str(torch.cuda.get_device_name(device.index or 0))


class _Kernels:
    """The measurements, each building its own tensors (freed when it returns) on the device."""

    def __init__(self, torch: Any, on: str, sizes: Sizes, fp8: str | None) -> None:
        self.torch = torch
        self.on = on
        self.sizes = sizes
        self.timer = _Timer(torch, on)
        self.f8 = _fp8_dtype(torch, fp8) if fp8 is not None else None

    def time(self, fn: Callable[[], object]) -> list[float]:
        return self.timer.seconds(fn, self.sizes.warmup, self.sizes.repeats)

    def memory_read(self) -> ProbeReading:
        size = self.sizes.read_bytes
        buffer = self.torch.ones(size // 4, dtype=self.torch.float32, device=self.on)
        times = self.time(buffer.sum)
        return _reading("memory_read", f"sum of a {size / MIB:,.0f} MiB float32 buffer", "GB/s", size, times)

    def _weights(self, element: int) -> list[Any]:
        """Square bf16 matrices of `decode_dim`, scaled so a chain through them stays finite, `decode_bytes` in all
        at `element` bytes each."""
        d = self.sizes.decode_dim
        count = max(self.sizes.decode_bytes // (d * d * element), 2)
        return [self.torch.randn(d, d, device=self.on, dtype=self.torch.bfloat16) * d**-0.5 for _ in range(count)]

    def decode_bf16(self) -> ProbeReading:
        torch = self.torch
        weights = self._weights(2)
        x = torch.randn(1, self.sizes.decode_dim, device=self.on, dtype=torch.bfloat16)

        def step() -> object:
            y = x
            for w in weights:
                y = torch.nn.functional.linear(y, w)
            return y

        total = sum(w.numel() * w.element_size() for w in weights)
        d = self.sizes.decode_dim
        what = f"M=1 through {len(weights)} bf16 {d}×{d} weights ({total / MIB:,.0f} MiB)"
        return _reading("decode.bf16", what, "GB/s", total, self.time(step))

    def decode_fp8(self) -> ProbeReading:
        """FP8 weights stored (N, K), so that `.t()` is the column-major operand `_scaled_mm` takes."""
        torch, f8 = self.torch, self.f8
        weights = [w.to(f8) for w in self._weights(1)]
        operands = [w.t() for w in weights]
        d = self.sizes.decode_dim
        m = 1
        try:
            _scaled(torch, torch.zeros(1, d, device=self.on).to(f8), operands[0], torch.bfloat16)
        except RuntimeError:  # a build whose scaled matmul wants M in multiples of 16
            m = 16
        x = torch.randn(m, d, device=self.on, dtype=torch.bfloat16)

        def step() -> object:
            y = x
            for w in operands:
                y = _scaled(torch, y.to(f8), w, torch.bfloat16)
            return y

        total = sum(w.numel() * w.element_size() for w in weights)
        what = f"M={m} through {len(weights)} FP8 {d}×{d} weights ({total / MIB:,.0f} MiB), torch._scaled_mm row-wise"
        return _reading("decode.fp8", what, "GB/s", total, self.time(step))

    def _rows(self, dtype: str, m: int) -> int:
        """`m`, or where the sizes bound a step's seconds and one step at `small_m` rows says a step at `m` would
        take longer, the most rows (a multiple of 16, at least `small_m`) that fit: a kernel that slow is no faster
        at more rows."""
        budget, small = self.sizes.step_s, self.sizes.small_m
        if budget is None or m <= small:
            return m
        step = self._step(dtype, small)
        step()  # the first call pays for the kernel's set-up
        t0 = time.perf_counter()
        step()
        per_row = (time.perf_counter() - t0) / small
        if per_row * m <= budget:
            return m
        return min(m, max(small, int(budget / per_row) // 16 * 16))

    def _step(self, dtype: str, m: int) -> Callable[[], None]:
        """One step: GEMMs of `m` rows over each (K, N) of `shapes`, weights stored (N, K) as a checkpoint
        stores them."""
        torch, on = self.torch, self.on
        runs: list[Callable[[], object]] = []
        for k, n in self.sizes.shapes:
            if dtype == "bf16":
                a = torch.randn(m, k, device=on, dtype=torch.bfloat16)
                w = torch.randn(n, k, device=on, dtype=torch.bfloat16)
                runs.append(partial(torch.nn.functional.linear, a, w))
            elif dtype == "int8":
                a = torch.randint(-8, 8, (m, k), device=on, dtype=torch.int8)
                w = torch.randint(-8, 8, (n, k), device=on, dtype=torch.int8)
                runs.append(partial(torch._int_mm, a, w.t()))
            else:
                a = torch.randn(m, k, device=on).to(self.f8)
                w = torch.randn(n, k, device=on).to(self.f8)
                runs.append(partial(_scaled, torch, a, w.t(), torch.bfloat16))

        def step() -> None:
            for run in runs:
                run()

        return step

    def gemm(self, dtype: str, m: int, key: str) -> ProbeReading:
        """GEMMs of `m` rows (fewer where a step would pass the sizes' bound) in `dtype`: FLOP/s."""
        rows = self._rows(dtype, m)
        cut = f" (cut from {m}: a step at {m} passes {self.sizes.step_s:g} s)" if rows < m else ""
        flops = sum(2 * rows * k * n for k, n in self.sizes.shapes)
        shapes = ", ".join(f"{k}×{n}" for k, n in self.sizes.shapes)
        kernel = {"bf16": "bf16", "int8": "INT8 torch._int_mm", "fp8": "FP8 torch._scaled_mm row-wise"}[dtype]
        unit: Unit = "TOP/s" if dtype == "int8" else "TFLOP/s"
        times = self.time(self._step(dtype, rows))
        return _reading(key, f"{kernel}, M={rows}{cut}, K×N {shapes}", unit, flops, times)


def measure(device: Device, profile: HardwareProfile, sizes: Sizes | None = None) -> ProbeRun:
    """Measure this node's `device` (CPU or CUDA) as an SKU of `profile`: memory read, decode chains and matmuls in
    each type the entry has units for (FP8 in its flavour, on CUDA only), allocatable memory; and why any
    reading could not be taken."""
    import torch

    started = time.perf_counter()
    cuda = device.is_cuda
    sizes = sizes or (CUDA_SIZES if cuda else CPU_SIZES)
    name = device_name(device)
    if cuda:
        torch.cuda.set_device(device.index or 0)
        runtime = f"torch {torch.__version__}, CUDA {torch.version.cuda or torch.version.hip}"
        how = "timed by CUDA events"
    else:
        runtime = f"torch {torch.__version__}, {torch.get_num_threads()} threads"
        how = "timed by the wall clock"
    kernels = _Kernels(torch, device.torch, sizes, profile.fp8 if cuda else None)
    readings: list[ProbeReading] = []
    skipped: dict[str, str] = {}

    def attempt(key: str, run: Callable[[], ProbeReading]) -> None:
        """One reading, or why not (a kernel this torch build or device lacks, or memory it lacks)."""
        try:
            readings.append(run())
        except (RuntimeError, TypeError, ValueError, NotImplementedError, AttributeError) as e:
            first = str(e).splitlines()[0][:200] if str(e) else ""
            skipped[key] = f"{type(e).__name__}: {first}"
        finally:
            if cuda:
                torch.cuda.empty_cache()

    attempt("memory_read", kernels.memory_read)
    attempt("decode.bf16", kernels.decode_bf16)
    types = ["bf16"]
    if profile.fp8 is None:
        skipped["matmul.fp8"] = f"{profile.name} has no FP8 units"
    elif not cuda:
        skipped["matmul.fp8"] = "FP8 matmuls are measured on CUDA devices only"
    else:
        attempt("decode.fp8", kernels.decode_fp8)
        types.append("fp8")
    if profile.tflops.int8 is None:
        skipped["matmul.int8"] = f"{profile.name} has no INT8 rate"
    else:
        types.append("int8")
    for dtype in types:
        for key, m in ((f"matmul.{dtype}", sizes.large_m), (f"matmul_small_m.{dtype}", sizes.small_m)):
            attempt(key, partial(kernels.gemm, dtype, m, key))
    allocatable: float | None
    if cuda:
        try:
            allocatable = _allocatable_cuda_gib(torch, device.index or 0)
        except RuntimeError as e:
            allocatable = None
            skipped["allocatable_gib"] = str(e)[:200]
    else:
        allocatable = _mem_available_gib()
        if allocatable is None:
            skipped["allocatable_gib"] = "no MemAvailable in /proc/meminfo"
    return ProbeRun(
        device=device.torch,
        device_name=name,
        runtime=runtime,
        timer=how,
        readings=tuple(readings),
        skipped=skipped,
        allocatable_gib=allocatable,
        measured_on=datetime.now(UTC).date().isoformat(),
        seconds=round(time.perf_counter() - started, 2),
    )


# --- against a catalog entry -------------------------------------------------------------------------------


def identify(name: str, cuda: bool, catalog: HardwareCatalog, asked: str | None = None) -> HardwareProfile:
    """The SKU a device is: `asked` (--hardware), else for a GPU the entry one of whose `products` its `name` is
    (or holds as a word, the longest such: "NVIDIA H100 PCIe" is an H100, "NVIDIA GH200 480GB" is not an
    H200), else `cpu`."""
    if asked is not None:
        return catalog.get(asked)
    if not cuda:
        return catalog.get("cpu")
    lower = name.strip().lower()
    best: tuple[int, HardwareProfile] | None = None
    for profile in catalog:
        for product in profile.products:
            p = product.lower()
            if p == lower:
                return profile
            if re.search(rf"\b{re.escape(p)}\b", lower) and (best is None or len(p) > best[0]):
                best = (len(p), profile)
    if best is None:
        known = sorted(p for profile in catalog for p in profile.products)
        raise InvalidInput(
            f"no catalog entry names the device {name[:200]!r} among its products; name the SKU with --hardware",
            code=Codes.HARDWARE_NOT_IDENTIFIED,
            details={"device_name": name[:200], "known": known},
        )
    return best[1]


@dataclass(frozen=True)
class Row:
    """One line of the probe's table: a reading against its peak."""

    reading: ProbeReading
    peak: float | None  # the catalog's, in the reading's unit; None: the entry has no such peak
    fraction: float | None

    def as_reading(self) -> Reading:
        return Reading(**self.reading.model_dump(), peak=self.peak, fraction=self.fraction)


class Reading(ProbeReading):
    """A reading as `kiln hardware probe --json` shows it: beside its peak, and the share of it reached."""

    peak: float | None
    fraction: float | None


class ProbeReport(BaseModel):
    """What `kiln hardware probe` found: the SKU, the run, each reading against its peak, the `measured` record
    they make (None without the memory read), what was left out, and where it was published (if it was)."""

    hardware: str
    run: ProbeRun
    readings: list[Reading]
    measured: MeasuredEfficiency | None
    problems: list[str]
    published: str | None = None


def _peak(profile: HardwareProfile, key: str) -> float | None:
    if key == "memory_read" or key.startswith("decode."):
        return profile.bandwidth_gbs
    value = getattr(profile.tflops, key.split(".")[1])
    return float(value) if value is not None else None


def efficiency(run: ProbeRun, profile: HardwareProfile) -> tuple[MeasuredEfficiency | None, list[Row], list[str]]:
    """The run as `profile`'s `measured` record (each median over the entry's peak), its table rows, and the
    problems that leave a share out (a peak the entry lacks; a share outside the catalog's range, which says the
    entry's peak is wrong). No record without the memory read."""
    rows: list[Row] = []
    problems: list[str] = []
    shares: dict[str, float] = {}
    low, high = FRACTION
    for reading in run.readings:
        peak = _peak(profile, reading.key)
        fraction = float(f"{reading.median / peak:.4g}") if peak is not None else None
        rows.append(Row(reading, peak, fraction))
        if fraction is None:
            problems.append(f"{reading.key}: {profile.name}'s entry gives no such peak")
        elif not low <= fraction <= high:
            problems.append(
                f"{reading.key}: {reading.median:.4g} {reading.unit} is {fraction:g} of {profile.name}'s peak "
                f"{peak:g}, outside {low:g} to {high:g}: correct the entry's peak"
            )
        else:
            shares[reading.key] = fraction
    if "memory_read" not in shares:
        return None, rows, problems or ["memory_read: not measured"]
    allocatable = run.allocatable_gib
    if allocatable is not None and not MEMORY_GIB[0] <= allocatable <= MEMORY_GIB[1]:
        problems.append(f"allocatable_gib: {allocatable:.1f} is outside {MEMORY_GIB[0]} to {MEMORY_GIB[1]}")
        allocatable = None

    def of(kind: str) -> DtypeFractions:
        return DtypeFractions(**{k.split(".")[1]: v for k, v in shares.items() if k.split(".")[0] == kind})

    record = MeasuredEfficiency(
        memory_read=shares["memory_read"],
        decode=of("decode"),
        matmul=of("matmul"),
        matmul_small_m=of("matmul_small_m"),
        allocatable_gib=round(allocatable, 1) if allocatable is not None else None,
        source=run.source()[:300],
        measured_on=run.measured_on,
    )
    return record, rows, problems


def table(run: ProbeRun, profile: HardwareProfile, rows: Iterable[Row]) -> list[str]:
    """The probe's table for people: each reading, the catalog's peak and the share."""
    lines = [
        f"{run.device_name} ({run.device}, {run.runtime}) as {profile.name}: {run.seconds:.1f} s, {run.timer}",
        f"{'measured':<20} {'median':>10} {'best':>10} {'peak':>10} {'unit':<8} {'share':>8}  how",
    ]
    for row in rows:
        r = row.reading
        peak = f"{row.peak:,.0f}" if row.peak is not None else "-"
        share = f"{row.fraction:.3g}" if row.fraction is not None else "-"
        lines.append(f"{r.key:<20} {r.median:>10,.4g} {r.best:>10,.4g} {peak:>10} {r.unit:<8} {share:>8}  {r.what}")
    if run.allocatable_gib is not None:
        lines.append(
            f"{'allocatable':<20} {run.allocatable_gib:>10,.1f} {'':>10} {profile.memory_gib:>10,.0f} {'GiB':<8} "
            f"{run.allocatable_gib / profile.memory_gib:>8.3g}"
        )
    lines += [f"{key:<20} not measured: {why}" for key, why in run.skipped.items()]
    return lines
