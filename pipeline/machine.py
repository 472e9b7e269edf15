"""The machine a build runs on, as the plan checks stages against it: its memory and the free disk of its work dir."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Machine:
    """`memory_bytes` in all, `available_bytes` of it free for a stage now, `disk_free_bytes` where the work dir is."""

    memory_bytes: int
    available_bytes: int
    disk_free_bytes: int


def _meminfo(key: str) -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def this_machine(work_dir: Path) -> Machine:
    """This machine: its memory (MemTotal and MemAvailable where /proc/meminfo has them, else the physical pages)
    and the free disk of `work_dir` (of its nearest existing parent, before the build makes it)."""
    total = _meminfo("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    available = _meminfo("MemAvailable") or total
    where = work_dir.resolve()
    while not where.exists() and where != where.parent:
        where = where.parent
    return Machine(total, available, shutil.disk_usage(where).free)
