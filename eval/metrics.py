"""Metrics of a candidate runtime against the reference, as pure functions over logits.

Definitions (row `t` of a logits array is the next-token distribution that predicts `targets[t]`;
all softmaxes are taken in float64 over the first `vocab_size` columns; torch computes them, on every
core: numpy's float64 `exp` runs on one, and was half of a small model's eval):

- perplexity: `exp(mean_t -log p(targets[t]))`, for the reference (`ppl_ref`) and the candidate
  (`ppl`); `ppl_change = (ppl - ppl_ref) / ppl_ref` (negative when the candidate does better).
- KL: `mean_t sum_v p_ref(v) * (log p_ref(v) - log p_cand(v))`, nats per position; `kl_max` is
  the largest single-position value.
- top-1 agreement: fraction of positions where `argmax ref == argmax cand` (first index on ties).
- greedy continuation match, per prompt, between the reference's greedy tokens `r` and the
  candidate's `c` (both exactly `n` tokens; generation does not stop at EOS):
  * `greedy_match` = (length of the longest common prefix of r and c) / n, i.e. the tokens the
    candidate reproduces in order before its first divergence; once a runtime picks a different
    token the two continuations condition on different text, so later agreement is not counted;
  * `greedy_match_total` = (number of positions i with r[i] == c[i]) / n, position-wise agreement
    including any re-convergence after a divergence. Always >= `greedy_match`.
  Over many prompts both are pooled: summed matches / summed generated tokens.

Vocab padding: runtimes may return more columns than the model's vocab (GGUF writers and some
serving stacks pad the embedding to a multiple of 32/64/128). Both sides are then compared on the
first `vocab_size` columns, `vocab_size` being config.json's `vocab_size` (the model's vocab, which
itself may exceed the tokenizer's token count); the padded columns' probability mass is dropped
and each side renormalised. A runtime returning fewer columns than `vocab_size` is an error.

`MetricAccumulator` is fed one window at a time and keeps only running sums, so memory does not
grow with the length of the text; feeding windows one by one gives the same numbers as one call on
their concatenation (up to float64 summation order).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from core.errors import InvalidInput
from eval.gates import EvalMetrics


def log_softmax(logits: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """Row-wise log-softmax in float64 (max-subtracted, so large logits do not overflow)."""
    return _log_softmax(logits).numpy()  # type: ignore[no-any-return]


def kl_divergence(ref_logp: npt.NDArray[np.float64], cand_logp: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """KL(ref || cand) per row from log-probabilities; zero-probability reference terms add 0."""
    import torch

    return _kl(torch.from_numpy(np.asarray(ref_logp, dtype=np.float64)), torch.from_numpy(cand_logp)).numpy()  # type: ignore[no-any-return]


def _log_softmax(logits: npt.ArrayLike) -> Any:
    import torch

    x = torch.from_numpy(np.asarray(logits, dtype=np.float64))
    out = torch.log_softmax(x, dim=-1)
    dead = torch.isneginf(x).all(dim=-1)
    if bool(dead.any()):  # an all -inf row stays -inf instead of becoming NaN
        out[dead] = -math.inf
    return out


def _kl(ref_logp: Any, cand_logp: Any) -> Any:
    import torch

    p = torch.exp(ref_logp)
    terms = torch.sub(ref_logp, cand_logp).mul_(p)  # in place: these are [positions, vocab] float64
    zero = p == 0.0
    if bool(zero.any()):
        terms[zero] = 0.0  # zero-probability reference terms add 0 (not 0 * inf)
    # Mathematically >= 0; clip the last-ulp negatives that summation order can leave.
    return torch.clamp(terms.sum(dim=-1), min=0.0)


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


def greedy_agreement(reference: Sequence[int], candidate: Sequence[int]) -> tuple[int, int]:
    """(common prefix length, position-wise matches) of two greedy continuations of equal length."""
    if len(reference) != len(candidate):
        raise InvalidInput(f"greedy continuations differ in length: {len(reference)} vs {len(candidate)}")
    same = [int(r) == int(c) for r, c in zip(reference, candidate, strict=True)]
    prefix = same.index(False) if False in same else len(same)
    return prefix, sum(same)


class MetricAccumulator:
    """Running sums of every metric; feed windows with `add`, prompts with `add_greedy`, then `result`."""

    def __init__(self, vocab_size: int | None = None) -> None:
        self.vocab_size = vocab_size
        self._columns: int | None = vocab_size
        self.tokens = 0
        self.windows = 0
        self._nll_ref = 0.0
        self._nll = 0.0
        self._kl = 0.0
        self._kl_max = 0.0
        self._top1 = 0
        self.greedy_tokens = 0
        self._greedy_prefix = 0
        self._greedy_total = 0

    def add(self, ref_logits: npt.ArrayLike, cand_logits: npt.ArrayLike, targets: Sequence[int] | np.ndarray) -> None:
        """Add one window: `ref_logits[t]` and `cand_logits[t]` predict `targets[t]`."""
        ref = common_vocab(np.asarray(ref_logits), self.vocab_size, "reference")
        cand = common_vocab(np.asarray(cand_logits), self.vocab_size, "candidate")
        tgt = np.asarray(targets, dtype=np.int64)
        if ref.shape != cand.shape:
            raise InvalidInput(
                f"reference logits {ref.shape} and candidate logits {cand.shape} differ in shape; "
                "pass vocab_size to compare on the common model vocab"
            )
        if tgt.shape != (ref.shape[0],):
            raise InvalidInput(f"{tgt.shape[0] if tgt.ndim else 0} targets for {ref.shape[0]} logit rows")
        if self._columns is None:
            self._columns = int(ref.shape[1])
        elif ref.shape[1] != self._columns:
            raise InvalidInput(f"window has {ref.shape[1]} vocab columns, earlier windows had {self._columns}")
        if tgt.size and (tgt.min() < 0 or tgt.max() >= ref.shape[1]):
            raise InvalidInput(f"target ids must lie in [0, {ref.shape[1]}), got {int(tgt.min())}..{int(tgt.max())}")
        self.windows += 1
        if not tgt.size:
            return
        import torch

        lr, lc = _log_softmax(ref), _log_softmax(cand)
        rows, index = torch.arange(tgt.size), torch.from_numpy(tgt)
        kl = _kl(lr, lc)
        self.tokens += int(tgt.size)
        self._nll_ref -= float(lr[rows, index].sum())
        self._nll -= float(lc[rows, index].sum())
        self._kl += float(kl.sum())
        self._kl_max = max(self._kl_max, float(kl.max()))
        if bool(kl.isnan().any()):
            self._kl_max = math.nan
        self._top1 += int(np.sum(np.argmax(ref, axis=-1) == np.argmax(cand, axis=-1)))

    def add_greedy(self, reference: Sequence[int], candidate: Sequence[int]) -> None:
        """Add one prompt's greedy continuations (equal length, reference first)."""
        prefix, total = greedy_agreement(reference, candidate)
        self.greedy_tokens += len(reference)
        self._greedy_prefix += prefix
        self._greedy_total += total

    def result(self) -> EvalMetrics:
        """The metrics over everything added so far."""
        if self.tokens == 0:
            raise InvalidInput("no positions were scored (every window shorter than 2 tokens?)")
        ppl_ref = _exp(self._nll_ref / self.tokens)
        ppl = _exp(self._nll / self.tokens)
        g = self.greedy_tokens
        return EvalMetrics(
            tokens=self.tokens,
            windows=self.windows,
            vocab_size=self._columns or 1,
            ppl_ref=ppl_ref,
            ppl=ppl,
            ppl_change=(ppl - ppl_ref) / ppl_ref,
            kl=self._kl / self.tokens,
            kl_max=self._kl_max,
            top1=self._top1 / self.tokens,
            greedy_tokens=g,
            greedy_match=self._greedy_prefix / g if g else None,
            greedy_match_total=self._greedy_total / g if g else None,
        )


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:  # a candidate that puts ~0 probability on the text
        return math.inf


def compare(
    ref_logits: npt.ArrayLike,
    cand_logits: npt.ArrayLike,
    targets: Sequence[int] | np.ndarray,
    *,
    vocab_size: int | None = None,
) -> EvalMetrics:
    """One-shot metrics of one block of logits (the accumulator fed once)."""
    acc = MetricAccumulator(vocab_size)
    acc.add(ref_logits, cand_logits, targets)
    return acc.result()
