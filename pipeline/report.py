"""What a build reports: each artifact with where it is and how its evals went, the stages' counts and times.

`pipeline.build.BuildResult` makes these from the outcomes of the graph's nodes; `kiln build` prints them as a
table, writes them as the build's report (`reports/<model>-<version>.json`) and, with `--json`, on stdout. The
JSON is these records' own dump, so a reader of the report can parse it back with `BuildSummary`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kiln.core.evals import EvalMetrics
from kiln.pipeline.executors.node import Status
from kiln.pipeline.records import IgnoredFile


class Report(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RuntimeEval(Report):
    """One runtime's eval of an artifact: its status, metrics and failures, or why it did not run."""

    runtime: str = Field(description="the eval's column: the runtime, and the GPU SKU of a runner's eval")
    runtime_version: str | None
    status: str = Field(description="the report's status (passed, failed, not_evaluated), or the stage's")
    metrics: EvalMetrics | None
    failures: list[str]
    reason: str | None
    seconds: float


class BuiltArtifact(Report):
    """An artifact of the build: where it is, its size, and its eval outcome (or the runner it waits for)."""

    artifact: str
    quant: str
    export: Status = Field(description="how the stage that made it ended")
    path: str | None = Field(description="its files, once made")
    size: int | None
    published: Status | None = Field(description="how its publish stage ended (None: the build publishes nothing)")
    eval: str = Field(description="failed if any runtime failed it, passed if any passed; deferred, not_evaluated")
    metrics: EvalMetrics | None = Field(description="the first runtime's")
    failures: list[str] = Field(description="every runtime's gate failures, each but the first's named")
    reason: str | None
    evals: list[RuntimeEval] = Field(default_factory=list, description="one per runtime that evaluates it here")
    # An artifact kiln does not evaluate (an engine): its runtime's runner does, with these.
    runner: str | None = None
    command: list[list[str]] | None = None
    runtime: str | None = None


class DeferredStage(BaseModel):
    """A stage this machine did not run, and why; one waiting for a runner carries what its stage's deferral says
    (the runner, the command, what this machine lacks), kept as the stage gives it."""

    model_config = ConfigDict(frozen=True, extra="allow")

    node: str
    reason: str

    @property
    def runner(self) -> str | None:
        return (self.model_extra or {}).get("runner")

    @property
    def command(self) -> list[list[str]]:
        return list((self.model_extra or {}).get("command") or [])


class BuildSummary(Report):
    """The build as a whole: what each stage did, its artifacts, and what it left for runners or ignored."""

    model: str
    version: str
    stages: dict[Status, int] = Field(description="how many stages ended each way")
    artifacts: list[BuiltArtifact]
    failed_gates: list[str] = Field(description="the artifacts an eval failed")
    deferred: list[DeferredStage]
    ignored: list[IgnoredFile] = Field(description="source files ingest left alone (pickles beside SafeTensors, ...)")
    stage_seconds: dict[str, float] = Field(description="what each stage that ran took (cached ones took nothing)")
    seconds: float | None = Field(default=None, description="the whole build's wall time, as `kiln build` timed it")
    peak_rss_mib: float | None = Field(default=None, description="the build process's peak RSS and its children's")

    def as_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")
