"""Metrics on hand-made logits whose values are known in closed form."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kiln.core.errors import InvalidInput
from kiln.eval.metrics import MetricAccumulator, compare, greedy_agreement, log_softmax


def random_logits(t: int, v: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 3.0, (t, v)).astype(np.float32)


def test_identical_logits_agree_perfectly() -> None:
    ref = random_logits(50, 32)
    targets = np.random.default_rng(1).integers(0, 32, 50)
    m = compare(ref, ref.copy(), targets)
    assert m.kl == 0.0 and m.kl_max == 0.0
    assert m.top1 == 1.0
    assert m.ppl == m.ppl_ref and m.ppl_change == 0.0
    assert m.tokens == 50 and m.windows == 1 and m.vocab_size == 32


def test_uniform_distribution_has_perplexity_vocab_size() -> None:
    m = compare(np.zeros((7, 16), np.float32), np.zeros((7, 16), np.float32), [3] * 7)
    assert m.ppl_ref == pytest.approx(16.0, rel=1e-12)


def test_known_perplexity_and_change() -> None:
    # Reference puts 1/2 on the target, candidate 1/4: ppl 2 vs 4, a +100 % change.
    ref = np.log(np.array([[0.5, 0.25, 0.25]], np.float32))
    cand = np.log(np.array([[0.25, 0.5, 0.25]], np.float32))
    m = compare(ref, cand, [0])
    assert m.ppl_ref == pytest.approx(2.0, rel=1e-6)
    assert m.ppl == pytest.approx(4.0, rel=1e-6)
    assert m.ppl_change == pytest.approx(1.0, rel=1e-6)
    assert m.top1 == 0.0


def test_known_kl_of_shifted_distribution() -> None:
    # p = (1/2, 1/2), q = (3/4, 1/4): KL(p || q) = 1/2 ln(2/3) + 1/2 ln 2 = 1/2 ln(4/3).
    ref = np.array([[0.0, 0.0]], np.float32)
    cand = np.array([[math.log(3.0), 0.0]], np.float32)
    m = compare(ref, cand, [0])
    assert m.kl == pytest.approx(0.5 * math.log(4.0 / 3.0), rel=1e-6)
    # KL is not symmetric: KL(q || p) = 3/4 ln(3/2) + 1/4 ln(1/2).
    assert compare(cand, ref, [0]).kl == pytest.approx(0.75 * math.log(1.5) + 0.25 * math.log(0.5), rel=1e-6)


def test_constant_shift_per_row_changes_nothing() -> None:
    ref = random_logits(20, 64)
    shifted = ref + np.linspace(-50, 50, 20, dtype=np.float32)[:, None]
    m = compare(ref, shifted, np.zeros(20, int))
    assert m.kl == pytest.approx(0.0, abs=1e-10)
    assert m.top1 == 1.0
    assert m.ppl_change == pytest.approx(0.0, abs=1e-6)  # float32 rounding of the shifted logits


def test_top1_is_the_fraction_of_equal_argmax() -> None:
    ref = np.eye(4, dtype=np.float32) * 5
    cand = ref.copy()
    cand[2] = [0, 0, 0, 9]  # one row of four picks another token
    assert compare(ref, cand, [0, 1, 2, 3]).top1 == 0.75


def test_large_logits_are_stable() -> None:
    ref = np.array([[1e4, 0.0, -1e4]], np.float32)
    lp = log_softmax(ref)
    assert np.all(np.isfinite(lp[:, :2])) and lp[0, 0] == pytest.approx(0.0)
    m = compare(ref, ref, [0])
    assert m.ppl_ref == pytest.approx(1.0) and m.kl == 0.0


def test_accumulator_over_windows_equals_one_shot() -> None:
    ref, cand = random_logits(90, 40, seed=1), random_logits(90, 40, seed=2)
    targets = np.random.default_rng(3).integers(0, 40, 90)
    whole = compare(ref, cand, targets)
    acc = MetricAccumulator()
    for lo, hi in [(0, 10), (10, 55), (55, 90)]:
        acc.add(ref[lo:hi], cand[lo:hi], targets[lo:hi])
    parts = acc.result()
    assert parts.tokens == whole.tokens == 90 and parts.windows == 3
    for field in ("ppl_ref", "ppl", "ppl_change", "kl", "kl_max", "top1"):
        assert getattr(parts, field) == pytest.approx(getattr(whole, field), rel=1e-12), field


def test_padded_vocab_is_compared_on_the_model_vocab() -> None:
    ref, cand = random_logits(10, 30, seed=4), random_logits(10, 30, seed=5)
    padding = np.full((10, 2), 100.0, np.float32)  # would dominate the softmax if it were kept
    targets = list(range(10))
    plain = compare(ref, cand, targets)
    padded = compare(ref, np.concatenate([cand, padding], axis=1), targets, vocab_size=30)
    assert padded == plain
    with pytest.raises(InvalidInput, match="differ in shape"):
        compare(ref, np.concatenate([cand, padding], axis=1), targets)
    with pytest.raises(InvalidInput, match="fewer than the model vocab_size"):
        compare(ref, cand[:, :20], targets, vocab_size=30)


def test_bad_inputs_are_rejected() -> None:
    ref = random_logits(3, 8)
    with pytest.raises(InvalidInput, match="targets for 3"):
        compare(ref, ref, [1, 2])
    with pytest.raises(InvalidInput, match="target ids"):
        compare(ref, ref, [1, 2, 8])
    with pytest.raises(InvalidInput, match="no positions"):
        MetricAccumulator().result()


def test_non_finite_candidate_gives_non_finite_metrics() -> None:
    ref = random_logits(4, 8)
    cand = ref.copy()
    cand[0, 5] = -np.inf  # the candidate rules out the target entirely
    m = compare(ref, cand, [5, 1, 2, 3])
    assert m.ppl == math.inf and m.kl == math.inf
    cand[1, :] = np.nan
    assert math.isnan(compare(ref, cand, [0, 1, 2, 3]).kl)


def test_greedy_match_counts_the_prefix_and_the_positions() -> None:
    assert greedy_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == (2, 3)
    assert greedy_agreement([1, 2], [1, 2]) == (2, 2)
    assert greedy_agreement([1, 2], [7, 2]) == (0, 1)
    acc = MetricAccumulator()
    acc.add(np.zeros((1, 4), np.float32), np.zeros((1, 4), np.float32), [0])
    acc.add_greedy([1, 2, 3, 4], [1, 2, 9, 4])  # prefix 2, total 3
    acc.add_greedy([5, 6, 7, 8], [5, 6, 7, 8])  # prefix 4, total 4
    m = acc.result()
    assert m.greedy_tokens == 8
    assert m.greedy_match == 6 / 8
    assert m.greedy_match_total == 7 / 8
    with pytest.raises(InvalidInput, match="length"):
        greedy_agreement([1, 2], [1])


def test_greedy_is_absent_when_not_measured() -> None:
    m = compare(np.zeros((1, 4), np.float32), np.zeros((1, 4), np.float32), [0])
    assert m.greedy_tokens == 0 and m.greedy_match is None and m.greedy_match_total is None
