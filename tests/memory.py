"""Memory a test's work holds on purpose, so that what `core.usage` measures is what the work added."""

from __future__ import annotations

import mmap

MIB = 1 << 20


def new_pages(mib: int) -> mmap.mmap:
    """`mib` MiB of new private anonymous pages, each written: resident, and in the process's RssAnon, until
    closed. A bytearray comes from malloc, which may hand back memory the process freed but still holds (glibc
    keeps freed heap for reuse), so holding it need not add anything."""
    block = mmap.mmap(-1, mib * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for page in range(0, mib * MIB, mmap.PAGESIZE):
        block[page] = 1
    return block
