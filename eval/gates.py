"""Eval gates: the thresholds an artifact must meet against the reference, per quantization scheme.

A `Gate` is frozen data; a threshold left at `None` is not checked (the metric is still reported).
`gate_for(quant, overrides)` returns the documented default for a scheme with the recipe's
overrides applied; `check(metrics, gate)` says whether the metrics pass and, if not, why.
`Gate` and `EvalMetrics` cross the wire to the registry, so they are defined in `core.evals`
and used from here.

Default gates (`DEFAULT_GATES`; a method's own row is its `gate` in `quant.methods`)
------------------------------------------------------------------------------

Metrics are measured against the reference (transformers on CPU, bf16 weights in float32 math);
`kl` is the mean KL(reference || candidate) in nats per token, `top1` the fraction of positions
where both pick the same next token, `ppl +` the relative perplexity increase
(ppl - ppl_ref) / ppl_ref. A candidate with a lower perplexity is never failed for it.

| scheme                   | max_kl | min_top1 | max_ppl_increase | min_greedy_match |
|--------------------------|--------|----------|------------------|------------------|
| f32                      | 1e-4   | 0.995    | 0.001            | -                |
| f16, bf16                | 1e-3   | 0.99     | 0.005            | -                |
| q8_0                     | 5e-3   | 0.95     | 0.01             | -                |
| q6_k, int8-w8a8/-w8a16   | 0.015  | 0.93     | 0.02             | -                |
| fp8, fp8-block, fp8-kv8  | 0.02   | 0.92     | 0.03             | -                |
| q4_k_m                   | 0.06   | 0.85     | 0.08             | -                |
| w4a16-gptq, w4a16-awq    | 0.06   | 0.85     | 0.08             | -                |
| q4_0, mxfp4, nvfp4,      | 0.15   | 0.80     | 0.15             | -                |
| int4-rtn, nvfp4-w4a16    |        |          |                  |                  |
| nvfp4-w4a4 (-gptq),      | 0.25   | 0.75     | 0.25             | -                |
| mxfp4-w4a4               |        |          |                  |                  |

Why these values:

- f32 / f16 / bf16 carry the reference's own weights (bf16 bit for bit; f16 holds every bf16
  value of normal range exactly). What remains is the runtime's arithmetic (ggml rounds
  activations to f16/bf16 before its matmuls, accumulation order differs): llama.cpp measures
  BF16 vs FP16 Llama 3 8B at KL 2.5e-5 and 99.7 % same top token, and the example model
  (examples/tiny-llama) gives KL 1e-7 (f16) and 4e-6 (bf16) with top-1 >= 0.998. 1e-3 / 0.99
  leaves more than an order of magnitude of headroom while any conversion bug fails loudly: a
  GGUF written without llama.cpp's q/k permutation scores KL ~4 and top-1 ~0.17 in our tests.
- The quantized rows are anchored on llama.cpp's own KL statistics for Llama 3 8B against FP16
  (tools/perplexity/README.md, "LLaMA 3 8b Scoreboard"), a model that is known to quantize
  worse than Llama 2: q8_0 KL 0.0014 / same top 97.7 % / ppl +0.04 %; q6_K 0.0055 / 96.0 % /
  +0.35 %; q4_K_M 0.031 / 91.9 % / +2.8 %; q4_0 0.072 / ppl +7.5 %. Each gate allows about 2x
  that KL, a few points less top-1 agreement and about 2x the perplexity increase, so a sound
  quantization of a hard model passes, while a broken file (the missing permutation above)
  misses by more than an order of magnitude. The example model sits far inside (q8_0 KL 8e-5,
  q4_k_m 3e-3, q4_0 4e-3; top-1 0.992 / 0.947 / 0.938).
- MXFP4 (OCP MX: 32 E2M1 values sharing a power-of-two scale) and llama.cpp's NVFP4 (16 E2M1 values
  under an E4M3 scale) take Q4_0's gate: 4-bit values with one scale per 32 or 16 (the example model:
  KL 7.6e-3 and 4.9e-3 against Q4_0's 4.1e-3; top-1 0.921 and 0.931 against 0.938).
- The compressed-tensors FP4 methods: weight-only NVFP4 takes round-to-nearest int4's gate (4-bit values,
  scale per 16; the example model: KL 3.0e-3, top-1 0.942). W4A4 (NVFP4, MXFP4) also rounds every matmul's
  input to 4 bits at run time, so it gets a wider one (the example model: KL 1.2e-2 and 2.1e-2, top-1 0.899
  and 0.870, ppl +1.2 % and +1.4 %): wide enough for the activation rounding, narrow enough that a broken
  file (KL ~4, top-1 ~0.2) fails by an order of magnitude.
- hf-bundle schemes sit next to the GGUF type of similar fidelity: int8 (which may also quantize
  activations) with q6_k, GPTQ/AWQ 4-bit with q4_k_m, round-to-nearest int4 with q4_0; fp8 e4m3
  has 3 mantissa bits and dynamic activation scales, between q6_k and q4_k_m.
- Greedy continuation match is reported but not gated by default: one near-tie decided
  differently changes every later token, so over a few 32-token continuations it measures luck
  as much as fidelity (the example model's q4_k_m keeps 52 % of greedy tokens while its top-1
  agreement is 95 %). KL and top-1 already score every position. Recipes may gate it.

Recipes override any threshold per scheme (`gate_for("q4_0", {"max_kl": 0.2})`); `None` turns a
check off. An unknown key is an error naming it and the known keys.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from kiln.core.errors import RecipeInvalid, UnknownName
from kiln.core.evals import EvalMetrics, Gate
from kiln.quant.catalog import METHODS
from kiln.quant.methods import dense, int4, int8
from kiln.quant.methods.base import GateDefaults

__all__ = ["DEFAULT_GATES", "GATE_KEYS", "EvalMetrics", "Gate", "GateResult", "check", "gate_for"]


class GateResult(BaseModel):
    """Outcome of `check`: `failures` holds one readable reason per threshold missed."""

    model_config = ConfigDict(frozen=True)

    passed: bool
    failures: list[str]


def _gate(defaults: GateDefaults) -> Gate:
    return Gate(max_kl=defaults.max_kl, min_top1=defaults.min_top1, max_ppl_increase=defaults.max_ppl_increase)


# The table in the module docstring, as data: every method of the catalog (`quant.catalog`) with its own
# defaults, and the GGUF types beside the method of similar fidelity.
DEFAULT_GATES: Mapping[str, Gate] = {
    "f32": Gate(max_kl=1e-4, min_top1=0.995, max_ppl_increase=0.001),
    "f16": _gate(dense.LOSSLESS),
    "q8_0": Gate(max_kl=5e-3, min_top1=0.95, max_ppl_increase=0.01),
    "q6_k": _gate(int8.GATE),
    "q4_k_m": _gate(int4.CALIBRATED),
    "q4_0": _gate(int4.ROUNDED),
    "mxfp4": _gate(int4.ROUNDED),
    "nvfp4": _gate(int4.ROUNDED),
    **{name: _gate(method.gate) for name, method in METHODS.items()},
}

GATE_KEYS: tuple[str, ...] = tuple(Gate.model_fields)


def gate_for(quant: str, overrides: Mapping[str, Any] | None = None) -> Gate:
    """The default gate for scheme `quant` with the recipe's `overrides` applied.

    Raises `UnknownName` for a scheme without a default (listing the known ones) and
    `RecipeInvalid` for an unknown override key (naming it) or an out-of-range value.
    """
    if quant not in DEFAULT_GATES:
        raise UnknownName(
            f"no default eval gate for quant {quant!r}; known: {', '.join(DEFAULT_GATES)}",
            details={"quant": quant, "known": list(DEFAULT_GATES)},
        )
    base = DEFAULT_GATES[quant]
    if not overrides:
        return base
    unknown = sorted(k for k in overrides if k not in GATE_KEYS)
    if unknown:
        raise RecipeInvalid(
            f"eval gate for {quant!r}: unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(GATE_KEYS)}",
            details={"quant": quant, "unknown": unknown, "known": list(GATE_KEYS)},
        )
    try:
        return Gate.model_validate({**base.model_dump(), **overrides})
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise RecipeInvalid(f"eval gate for {quant!r}: {problems}", details={"quant": quant}) from None


def check(metrics: EvalMetrics, gate: Gate) -> GateResult:
    """Compare `metrics` with `gate`. A non-finite metric under a threshold always fails."""
    failures: list[str] = []

    def upper(name: str, value: float, key: str, limit: float | None) -> None:
        if limit is not None and not (math.isfinite(value) and value <= limit):
            failures.append(f"{name} {value:.4g} is above {key} {limit:.4g}")

    def lower(name: str, value: float, key: str, limit: float | None) -> None:
        if limit is not None and not (math.isfinite(value) and value >= limit):
            failures.append(f"{name} {value:.4g} is below {key} {limit:.4g}")

    # The gate judges the largest mean KL the stored reference allows (kl + kl_error), never a lower bound.
    upper("kl", metrics.kl + metrics.kl_error, "max_kl", gate.max_kl)
    lower("top1", metrics.top1, "min_top1", gate.min_top1)
    upper("ppl_change", metrics.ppl_change, "max_ppl_increase", gate.max_ppl_increase)
    if gate.min_greedy_match is not None:
        if metrics.greedy_match is None:
            failures.append("greedy_match was not measured (no greedy prompts) but min_greedy_match is set")
        else:
            lower("greedy_match", metrics.greedy_match, "min_greedy_match", gate.min_greedy_match)
    return GateResult(passed=not failures, failures=failures)
