"""ORM row for a measured performance record."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ForeignKey, Index, String
from sqlalchemy.orm import Mapped, mapped_column

from kiln.registry.db import Base, utcnow


class PerformanceRecord(Base):
    """Serving speed of one artifact on one SKU at a stated context, concurrency and TP, by one runtime."""

    __tablename__ = "performance_records"
    __table_args__ = (Index("ix_performance_records_artifact_hardware", "artifact_id", "hardware"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    artifact_id: Mapped[int] = mapped_column(ForeignKey("artifacts.id"))
    hardware: Mapped[str] = mapped_column(String(32))
    runtime: Mapped[str] = mapped_column(String(64))
    runtime_version: Mapped[str] = mapped_column(String(200))
    tp: Mapped[int]
    context: Mapped[int]
    concurrency: Mapped[int]
    tokens_per_s: Mapped[float]  # output tokens/s of the whole replica
    ttft_ms: Mapped[float]
    itl_p50_ms: Mapped[float]
    itl_p99_ms: Mapped[float]
    recorded_by: Mapped[str] = mapped_column(String(128))
    recorded_at: Mapped[datetime] = mapped_column(default=utcnow)
