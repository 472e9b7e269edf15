"""Supply chain: artifact attestations (signatures, provenance) and the publisher keys trusted per model pattern.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "attestations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("artifact_id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("media_type", sa.String(length=255), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("signer", sa.String(length=255), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["artifact_id"], ["artifacts.id"], name=op.f("fk_attestations_artifact_id_artifacts")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_attestations")),
        sa.UniqueConstraint("artifact_id", "kind", name=op.f("uq_attestations_artifact_id_kind")),
    )
    op.create_index(op.f("ix_attestations_artifact_id"), "attestations", ["artifact_id"])
    op.create_table(
        "trusted_keys",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("key_id", sa.String(length=128), nullable=False),
        sa.Column("model_pattern", sa.String(length=64), nullable=False),
        sa.Column("public_key_pem", sa.Text(), nullable=False),
        sa.Column("created_by", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_trusted_keys")),
        sa.UniqueConstraint("key_id", name=op.f("uq_trusted_keys_key_id")),
    )


def downgrade() -> None:
    op.drop_table("trusted_keys")
    op.drop_index(op.f("ix_attestations_artifact_id"), table_name="attestations")
    op.drop_table("attestations")
