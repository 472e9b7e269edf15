"""What a piece of work used of this process and its children: time, peak memory, bytes read and written.

`measure_usage()` wraps one stage run (`pipeline.executors.node`) and yields a `ResourceUsage` that its
provenance records; the benchmarks use the same readers (`status_kb`, `MemorySampler`). Linux only: where
/proc lacks a file, the figure it would give is None, never a guess.

Peak resident memory. The kernel keeps one high-water mark per process (VmHWM); `/proc/self/clear_refs`
("5") restarts it, but that also restarts what getrusage's ru_maxrss reports for the process and, once it
exits, for its parent (`kiln build`'s own peak, `/usr/bin/time`), so a stage does not reset it. Instead:
when VmHWM rose during the stage, that new mark is the stage's exact peak; when it did not (an earlier stage
peaked higher), the stage's peak is VmRSS sampled every 10 ms (`peak_rss_exact` False: a spike shorter
than that can be missed). VmRSS counts file pages mapped into the process (memory-mapped SafeTensors),
which the kernel reclaims under pressure; `peak_anon_bytes` (RssAnon, sampled) is the memory the work
itself holds. A process reset on purpose (a benchmark's fresh child) may call `reset_peak`.

Children. A stage may run work in other processes (vLLM's worker, kept across the stages it serves; a
converter's subprocess), whose memory is not in this process's figures. getrusage(RUSAGE_CHILDREN) knows
only the children already waited for, its ru_maxrss is a maximum over this process's lifetime, and a
child's starts from the parent's resident size at fork + exec; so `children_peak_rss_bytes` is measured
instead: the larger of the summed VmRSS of this process's descendants, sampled every 10 ms, and one
descendant's own VmHWM where it rose while the stage ran (exact for a worker the stage started). The
descendants are found by scanning /proc a few times a second: a child that lives less than that may be
missed. Bytes a child read or wrote are in `io` once it has been waited for (the kernel adds them to its
parent's counters); those of descendants still running at the end (a kept worker) are in `children_io`,
counted from the stage's start (or their birth).

Memory left behind. A stage runs in a long-lived process (the local build, a Ray worker), and what it
dropped is not always returned: a model held in a reference cycle (transformers' modules and hooks) waits
for a full garbage collection, which may not come for many stages, and glibc keeps freed heap memory
for reuse. At 1B, three evals in transformers left 15 GB behind. `release_memory` (a full collection,
then glibc's malloc_trim) returns it; `pipeline.executors.node` calls it after a stage whose anonymous
memory grew by more than RELEASE_THRESHOLD_BYTES (a collection takes ~0.4 s with transformers loaded).

GPU memory: `device_peak_bytes`, torch's peak allocation on the process's CUDA devices during the work
(its peak counters are reset when the work starts), where torch had CUDA in use by the end, and
`device_end_bytes`, what was still allocated when it ended. On an H200 a transformers eval left its
model's 4.7 GB allocated (held by reference cycles until a full collection), which the next stage then
counted as its own peak; memory left on a device is released after the stage like host memory.

Weights read: a runtime that computes with a model's weights says what it opened (`weights_opened`: the
checkpoint's bytes and how it holds them, whole or streamed a layer at a time) and what it read of them
(`weights_read`), and `weights` records both: `passes` = bytes read / the checkpoint's bytes, so a model
loaded once is 1.0, and one streamed layer by layer for every generated token is one more per token.

Bytes read and written (/proc/<pid>/io): `read_bytes`/`write_bytes` are what reached the storage layer
(a file read from the page cache, or memory-mapped and already resident, reads 0; a write counts when it
is dirtied); `rchar`/`wchar` are what passed through read/write system calls (not memory-mapped access).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import gc
import os
import resource
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, astuple, dataclass, field
from pathlib import Path
from typing import Any

SAMPLE_INTERVAL_S = 0.01  # how often RssAnon / VmRSS are read
# How often the process table is scanned for descendants: at least this often, and never so often that
# the scans take more than 1/SCAN_BUDGET of a core (a /proc scan of 100 processes takes ~3 ms of CPU).
SCAN_INTERVAL_S = 0.25
SCAN_BUDGET = 50
KIB = 1024
RELEASE_THRESHOLD_BYTES = 256 << 20


def status_kb(field: str, pid: int | str = "self") -> int | None:
    """A `kB` field of /proc/<pid>/status (VmRSS, VmHWM, RssAnon, ...), or None where there is none."""
    return _status_fields(pid, field).get(field)


def _status_fields(pid: int | str, *fields: str) -> dict[str, int]:
    """Several `kB` fields of /proc/<pid>/status from one read (a missing process: none)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            lines = f.read().split(b"\n")
    except OSError:
        return {}
    wanted = {f.encode(): f for f in fields}
    out = {}
    for line in lines:
        name, _, value = line.partition(b":")
        if name in wanted:
            with contextlib.suppress(IndexError, ValueError):
                out[wanted[name]] = int(value.split()[0])
    return out


def release_memory() -> None:
    """Free what unreachable objects hold (a full garbage collection) and return freed heap to the system
    (glibc's malloc_trim; nothing where the C library has none) and freed GPU memory to the driver
    (torch's caching allocator, where this process uses CUDA)."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
    cuda = _cuda()
    if cuda is not None:
        cuda.empty_cache()


@functools.cache
def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):  # not glibc
        return None


def left_behind(usage: ResourceUsage) -> bool:
    """Whether work that ended with `usage` left enough anonymous memory behind to release it, or any GPU
    memory still allocated (no stage keeps anything on a device for the next)."""
    if (usage.device_end_bytes or 0) > RELEASE_THRESHOLD_BYTES:
        return True
    if usage.anon_end_bytes is None or usage.anon_start_bytes is None:
        return False
    return usage.anon_end_bytes - usage.anon_start_bytes > RELEASE_THRESHOLD_BYTES


def reset_peak() -> bool:
    """Restart this process's VmHWM from its current RSS (Linux >= 4.0); False where it cannot.

    It restarts ru_maxrss too (for this process and, after it exits, for its parent's view of it): only for
    a process whose earlier peak nobody needs, such as a benchmark's fresh child measuring its phases."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class IOCounters:
    """Bytes through the storage layer (`read_bytes`, `write_bytes`) and through read/write calls (`rchar`, `wchar`)."""

    read_bytes: int = 0
    write_bytes: int = 0
    rchar: int = 0
    wchar: int = 0

    def __add__(self, other: IOCounters) -> IOCounters:
        return IOCounters(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def __sub__(self, other: IOCounters) -> IOCounters:
        """The counts since `other` (a process's earlier reading); never negative."""
        return IOCounters(*(max(0, a - b) for a, b in zip(astuple(self), astuple(other), strict=True)))


def read_io(pid: int | str = "self") -> IOCounters | None:
    """/proc/<pid>/io (the whole process, with the children it has waited for), or None where unreadable."""
    try:
        with open(f"/proc/{pid}/io", "rb") as f:
            text = f.read()
    except OSError:
        return None
    values: dict[str, int] = {}
    for line in text.split(b"\n"):
        name, _, value = line.partition(b":")
        with contextlib.suppress(ValueError):
            values[name.decode()] = int(value)
    try:
        return IOCounters(values["read_bytes"], values["write_bytes"], values["rchar"], values["wchar"])
    except KeyError:
        return None


def descendants(pid: int | None = None) -> set[int]:
    """The processes below `pid` (this one by default), from each process's parent in /proc/<pid>/stat."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return set()
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ')'
            ppid = int(stat[stat.rindex(b")") + 2 :].split(maxsplit=2)[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found: set[int] = set()
    todo = list(children.get(root, []))
    while todo:
        child = todo.pop()
        if child not in found:
            found.add(child)
            todo.extend(children.get(child, []))
    return found


@dataclass
class _Child:
    """A descendant as first seen: its VmHWM then (None: born during the measurement) and its I/O then."""

    hwm_kb: int | None
    io: IOCounters | None


class MemorySampler:
    """Peaks sampled every 10 ms on a thread: this process's anonymous memory (RssAnon) and resident memory
    (VmRSS); with `children`, its descendants' as well (see the module docstring).

    VmHWM also counts file pages mapped into the process (the source's SafeTensors, an offload folder), which
    the kernel reclaims under pressure; RssAnon is the memory the work itself holds.
    """

    def __init__(self, *, children: bool = False, interval: float = SAMPLE_INTERVAL_S) -> None:
        self.peak_anon_kb = 0
        self.peak_rss_kb = 0
        self.children_rss_kb = 0  # the highest summed VmRSS of the descendants seen
        self.children_hwm_kb = 0  # the highest VmHWM of a descendant whose mark rose while sampled
        self._children = children
        self._interval = interval
        self._seen: dict[int, _Child] = {}
        self._known: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="kiln-memory-sampler", daemon=True)

    def _sample(self) -> None:
        own = _status_fields("self", "RssAnon", "VmRSS")
        self.peak_anon_kb = max(self.peak_anon_kb, own.get("RssAnon", 0))
        self.peak_rss_kb = max(self.peak_rss_kb, own.get("VmRSS", 0))
        if not self._known:
            return
        total = 0
        for pid in list(self._known):
            fields = _status_fields(pid, "VmRSS", "VmHWM")
            if not fields:
                self._known.discard(pid)  # gone (its I/O is in ours once waited for)
                continue
            total += fields.get("VmRSS", 0)
            first = self._seen[pid].hwm_kb
            hwm = fields.get("VmHWM", 0)
            if first is None or hwm > first:
                self.children_hwm_kb = max(self.children_hwm_kb, hwm)
        self.children_rss_kb = max(self.children_rss_kb, total)

    def _scan(self, *, first: bool = False) -> None:
        for pid in descendants() - set(self._seen):
            # A descendant there at the start keeps its earlier peak and I/O as its baseline; a later one's is 0.
            hwm = status_kb("VmHWM", pid) if first else None
            self._seen[pid] = _Child(hwm, read_io(pid) if first else IOCounters())
            self._known.add(pid)

    def _poll(self) -> None:
        # `__enter__` has just scanned: the first scan here is one interval on. Each turn samples before it
        # scans, so a slow scan (a loaded machine, many processes) never delays the work's first samples.
        next_scan = time.monotonic() + SCAN_INTERVAL_S
        while not self._stop.is_set():
            self._sample()
            if self._children and time.monotonic() >= next_scan:
                cpu0 = time.thread_time()  # the scan's own CPU time: waiting for the GIL is not its cost
                self._scan()
                scan_every = max(SCAN_INTERVAL_S, (time.thread_time() - cpu0) * SCAN_BUDGET)
                next_scan = time.monotonic() + scan_every
            self._stop.wait(self._interval)

    def children_io(self) -> IOCounters | None:
        """Bytes read and written by the descendants still running, since the start (or their birth)."""
        total = IOCounters()
        for pid in descendants() & set(self._seen):
            now, then = read_io(pid), self._seen[pid].io
            if now is None or then is None:
                return None
            total += now - then
        return total

    def __enter__(self) -> MemorySampler:
        if self._children:
            self._scan(first=True)
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self._children:
            self._scan()
        self._sample()


@dataclass
class WeightReads:
    """The model weights a piece of work opened and read: `passes` over them = `read_bytes` / `model_bytes`."""

    model_bytes: int = 0  # the checkpoints it opened (their SafeTensors files' bytes)
    read_bytes: int = 0  # what it read of them, each time it read it
    held: list[str] = field(default_factory=list)  # how it held each model it opened ("whole", "streamed ...")
    resident_bytes: int = 0  # what a streamed model may keep loaded besides its one layer (its plan's budget)

    def to_json(self) -> dict[str, Any]:
        passes = round(self.read_bytes / self.model_bytes, 3) if self.model_bytes else None
        return {**asdict(self), "passes": passes}


_WEIGHTS: contextvars.ContextVar[WeightReads | None] = contextvars.ContextVar("weights", default=None)


def weights_opened(model_bytes: int, held: str, resident_bytes: int = 0) -> None:
    """A runtime opened a checkpoint of `model_bytes` and holds it as `held` (streamed: keeping up to
    `resident_bytes` loaded): counted by `measure_usage`."""
    reads = _WEIGHTS.get()
    if reads is not None:
        reads.model_bytes += model_bytes
        reads.held.append(held)
        reads.resident_bytes += resident_bytes


def weights_read(nbytes: int) -> None:
    """A runtime read `nbytes` of a checkpoint's weights (again, where it reads them more than once)."""
    reads = _WEIGHTS.get()
    if reads is not None:
        reads.read_bytes += nbytes


@contextlib.contextmanager
def counting_weights() -> Iterator[WeightReads]:
    """Count the weights the work in the block opens and reads (`weights_opened`, `weights_read`)."""
    reads = WeightReads()
    token = _WEIGHTS.set(reads)
    try:
        yield reads
    finally:
        _WEIGHTS.reset(token)


@dataclass(frozen=True)
class ResourceUsage:
    """What one piece of work used (byte counts in bytes; None: this machine's /proc does not say)."""

    wall_s: float
    cpu_s: float  # this process's user + system time
    rss_start_bytes: int | None  # VmRSS when it started: what earlier work left in the process
    peak_rss_bytes: int | None
    peak_rss_exact: bool  # the peak is VmHWM (it rose during the work), not VmRSS sampled every 10 ms
    anon_start_bytes: int | None
    peak_anon_bytes: int | None  # RssAnon sampled every 10 ms
    anon_end_bytes: int | None  # RssAnon when it ended: what it left behind (before `release_memory`)
    children_peak_rss_bytes: int  # 0: no child process ran, or none was seen
    io: IOCounters | None  # this process and the children it waited for during the work
    children_io: IOCounters | None  # descendants still running at the end
    # The most this process's torch held allocated on its CUDA devices during the work (the largest device's
    # peak); None where CUDA was not in use by the end of it (a CPU stage, or a child's GPU: vLLM's worker).
    device_peak_bytes: int | None = None
    device_end_bytes: int | None = None  # still allocated there when it ended (the largest device's)
    # The model weights it opened and read, and the passes over them (`WeightReads`); None: it opened none.
    weights: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _kb(value: int | None) -> int | None:
    return None if value is None else value * KIB


def _cuda() -> Any:
    """torch.cuda where this process already imported torch and initialised CUDA; else None (never imports)."""
    import sys

    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    return cuda if cuda is not None and cuda.is_initialized() else None


def _reset_device_peaks() -> None:
    cuda = _cuda()
    if cuda is not None:
        for i in range(cuda.device_count()):
            cuda.reset_peak_memory_stats(i)


def _device_bytes(counter: str) -> int | None:
    """torch.cuda's `counter` (memory_allocated, max_memory_allocated) of the device where it is largest."""
    cuda = _cuda()
    if cuda is None:
        return None
    return max((int(getattr(cuda, counter)(i)) for i in range(cuda.device_count())), default=0)


class UsageMeter:
    """Set while `measure_usage` runs; `usage` is filled in when it ends."""

    usage: ResourceUsage | None = None


@contextlib.contextmanager
def measure_usage() -> Iterator[UsageMeter]:
    """Measure the work in the `with` block (see `ResourceUsage`); the meter's `usage` is set at its end,
    also when the work raises."""
    meter = UsageMeter()
    start = _status_fields("self", "VmRSS", "VmHWM", "RssAnon")
    io0 = read_io()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    sampler = MemorySampler(children=True)
    _reset_device_peaks()
    weights = WeightReads()
    counting = _WEIGHTS.set(weights)
    try:
        with sampler:
            yield meter
    finally:
        _WEIGHTS.reset(counting)
        wall = time.perf_counter() - t0
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        end = _status_fields("self", "VmRSS", "VmHWM", "RssAnon")
        io1 = read_io()
        hwm0, hwm1 = start.get("VmHWM"), end.get("VmHWM")
        exact = hwm0 is not None and hwm1 is not None and hwm1 > hwm0
        sampled = max(sampler.peak_rss_kb, end.get("VmRSS", 0)) if "VmRSS" in end else None
        peak = hwm1 if exact else sampled
        meter.usage = ResourceUsage(
            wall_s=round(wall, 3),
            cpu_s=round(ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime, 3),
            rss_start_bytes=_kb(start.get("VmRSS")),
            peak_rss_bytes=_kb(peak),
            peak_rss_exact=exact,
            anon_start_bytes=_kb(start.get("RssAnon")),
            peak_anon_bytes=_kb(max(sampler.peak_anon_kb, end.get("RssAnon", 0))) if "RssAnon" in end else None,
            anon_end_bytes=_kb(end.get("RssAnon")),
            children_peak_rss_bytes=max(sampler.children_rss_kb, sampler.children_hwm_kb) * KIB,
            io=io1 - io0 if io0 is not None and io1 is not None else None,
            children_io=sampler.children_io(),
            device_peak_bytes=_device_bytes("max_memory_allocated"),
            device_end_bytes=_device_bytes("memory_allocated"),
            weights=weights.to_json() if weights.model_bytes else None,
        )
