"""The `Runtime` protocol every evaluated runtime implements, and a caching wrapper for the reference.

A runtime is given token ids, never text (see `eval.text`), and must use exactly those ids: no
BOS or other special token of its own. Each call is independent: state (a KV cache) left by an
earlier call must not influence a later one.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import BinaryIO, Protocol, runtime_checkable

import numpy as np

from kiln.core.digest import sha256_json
from kiln.core.errors import Deferred, InvalidInput

# Vocabulary rows of an output head the streamed forwards cast and apply at a time (256 MiB in float32 at hidden
# 4,096), so no [vocab, hidden] matrix is ever whole in float32 (2.1 GB at 128,256 x 4,096); the plan counts it.
HEAD_BLOCK = 16384
# A checkpoint up to this size is restored whole by the JAX forward: streaming costs a pass over the files per
# call, more than computing takes on a small model; a larger one streams by layer. (The transformers forward
# holds a model as its stage's plan decides, `eval.runtimes.residency`.)
RESIDENT_BYTES = 256 * 1024 * 1024


@runtime_checkable
class Runtime(Protocol):
    """A model loaded in the runtime that serves it."""

    @property
    def name(self) -> str:
        """The runtime, e.g. "transformers" or "llama.cpp"."""
        ...

    @property
    def version(self) -> str:
        """The runtime's package version(s), recorded in the report."""
        ...

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Next-token logits at every position of one window: float32 [len(token_ids), V]."""
        ...

    def greedy(self, prompts: Sequence[Sequence[int]], n: int) -> list[list[int]]:
        """Exactly `n` tokens continuing each prompt by argmax (no stop at EOS), one list per prompt.

        A runtime may decode prompts of equal length together, one batch on one KV cache, as a server
        batches requests; each prompt's continuation depends on that prompt alone.
        """
        ...

    def close(self) -> None:
        """Release the model; the runtime is unusable afterwards."""
        ...


def checkpoint_bytes(model_dir: str | Path) -> int:
    """The bytes of a model directory's SafeTensors files: one pass over its weights."""
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def check_ids(token_ids: Sequence[int], vocab: int, who: str) -> list[int]:
    """`token_ids` as a non-empty list of ints in [0, vocab); a clear error instead of a native crash."""
    ids = [int(t) for t in token_ids]
    if not ids:
        raise InvalidInput(f"{who}: no token ids given")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise InvalidInput(f"{who}: token id {bad[0]} is outside the vocab [0, {vocab})", details={"id": bad[0]})
    return ids


def greedy_by_length(
    prompts: Sequence[Sequence[int]],
    vocab: int,
    who: str,
    decode: Callable[[list[list[int]], int], list[list[int]]],
    n: int,
) -> list[list[int]]:
    """Each prompt's `n` greedy tokens, prompts of equal length decoded together by `decode(batch, n)` (one
    batch without padding, so no prompt's result depends on another's length)."""
    checked = [check_ids(p, vocab, who) for p in prompts]
    out: list[list[int]] = [[] for _ in checked]
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(checked):
        by_length.setdefault(len(ids), []).append(i)
    for indices in by_length.values():
        for i, tokens in zip(indices, decode([checked[i] for i in indices], n), strict=True):
            out[i] = tokens
    return out


def import_runtime(modules: Sequence[str], runtime: str, where: str = "install kiln[build]") -> list[ModuleType]:
    """`modules` imported, or Deferred naming the runtime that is not here (`runtime_needed`) and `where` it is."""
    import importlib

    try:
        return [importlib.import_module(name) for name in modules]
    except ImportError as e:
        names = "/".join(dict.fromkeys(name.partition(".")[0] for name in modules))
        raise Deferred(
            f"{names} {'is' if '/' not in names else 'are'} not installed here ({e}); {where}",
            details={"runtime_needed": runtime},
        ) from None


def import_torch_transformers() -> tuple[ModuleType, ModuleType]:
    """torch and transformers, or Deferred naming what to install."""
    torch, transformers = import_runtime(("torch", "transformers"), "transformers")
    return torch, transformers


class CachedRuntime:
    """Wraps a runtime and computes each window's logits (and each greedy continuation) once.

    The reference is evaluated once and compared with many candidates. Results are keyed by the
    sha256 of (runtime name, version, `identity`, token ids). Two stores, chosen by `cache_dir`:

    - `None` (default): kept in memory. 4096 tokens x vocab 4096 x float32 is 64 MiB; for larger
      vocabularies or texts use a directory.
    - a directory: each window's logits are written as one `.npy` (temp file, then rename, so a
      crash leaves no partial entry) and read back memory-mapped, so memory does not grow with the
      text. The directory may be shared between runs and processes; `identity` (e.g. the source
      digest) must then tell apart models whose runtime and ids are the same.
    """

    def __init__(self, runtime: Runtime, cache_dir: str | Path | None = None, *, identity: str = "") -> None:
        self.runtime = runtime
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.identity = identity
        self._logits: dict[str, np.ndarray] = {}
        self._greedy: dict[str, list[int]] = {}
        self.computed = 0  # runtime calls actually made (a cache miss each)
        if self.cache_dir is not None:
            self.cache_dir.mkdir(parents=True, exist_ok=True)

    @property
    def name(self) -> str:
        return self.runtime.name

    @property
    def version(self) -> str:
        return self.runtime.version

    def _key(self, kind: str, payload: object) -> str:
        return sha256_json(
            {"kind": kind, "runtime": self.name, "version": self.version, "identity": self.identity, "ids": payload}
        )

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        key = self._key("logits", [int(t) for t in token_ids])
        if self.cache_dir is None:
            if key not in self._logits:
                self.computed += 1
                logits = np.asarray(self.runtime.logits(token_ids), dtype=np.float32)
                logits.flags.writeable = False  # shared by every comparison that reads it
                self._logits[key] = logits
            return self._logits[key]
        path = self.cache_dir / f"{key}.npy"
        if not path.exists():
            self.computed += 1
            _atomic_write(path, lambda f: np.save(f, np.asarray(self.runtime.logits(token_ids), dtype=np.float32)))
        arr: np.ndarray = np.load(path, mmap_mode="r")
        return arr

    def greedy(self, prompts: Sequence[Sequence[int]], n: int) -> list[list[int]]:
        keys = [self._key("greedy", {"prompt": [int(t) for t in p], "n": n}) for p in prompts]
        missing: dict[str, Sequence[int]] = {}
        for key, prompt in zip(keys, prompts, strict=True):
            if key in self._greedy:
                continue
            path = self.cache_dir / f"{key}.json" if self.cache_dir is not None else None
            if path is not None and path.exists():
                self._greedy[key] = [int(t) for t in json.loads(path.read_text())]
            else:
                missing[key] = prompt
        if missing:  # one call for every prompt not cached: the runtime may batch them
            self.computed += len(missing)
            for key, tokens in zip(missing, self.runtime.greedy(list(missing.values()), n), strict=True):
                tokens = [int(t) for t in tokens]
                if self.cache_dir is not None:
                    _atomic_write(self.cache_dir / f"{key}.json", _writer(json.dumps(tokens).encode()))
                self._greedy[key] = tokens
        return [list(self._greedy[key]) for key in keys]

    def close(self) -> None:
        self._logits.clear()
        self.runtime.close()


def _writer(data: bytes) -> Callable[[BinaryIO], object]:
    return lambda f: f.write(data)


def write_atomic(path: Path, data: bytes) -> None:
    """`data` into `path` through a temporary file and a rename: readers see all of it or none."""
    _atomic_write(path, _writer(data))


def _atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
