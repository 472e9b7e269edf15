"""ORM rows for artifacts, their files and their eval results."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, CheckConstraint, ForeignKey, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column, relationship

from kiln.core.evals import EvalMetrics, Gate
from kiln.registry.db import Base, RecordJSON, utcnow


class Artifact(Base):
    __tablename__ = "artifacts"
    __table_args__ = (UniqueConstraint("release_id", "name"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    release_id: Mapped[int] = mapped_column(ForeignKey("releases.id"))
    name: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(64))
    format: Mapped[str] = mapped_column(String(64))
    quant: Mapped[str] = mapped_column(String(64))
    hardware: Mapped[list[str]]
    # Hardware it does not run on -> why (e.g. "FP8 tensor cores need sm89+"); resolve's 404 names it.
    unsupported: Mapped[dict[str, Any]]
    runtime: Mapped[dict[str, Any]]
    provenance: Mapped[dict[str, Any]]
    # ArtifactManifest.content_digest(): what a consumer gets, provenance excluded.
    manifest_digest: Mapped[str] = mapped_column(String(64))
    total_size: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    files: Mapped[list[ArtifactFile]] = relationship(
        back_populates="artifact", lazy="raise", order_by="ArtifactFile.path"
    )
    evals: Mapped[list[EvalResult]] = relationship(
        back_populates="artifact", lazy="raise", order_by="EvalResult.runtime"
    )


class ArtifactFile(Base):
    __tablename__ = "artifact_files"

    artifact_id: Mapped[int] = mapped_column(ForeignKey("artifacts.id"), primary_key=True)
    path: Mapped[str] = mapped_column(String(512), primary_key=True)
    sha256: Mapped[str] = mapped_column(ForeignKey("blobs.sha256"), index=True)
    size: Mapped[int] = mapped_column(BigInteger)

    artifact: Mapped[Artifact] = relationship(back_populates="files", lazy="raise")


class EvalResult(Base):
    """One runtime's verdict on an artifact; one row per (artifact, runtime), never overwritten."""

    __tablename__ = "eval_results"
    __table_args__ = (
        UniqueConstraint("artifact_id", "runtime"),
        CheckConstraint("status IN ('passed', 'failed', 'not_evaluated')", name="status"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    artifact_id: Mapped[int] = mapped_column(ForeignKey("artifacts.id"))
    runtime: Mapped[str] = mapped_column(String(64))
    # The exact runtime that ran it, e.g. "transformers 5.17.0, torch 2.9.0"; None when not recorded
    # (a not_evaluated result, or one posted before this column existed).
    runtime_version: Mapped[str | None] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16))
    # Validated into their records as they are read; None where none were measured or applied.
    metrics: Mapped[EvalMetrics | None] = mapped_column(RecordJSON(EvalMetrics), nullable=False)
    gates: Mapped[Gate | None] = mapped_column(RecordJSON(Gate), nullable=False)
    reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    artifact: Mapped[Artifact] = relationship(back_populates="evals", lazy="raise")
