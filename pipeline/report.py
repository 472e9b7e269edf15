"""What a build reports: each artifact with where it is and how its evals went, the stages' counts and times;
and what a plan reports before it: each node's needs, costs and state, and the graph by level for a CI workflow.

`pipeline.build.BuildResult` makes the build's records from the outcomes of the graph's nodes; `kiln build` prints
them as a table, writes them as the build's report (`reports/<model>-<version>.json`) and, with `--json`, on stdout.
`pipeline.build.status` makes a `PlanRow` per node (`kiln plan`) and `pipeline.build.matrix` the `Matrix` (`kiln
plan --matrix`). The JSON is these records' own dump, so a reader can parse it back with the record.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kiln.core.evals import EvalMetrics
from kiln.pipeline.executors.node import Status
from kiln.pipeline.records import IgnoredFile
from kiln.pipeline.requirements import Requirements

# A node's state in the plan: its output is stored, it is to be built here, it waits for a runner (or for a node
# that does), or the source is a shape alone (config.json), which is sized but never built.
PlanState = Literal["cached", "to build", "deferred", "shape only"]
MisfitKind = Literal["memory", "device", "disk"]


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


def _absent(description: str | None = None) -> Any:
    """A field the dump leaves out while it is None: the plan's JSON has such a key only where it applies."""
    return Field(default=None, exclude_if=lambda v: v is None, description=description)


class DiskUse(Report):
    """What a node does to the disk (`placement.cost.StageWork`): what it reads, what it leaves, and what it writes
    and removes before it ends."""

    read_bytes: int
    written_bytes: int
    scratch_bytes: int


class Misfit(Report):
    """Something of this machine a node to build would not fit: what it needs, and what would make it fit."""

    needed_bytes: int
    fix: str

    @property
    def have_bytes(self) -> int | None:
        """What this machine has of it, where that is a number of bytes."""
        return None


class MemoryMisfit(Misfit):
    """Host memory beyond this machine's."""

    memory_bytes: int = Field(description="this machine's")

    @property
    def have_bytes(self) -> int | None:
        return self.memory_bytes


class DeviceMisfit(Misfit):
    """A per-GPU share beyond the memory of the GPU the plan is sized for; `needed_bytes` per GPU."""

    gpus: int


class DiskMisfit(Misfit):
    """The disk this node and the stages to build before it fill, beyond what is free."""

    free_bytes: int

    @property
    def have_bytes(self) -> int | None:
        return self.free_bytes


class Misfits(Report):
    """What of this machine a node would not fit, by kind; a kind it fits is absent from the JSON."""

    memory: MemoryMisfit | None = _absent()
    device: DeviceMisfit | None = _absent()
    disk: DiskMisfit | None = _absent()

    def found(self) -> dict[MisfitKind, Misfit]:
        """The misfits there are, by kind, in the order memory, device, disk."""
        kinds: dict[MisfitKind, Misfit | None] = {"memory": self.memory, "device": self.device, "disk": self.disk}
        return {kind: m for kind, m in kinds.items() if m is not None}


class PlanRow(Report):
    """One node of the plan (`kiln plan`): what it needs and costs, its cache key, whether it is built, and what of
    this machine it would not fit; for a deferred node, what its stage's deferral says this machine lacks."""

    node: str
    stage: str
    inputs: dict[str, str] = Field(description="the node each input role reads")
    key: str | None = Field(description="its cache key, once every input is stored and the source is hashed")
    state: PlanState
    requires: Requirements
    disk: DiskUse
    flops: int
    kind: str = Field(description="the kind of work its time is estimated for (`pipeline.requirements.stage_kind`)")
    seconds: float | None = Field(description="the estimate on its device; None on a device of unknown rates")
    timed: bool = Field(description="whether its kind was measured there (else `seconds` is the floor)")
    floor_seconds: float | None
    rates: str | None = Field(description="the rates the estimate rests on")
    misfits: Misfits
    # The keys below are in the JSON only where they apply, as they were when the row was a dict.
    reason: str | None = _absent("why it waits on another node, or has no key yet")
    # What a stage's deferral says (`pipeline.stage.Stage.deferral`): the runner it waits for and what it lacks here.
    runner: str | None = _absent()
    sku: str | None = _absent()
    compute_capability: int | None = _absent()
    tensorrt_llm: str | None = _absent("the tensorrt_llm the runner runs")
    missing: list[str] | None = _absent("what this machine lacks")
    command: list[list[str]] | None = _absent("the commands the runner runs")


class MatrixEntry(Report):
    """One job of a level: `kiln run-stage RECIPE STAGE` on a runner with these labels."""

    stage: str
    runs_on: list[str]
    accelerator: str | None
    runtime_env: str | None


class MatrixLevel(Report):
    """A GitHub Actions matrix: jobs whose inputs are all made by earlier levels, so they may run in parallel."""

    include: list[MatrixEntry]


class Matrix(Report):
    """The graph for a CI workflow (`kiln plan --matrix`): its stages by level, and the same stages by the runner
    labels they need (comma-joined)."""

    model: str
    version: str
    levels: list[MatrixLevel]
    by_runner: dict[str, list[str]]
