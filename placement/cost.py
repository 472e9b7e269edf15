"""What a stage costs besides memory: the disk it writes and reads, and an estimate of its time on its device.

Pure functions over a stage's work (`StageWork`: bytes read, bytes written and kept, bytes written and removed
before it ends, FLOPs) and a device's rates (`Rates`); the pipeline counts each stage's work from the model's shape
(`pipeline.requirements.stage_work`).

Time is a roofline plus the disk: bytes through memory (read + written) at the device's measured memory-read share
of its bandwidth, or FLOPs at its measured large-M matmul share of its bf16 peak, whichever takes longer
(`placement.fit.shares`, the catalog's `measured` record; the data sheet's peak where there is none), and every byte
read or written on disk at `HOST_DISK_BYTES_S` besides (a scratch file twice: written, then read back). That is a
bound, not a forecast: it counts no Python overhead or process start, float32 compute where a CPU lacks bf16, nor a
quantizer's search (llama.cpp's K-quants), and the page cache can beat its disk term. On a device where kiln has
measured its stages (`Rates.times`: the build host, `BUILD_HOST_TIMES`), the estimate is each kind of stage's
measured line over its floor, `fixed_s + per_floor x floor`, fitted to one run of the whole recipe at two sizes;
elsewhere (a catalog GPU) it is the floor, and says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from kiln.core.hardware import DtypeFractions, HardwareProfile, MeasuredEfficiency, get_profile
from kiln.placement.fit import shares

# This build host, as `kiln hardware probe` measured it (bench/results/hardware_probe.jsonl, 2026-11-27, two cores
# of an AMD EPYC, torch 2.13.0+cpu, medians of 5): a 512 MiB read at 16.7 GB/s, bf16 matmuls at M=1024 at
# 0.155 TFLOP/s; as shares of the catalog's `cpu` socket (50 GB/s, 2 TFLOP/s bf16).
BUILD_HOST_PROFILE = "cpu"
BUILD_HOST_MEASURED = MeasuredEfficiency(
    memory_read=round(16.747 / 50, 4),
    matmul=DtypeFractions(bf16=round(0.155 / 2.0, 4)),
    source="kiln hardware probe --device cpu on the 2-core build host (AMD EPYC, torch 2.13.0+cpu)",
    measured_on="2026-11-27",
)
# The work dir's disk, bytes read plus written per second: ingest copying Llama-3-8B's 16.07 GB (32.1 GB moved)
# took 10-47 s, median 21.8 s (bench/results/scale.jsonl, seven runs).
HOST_DISK_BYTES_S = 1.5e9


@dataclass(frozen=True)
class StageTime:
    """A kind of stage's measured wall time on one device: `fixed_s` (its process, imports, a runtime's start)
    plus `per_floor` times its floor (`seconds`)."""

    fixed_s: float
    per_floor: float

    def __call__(self, floor: float) -> float:
        return self.fixed_s + self.per_floor * floor


# Each kind of stage (`pipeline.requirements.stage_kind`) on the build host: fitted (`bench/fit_times.py`) to the
# 1B and 8B rows of one `bench/scale.py --sizes 1b,8b --split --small-eval` run (bench/results/scale.jsonl).
BUILD_HOST_TIMES_SOURCE = "bench/scale.py --sizes 1b,8b --split --small-eval, 2026-11-29 (bench/results/scale.jsonl)"
BUILD_HOST_TIMES: dict[str, StageTime] = {
    "eval:jax": StageTime(5.5, 3.41),
    "eval:jax:bf16": StageTime(5.5, 3.41),
    "eval:llama.cpp": StageTime(2.7, 1.13),
    "eval:llama.cpp:f16": StageTime(0.0, 1.93),
    "eval:llama.cpp:mxfp4": StageTime(3.9, 0.97),
    "eval:llama.cpp:q4_k_m": StageTime(3.0, 0.86),
    "eval:llama.cpp:q8_0": StageTime(0.0, 2.2),
    "eval:transformers": StageTime(0.0, 4.78),
    "eval:transformers:fp8": StageTime(0.0, 4.46),
    "eval:transformers:int4-rtn": StageTime(18.0, 6.34),
    "eval:transformers:int8-w8a8": StageTime(0.0, 4.43),
    "eval:vllm": StageTime(41.5, 2.56),
    "eval:vllm:fp8": StageTime(0.0, 16.24),
    "eval:vllm:int4-rtn": StageTime(32.4, 3.87),
    "eval:vllm:int8-w8a8": StageTime(34.9, 1.79),
    "export:gguf": StageTime(0.0, 0.77),
    "export:gguf-llama.cpp": StageTime(0.0, 7.79),
    "export:gguf-llama.cpp:q4_k_m": StageTime(0.0, 7.79),
    "export:gguf:f16": StageTime(0.0, 0.62),
    "export:gguf:mxfp4": StageTime(0.0, 9.24),
    "export:gguf:q8_0": StageTime(0.0, 1.14),
    "export:hf-bundle": StageTime(1.7, 0.36),
    "export:hf-bundle:fp8": StageTime(1.1, 0.57),
    "export:hf-bundle:int4-rtn": StageTime(2.0, 0.24),
    "export:hf-bundle:int8-w8a8": StageTime(1.4, 0.52),
    "export:orbax": StageTime(0.0, 2.12),
    "export:orbax:bf16": StageTime(0.0, 2.12),
    "export:trtllm": StageTime(0.0, 0.51),
    "export:trtllm:fp8": StageTime(0.0, 0.51),
    "prepare": StageTime(1.9, 0.0),
    "quantize:fp8": StageTime(0.0, 7.5),
    "quantize:int4-rtn": StageTime(0.0, 10.35),
    "quantize:int8-w8a8": StageTime(0.0, 6.59),
    "reference": StageTime(0.0, 3.4),
}


@dataclass(frozen=True)
class StageWork:
    """What a stage moves: `read_bytes` from disk, `written_bytes` it leaves there, `scratch_bytes` it writes and
    removes before it ends (a lossless intermediate), and the `flops` of its matmuls."""

    read_bytes: int = 0
    written_bytes: int = 0
    scratch_bytes: int = 0
    flops: int = 0

    @property
    def disk_peak_bytes(self) -> int:
        """The most it holds on disk at once: what it keeps and its scratch."""
        return self.written_bytes + self.scratch_bytes


@dataclass(frozen=True)
class Rates:
    """A device's rates as a plan uses them: memory bytes/s and FLOP/s (its shares of the peaks), disk bytes/s."""

    memory_bytes_s: float
    flops_s: float
    disk_bytes_s: float
    basis: str
    times: Mapping[str, StageTime] = field(default_factory=dict)  # measured kinds of stage (module doc)


def device_rates(profile: HardwareProfile, disk_bytes_s: float = HOST_DISK_BYTES_S) -> Rates:
    """`profile`'s memory bandwidth at its measured memory-read share and its bf16 peak at its measured large-M
    matmul share (`placement.fit.shares`; the peaks where it has no measurement)."""
    share = shares(profile, None, "bf16")
    memory = profile.bandwidth_gbs * 1e9 * share.weights
    flops = profile.tflops.bf16 * 1e12 * share.matmul
    basis = f"{profile.name}: {memory / 1e9:.3g} GB/s, {flops / 1e12:.3g} TFLOP/s bf16"
    return Rates(memory, flops, disk_bytes_s, basis + (" (measured)" if share.source else " (data sheet)"))


def build_host_rates() -> Rates:
    """The rates of the CPU this plan's CPU stages run on: the catalog's `cpu` socket at this host's measured
    shares (`BUILD_HOST_MEASURED`)."""
    profile = get_profile(BUILD_HOST_PROFILE).model_copy(update={"measured": BUILD_HOST_MEASURED})
    rates = device_rates(profile)
    return replace(rates, times=BUILD_HOST_TIMES, basis=rates.basis + f"; times fitted to {BUILD_HOST_TIMES_SOURCE}")


def seconds(work: StageWork, rates: Rates) -> float:
    """The floor: the slower of its bytes through memory and its FLOPs, plus its disk bytes (module doc)."""
    moved = work.read_bytes + work.written_bytes
    compute = max(moved / rates.memory_bytes_s, work.flops / rates.flops_s)
    return compute + (moved + 2 * work.scratch_bytes) / rates.disk_bytes_s


def estimate(work: StageWork, rates: Rates, kind: str) -> tuple[float, bool]:
    """The seconds a stage of `kind` (`eval:vllm:fp8`) doing `work` takes on the device of `rates`, and whether that
    was measured: the line of the most specific kind measured there (`eval:vllm:fp8`, else `eval:vllm`, else
    `eval`) over its floor, or the floor alone (a device or kind kiln has not timed)."""
    floor = seconds(work, rates)
    parts = kind.split(":")
    for n in range(len(parts), 0, -1):
        line = rates.times.get(":".join(parts[:n]))
        if line is not None:
            return line(floor), True
    return floor, False
