"""The reference's next-token distributions, stored small, with a bound on the KL they can give.

Full float32 logits of Llama-3's 128,256-token vocabulary are 513 KB per scored position: 2.1 GB for a
4,096-token eval text, per release, read back by every eval. The reference stage stores instead, for
each row t (the distribution p that predicts `targets[t]`):

- the smallest set K of most likely tokens whose remaining mass p_T = 1 - sum_K p falls to `tail_mass`
  or below, capped at `max_entries` tokens, with their log-probabilities (float64);
- log p_T, the rest of the vocabulary as one mass (-inf when K is the whole vocabulary);
- log p(targets[t]) (the reference's perplexity) and the argmax, first index on ties (top-1), exact.

KL(p || q) against a candidate q is then bounded on both sides from the stored rows and the candidate's
own full logits (`kl_bounds`). Merging the tail into one outcome can only lower KL (the log-sum
inequality), so

    KL_K = sum_K p_i log(p_i / q_i) + p_T log(p_T / q_T)  <=  KL(p || q),    q_T = 1 - sum_K q_i.

What it misses, G = sum_T p_i log(p_i / q_i) - p_T log(p_T / q_T), is at most its largest value over
every tail consistent with what was stored: each tail p_i at most c (the smallest kept probability: K
holds the most likely tokens), summing to p_T. A convex function over that polytope peaks at a vertex,
which puts mass c on the tail tokens the candidate finds least likely (q_(0) <= q_(1) <= ...):

    G  <=  sum_{j<m} c log(c / q_(j)) + r log(r / q_(m)) - p_T log(p_T / q_T),   m = floor(p_T / c), r = p_T - m c.

A window whose kept tokens would take more bytes than its logits (12 per token against 4 per column: a
vocabulary less than three times the tokens kept) stores its float32 logits instead, exactly.

So each eval reports `kl` = mean KL_K and `kl_error` = the mean of that bound: the true mean KL lies in
[kl, kl + kl_error] (tests/eval/test_reference_rows.py checks it against full logits). Where K is the
whole vocabulary (a small vocabulary, or a row whose tail is empty) both are exact and the bound is 0.
A peaked row reaches the tail mass in a few hundred tokens; a flat row (a random-weight model's, or a
position where the model hesitates between thousands of tokens) reaches `max_entries` first, and its
bound says how much is then unknown.
"""

from __future__ import annotations

import io
import json
import math
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput, KilnError

# Defaults. A row stops keeping tokens once the rest of the vocabulary holds at most TAIL_MASS (what it
# leaves out of KL is then at most about TAIL_MASS x log(c / q_min): ~3e-8 nats), or at MAX_ENTRIES tokens
# (12 bytes each): at most 48 KiB per position, 201 MB for 4,096 positions at any vocabulary, against
# 2.1 GB of float32 logits at 128,256; a vocabulary of up to 4,096 tokens is kept whole (exact).
TAIL_MASS = 1e-9
MAX_ENTRIES = 4096
CHUNK_BYTES = 64 * 1024 * 1024  # float64 work arrays are processed this many bytes of rows at a time


@dataclass(frozen=True)
class ReferenceRows:
    """One window's stored reference distributions (see the module docstring); rows are CSR-packed."""

    vocab_size: int
    target_logp: npt.NDArray[np.float64]  # [rows] log p(targets[t])
    argmax: npt.NDArray[np.int64]  # [rows]
    offsets: npt.NDArray[np.int64]  # [rows + 1]: row t keeps ids[offsets[t]:offsets[t + 1]]
    ids: npt.NDArray[np.int32]  # kept token ids, most likely first within a row
    logp: npt.NDArray[np.float64]  # their log-probabilities
    tail_logp: npt.NDArray[np.float64]  # [rows] log of the mass not kept; -inf when nothing is left
    # The window's logits whole [rows, vocab] (float32, as the runtime gave them), instead of the kept tokens,
    # where that is smaller: a vocabulary not much wider than the tokens a row keeps. Exact; nothing in a tail.
    dense: np.ndarray | None = None

    @property
    def rows(self) -> int:
        return int(self.target_logp.shape[0])

    def to_bytes(self) -> bytes:
        arrays: dict[str, np.ndarray] = {
            "vocab_size": np.asarray(self.vocab_size, dtype=np.int64),
            "target_logp": self.target_logp,
            "argmax": self.argmax,
            "offsets": self.offsets,
            "ids": self.ids,
            "logp": self.logp,
            "tail_logp": self.tail_logp,
        }
        if self.dense is not None:
            arrays["dense"] = self.dense
        buf = io.BytesIO()
        np.savez(buf, allow_pickle=False, **arrays)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> ReferenceRows:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            rows = cls(
                vocab_size=int(z["vocab_size"]),
                target_logp=np.asarray(z["target_logp"], dtype=np.float64),
                argmax=np.asarray(z["argmax"], dtype=np.int64),
                offsets=np.asarray(z["offsets"], dtype=np.int64),
                ids=np.asarray(z["ids"], dtype=np.int32),
                logp=np.asarray(z["logp"], dtype=np.float64),
                tail_logp=np.asarray(z["tail_logp"], dtype=np.float64),
                dense=np.asarray(z["dense"]) if "dense" in z.files else None,
            )
        rows.check()
        return rows

    def check(self) -> None:
        """The arrays agree with each other (a stored file is read back through this)."""
        n = self.rows
        shapes = self.argmax.shape == (n,) and self.tail_logp.shape == (n,) and self.offsets.shape == (n + 1,)
        if self.dense is not None:
            ok = (
                shapes
                and self.dense.shape == (n, self.vocab_size)
                and self.dense.dtype in (np.float32, np.float64)
                and self.ids.size == 0
                and not bool(np.isfinite(self.tail_logp).any())
            )
        else:
            ok = (
                shapes
                and self.ids.shape == self.logp.shape
                and (n == 0 or (self.offsets[0] == 0 and self.offsets[-1] == self.ids.shape[0]))
                and bool(np.all(np.diff(self.offsets) >= 1) if n else True)
                and (self.ids.size == 0 or (int(self.ids.min()) >= 0 and int(self.ids.max()) < self.vocab_size))
            )
        if not ok:
            raise InvalidInput("stored reference rows are inconsistent", code=Codes.REFERENCE_ROWS_CORRUPT)


def reference_rows(
    logits: npt.ArrayLike,
    targets: npt.ArrayLike,
    *,
    vocab_size: int | None = None,
    tail_mass: float = TAIL_MASS,
    max_entries: int = MAX_ENTRIES,
) -> ReferenceRows:
    """The stored form of `logits` [rows, columns] whose row t predicts `targets[t]`, on the first
    `vocab_size` columns (all when None; `eval.metrics.common_vocab`)."""
    import torch

    if not (0.0 <= tail_mass < 1.0) or max_entries < 1:
        raise InvalidInput(f"tail_mass must lie in [0, 1) and max_entries be >= 1, got {tail_mass}, {max_entries}")
    arr = common_vocab(np.asarray(logits), vocab_size, "reference")
    tgt = np.asarray(targets, dtype=np.int64)
    rows, vocab = arr.shape
    if tgt.shape != (rows,):
        raise InvalidInput(f"{tgt.shape[0] if tgt.ndim else 0} targets for {rows} logit rows")
    if tgt.size and (tgt.min() < 0 or tgt.max() >= vocab):
        raise InvalidInput(f"target ids must lie in [0, {vocab}), got {int(tgt.min())}..{int(tgt.max())}")
    keep_cap = min(max_entries, vocab)
    target_logp = np.empty(rows, dtype=np.float64)
    argmax = np.argmax(arr, axis=-1).astype(np.int64) if rows else np.zeros(0, dtype=np.int64)
    tail_logp = np.empty(rows, dtype=np.float64)
    counts = np.empty(rows, dtype=np.int64)
    ids_parts: list[np.ndarray] = []
    logp_parts: list[np.ndarray] = []
    step = max(1, CHUNK_BYTES // (8 * max(vocab, 1)))
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        lp = log_softmax_t(arr[lo:hi])
        target_logp[lo:hi] = lp[torch.arange(hi - lo), torch.from_numpy(tgt[lo:hi])].numpy()
        vals, idx = torch.topk(lp, keep_cap, dim=-1, largest=True, sorted=True)
        # Mass left after keeping j + 1 tokens; keep the fewest that leave <= tail_mass, at most keep_cap.
        left = 1.0 - torch.cumsum(torch.exp(vals), dim=-1)
        enough = left <= tail_mass
        k = torch.where(enough.any(dim=-1), enough.to(torch.int8).argmax(dim=-1) + 1, keep_cap)
        if tail_mass == 0.0:  # keep every token up to the cap (1 - cumsum can reach 0 early by rounding)
            k = torch.full_like(k, keep_cap)
        kept = torch.arange(keep_cap)[None, :] < k[:, None]
        counts[lo:hi] = k.numpy()
        ids_parts.append(idx[kept].numpy().astype(np.int32))  # row-major: each row's tokens, most likely first
        logp_parts.append(vals[kept].numpy())
        # The tail's mass summed from its own terms (1 - cumsum would lose it to rounding); -inf when empty.
        rest = lp.scatter(1, idx, torch.where(kept, -math.inf, vals))
        tail_logp[lo:hi] = torch.logsumexp(rest, dim=-1).numpy()
    offsets = np.zeros(rows + 1, dtype=np.int64)
    if int(counts.sum()) * 12 >= arr.size * arr.itemsize and arr.dtype in (np.float32, np.float64):
        # Keeping the tokens would take more than the logits themselves: keep the logits (exact).
        return ReferenceRows(
            vocab_size=vocab,
            target_logp=target_logp,
            argmax=argmax,
            offsets=offsets,
            ids=np.zeros(0, dtype=np.int32),
            logp=np.zeros(0, dtype=np.float64),
            tail_logp=np.full(rows, -math.inf),
            dense=np.ascontiguousarray(arr),
        )
    np.cumsum(counts, out=offsets[1:])
    return ReferenceRows(
        vocab_size=vocab,
        target_logp=target_logp,
        argmax=argmax,
        offsets=offsets,
        ids=np.concatenate(ids_parts) if ids_parts else np.zeros(0, dtype=np.int32),
        logp=np.concatenate(logp_parts) if logp_parts else np.zeros(0, dtype=np.float64),
        tail_logp=tail_logp,
    )


def common_vocab(logits: np.ndarray, vocab_size: int | None, who: str) -> np.ndarray:
    """The first `vocab_size` columns of `logits` (all of them when `vocab_size` is None)."""
    if logits.ndim != 2:
        raise InvalidInput(f"{who} logits must be 2-D [positions, vocab], got shape {logits.shape}")
    if vocab_size is None:
        return logits
    if logits.shape[1] < vocab_size:
        raise InvalidInput(
            f"{who} logits have {logits.shape[1]} columns, fewer than the model vocab_size {vocab_size}",
            details={"columns": int(logits.shape[1]), "vocab_size": vocab_size},
        )
    return logits[:, :vocab_size]


def log_softmax_t(logits: npt.ArrayLike) -> Any:
    import torch

    x = torch.from_numpy(np.asarray(logits, dtype=np.float64))
    out = torch.log_softmax(x, dim=-1)
    dead = torch.isneginf(x).all(dim=-1)
    if bool(dead.any()):  # an all -inf row stays -inf instead of becoming NaN
        out[dead] = -math.inf
    return out


class ReferenceStore:
    """The reference's stored rows per window and greedy continuations per prompt, in one directory.

    Entries are keyed by the sha256 of (kind, `identity`, token ids), written to a temporary file and
    renamed (a crash leaves no partial entry), and read back checked. The reference stage writes them
    (`put_rows`, `put_greedy`); every eval reads them (`rows`, `greedy`); asking for an entry that was
    not stored is an error, never a recomputation."""

    def __init__(self, directory: str | Path, *, identity: str, name: str = "transformers", version: str = "") -> None:
        self.directory = Path(directory)
        self.identity = identity
        self.name = name
        self.version = version

    def _path(self, kind: str, payload: object, suffix: str) -> Path:
        from kiln.core.digest import sha256_json

        key = sha256_json({"kind": kind, "identity": self.identity, "ids": payload})
        return self.directory / f"{key}{suffix}"

    def put_rows(self, window: Sequence[int], rows: ReferenceRows) -> None:
        from kiln.eval.runtimes.base import write_atomic

        write_atomic(self._path("rows", [int(t) for t in window], ".npz"), rows.to_bytes())

    def rows(self, window: Sequence[int]) -> ReferenceRows:
        path = self._path("rows", [int(t) for t in window], ".npz")
        if not path.is_file():
            raise KilnError("reference rows for these token ids were not recorded", code=Codes.REFERENCE_MISSING)
        try:
            return ReferenceRows.from_bytes(path.read_bytes())
        except (ValueError, KeyError, OSError, EOFError, zipfile.BadZipFile) as e:
            raise InvalidInput(
                f"stored reference rows {path.name} are unreadable: {e}", code=Codes.REFERENCE_ROWS_CORRUPT
            ) from None

    def put_greedy(self, prompt: Sequence[int], n: int, tokens: Sequence[int]) -> None:
        from kiln.eval.runtimes.base import write_atomic

        path = self._path("greedy", {"prompt": [int(t) for t in prompt], "n": n}, ".json")
        write_atomic(path, json.dumps([int(t) for t in tokens]).encode())

    def greedy(self, prompts: Sequence[Sequence[int]], n: int) -> list[list[int]]:
        out = []
        for prompt in prompts:
            path = self._path("greedy", {"prompt": [int(t) for t in prompt], "n": n}, ".json")
            if not path.is_file():
                raise KilnError("reference continuation for this prompt was not recorded", code=Codes.REFERENCE_MISSING)
            tokens = json.loads(path.read_text())
            if not (isinstance(tokens, list) and len(tokens) == n and all(type(t) is int for t in tokens)):
                raise InvalidInput(
                    f"stored continuation {path.name} is not {n} token ids", code=Codes.REFERENCE_ROWS_CORRUPT
                )
            out.append(tokens)
        return out

    def close(self) -> None:
        pass
