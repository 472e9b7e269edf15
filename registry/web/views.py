"""What the pages show, computed from ORM rows: the artifact × runtime eval matrix, the quality plot's
points, lineage and provenance as tables, resolve's ranking of a release as the fit page shows it, and small
formatters.

Pure functions over rows and records the routes loaded through the services; templates only lay these out.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Any, Literal

from kiln.core.errors import KilnError
from kiln.core.evals import EvalMetrics, Gate, eval_status
from kiln.core.manifest import ArtifactIdentity
from kiln.core.resolve import Policy
from kiln.registry.artifacts.service import Artifact, EvalResult
from kiln.registry.audit.service import AuditEvent
from kiln.registry.resolve.explain import explain_choice
from kiln.registry.resolve.query import ResolveQuery
from kiln.registry.resolve.ranking import Candidate, Ranking, Unranked, rank_criteria, rank_key
from kiln.registry.web.bars import MemoryBar, bar_domain, memory_bar, render_bar
from kiln.registry.web.plot import PlotPoint, QualityPlot, quality_plot
from kiln.registry.web.units import human_size, json_number

__all__ = ["human_size"]  # re-exported: the templates' `size` filter

CellState = Literal["pass", "fail", "ungated", "missing"]

STATUS_LABELS = {"passed": "passed", "failed": "failed", "not_evaluated": "not evaluated"}
NO_EVAL_REASON = "no eval result was published for this artifact"


def _percent(value: float) -> str:
    return f"{value:+.2%}"


def _scientific(value: float) -> str:
    return f"{value:.2e}"


def _fraction(value: float) -> str:
    return f"{value:.4f}"


@dataclass(frozen=True)
class MetricColumn:
    """One metric column: which field of an eval's metrics it shows, which field of its gate bounds it,
    and which way it gates."""

    metric: str  # an EvalMetrics field
    label: str
    gate: str  # a Gate field
    bound: Literal["max", "min"]
    fmt: Callable[[float], str]

    def __post_init__(self) -> None:
        if self.metric not in EvalMetrics.model_fields or self.gate not in Gate.model_fields:
            raise ValueError(f"no such metric or gate field: {self.metric!r}, {self.gate!r}")

    def value(self, metrics: EvalMetrics) -> float | None:
        value: float | None = getattr(metrics, self.metric)
        return value

    def limit(self, gate: Gate) -> float | None:
        limit: float | None = getattr(gate, self.gate)
        return limit


# The gate semantics of eval.gates.check, as columns: a value at its limit passes; NaN never does.
METRIC_COLUMNS: tuple[MetricColumn, ...] = (
    MetricColumn("ppl_change", "Perplexity change", "max_ppl_increase", "max", _percent),
    MetricColumn("kl", "KL divergence", "max_kl", "max", _scientific),
    MetricColumn("top1", "Top-1 agreement", "min_top1", "min", _fraction),
    MetricColumn("greedy_match", "Greedy match", "min_greedy_match", "min", _fraction),
)


# The matrix's (and the plot legend's) runtime order: the reference runtime first, vLLM beside it (the
# two evaluate the same bundles), then the other runtimes kiln evaluates on CPU, each followed by its
# variants (`llama.cpp-metal`, `vllm-cpu`, `vllm@h100`), then every other runtime alphabetically. A
# fixed order rather than first appearance, so a runtime keeps its place from one release to the next.
PREFERRED_RUNTIMES = ("transformers", "vllm", "llama.cpp", "jax")


def runtime_order(runtime: str) -> tuple[int, str]:
    """Sort key of a runtime's column group (see PREFERRED_RUNTIMES)."""
    base = runtime.split("@", 1)[0]
    for rank, name in enumerate(PREFERRED_RUNTIMES):
        if base == name or base.startswith(name + "-"):
            return rank, runtime
    return len(PREFERRED_RUNTIMES), runtime


@dataclass(frozen=True)
class MetricCell:
    metric: str
    value: str
    limit: str  # "≤ 0.02", "≥ 0.92", or "no gate"
    state: CellState


@dataclass(frozen=True)
class RuntimeColumn:
    """One runtime's column group: a verdict column and one column per metric.

    `version` is what the header shows: the one version every eval of this runtime in the release
    recorded; None when none was recorded or they differ (`versions_differ`: each cell shows its own).
    """

    runtime: str
    version: str | None
    versions_differ: bool


@dataclass(frozen=True)
class EvalGroup:
    """One runtime's verdict on an artifact, the cells of its column group; `cells` is empty when it
    was not evaluated. `show_version`: the header cannot say the version, so the cell does."""

    runtime: str
    status: str
    label: str
    reason: str | None
    version: str | None
    show_version: bool
    cells: tuple[MetricCell, ...]


@dataclass(frozen=True)
class FileLink:
    path: str
    size: str
    sha256: str
    url: str


@dataclass(frozen=True)
class Cell:
    """A value as a table shows it: `title` holds the full value where `text` shortens it; `code`
    sets it in monospace (digests, and the JSON of values that do not fit a table)."""

    text: str
    title: str | None = None
    code: bool = False


@dataclass(frozen=True)
class RecordTable:
    """A list of flat mappings (e.g. lineage's source files) as a table, one row per mapping."""

    columns: tuple[str, ...]
    rows: tuple[tuple[Cell, ...], ...]


@dataclass(frozen=True)
class FlatRow:
    """One key of a flattened mapping (nested keys dotted: `inputs.model.digest`) with its value as
    a cell, or as a table when it is a list of flat mappings."""

    key: str
    cell: Cell | None
    table: RecordTable | None


@dataclass(frozen=True)
class ArtifactRow:
    """One matrix row: the artifact's facts, its eval per runtime group of the release (None where it
    has none), its files and its provenance."""

    identity: ArtifactIdentity
    size: str
    unsupported: tuple[tuple[str, str], ...]
    status: str
    label: str
    evaluated: bool  # False: no runtime has published an eval of it
    evals: tuple[EvalGroup | None, ...]
    files: tuple[FileLink, ...]
    provenance: tuple[FlatRow, ...]
    provenance_summary: str


@dataclass(frozen=True)
class ReleaseMatrix:
    """The release page's artifact × runtime matrix and its quality-against-size plot."""

    runtimes: tuple[RuntimeColumn, ...]
    rows: tuple[ArtifactRow, ...]
    plot: QualityPlot


def timestamp(at: datetime | None) -> str:
    """A UTC timestamp to the second; empty for None."""
    return at.strftime("%Y-%m-%d %H:%M:%S UTC") if at is not None else ""


def compact_json(value: Any) -> str:
    """Canonical one-line JSON (sorted keys) for before/after and other free-form details."""
    return json.dumps(value, sort_keys=True, separators=(", ", ": "), default=str)


def metric_cell(column: MetricColumn, metrics: EvalMetrics | None, gate: Gate | None) -> MetricCell:
    """One metric of one eval result, judged against its gate threshold when the gate sets one."""
    value = column.value(metrics) if metrics is not None else None
    if value is None:
        shown = "—"
    elif math.isfinite(value):
        shown = column.fmt(value)
    else:
        shown = "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")
    limit = column.limit(gate) if gate is not None else None
    if limit is None:
        return MetricCell(column.metric, shown, "no gate", "ungated")
    sign = "≤" if column.bound == "max" else "≥"
    limit_text = f"{sign} {column.fmt(limit)}"
    if value is None:
        return MetricCell(column.metric, shown, limit_text, "missing")
    ok = math.isfinite(value) and (value <= limit if column.bound == "max" else value >= limit)
    return MetricCell(column.metric, shown, limit_text, "pass" if ok else "fail")


def runtime_columns(evals: Iterable[EvalResult]) -> tuple[RuntimeColumn, ...]:
    """The column groups of the runtimes that appear in `evals`, in `runtime_order`."""
    versions: dict[str, set[str | None]] = {}
    for e in evals:
        seen = versions.setdefault(e.runtime, set())
        # A not_evaluated result ran nothing: it has no version to agree or disagree with.
        if e.status != "not_evaluated":
            seen.add(e.runtime_version)
    columns = []
    for runtime in sorted(versions, key=runtime_order):
        seen = versions[runtime]
        single = next(iter(seen)) if len(seen) == 1 else None
        columns.append(RuntimeColumn(runtime, single, versions_differ=len(seen) > 1))
    return tuple(columns)


def eval_group(result: EvalResult, column: RuntimeColumn) -> EvalGroup:
    """`result` as the cells of its runtime's column group."""
    label = STATUS_LABELS.get(result.status, result.status)
    show_version = column.versions_differ  # the header cannot say it: the cell does, or that it is unknown
    if result.status == "not_evaluated":
        # The runtime of a not_evaluated result is the one it needs (see pipeline/stages/publish.py).
        return EvalGroup(result.runtime, result.status, label, result.reason, None, False, ())
    cells = tuple(metric_cell(c, result.metrics, result.gates) for c in METRIC_COLUMNS)
    return EvalGroup(result.runtime, result.status, label, result.reason, result.runtime_version, show_version, cells)


# Flattening: how deep nested mappings become dotted keys before the rest is shown as JSON.
MAX_FLAT_DEPTH = 3
# A record table's leading columns, where present; the others follow in order of first appearance.
RECORD_COLUMNS_FIRST = ("path", "name", "size")
PROVENANCE_FIRST = ("stage", "code_version", "cache_key", "host", "started_at", "duration_s", "kiln_version", "python")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
Scalar = str | int | float | bool | None


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


def _is_flat_mapping(value: Any) -> bool:
    return isinstance(value, Mapping) and all(_is_scalar(v) for v in value.values())


def scalar_cell(key: str, value: Scalar) -> Cell:
    """A scalar as a cell: a sha256 digest shortened (full in the title), a byte count in binary units
    (exact in the title) when its key says it is a size, anything else as text."""
    if value is None:
        return Cell("—")
    if isinstance(value, bool):
        return Cell("true" if value else "false")
    if isinstance(value, int) and (key == "size" or key.endswith(("_size", "_bytes"))):
        return Cell(human_size(value), title=f"{value} bytes")
    if isinstance(value, str) and _SHA256.fullmatch(value):
        return Cell(value[:12] + "…", title=value, code=True)
    return Cell(str(value))


def record_table(records: Sequence[Mapping[str, Any]]) -> RecordTable:
    """Flat mappings as a table; a mapping without one of the columns shows "—" there."""
    seen = list(dict.fromkeys(str(k) for r in records for k in r))
    columns = tuple([c for c in RECORD_COLUMNS_FIRST if c in seen] + [c for c in seen if c not in RECORD_COLUMNS_FIRST])
    rows = tuple(tuple(scalar_cell(c, r.get(c)) for c in columns) for r in records)
    return RecordTable(columns, rows)


def _value_rows(key: str, value: Any, depth: int) -> list[FlatRow]:
    leaf = key.rsplit(".", 1)[-1]
    if _is_scalar(value):
        return [FlatRow(key, scalar_cell(leaf, value), None)]
    if isinstance(value, Mapping) and value and depth < MAX_FLAT_DEPTH:
        return flat_rows(value, prefix=f"{key}.", depth=depth + 1)
    if isinstance(value, list | tuple | Mapping) and not value:
        return [FlatRow(key, Cell("—"), None)]
    if isinstance(value, list | tuple) and all(_is_scalar(v) for v in value):
        return [FlatRow(key, Cell(", ".join(scalar_cell(leaf, v).text for v in value)), None)]
    if isinstance(value, list | tuple) and all(_is_flat_mapping(v) for v in value):
        return [FlatRow(key, None, record_table(value))]
    # Anything else (lists of nested values, nesting past MAX_FLAT_DEPTH): compact JSON, still text.
    return [FlatRow(key, Cell(compact_json(value), code=True), None)]


def flat_rows(
    mapping: Mapping[str, Any], first: Sequence[str] = (), *, prefix: str = "", depth: int = 0
) -> list[FlatRow]:
    """`mapping` as key/value rows for a table or a definition list.

    Keys in `first` lead in that order, the others follow sorted (the same order on every database).
    Nested mappings become dotted keys, lists of scalars one comma-separated cell, lists of flat
    mappings a `RecordTable`; anything else is shown as compact JSON in a code cell.
    """
    keys = [k for k in first if k in mapping] + sorted(str(k) for k in mapping if k not in first)
    return [row for k in keys for row in _value_rows(prefix + k, mapping[k], depth)]


def provenance_summary(provenance: Mapping[str, Any]) -> str:
    """A line for the provenance's collapsed view: stage, host and duration where recorded."""
    parts = []
    if _is_scalar(provenance.get("stage")) and provenance.get("stage") is not None:
        parts.append(f"stage {provenance['stage']}")
    if isinstance(provenance.get("host"), str):
        parts.append(f"on {provenance['host']}")
    duration = json_number(provenance.get("duration_s"))
    if duration is not None and math.isfinite(duration):
        parts.append(f"{duration:.1f} s")
    return ", ".join(parts)


def artifact_row(artifact: Artifact, runtimes: Sequence[RuntimeColumn], file_url: Callable[[str], str]) -> ArtifactRow:
    """The matrix row of an artifact (needs `evals` and `files` loaded), one eval group per runtime in
    `runtimes`; `file_url(path)` is a file's download URL."""
    by_runtime = {e.runtime: e for e in artifact.evals}
    evals = tuple(eval_group(by_runtime[c.runtime], c) if c.runtime in by_runtime else None for c in runtimes)
    status = eval_status(artifact.evals)
    provenance = artifact.provenance or {}
    return ArtifactRow(
        identity=ArtifactIdentity.of(artifact),
        size=human_size(artifact.total_size),
        unsupported=tuple(sorted((str(k), str(v)) for k, v in artifact.unsupported.items())),
        status=status,
        label=STATUS_LABELS[status],
        evaluated=bool(artifact.evals),
        evals=evals,
        files=tuple(FileLink(f.path, human_size(f.size), f.sha256, file_url(f.path)) for f in artifact.files),
        provenance=tuple(flat_rows(provenance, PROVENANCE_FIRST)),
        provenance_summary=provenance_summary(provenance),
    )


def plot_points(artifacts: Sequence[Artifact]) -> list[PlotPoint]:
    """One point per eval with metrics (passed or failed), by runtime in `runtime_order` (the plot's
    legend follows the order runtimes first appear), then in artifact order."""
    points = [
        PlotPoint(a.name, e.runtime, a.total_size, e.metrics.kl, e.status)
        for a in artifacts
        for e in a.evals
        if e.status != "not_evaluated" and e.metrics is not None
    ]
    return sorted(points, key=lambda p: runtime_order(p.runtime))  # stable: artifacts keep their order


def release_matrix(artifacts: Sequence[Artifact], file_url: Callable[[str, str], str]) -> ReleaseMatrix:
    """The release page's matrix and plot (artifacts need `evals` and `files` loaded);
    `file_url(artifact, path)` is a file's download URL."""
    runtimes = runtime_columns(e for a in artifacts for e in a.evals)
    rows = tuple(artifact_row(a, runtimes, partial(file_url, a.name)) for a in artifacts)
    return ReleaseMatrix(runtimes, rows, quality_plot(plot_points(artifacts)))


@dataclass(frozen=True)
class AuditRow:
    at: str
    actor: str
    action: str
    target: str
    model: str | None
    reason: str | None
    before: str
    after: str
    other: str  # the remaining details, e.g. the failures a forced promotion overrode


def audit_row(event: AuditEvent) -> AuditRow:
    """An audit event with its details split into before, after and the rest (empty entries left out)."""
    details = event.details or {}
    rest = {k: v for k, v in details.items() if k not in ("before", "after") and v not in (None, "", [], {})}
    return AuditRow(
        at=timestamp(event.at),
        actor=event.actor,
        action=event.action,
        target=event.target,
        model=event.model,
        reason=event.reason,
        before=compact_json(details.get("before")),
        after=compact_json(details.get("after")),
        other=compact_json(rest) if rest else "",
    )


# --- the fit explorer: resolve's ranking of one release for pools a caller names ---------------------------

# A figure's label: a performance record of the artifact on that SKU ("measured"), a bound on the SKU's
# measured shares of its peaks ("shares", the catalog entry's `measured` record), or on data-sheet peaks ("spec").
BoundSource = Literal["measured", "shares", "spec"]
BOUND_LABELS: dict[BoundSource, str] = {"measured": "measured", "shares": "measured share", "spec": "spec"}


@dataclass(frozen=True)
class FigureLabels:
    """Where a candidate's decode and TTFT figures come from, and a line that says which record or which rates."""

    decode: BoundSource
    ttft: BoundSource
    detail: str

    @property
    def decode_label(self) -> str:
        return BOUND_LABELS[self.decode]

    @property
    def ttft_label(self) -> str:
        return BOUND_LABELS[self.ttft]


def figure_labels(candidate: Candidate) -> FigureLabels:
    """The labels of a candidate's decode and TTFT figures: "measured" when a performance record replaced the
    estimate (both figures then come from it), else what the plan's bounds rest on (`ReplicaPlan.basis`): the
    SKU's measured shares of its peaks, or the data sheet."""
    if candidate.speed.source == "measured":
        return FigureLabels(decode="measured", ttft="measured", detail=candidate.speed.note)
    basis = candidate.plan.basis
    decode: BoundSource = "shares" if basis.decode == "measured" else "spec"
    ttft: BoundSource = "shares" if basis.prefill == "measured" else "spec"
    where = f" ({basis.source})" if basis.source else ""
    return FigureLabels(decode=decode, ttft=ttft, detail=f"{candidate.speed.note}{where}")


def form_number(value: float) -> str:
    """A number as a form field holds it: short where that is exact ("500", not "500.0"), else in full."""
    short = f"{value:g}"
    return short if float(short) == value else repr(value)


def tokens_per_s(value: float) -> str:
    return f"{value:,.1f}"


def duration_ms(value: float | None) -> str:
    """A time to first token: ms below a second, seconds to two decimals below 100 s, whole seconds past that;
    "unknown" for None."""
    if value is None:
        return "unknown"
    if value < 1000:
        return f"{value:.0f} ms"
    return f"{value / 1000:,.2f} s" if value < 100_000 else f"{value / 1000:,.0f} s"


def dollars(value: float | None) -> str:
    """USD per million tokens to the cent (two significant digits below a cent); "no price" for None."""
    if value is None:
        return "no price"
    return f"${value:,.2f}" if value >= 0.01 else f"${value:.2g}"


def shortfall(c: Candidate) -> str | None:
    """What keeps `c` from being served whatever the other candidates are: it does not fit in memory or in
    its pool's free devices, or it misses the SLO; None when nothing does. From the plan's own figures."""
    p = c.plan
    if not p.fits:
        devices = f"{p.max_tp} device{'s' if p.max_tp > 1 else ''}"
        free = f"; the pool has {c.pool.free_devices} free" if c.pool.free_devices is not None else ""
        return (
            f"does not fit in {devices}: at TP {p.tp} it needs {human_size(p.required_per_device_bytes)} per device "
            f"(weights {human_size(p.weights_per_device_bytes)} + KV cache {human_size(p.kv_per_device_bytes)}) "
            f"of {human_size(p.usable_per_device_bytes)} usable{free}"
        )
    if not c.fits:
        return (
            f"needs TP {p.tp}; the pool has {c.pool.free_devices} free device{'s' if c.pool.free_devices != 1 else ''}"
        )
    if not c.meets_slo:
        return "misses the SLO: " + "; ".join(c.slo_misses)
    return None


def _kl_text(kl: float | None) -> str:
    return "not reported" if kl is None else f"{kl:.3g}"


def why_behind(c: Candidate, first: Candidate, policy: Policy) -> str:
    """Why `c` ranks after `first`: the first of the ranking's criteria (`rank_criteria`, the order of its sort
    key) on which the two differ, told with both candidates' own figures."""
    names = rank_criteria(policy)
    mine, theirs = rank_key(c, policy), rank_key(first, policy)
    name = next((n for n, a, b in zip(names, mine, theirs, strict=True) if a != b), None)
    if name in ("fits", "slo"):
        return shortfall(c) or ""
    if name == "eval":
        return (
            f"its eval is {STATUS_LABELS.get(c.artifact.eval_status, c.artifact.eval_status)}: ranked after passed ones"
        )
    if name == "speed":
        return (
            f"slower: {tokens_per_s(c.speed.tokens_per_s_per_sequence)} tokens/s per sequence, "
            f"against {tokens_per_s(first.speed.tokens_per_s_per_sequence)}"
        )
    if name == "kl":
        return f"further from the reference: KL {_kl_text(c.artifact.kl)}, against {_kl_text(first.artifact.kl)}"
    if name == "cost":
        return (
            f"costlier: {dollars(c.speed.cost_per_mtok)} per million tokens, "
            f"against {dollars(first.speed.cost_per_mtok)}"
        )
    if name == "pool":
        return f"as good on every count as {first.artifact.identity.name} on {first.hardware}, a pool listed before it"
    return f"as good on every count as {first.artifact.identity.name}, which comes first by name"


@dataclass(frozen=True)
class FitRow:
    """One ranked candidate as the fit page shows it; `verdict` is "chosen", why it ranks after the chosen
    one, or (when none can be served) what keeps it from being served."""

    rank: int
    candidate: Candidate
    chosen: bool
    bar: MemoryBar
    bar_svg: str
    decode_per_sequence: str
    decode_replica: str
    decode_bound: str  # the plan's bound per sequence, shown beside a measured figure
    ttft: str
    cost: str
    basis: FigureLabels
    verdict: str


@dataclass(frozen=True)
class LeftOut:
    """An artifact the ranking left out, with the same reason, on one or more of the pools."""

    artifact: str
    hardware: tuple[str, ...]
    reason: str
    eval_failed: bool


def left_out(unranked: Iterable[Unranked]) -> tuple[LeftOut, ...]:
    """The ranking's left-out (artifact, pool) pairs, one row per artifact and reason, in the order first seen."""
    grouped: dict[tuple[str, str, bool], list[str]] = {}
    for u in unranked:
        grouped.setdefault((u.artifact.identity.name, u.reason, u.eval_failed), []).append(u.hardware)
    return tuple(LeftOut(name, tuple(hw), reason, failed) for (name, reason, failed), hw in grouped.items())


@dataclass(frozen=True)
class FitPage:
    """Resolve's ranking of one release over the pools asked for: every candidate, best first, with its memory
    bar; the artifacts left out and why; the chosen one and resolve's sentence on it, or the error resolve
    answers instead (NO_COMPATIBLE_ARTIFACT, SLO_UNMET)."""

    rows: tuple[FitRow, ...]
    left_out: tuple[LeftOut, ...]
    chosen: FitRow | None
    explanation: str | None
    problem: KilnError | None


def fit_row(
    rank: int, c: Candidate, first: Candidate, problem: KilnError | None, policy: Policy, domain: int
) -> FitRow:
    """A candidate of the ranking as a row; `first` is the ranking's first, `domain` the page's bar scale."""
    chosen = problem is None and c is first
    if chosen:
        verdict = "chosen"
    elif problem is not None:
        verdict = shortfall(c) or ""
    else:
        verdict = why_behind(c, first, policy)
    bar = memory_bar(c.plan, domain)
    return FitRow(
        rank=rank,
        candidate=c,
        chosen=chosen,
        bar=bar,
        bar_svg=render_bar(bar),
        decode_per_sequence=tokens_per_s(c.speed.tokens_per_s_per_sequence),
        decode_replica=tokens_per_s(c.speed.tokens_per_s),
        decode_bound=tokens_per_s(c.plan.decode_tokens_per_s_per_sequence),
        ttft=duration_ms(c.speed.ttft_ms),
        cost=dollars(c.speed.cost_per_mtok),
        basis=figure_labels(c),
        verdict=verdict,
    )


def fit_page(ranking: Ranking, query: ResolveQuery) -> FitPage:
    """The fit page's content from resolve's ranking of a release for `query`."""
    if not ranking.ranked:
        return FitPage((), left_out(ranking.unranked), None, None, ranking.problem)
    first = ranking.ranked[0]
    domain = bar_domain(c.plan for c in ranking.ranked)
    rows = tuple(
        fit_row(i, c, first, ranking.problem, query.policy, domain) for i, c in enumerate(ranking.ranked, start=1)
    )
    chosen = rows[0] if rows[0].chosen else None
    sentence = explain_choice(list(ranking.ranked), query) if chosen is not None else None
    explanation = sentence[:1].upper() + sentence[1:] if sentence else None  # it follows another sentence
    return FitPage(rows, left_out(ranking.unranked), chosen, explanation, ranking.problem)
