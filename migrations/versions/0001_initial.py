"""Initial registry schema: models, releases, blobs, artifacts, files, evals, channels, audit.

Revision ID: 0001
Revises:
Create Date: 2026-11-21
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _timestamp(name: str) -> sa.Column:
    # registry.db.UTCDateTime stores this type; the decorator only adds UTC back on SQLite reads.
    return sa.Column(name, sa.DateTime(timezone=True), nullable=False)


def upgrade() -> None:
    op.create_table(
        "models",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("description", sa.Text(), nullable=False),
        _timestamp("created_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_models")),
        sa.UniqueConstraint("name", name=op.f("uq_models_name")),
    )
    op.create_table(
        "releases",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("version", sa.String(length=64), nullable=False),
        sa.Column("source_digest", sa.String(length=64), nullable=False),
        sa.Column("lineage", sa.JSON(), nullable=False),
        sa.Column("model_config", sa.JSON(), nullable=False),
        _timestamp("created_at"),
        sa.ForeignKeyConstraint(["model_id"], ["models.id"], name=op.f("fk_releases_model_id_models")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_releases")),
        sa.UniqueConstraint("model_id", "version", name=op.f("uq_releases_model_id_version")),
    )
    op.create_table(
        "blobs",
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        _timestamp("created_at"),
        sa.PrimaryKeyConstraint("sha256", name=op.f("pk_blobs")),
    )
    op.create_table(
        "artifacts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("release_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("target", sa.String(length=64), nullable=False),
        sa.Column("format", sa.String(length=64), nullable=False),
        sa.Column("quant", sa.String(length=64), nullable=False),
        sa.Column("hardware", sa.JSON(), nullable=False),
        sa.Column("runtime", sa.JSON(), nullable=False),
        sa.Column("provenance", sa.JSON(), nullable=False),
        sa.Column("manifest_digest", sa.String(length=64), nullable=False),
        sa.Column("total_size", sa.BigInteger(), nullable=False),
        _timestamp("created_at"),
        sa.ForeignKeyConstraint(["release_id"], ["releases.id"], name=op.f("fk_artifacts_release_id_releases")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_artifacts")),
        sa.UniqueConstraint("release_id", "name", name=op.f("uq_artifacts_release_id_name")),
    )
    op.create_table(
        "artifact_files",
        sa.Column("artifact_id", sa.Integer(), nullable=False),
        sa.Column("path", sa.String(length=512), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["artifact_id"], ["artifacts.id"], name=op.f("fk_artifact_files_artifact_id_artifacts")
        ),
        sa.ForeignKeyConstraint(["sha256"], ["blobs.sha256"], name=op.f("fk_artifact_files_sha256_blobs")),
        sa.PrimaryKeyConstraint("artifact_id", "path", name=op.f("pk_artifact_files")),
    )
    op.create_index(op.f("ix_artifact_files_sha256"), "artifact_files", ["sha256"], unique=False)
    op.create_table(
        "eval_results",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("artifact_id", sa.Integer(), nullable=False),
        sa.Column("runtime", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("gates", sa.JSON(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        _timestamp("created_at"),
        sa.CheckConstraint("status IN ('passed', 'failed', 'not_evaluated')", name=op.f("ck_eval_results_status")),
        sa.ForeignKeyConstraint(["artifact_id"], ["artifacts.id"], name=op.f("fk_eval_results_artifact_id_artifacts")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_eval_results")),
        sa.UniqueConstraint("artifact_id", "runtime", name=op.f("uq_eval_results_artifact_id_runtime")),
    )
    op.create_table(
        "channels",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=32), nullable=False),
        sa.Column("release_id", sa.Integer(), nullable=False),
        _timestamp("updated_at"),
        sa.ForeignKeyConstraint(["model_id"], ["models.id"], name=op.f("fk_channels_model_id_models")),
        sa.ForeignKeyConstraint(["release_id"], ["releases.id"], name=op.f("fk_channels_release_id_releases")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_channels")),
        sa.UniqueConstraint("model_id", "name", name=op.f("uq_channels_model_id_name")),
    )
    op.create_table(
        "channel_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("channel_id", sa.Integer(), nullable=False),
        sa.Column("from_version", sa.String(length=64), nullable=True),
        sa.Column("to_version", sa.String(length=64), nullable=False),
        sa.Column("forced", sa.Boolean(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("actor", sa.String(length=128), nullable=True),
        _timestamp("at"),
        sa.ForeignKeyConstraint(["channel_id"], ["channels.id"], name=op.f("fk_channel_events_channel_id_channels")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_channel_events")),
    )
    op.create_index(op.f("ix_channel_events_channel_id"), "channel_events", ["channel_id"], unique=False)
    op.create_table(
        "audit_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("actor", sa.String(length=128), nullable=False),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("model", sa.String(length=64), nullable=True),
        sa.Column("target", sa.String(length=255), nullable=False),
        sa.Column("details", sa.JSON(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        _timestamp("at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_events")),
    )
    op.create_index(op.f("ix_audit_events_model"), "audit_events", ["model"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_audit_events_model"), table_name="audit_events")
    op.drop_table("audit_events")
    op.drop_index(op.f("ix_channel_events_channel_id"), table_name="channel_events")
    op.drop_table("channel_events")
    op.drop_table("channels")
    op.drop_table("eval_results")
    op.drop_index(op.f("ix_artifact_files_sha256"), table_name="artifact_files")
    op.drop_table("artifact_files")
    op.drop_table("artifacts")
    op.drop_table("blobs")
    op.drop_table("releases")
    op.drop_table("models")
