"""Placing a file at a second path without a second copy of its bytes: a reflink, a hard link, or a reference.

A 70B release is 141 GB; a store that copies it holds 282 GB before any artifact. `place` tries, in order:

- a reflink (`ioctl(FICLONE)`, as `cp --reflink=always`; btrfs, XFS, bcachefs, ZFS 2.2+): a copy-on-write
  clone that shares the source's blocks and is a file of its own, so a later write to the source leaves
  it as it was;
- a hard link (same filesystem): the same inode under a second name; a write to the source in place
  changes it too, which the store notices (its stat-keyed verification re-hashes a file whose ctime
  moved) and refuses;
- a symbolic link to the source's resolved path: the file referenced in place (another filesystem, or a
  source this user may not link: `fs.protected_hardlinks`), verified the same way.

`copy=True` writes a copy instead, for who wants the store to stand alone.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from pathlib import Path
from typing import Literal

Placement = Literal["reflink", "hardlink", "symlink", "copy"]
FICLONE = 0x40049409  # _IOW(0x94, 9, int), linux/fs.h
# Errors that mean "this filesystem (or this pair of files) cannot do that": try the next way.
_CANNOT = {errno.EXDEV, errno.EPERM, errno.EACCES, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EINVAL}
_CANNOT.add(errno.ENOTTY)  # FICLONE on a filesystem whose ioctl table lacks it


def place(source: Path, dest: Path, *, copy: bool = False) -> Placement:
    """Make `dest` (which must not exist) hold the content of the regular file `source` (links followed)
    without copying it when the filesystem allows; which way it took."""
    source = source.resolve()
    if copy:
        shutil.copyfile(source, dest)
        return "copy"
    if reflink(source, dest):
        return "reflink"
    try:
        os.link(source, dest)
        return "hardlink"
    except OSError as e:
        if e.errno not in _CANNOT:
            raise
    os.symlink(source, dest)
    return "symlink"


def reflink(source: Path, dest: Path) -> bool:
    """Clone `source` to `dest` copy-on-write; False (and no `dest`) where the filesystem cannot."""
    if not hasattr(fcntl, "ioctl"):
        return False
    with open(source, "rb") as src:
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            fcntl.ioctl(fd, FICLONE, src.fileno())
        except OSError as e:
            os.close(fd)
            os.unlink(dest)
            if e.errno in _CANNOT:
                return False
            raise
        os.close(fd)
    return True
