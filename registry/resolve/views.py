"""What resolve ranks: a release and its artifacts as a channel judges them, read once and cached (plain data)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kiln.core.evals import EvalStatus
from kiln.core.manifest import ArtifactIdentity
from kiln.core.resolve import MeasurementOut
from kiln.core.shape import ShapeRecord


@dataclass(frozen=True)
class FileView:
    path: str
    sha256: str
    size: int


@dataclass(frozen=True)
class ArtifactView:
    identity: ArtifactIdentity
    manifest_digest: str
    unsupported: Mapping[str, str]  # hardware it does not run on -> why
    total_size: int
    eval_status: EvalStatus
    kl: float | None  # best (lowest) metrics.kl over its evals
    failed_reasons: tuple[str, ...]
    files: tuple[FileView, ...]
    measurements: tuple[MeasurementOut, ...] = ()


@dataclass(frozen=True)
class ReleaseView:
    model: str
    version: str
    shape: ShapeRecord | str  # the release's model_config read once (`ShapeRecord.from_untrusted`)
    artifacts: tuple[ArtifactView, ...]
