"""The eval record published with an artifact: what was compared, the numbers, the gate, the verdict.

`EvalReport` is frozen and JSON-serialisable (`model_dump_json` / `model_validate_json` round-trip,
non-finite floats included). Its status is one of

- `passed`        every threshold of the gate was met;
- `failed`        at least one was missed (`failures` says which and by how much);
- `not_evaluated` the artifact's runtime is not on this machine; `runtime_needed` names the runner
                  it needs. Such a report never counts as passed.

This module imports neither numpy nor torch: the registry reads reports without them.
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from eval.gates import EvalMetrics, Gate, check

__all__ = ["EvalMetrics", "EvalReport", "EvalStatus"]

EvalStatus = Literal["passed", "failed", "not_evaluated"]


class EvalReport(BaseModel):
    """One artifact's eval: runtime, metrics, gate and verdict, or why it was not evaluated here."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    status: EvalStatus
    passed: bool
    runtime: str | None = None
    runtime_version: str | None = None
    reference: str | None = None
    reference_version: str | None = None
    text_digest: str | None = Field(default=None, description="sha256 of the token windows and prompts compared")
    metrics: EvalMetrics | None = None
    gate: Gate | None = None
    failures: list[str] = Field(default_factory=list)
    runtime_needed: str | None = None
    reason: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        # Reject contradictions rather than repair them: a report is evidence.
        if self.status == "not_evaluated":
            if self.passed:
                raise ValueError("a not_evaluated report is never passed")
            if not self.runtime_needed or not self.reason:
                raise ValueError("a not_evaluated report names runtime_needed and a reason")
            if self.metrics is not None:
                raise ValueError("a not_evaluated report carries no metrics")
            return self
        if self.metrics is None or self.gate is None or not self.runtime:
            raise ValueError(f"a {self.status} report carries runtime, metrics and gate")
        if self.passed != (self.status == "passed"):
            raise ValueError(f"status {self.status!r} contradicts passed={self.passed}")
        if self.passed and self.failures:
            raise ValueError("a passed report has no failures")
        if not self.passed and not self.failures:
            raise ValueError("a failed report says why in failures")
        return self

    @classmethod
    def judged(
        cls,
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
        return cls(
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

    @classmethod
    def not_evaluated(cls, runtime_needed: str, reason: str, *, gate: Gate | None = None) -> EvalReport:
        """The artifact's runtime is not here: deferred to a runner with `runtime_needed`, never passed."""
        return cls(status="not_evaluated", passed=False, runtime_needed=runtime_needed, reason=reason, gate=gate)
