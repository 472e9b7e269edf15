"""The stored reference rows (eval.reference_rows): the KL they give brackets the KL of full logits.

Every case compares the accumulator fed stored rows with the same accumulator fed the full reference
logits (every token kept: exact), on the same candidate logits.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.core.errors import InvalidInput, KilnError
from kiln.eval import metrics
from kiln.eval import reference_rows as rr
from kiln.eval.metrics import MetricAccumulator
from kiln.eval.reference_rows import ReferenceRows, ReferenceStore, reference_rows


def _case(
    seed: int, rows: int, vocab: int, sharpness: float, noise: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ref = (rng.standard_normal((rows, vocab)) * sharpness).astype(np.float32)
    cand = (ref + rng.standard_normal((rows, vocab)) * noise).astype(np.float32)
    targets = rng.integers(0, vocab, rows)
    return ref, cand, targets


def _exact_and_stored(ref, cand, targets, **cut):  # type: ignore[no-untyped-def]
    exact, stored = MetricAccumulator(), MetricAccumulator()
    exact.add(ref, cand, targets)
    stored.add_rows(reference_rows(ref, targets, **cut), cand, targets)
    return exact.result(), stored.result()


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    vocab=st.integers(2, 700),
    sharpness=st.sampled_from([0.1, 1.0, 3.0, 8.0]),
    noise=st.sampled_from([0.0, 0.05, 0.5, 3.0]),
    tail_mass=st.sampled_from([0.0, 1e-6, 1e-3, 0.2]),
    max_entries=st.integers(1, 64),
)
def test_true_kl_lies_within_the_stored_bound(
    seed: int, vocab: int, sharpness: float, noise: float, tail_mass: float, max_entries: int
) -> None:
    ref, cand, targets = _case(seed, 9, vocab, sharpness, noise)
    exact, stored = _exact_and_stored(ref, cand, targets, tail_mass=tail_mass, max_entries=max_entries)
    tol = 1e-12 + 1e-9 * exact.kl
    assert exact.kl_error == 0.0
    assert stored.kl <= exact.kl + tol
    assert exact.kl <= stored.kl + stored.kl_error + tol
    # What the rows keep exactly: the reference's perplexity, the candidate's, top-1 agreement.
    assert stored.ppl_ref == pytest.approx(exact.ppl_ref, rel=1e-12)
    assert stored.ppl == pytest.approx(exact.ppl, rel=1e-12)
    assert stored.top1 == exact.top1


def test_the_bound_is_reached_when_the_tail_sits_on_the_candidates_least_likely_token() -> None:
    """The upper bound is the KL of a distribution consistent with the rows, so it is as low as it can be."""
    vocab = 64
    q = np.ones(vocab)
    q[:3] = [1e-6, 1e-4, 1e-2]  # the candidate's least likely tokens
    q /= q.sum()
    p = np.zeros(vocab)
    p[60], p[61], p[0] = 0.6, 0.3, 0.1  # kept: 60 and 61; the tail's 0.1 (< c = 0.3) all on token 0
    ref = np.log(np.where(p > 0, p, 1e-300))[None]
    cand = np.log(q)[None]
    targets = np.array([60])
    exact = MetricAccumulator()
    exact.add(ref, cand, targets)
    stored = MetricAccumulator()
    stored.add_rows(reference_rows(ref, targets, tail_mass=0.2, max_entries=2), cand, targets)
    got = stored.result()
    assert got.kl_error > 0.5  # the tail on a token the candidate gives 1e-6 is most of the KL
    assert got.kl + got.kl_error == pytest.approx(exact.result().kl, rel=1e-9)


def test_rows_that_keep_every_token_are_exact_and_a_cut_rows_tail_is_its_mass() -> None:
    ref, cand, targets = _case(1, 5, 50, 2.0, 0.3)
    exact, whole = _exact_and_stored(ref, cand, targets, tail_mass=0.0, max_entries=50)
    assert whole.kl == pytest.approx(exact.kl, rel=1e-12) and whole.kl_error == 0.0
    rows = reference_rows(ref, targets, tail_mass=0.0, max_entries=10)
    lp = metrics.log_softmax(ref)
    for t in range(5):
        kept = rows.ids[rows.offsets[t] : rows.offsets[t + 1]]
        assert list(kept) == list(np.argsort(-lp[t], kind="stable")[:10])
        rest = np.delete(np.exp(lp[t]), kept).sum()
        assert math.exp(rows.tail_logp[t]) == pytest.approx(rest, rel=1e-12)
        assert rows.argmax[t] == int(np.argmax(ref[t]))
        assert rows.target_logp[t] == pytest.approx(lp[t, targets[t]], rel=1e-12)


def test_blocks_of_rows_give_the_same_numbers_as_one_block(monkeypatch: pytest.MonkeyPatch) -> None:
    ref, cand, targets = _case(2, 40, 300, 2.0, 0.4)
    whole = _exact_and_stored(ref, cand, targets, tail_mass=1e-3, max_entries=20)[1]
    monkeypatch.setattr(rr, "CHUNK_BYTES", 8 * 300 * 3)  # three rows at a time
    monkeypatch.setattr(metrics, "CHUNK_BYTES", 8 * 300 * 3)
    blocked = _exact_and_stored(ref, cand, targets, tail_mass=1e-3, max_entries=20)[1]
    assert blocked.kl == pytest.approx(whole.kl, rel=1e-12)
    assert blocked.kl_error == pytest.approx(whole.kl_error, rel=1e-12)


def test_stored_size_at_llama3_vocabulary_is_bounded_by_max_entries() -> None:
    """A flat 128,256-token row keeps `max_entries` tokens: 12 bytes each, not the 513 KB of its logits."""
    ref, _, targets = _case(3, 4, 128_256, 1.0, 0.0)
    rows = reference_rows(ref, targets, tail_mass=1e-6, max_entries=256)
    assert list(np.diff(rows.offsets)) == [256] * 4
    assert len(rows.to_bytes()) < 4 * 256 * 12 + 4 * 64 + 2048


def test_store_round_trip_and_corruption(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ref, _, targets = _case(4, 6, 40, 2.0, 0.0)
    rows = reference_rows(ref, targets, tail_mass=1e-4, max_entries=8)
    store = ReferenceStore(tmp_path, identity="source-digest")
    window = [int(t) for t in range(7)]
    store.put_rows(window, rows)
    back = store.rows(window)
    assert isinstance(back, ReferenceRows)
    for name in ("target_logp", "argmax", "offsets", "ids", "logp", "tail_logp"):
        assert np.array_equal(getattr(back, name), getattr(rows, name))
    with pytest.raises(KilnError) as missing:
        store.rows([1, 2, 3])
    assert missing.value.code == "REFERENCE_MISSING"
    other = ReferenceStore(tmp_path, identity="another-source")
    with pytest.raises(KilnError):
        other.rows(window)  # another source's rows are never read for this one
    (path,) = tmp_path.glob("*.npz")
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(InvalidInput) as corrupt:
        store.rows(window)
    assert corrupt.value.code == "REFERENCE_ROWS_CORRUPT"
    store.put_greedy([1, 2], 3, [4, 5, 6])
    assert store.greedy([[1, 2]], 3) == [[4, 5, 6]]
    with pytest.raises(KilnError):
        store.greedy([[1, 2]], 4)


def test_inconsistent_rows_are_refused() -> None:
    ref, _, targets = _case(5, 3, 20, 1.0, 0.0)
    rows = reference_rows(ref, targets, tail_mass=0.0, max_entries=4)
    bad = ReferenceRows(**{**rows.__dict__, "ids": np.full_like(rows.ids, 99)})
    with pytest.raises(InvalidInput) as e:
        bad.check()
    assert e.value.code == "REFERENCE_ROWS_CORRUPT"


def test_a_window_whose_kept_tokens_outweigh_its_logits_keeps_the_logits(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A small vocabulary (the example's 4,096) keeps nearly every token: 12 bytes each would be three times
    the float32 logits, so the window stores those, and its KL is exact."""
    ref, cand, targets = _case(6, 30, 64, 0.5, 0.2)
    rows = reference_rows(ref, targets, tail_mass=1e-9, max_entries=4096)
    assert rows.dense is not None and rows.dense.dtype == np.float32 and rows.ids.size == 0
    store = ReferenceStore(tmp_path, identity="s")
    store.put_rows(list(range(31)), rows)
    back = store.rows(list(range(31)))
    assert back.dense is not None and np.array_equal(back.dense, ref)
    assert len(rows.to_bytes()) < ref.nbytes + 4096
    exact, stored = MetricAccumulator(), MetricAccumulator()
    exact.add(ref, cand, targets)
    stored.add_rows(back, cand, targets)
    assert stored.result().kl == exact.result().kl and stored.result().kl_error == 0.0
