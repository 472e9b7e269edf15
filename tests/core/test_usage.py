"""What a piece of work used, as `core.usage` measures it: its own peak memory (exact or sampled), its child
processes' peak, and the bytes it read and wrote. Allocations are held for longer than the 10 ms sampling."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.core.usage import (
    IOCounters,
    MemorySampler,
    ResourceUsage,
    descendants,
    left_behind,
    measure_usage,
    read_io,
    status_kb,
)
from tests.memory import MIB, new_pages

pytestmark = pytest.mark.skipif(read_io() is None or status_kb("RssAnon") is None, reason="needs Linux /proc")


def _hold(mib: int, seconds: float = 0.1) -> None:
    """Hold `mib` MiB of new pages (`tests.memory`) for `seconds`."""
    with new_pages(mib):
        time.sleep(seconds)


def _child(mib: int, seconds: float) -> list[str]:
    return [sys.executable, "-c", f"import time; b = bytearray({mib} << 20); time.sleep({seconds})"]


def test_a_new_peak_is_the_kernels_high_water_mark() -> None:
    # Above whatever ran before in this process: past its high-water mark.
    mib = max(64, ((status_kb("VmHWM") or 0) - (status_kb("VmRSS") or 0)) // 1024 + 32)
    with measure_usage() as meter:
        _hold(mib)
    usage = meter.usage
    assert usage is not None and usage.peak_rss_exact
    assert usage.peak_rss_bytes is not None and usage.peak_rss_bytes >= mib * MIB
    assert usage.peak_anon_bytes is not None and usage.anon_start_bytes is not None
    assert usage.peak_anon_bytes - usage.anon_start_bytes >= mib * MIB * 0.95  # sampled while held
    assert usage.wall_s >= 0.1 and usage.cpu_s >= 0


def test_a_peak_below_an_earlier_one_is_sampled_not_the_process_lifetime_mark() -> None:
    _hold(256)  # the process's high-water mark is now at least 256 MiB above what follows
    with measure_usage() as meter:
        _hold(48)
    usage = meter.usage
    assert usage is not None and not usage.peak_rss_exact
    assert usage.peak_rss_bytes is not None and usage.rss_start_bytes is not None
    assert usage.peak_rss_bytes - usage.rss_start_bytes >= 48 * MIB * 0.95
    # Not the lifetime mark: the 256 MiB block was freed before the work began.
    assert usage.peak_rss_bytes < (status_kb("VmHWM") or 0) * 1024 - 128 * MIB


def test_a_child_process_peak_is_measured_and_not_counted_as_this_process() -> None:
    with measure_usage() as meter:
        subprocess.run(_child(96, 0.6), check=True)
    usage = meter.usage
    assert usage is not None
    assert usage.children_peak_rss_bytes >= 96 * MIB
    assert usage.peak_anon_bytes is not None and usage.anon_start_bytes is not None
    assert usage.peak_anon_bytes - usage.anon_start_bytes < 48 * MIB


def test_a_worker_kept_across_measurements_counts_what_it_holds_in_each() -> None:
    """A long-lived child (as vLLM's worker is) started earlier: its resident memory, sampled, counts."""
    # What this process's other descendants hold already (a test runner's servers, started by fixtures).
    with measure_usage() as meter:
        time.sleep(0.05)
    assert meter.usage is not None
    others = meter.usage.children_peak_rss_bytes
    worker = subprocess.Popen(_child(80, 30))
    try:
        deadline = time.monotonic() + 20
        while (status_kb("VmRSS", worker.pid) or 0) < 80 * 1024 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.pid in descendants()
        with measure_usage() as meter:
            time.sleep(0.4)
        assert meter.usage is not None and meter.usage.children_peak_rss_bytes >= 80 * MIB
    finally:
        worker.kill()
        worker.wait()
    with measure_usage() as meter:
        time.sleep(0.05)
    assert worker.pid not in descendants()
    assert meter.usage is not None and meter.usage.children_peak_rss_bytes < others + 40 * MIB  # it is gone


def test_bytes_written_and_read_are_counted(tmp_path: Path) -> None:
    path = tmp_path / "data"
    with measure_usage() as meter:
        with open(path, "wb") as f:
            for _ in range(16):
                f.write(os.urandom(MIB))
            f.flush()
            os.fsync(f.fileno())
        with open(path, "rb") as f:
            while f.read(MIB):
                pass
    usage = meter.usage
    assert usage is not None and usage.io is not None
    assert usage.io.wchar >= 16 * MIB and usage.io.rchar >= 16 * MIB
    assert usage.io.write_bytes >= 16 * MIB  # fsynced: it reached the storage layer


def test_a_childs_bytes_are_counted_once_it_has_been_waited_for(tmp_path: Path) -> None:
    path = tmp_path / "data"
    code = f"open({str(path)!r}, 'wb').write(bytes(8 << 20))"
    with measure_usage() as meter:
        subprocess.run([sys.executable, "-c", code], check=True)
    assert meter.usage is not None and meter.usage.io is not None and meter.usage.io.wchar >= 8 * MIB


def test_io_counters_subtract_to_a_delta_that_is_never_negative() -> None:
    assert IOCounters(10, 20, 30, 40) - IOCounters(1, 2, 3, 50) == IOCounters(9, 18, 27, 0)
    assert IOCounters(1, 2, 3, 4) + IOCounters(1, 1, 1, 1) == IOCounters(2, 3, 4, 5)


def test_the_usage_is_set_when_the_work_raises() -> None:
    with pytest.raises(RuntimeError), measure_usage() as meter:
        raise RuntimeError("the stage failed")
    assert meter.usage is not None and meter.usage.wall_s >= 0


def test_the_sampler_alone_reports_the_anonymous_peak() -> None:
    """What the benchmarks use (bench/calibration_memory.py)."""
    start = status_kb("RssAnon") or 0
    with MemorySampler() as sampler:
        _hold(32)
    assert sampler.peak_anon_kb - start >= 32 * 1024 * 0.95


@pytest.mark.parametrize(
    ("anon_growth_mib", "device_end_mib", "release"),
    [(0, None, False), (512, None, True), (0, 0, False), (0, 64, False), (0, 4800, True), (512, 0, True)],
)
def test_memory_left_on_the_host_or_a_gpu_is_released_after_the_stage(
    anon_growth_mib: int, device_end_mib: int | None, release: bool
) -> None:
    """A stage that ends holding host memory it allocated, or any GPU memory (an H200 showed a transformers
    eval leaving its model allocated there), is followed by a collection (`release_memory`)."""
    mib = 1 << 20
    usage = ResourceUsage(
        wall_s=1.0,
        cpu_s=1.0,
        rss_start_bytes=None,
        peak_rss_bytes=None,
        peak_rss_exact=False,
        anon_start_bytes=100 * mib,
        peak_anon_bytes=None,
        anon_end_bytes=(100 + anon_growth_mib) * mib,
        children_peak_rss_bytes=0,
        io=None,
        children_io=None,
        device_end_bytes=None if device_end_mib is None else device_end_mib * mib,
    )
    assert left_behind(usage) is release


def test_without_cuda_in_use_no_gpu_figure_is_recorded() -> None:
    with measure_usage() as meter:
        sum(range(1000))
    assert meter.usage is not None
    assert meter.usage.device_peak_bytes is None and meter.usage.device_end_bytes is None
