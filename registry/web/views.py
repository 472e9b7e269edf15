"""What the pages show, computed from ORM rows: the artifact × eval-metrics matrix and small formatters.

Pure functions over rows the routes loaded through the services; templates only lay these out.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from registry.artifacts.models import Artifact, EvalResult, eval_status
from registry.audit.models import AuditEvent

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
    """One metric column: where its value and its threshold live in an EvalResult, and which way it gates."""

    metric: str  # key in EvalResult.metrics
    label: str
    gate: str  # key in EvalResult.gates (eval.gates.Gate's field)
    bound: Literal["max", "min"]
    fmt: Callable[[float], str]


# The gate semantics of eval.gates.check, as columns: a value at its limit passes; NaN never does.
METRIC_COLUMNS: tuple[MetricColumn, ...] = (
    MetricColumn("ppl_change", "Perplexity change", "max_ppl_increase", "max", _percent),
    MetricColumn("kl", "KL divergence", "max_kl", "max", _scientific),
    MetricColumn("top1", "Top-1 agreement", "min_top1", "min", _fraction),
    MetricColumn("greedy_match", "Greedy match", "min_greedy_match", "min", _fraction),
)


@dataclass(frozen=True)
class MetricCell:
    metric: str
    value: str
    limit: str  # "≤ 0.02", "≥ 0.92", or "no gate"
    state: CellState


@dataclass(frozen=True)
class EvalRow:
    """One runtime's verdict on an artifact; `cells` is empty when it was not evaluated."""

    runtime: str | None
    status: str
    label: str
    reason: str | None
    cells: tuple[MetricCell, ...]


@dataclass(frozen=True)
class FileLink:
    path: str
    size: str
    sha256: str
    url: str


@dataclass(frozen=True)
class ArtifactRow:
    """One matrix row group: the artifact's facts, one EvalRow per runtime (at least one), its files."""

    name: str
    target: str
    format: str
    quant: str
    size: str
    hardware: tuple[str, ...]
    unsupported: tuple[tuple[str, str], ...]
    status: str
    label: str
    evals: tuple[EvalRow, ...]
    files: tuple[FileLink, ...]


def human_size(n: int) -> str:
    """Bytes in binary units, as the CLI prints them."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def timestamp(at: datetime | None) -> str:
    """A UTC timestamp to the second; empty for None."""
    return at.strftime("%Y-%m-%d %H:%M:%S UTC") if at is not None else ""


def compact_json(value: Any) -> str:
    """Canonical one-line JSON (sorted keys) for before/after and other free-form details."""
    return json.dumps(value, sort_keys=True, separators=(", ", ": "), default=str)


def _number(value: Any) -> float | None:
    # Non-finite metrics are stored as the strings "NaN"/"Infinity" (EvalMetrics' JSON form).
    if isinstance(value, bool) or value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def metric_cell(column: MetricColumn, metrics: dict[str, Any], gates: dict[str, Any]) -> MetricCell:
    """One metric of one eval result, judged against its gate threshold when the gate sets one."""
    raw = metrics.get(column.metric)
    value = _number(raw)
    if value is None:
        shown = "—" if raw is None else str(raw)
    elif math.isfinite(value):
        shown = column.fmt(value)
    else:
        shown = "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")
    limit = _number(gates.get(column.gate))
    if limit is None:
        return MetricCell(column.metric, shown, "no gate", "ungated")
    sign = "≤" if column.bound == "max" else "≥"
    limit_text = f"{sign} {column.fmt(limit)}"
    if value is None:
        return MetricCell(column.metric, shown, limit_text, "missing")
    ok = math.isfinite(value) and (value <= limit if column.bound == "max" else value >= limit)
    return MetricCell(column.metric, shown, limit_text, "pass" if ok else "fail")


def eval_row(result: EvalResult) -> EvalRow:
    if result.status == "not_evaluated":
        # The runtime of a not_evaluated result is the one it needs (see pipeline/stages/publish.py).
        return EvalRow(result.runtime, result.status, STATUS_LABELS[result.status], result.reason, ())
    cells = tuple(metric_cell(c, result.metrics or {}, result.gates or {}) for c in METRIC_COLUMNS)
    return EvalRow(result.runtime, result.status, STATUS_LABELS.get(result.status, result.status), result.reason, cells)


def artifact_row(artifact: Artifact, file_url: Callable[[str], str]) -> ArtifactRow:
    """The matrix row of an artifact (needs `evals` and `files` loaded); `file_url(path)` is its download URL."""
    evals = tuple(eval_row(e) for e in artifact.evals) or (
        EvalRow(None, "not_evaluated", STATUS_LABELS["not_evaluated"], NO_EVAL_REASON, ()),
    )
    status = eval_status(artifact.evals)
    return ArtifactRow(
        name=artifact.name,
        target=artifact.target,
        format=artifact.format,
        quant=artifact.quant,
        size=human_size(artifact.total_size),
        hardware=tuple(artifact.hardware),
        unsupported=tuple(sorted((str(k), str(v)) for k, v in artifact.unsupported.items())),
        status=status,
        label=STATUS_LABELS[status],
        evals=evals,
        files=tuple(FileLink(f.path, human_size(f.size), f.sha256, file_url(f.path)) for f in artifact.files),
    )


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
