"""Model cars: the digests of the tar layers derived from artifact files, the blobs each holds, and
which replica is hashing one now.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "oci_tar_layers",
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("members_key", sa.String(length=64), nullable=False),
        sa.Column("member_count", sa.Integer(), nullable=False),
        sa.Column("members", sa.JSON(), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("headers", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("sha256", name=op.f("pk_oci_tar_layers")),
        sa.UniqueConstraint("members_key", name=op.f("uq_oci_tar_layers_members_key")),
    )
    op.create_table(
        "oci_tar_layer_blobs",
        sa.Column("layer_sha256", sa.String(length=64), nullable=False),
        sa.Column("blob_sha256", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(
            ["layer_sha256"],
            ["oci_tar_layers.sha256"],
            name=op.f("fk_oci_tar_layer_blobs_layer_sha256_oci_tar_layers"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["blob_sha256"],
            ["blobs.sha256"],
            name=op.f("fk_oci_tar_layer_blobs_blob_sha256_blobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("layer_sha256", "blob_sha256", name=op.f("pk_oci_tar_layer_blobs")),
    )
    op.create_index(op.f("ix_oci_tar_layer_blobs_blob_sha256"), "oci_tar_layer_blobs", ["blob_sha256"])
    op.create_table(
        "oci_layer_hashing",
        sa.Column("members_key", sa.String(length=64), nullable=False),
        sa.Column("holder", sa.String(length=255), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("members_key", name=op.f("pk_oci_layer_hashing")),
    )


def downgrade() -> None:
    op.drop_table("oci_layer_hashing")
    op.drop_index(op.f("ix_oci_tar_layer_blobs_blob_sha256"), table_name="oci_tar_layer_blobs")
    op.drop_table("oci_tar_layer_blobs")
    op.drop_table("oci_tar_layers")
