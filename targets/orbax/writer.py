"""A streaming orbax checkpoint writer: tensors are added a few at a time, never the whole model at once.

orbax's `save` takes a whole PyTree. Its partial-save session (`orbax.checkpoint.experimental.v1.partial`)
adds disjoint parts of the tree one call at a time and merges them at `finalize`, so only the arrays
of one call are in memory. Arrays are stored as one zarr3 array per tensor (OCDBT off): file names are
the tensor names, and the bytes of a tensor do not depend on the order or grouping of the calls.

`OrbaxWriter` is a state machine (planned -> writing -> finished | aborted) that raises on misuse:
writing a tensor that was not planned, twice, or with another dtype or shape than planned, and
finishing before every planned tensor was written.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.core.error_codes import Codes
from kiln.core.errors import KilnError, StageFailed
from kiln.targets.orbax.layout import nest

if TYPE_CHECKING:
    import numpy as np

CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
COMMIT_SUCCESS = "commit_success.txt"


class WriterState(enum.Enum):
    PLANNED = "planned"
    WRITING = "writing"
    FINISHED = "finished"
    ABORTED = "aborted"


class WriterMisuse(KilnError):
    code = Codes.ORBAX_WRITER_MISUSE


@contextlib.contextmanager
def quiet_orbax() -> Iterator[None]:
    """orbax logs a warning per partial save that has no OCDBT data to merge (expected here); keep stderr clean."""
    log = logging.getLogger("absl")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


class OrbaxWriter:
    """Writes the planned tensors `{name: (dtype, shape)}` into an orbax checkpoint at `path`."""

    def __init__(self, path: Path, planned: Mapping[str, tuple[str, tuple[int, ...]]]) -> None:
        self.path = Path(path).absolute()  # orbax refuses relative destinations (a relative --work-dir)
        self.planned = dict(planned)
        self.written: set[str] = set()
        self.state = WriterState.PLANNED
        nest({n: None for n in self.planned})  # refuses a name that is a prefix of another

    def _context(self) -> Any:
        import orbax.checkpoint.experimental.v1 as ocp

        ctx = ocp.Context()
        ctx.array.saving.use_ocdbt = False  # one zarr3 array per tensor, named after it (see module doc)
        return ctx

    def write(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Add `arrays` (numpy, exactly as planned) to the checkpoint; they may be freed when this returns."""
        import orbax.checkpoint.experimental.v1 as ocp

        if self.state not in (WriterState.PLANNED, WriterState.WRITING):
            raise WriterMisuse(f"orbax: cannot write to a checkpoint that is {self.state.value}")
        for name, arr in arrays.items():
            if name not in self.planned:
                raise WriterMisuse(f"orbax: tensor {name!r} was not planned")
            if name in self.written:
                raise WriterMisuse(f"orbax: tensor {name!r} was already written")
            dtype, shape = self.planned[name]
            if str(arr.dtype) != dtype or tuple(arr.shape) != shape:
                raise StageFailed(
                    f"orbax: tensor {name!r} is {arr.dtype} {list(arr.shape)}, planned {dtype} {list(shape)}",
                    code=Codes.ORBAX_PLAN_MISMATCH,
                    details={"tensor": name},
                )
        self.state = WriterState.WRITING
        try:
            with self._context(), quiet_orbax():
                ocp.partial.save(self.path, nest(arrays))
        except BaseException:
            self.abort()
            raise
        self.written.update(arrays)

    def finish(self) -> None:
        """Merge the session into the final checkpoint at `path`, with no build-specific bytes in it."""
        import orbax.checkpoint.experimental.v1 as ocp

        if self.state is not WriterState.WRITING:
            raise WriterMisuse(f"orbax: cannot finish a checkpoint that is {self.state.value}")
        missing = [n for n in self.planned if n not in self.written]
        if missing:
            raise WriterMisuse(f"orbax: {len(missing)} planned tensor(s) not written, e.g. {missing[0]!r}")
        try:
            with self._context(), quiet_orbax():
                ocp.partial.finalize(self.path)
            _make_reproducible(self.path)
        except BaseException:
            self.abort()
            raise
        self.state = WriterState.FINISHED

    def abort(self) -> None:
        """Remove whatever was written (the partial session and any final checkpoint)."""
        self.state = WriterState.ABORTED
        for p in [self.path, *self.path.parent.glob(self.path.name + ".*")]:
            shutil.rmtree(p, ignore_errors=True)


def _make_reproducible(path: Path) -> None:
    """Drop the two things orbax records about this build: the wall-clock time and the temporary path.

    The same source and quant then give the same bytes on any machine, so publishing a rebuilt artifact
    under a published version is idempotent instead of a conflict. orbax only checks that the commit
    marker exists; the timestamps are informational.
    """
    meta_path = path / CHECKPOINT_METADATA
    meta = json.loads(meta_path.read_text())
    for key in ("init_timestamp_nsecs", "commit_timestamp_nsecs"):
        if key in meta:
            meta[key] = 0
    meta_path.write_text(json.dumps(meta, sort_keys=True))
    marker = path / COMMIT_SUCCESS
    if marker.exists():
        marker.write_text("Checkpoint commit was successful\n")
    leftovers = [p.name for p in path.parent.glob(path.name + ".*")]
    if leftovers:
        raise StageFailed(f"orbax left {leftovers} beside the finished checkpoint", code=Codes.ORBAX_WRITE_FAILED)
