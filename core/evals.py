"""Eval records that cross the wire: the metrics, the gate, the report, and a runtime's eval as published.

The eval stage measures `EvalMetrics` and judges them against a `Gate` into an `EvalReport`
(`eval.gates.check`, `eval.report.judged`); the publish stage sends each report to the registry as a
`PublishedEval`, which the registry stores and answers as a `RecordedEval`. They live here, in the
ground layer, because the registry, the client and the pipeline all speak them, and the registry may
not import `eval`. How metrics are measured and gates chosen stays in `eval`.

Their JSON is the published form: non-finite floats (a runtime that produced NaN logits) are the
strings "NaN", "Infinity" and "-Infinity", and read back as floats.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Literal, Protocol, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

EvalStatus = Literal["passed", "failed", "not_evaluated"]
# A runtime name, optionally `@<hardware>` for an eval made on one GPU SKU (`tensorrt_llm@h100`,
# as the publish stage names a GPU runner's eval); the SKU is a hardware profile name (lowercase).
RUNTIME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._+:-]*(@[a-z0-9][a-z0-9._-]*)?$"
RUNTIME_MAX_LENGTH = 64  # what the registry stores it in
# What a runtime reports as its version ("transformers 5.17.0, torch 2.9.0+cu128", "vLLM 0.32.0 (CPU)"):
# printable and conservative, no leading or trailing space, no quotes or angle brackets.
RUNTIME_VERSION_PATTERN = r"^[A-Za-z0-9](?:[A-Za-z0-9 ._+:()/,=-]*[A-Za-z0-9._+:()/,=-])?$"
RUNTIME_VERSION_MAX_LENGTH = 200  # what the registry stores it in


class HasStatus(Protocol):
    @property
    def status(self) -> str: ...


def eval_status(evals: Iterable[HasStatus]) -> EvalStatus:
    """An artifact's gate status, judged from its evals (all of them, or those a channel was promoted with):
    failed if any runtime failed it, passed if any passed, else not_evaluated."""
    statuses = {e.status for e in evals}
    if "failed" in statuses:
        return "failed"
    if "passed" in statuses:
        return "passed"
    return "not_evaluated"


class EvalMetrics(BaseModel):
    """Candidate vs reference on the same token ids. See `eval.metrics` for the exact definitions."""

    # NaN/inf (a runtime that produced non-finite logits) survive a JSON round trip as strings.
    model_config = ConfigDict(frozen=True, ser_json_inf_nan="strings")

    tokens: int = Field(ge=0, description="scored positions (next-token predictions)")
    windows: int = Field(ge=0, description="text windows the positions came from")
    vocab_size: int = Field(ge=1, description="logit columns compared (the model's config vocab_size)")
    ppl_ref: float
    ppl: float
    ppl_change: float = Field(description="(ppl - ppl_ref) / ppl_ref")
    kl: float = Field(description="mean KL(reference || candidate), nats per position")
    kl_error: float = Field(
        default=0.0,
        description="how far above `kl` the true mean KL can lie, from the stored reference's tail "
        "(eval.reference_rows); 0 where the reference kept every token",
    )
    kl_max: float = Field(description="largest KL at any single position")
    top1: float = Field(description="fraction of positions where both argmaxes agree")
    greedy_tokens: int = Field(ge=0, description="tokens generated per runtime, over all prompts")
    greedy_match: float | None = Field(
        default=None, description="fraction of generated tokens equal to the reference's before the first divergence"
    )
    greedy_match_total: float | None = Field(
        default=None, description="fraction of generated tokens equal to the reference's at the same position"
    )


class Gate(BaseModel):
    """Thresholds one artifact must meet; `None` leaves that metric unchecked (`eval.gates` has the defaults)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_kl: float | None = Field(default=None, ge=0.0, description="mean KL(ref || candidate), nats per token")
    min_top1: float | None = Field(default=None, ge=0.0, le=1.0, description="fraction of positions with equal argmax")
    max_ppl_increase: float | None = Field(
        default=None, ge=0.0, description="relative perplexity increase, (ppl - ppl_ref) / ppl_ref"
    )
    min_greedy_match: float | None = Field(
        default=None, ge=0.0, le=1.0, description="greedy tokens equal to the reference's before the first divergence"
    )


class EvalReport(BaseModel):
    """One artifact's eval: runtime, metrics, gate and verdict, or why it was not evaluated here.

    Its status is `passed` (every threshold of the gate met), `failed` (`failures` says which were
    missed and by how much) or `not_evaluated` (the artifact's runtime is not on this machine;
    `runtime_needed` names the runner it needs). A not_evaluated report never counts as passed.
    `eval.report.judged` makes the first two from metrics and a gate.
    """

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
    def not_evaluated(cls, runtime_needed: str, reason: str, *, gate: Gate | None = None) -> EvalReport:
        """The artifact's runtime is not here: deferred to a runner with `runtime_needed`, never passed."""
        return cls(status="not_evaluated", passed=False, runtime_needed=runtime_needed, reason=reason, gate=gate)


class PublishedEval(BaseModel):
    """One runtime's eval of an artifact as a publisher sends it to the registry
    (`POST .../artifacts/{name}/evals`): the verdict, the metrics and gate behind it, and why.

    `runtime` is the registry's name for the runtime (`llama.cpp`, `tensorrt_llm@h100` for a GPU
    runner's eval); `metrics` and `gates` are None where none were measured or applied.
    """

    model_config = ConfigDict(frozen=True)

    runtime: str
    runtime_version: str | None = Field(
        default=None, description="the exact runtime that ran the eval, as it reports its name and version"
    )
    status: EvalStatus
    metrics: EvalMetrics | None = None
    gates: Gate | None = Field(default=None, description="the gate thresholds applied")
    reason: str | None = Field(default=None, description="why it failed / was not run")

    @classmethod
    def of_report(cls, runtime: str, report: EvalReport) -> PublishedEval:
        """`report` as the registry records it under `runtime`: its failures, or else its reason, as
        the reason (the runner a not_evaluated report needs is the runtime it is published under)."""
        return cls(
            runtime=runtime,
            runtime_version=report.runtime_version,
            status=report.status,
            metrics=report.metrics,
            gates=report.gate,
            reason="; ".join(report.failures) or report.reason,
        )


class RecordedEval(PublishedEval):
    """A `PublishedEval` as the registry holds it: what it answers for an artifact's evals, read from its row."""

    model_config = ConfigDict(frozen=True, from_attributes=True)

    created_at: datetime
