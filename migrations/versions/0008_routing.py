"""Routing for a fleet: the hardware catalog's registry entries, measured performance records, weighted
channel splits (canaries), and the routing revision resolve watches.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "hardware_entries",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=32), nullable=False),
        sa.Column("profile", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_by", sa.String(length=128), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_hardware_entries")),
        sa.UniqueConstraint("name", name=op.f("uq_hardware_entries_name")),
    )
    op.create_table(
        "performance_records",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("artifact_id", sa.Integer(), nullable=False),
        sa.Column("hardware", sa.String(length=32), nullable=False),
        sa.Column("runtime", sa.String(length=64), nullable=False),
        sa.Column("runtime_version", sa.String(length=200), nullable=False),
        sa.Column("tp", sa.Integer(), nullable=False),
        sa.Column("context", sa.Integer(), nullable=False),
        sa.Column("concurrency", sa.Integer(), nullable=False),
        sa.Column("tokens_per_s", sa.Double(), nullable=False),
        sa.Column("ttft_ms", sa.Double(), nullable=False),
        sa.Column("itl_p50_ms", sa.Double(), nullable=False),
        sa.Column("itl_p99_ms", sa.Double(), nullable=False),
        sa.Column("recorded_by", sa.String(length=128), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["artifact_id"], ["artifacts.id"], name=op.f("fk_performance_records_artifact_id_artifacts")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_performance_records")),
    )
    op.create_index("ix_performance_records_artifact_hardware", "performance_records", ["artifact_id", "hardware"])
    routing_state = op.create_table(
        "routing_state",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("revision", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_routing_state")),
    )
    op.bulk_insert(routing_state, [{"id": 1, "revision": 0}])
    with op.batch_alter_table("channels") as batch:
        batch.add_column(sa.Column("split", sa.JSON(), nullable=True))
    with op.batch_alter_table("channel_events") as batch:
        batch.add_column(sa.Column("split", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("channel_events") as batch:
        batch.drop_column("split")
    with op.batch_alter_table("channels") as batch:
        batch.drop_column("split")
    op.drop_table("routing_state")
    op.drop_index("ix_performance_records_artifact_hardware", table_name="performance_records")
    op.drop_table("performance_records")
    op.drop_table("hardware_entries")
