"""Default gates, recipe overrides and verdicts with their reasons."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from kiln.core.errors import RecipeInvalid, UnknownName
from kiln.eval.gates import DEFAULT_GATES, GATE_KEYS, EvalMetrics, Gate, check, gate_for
from kiln.formats.gguf.constants import QUANTS as GGUF_QUANTS
from kiln.quant.catalog import METHODS


def metrics(**changes: float | None) -> EvalMetrics:
    base: dict[str, float | int | None] = dict(
        tokens=1000, windows=4, vocab_size=512, ppl_ref=10.0, ppl=10.01, ppl_change=0.001, kl=1e-4,
        kl_max=1e-3, top1=0.999, greedy_tokens=128, greedy_match=1.0, greedy_match_total=1.0,
    )  # fmt: skip
    return EvalMetrics.model_validate({**base, **changes})


@pytest.mark.parametrize("quant", sorted({*GGUF_QUANTS, *METHODS}))
def test_every_offered_quant_has_a_default(quant: str) -> None:
    gate = gate_for(quant)
    assert gate == DEFAULT_GATES[quant]
    assert gate.max_kl is not None and gate.min_top1 is not None and gate.max_ppl_increase is not None


def test_registered_targets_quants_have_defaults() -> None:
    from kiln.targets.base import all_targets

    targets = all_targets()
    missing = {f"{t.name}:{q}" for t in targets.values() for q in t.quants if q not in DEFAULT_GATES}
    assert not missing


def test_defaults_loosen_as_bits_drop() -> None:
    order = ["f32", "f16", "q8_0", "q6_k", "q4_k_m", "q4_0"]
    gates = [DEFAULT_GATES[q] for q in order]
    kl = [g.max_kl for g in gates]
    top1 = [g.min_top1 for g in gates]
    ppl = [g.max_ppl_increase for g in gates]
    assert kl == sorted(kl) and ppl == sorted(ppl)  # type: ignore[type-var]
    assert top1 == sorted(top1, reverse=True)  # type: ignore[type-var]
    assert DEFAULT_GATES["f16"] == DEFAULT_GATES["bf16"]


def test_overrides_replace_only_what_they_name() -> None:
    gate = gate_for("q4_0", {"max_kl": 0.2, "min_greedy_match": 0.5})
    assert gate.max_kl == 0.2 and gate.min_greedy_match == 0.5
    assert gate.min_top1 == DEFAULT_GATES["q4_0"].min_top1
    assert gate_for("q4_0", {"min_top1": None}).min_top1 is None  # None turns a check off
    assert DEFAULT_GATES["q4_0"].max_kl == 0.15  # the defaults are untouched


def test_unknown_override_key_is_named() -> None:
    with pytest.raises(RecipeInvalid, match="'max_kld'") as e:
        gate_for("q8_0", {"max_kld": 0.1, "max_kl": 0.1})
    assert e.value.details["unknown"] == ["max_kld"]
    assert e.value.details["known"] == list(GATE_KEYS)


def test_bad_override_values_are_refused() -> None:
    with pytest.raises(RecipeInvalid, match="min_top1"):
        gate_for("q8_0", {"min_top1": 1.5})
    with pytest.raises(RecipeInvalid, match="max_kl"):
        gate_for("q8_0", {"max_kl": "lots"})


def test_unknown_quant_lists_the_known_ones() -> None:
    with pytest.raises(UnknownName, match="q4_0") as e:
        gate_for("q3_k_xs")
    assert set(GGUF_QUANTS) <= set(e.value.details["known"])


def test_gates_are_frozen_and_strict() -> None:
    with pytest.raises(ValidationError):
        DEFAULT_GATES["q8_0"].max_kl = 1.0  # type: ignore[misc]
    with pytest.raises(ValidationError):
        Gate(max_kl=0.1, top1=0.9)  # type: ignore[call-arg]


def test_check_passes_within_every_threshold() -> None:
    result = check(metrics(), gate_for("f16"))
    assert result.passed and result.failures == []
    # Thresholds are inclusive, and a candidate better than the reference is not penalised.
    edge = metrics(kl=1e-3, top1=0.99, ppl_change=-0.2)
    assert check(edge, gate_for("f16")).passed


def test_check_names_every_failure() -> None:
    result = check(
        metrics(kl=0.02, top1=0.9, ppl_change=0.03, greedy_match=0.25), gate_for("q8_0", {"min_greedy_match": 0.5})
    )
    assert not result.passed
    assert result.failures == [
        "kl 0.02 is above max_kl 0.005",
        "top1 0.9 is below min_top1 0.95",
        "ppl_change 0.03 is above max_ppl_increase 0.01",
        "greedy_match 0.25 is below min_greedy_match 0.5",
    ]


def test_non_finite_metrics_fail() -> None:
    result = check(metrics(kl=math.nan, ppl=math.inf, ppl_change=math.inf), gate_for("q4_0"))
    assert not result.passed and len(result.failures) == 2


def test_unchecked_metrics_never_fail() -> None:
    assert check(metrics(kl=5.0, top1=0.0, ppl_change=9.0, greedy_match=0.0), Gate()).passed


def test_greedy_gate_requires_a_measurement() -> None:
    result = check(metrics(greedy_tokens=0, greedy_match=None, greedy_match_total=None), Gate(min_greedy_match=0.5))
    assert not result.passed and "not measured" in result.failures[0]
