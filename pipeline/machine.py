"""The machine a build runs on, as the plan checks stages against it: the memory its stages may use and the free
disk of its work dir."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from kiln.core.device import host_memory_bytes


@dataclass(frozen=True)
class Machine:
    """`memory_bytes` a stage may use (`core.device.host_memory_bytes`: the RAM, a container's limit or
    `KILN_HOST_MEMORY`, the same limit that defers a stage at run time), `disk_free_bytes` where the work dir is."""

    memory_bytes: int
    disk_free_bytes: int


def this_machine(work_dir: Path) -> Machine:
    """This machine: the memory its stages may use and the free disk of `work_dir` (of its nearest existing
    parent, before the build makes it)."""
    memory = host_memory_bytes() or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    where = work_dir.resolve()
    while not where.exists() and where != where.parent:
        where = where.parent
    return Machine(memory, shutil.disk_usage(where).free)
