"""The eval record published with an artifact: what was compared, the numbers, the gate, the verdict.

`EvalReport` (defined in `core.evals`, as the registry and the client read it too) is frozen and
JSON-serialisable (`model_dump_json` / `model_validate_json` round-trip, non-finite floats included).
Its status is one of

- `passed`        every threshold of the gate was met;
- `failed`        at least one was missed (`failures` says which and by how much);
- `not_evaluated` the artifact's runtime is not on this machine; `runtime_needed` names the runner
                  it needs. Such a report never counts as passed.

`judged` makes the first two from measured metrics and a gate. This module imports neither numpy
nor torch.
"""

from __future__ import annotations

from kiln.core.evals import EvalMetrics, EvalReport, EvalStatus, Gate
from kiln.eval.gates import check

__all__ = ["EvalMetrics", "EvalReport", "EvalStatus", "judged"]


def judged(
    metrics: EvalMetrics,
    gate: Gate,
    *,
    runtime: str,
    runtime_version: str,
    reference: str | None = None,
    reference_version: str | None = None,
    text_digest: str | None = None,
) -> EvalReport:
    """A report whose verdict is `check(metrics, gate)`."""
    result = check(metrics, gate)
    return EvalReport(
        status="passed" if result.passed else "failed",
        passed=result.passed,
        runtime=runtime,
        runtime_version=runtime_version,
        reference=reference,
        reference_version=reference_version,
        text_digest=text_digest,
        metrics=metrics,
        gate=gate,
        failures=result.failures,
    )
