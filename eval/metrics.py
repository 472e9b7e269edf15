"""Metrics of a candidate runtime against the reference, as pure functions over logits.

Definitions (row `t` of a logits array is the next-token distribution that predicts `targets[t]`;
all softmaxes are taken in float64 over the first `vocab_size` columns; torch computes them, on every
core: numpy's float64 `exp` runs on one, and was half of a small model's eval):

- perplexity: `exp(mean_t -log p(targets[t]))`, for the reference (`ppl_ref`) and the candidate
  (`ppl`); `ppl_change = (ppl - ppl_ref) / ppl_ref` (negative when the candidate does better).
- KL: `mean_t sum_v p_ref(v) * (log p_ref(v) - log p_cand(v))`, nats per position; `kl_max` is
  the largest single-position value. The reference arrives as stored rows (`eval.reference_rows`: its
  most likely tokens and the rest as one mass), so `kl` is the KL those rows give, a lower bound, and
  `kl_error` the most the true value can exceed it by (0 when every token was kept, as `add` does with
  full reference logits).
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
grow with the length of the text (nor with the vocabulary: float64 work goes a block of rows at a
time); feeding windows one by one gives the same numbers as one call on
their concatenation (up to float64 summation order).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kiln.core.errors import InvalidInput
from kiln.eval.gates import EvalMetrics
from kiln.eval.reference_rows import CHUNK_BYTES, ReferenceRows, common_vocab, log_softmax_t, reference_rows


def log_softmax(logits: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """Row-wise log-softmax in float64 (max-subtracted, so large logits do not overflow)."""
    return log_softmax_t(logits).numpy()  # type: ignore[no-any-return]


def kl_divergence(ref_logp: npt.NDArray[np.float64], cand_logp: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """KL(ref || cand) per row from log-probabilities; zero-probability reference terms add 0."""
    import torch

    return _kl(torch.from_numpy(np.asarray(ref_logp, dtype=np.float64)), torch.from_numpy(cand_logp)).numpy()  # type: ignore[no-any-return]


def _kl(ref_logp: Any, cand_logp: Any) -> Any:
    import torch

    p = torch.exp(ref_logp)
    terms = torch.sub(ref_logp, cand_logp).mul_(p)  # in place: these are [positions, vocab] float64
    zero = p == 0.0
    if bool(zero.any()):
        terms[zero] = 0.0  # zero-probability reference terms add 0 (not 0 * inf)
    # Mathematically >= 0; clip the last-ulp negatives that summation order can leave.
    return torch.clamp(terms.sum(dim=-1), min=0.0)


def kl_bounds(ref: ReferenceRows, lo: int, cand_logp: Any) -> tuple[Any, Any]:
    """(KL_K, G) per row for reference rows lo..lo+n against `cand_logp`, the candidate's log-softmax
    (torch float64 [n, vocab]); both torch float64 [n]. KL_K <= KL(p || q) <= KL_K + G: the bounds of
    `eval.reference_rows` (exact, G = 0, for rows that kept every token)."""
    import torch

    n, vocab = cand_logp.shape
    if ref.dense is not None:  # the window's logits, whole: exact
        ref_logp = log_softmax_t(ref.dense[lo : lo + n])
        p = torch.exp(ref_logp)
        kl = torch.where(p > 0.0, p * (ref_logp - cand_logp), 0.0).sum(dim=-1)
        return torch.clamp(kl, min=0.0), torch.zeros(n, dtype=torch.float64)
    starts, ends = ref.offsets[lo : lo + n], ref.offsets[lo + 1 : lo + n + 1]
    # The kept tokens laid out dense ([n, vocab], -inf elsewhere): one scatter, then contiguous arithmetic.
    flat = torch.from_numpy(np.repeat(np.arange(n) * vocab, ends - starts) + ref.ids[starts[0] : ends[-1]])
    ref_logp = torch.full((n * vocab,), -math.inf, dtype=torch.float64)
    ref_logp[flat] = torch.from_numpy(ref.logp[starts[0] : ends[-1]])
    ref_logp = ref_logp.view(n, vocab)
    held = torch.zeros(n * vocab, dtype=torch.bool)
    held[flat] = True
    held = held.view(n, vocab)
    p = torch.exp(ref_logp)
    # Zero-probability reference terms add 0 (not 0 * inf).
    kl = torch.where(p > 0.0, p * (ref_logp - cand_logp), 0.0).sum(dim=-1)
    gap = torch.zeros(n, dtype=torch.float64)
    tail = torch.from_numpy(ref.tail_logp[lo : lo + n])
    rows_t = torch.nonzero(torch.isfinite(tail)).flatten()
    if rows_t.numel():
        # The candidate's log-probs on each tail; kept tokens are pushed past the end of an ascending sort.
        s = cand_logp[rows_t].masked_fill(held[rows_t], math.inf)
        kept = torch.from_numpy(np.diff(ref.offsets)[lo : lo + n]).to(torch.long)[rows_t]
        tail_count = vocab - kept
        lq_tail = torch.logsumexp(cand_logp[rows_t].masked_fill(held[rows_t], -math.inf), dim=-1)
        lp_tail = tail[rows_t]
        p_tail = torch.exp(lp_tail)
        merged = p_tail * (lp_tail - lq_tail)
        kl[rows_t] += merged
        # c: each row's smallest kept probability (rows keep their tokens most likely first).
        log_c = torch.from_numpy(ref.logp[ends[rows_t.numpy()] - 1])
        c = torch.exp(log_c)
        m = torch.minimum(torch.floor(p_tail / c).to(torch.long), tail_count)
        # Only the m + 1 least likely tail tokens matter: a partial selection when that is few, else a sort.
        need = max(1, min(int(m.max()) + 1, int(tail_count.max())))
        s = torch.topk(s, need, dim=-1, largest=False, sorted=True)[0] if 8 * need < vocab else torch.sort(s)[0]
        r = torch.where(m < tail_count, torch.clamp(p_tail - m.to(torch.float64) * c, min=0.0), 0.0)
        prefix = torch.cumsum(torch.where(s == math.inf, 0.0, s), dim=-1)
        last = s.shape[1] - 1
        before = torch.where(m > 0, prefix.gather(1, torch.clamp(m - 1, 0, last)[:, None])[:, 0], 0.0)
        nxt = s.gather(1, torch.clamp(m, 0, last)[:, None])[:, 0]
        vertex = c * m.to(torch.float64) * log_c - c * before
        rest = torch.where(r > 0, r * (torch.log(torch.where(r > 0, r, 1.0)) - nxt), 0.0)
        bound = vertex + rest - merged
        # An infinite merged term makes KL_K itself infinite: nothing is left to bound.
        gap[rows_t] = torch.where(torch.isfinite(merged), torch.clamp(bound, min=0.0), 0.0)
    return torch.clamp(kl, min=0.0), gap


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
        self._kl_error = 0.0
        self._top1 = 0
        self.greedy_tokens = 0
        self._greedy_prefix = 0
        self._greedy_total = 0

    def add(self, ref_logits: npt.ArrayLike, cand_logits: npt.ArrayLike, targets: Sequence[int] | np.ndarray) -> None:
        """Add one window from full reference logits: `ref_logits[t]` and `cand_logits[t]` predict `targets[t]`
        (the reference kept whole, so KL is exact: `add_rows` with every token kept)."""
        ref = common_vocab(np.asarray(ref_logits), self.vocab_size, "reference")
        cand = common_vocab(np.asarray(cand_logits), self.vocab_size, "candidate")
        if ref.shape != cand.shape:
            raise InvalidInput(
                f"reference logits {ref.shape} and candidate logits {cand.shape} differ in shape; "
                "pass vocab_size to compare on the common model vocab"
            )
        rows = reference_rows(ref, targets, tail_mass=0.0, max_entries=max(1, ref.shape[1]))
        self.add_rows(rows, cand, targets)

    def add_rows(self, ref: ReferenceRows, cand_logits: npt.ArrayLike, targets: Sequence[int] | np.ndarray) -> None:
        """Add one window: the stored reference rows `ref` (`eval.reference_rows`) and the candidate's full
        logits, row t predicting `targets[t]`. Float64 work runs `CHUNK_BYTES` of rows at a time, so memory
        is one window's candidate logits plus a bounded block, whatever the vocabulary."""
        import torch

        cand = common_vocab(np.asarray(cand_logits), self.vocab_size, "candidate")
        tgt = np.asarray(targets, dtype=np.int64)
        if cand.shape != (ref.rows, ref.vocab_size):
            raise InvalidInput(
                f"reference rows [{ref.rows}, {ref.vocab_size}] and candidate logits {cand.shape} differ in shape; "
                "pass vocab_size to compare on the common model vocab"
            )
        if tgt.shape != (ref.rows,):
            raise InvalidInput(f"{tgt.shape[0] if tgt.ndim else 0} targets for {ref.rows} logit rows")
        if self._columns is None:
            self._columns = ref.vocab_size
        elif ref.vocab_size != self._columns:
            raise InvalidInput(f"window has {ref.vocab_size} vocab columns, earlier windows had {self._columns}")
        if tgt.size and (tgt.min() < 0 or tgt.max() >= ref.vocab_size):
            raise InvalidInput(f"target ids must lie in [0, {ref.vocab_size}), got {int(tgt.min())}..{int(tgt.max())}")
        self.windows += 1
        step = max(1, CHUNK_BYTES // (8 * ref.vocab_size))
        for lo in range(0, ref.rows, step):
            hi = min(ref.rows, lo + step)
            lc = log_softmax_t(cand[lo:hi])
            kl, gap = kl_bounds(ref, lo, lc)
            self._nll -= float(lc[torch.arange(hi - lo), torch.from_numpy(tgt[lo:hi])].sum())
            self._nll_ref -= float(torch.from_numpy(ref.target_logp[lo:hi]).sum())  # summed as the candidate's
            self._kl += float(kl.sum())
            self._kl_error += float(gap.sum())
            self._kl_max = max(self._kl_max, float(kl.max()))
            if bool(kl.isnan().any()):
                self._kl_max = math.nan
            self._top1 += int(np.sum(ref.argmax[lo:hi] == np.argmax(cand[lo:hi], axis=-1)))
        self.tokens += ref.rows

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
            kl_error=self._kl_error / self.tokens,
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
