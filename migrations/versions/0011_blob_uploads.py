"""Who uploaded each blob: a blob no artifact holds yet is readable only by the tokens that uploaded it.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "blob_uploads",
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("token_id", sa.Integer(), nullable=False),
        sa.Column("uploaded_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["sha256"], ["blobs.sha256"], name=op.f("fk_blob_uploads_sha256_blobs"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["token_id"], ["tokens.id"], name=op.f("fk_blob_uploads_token_id_tokens"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("sha256", "token_id", name=op.f("pk_blob_uploads")),
    )
    op.create_index(op.f("ix_blob_uploads_token_id"), "blob_uploads", ["token_id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_blob_uploads_token_id"), table_name="blob_uploads")
    op.drop_table("blob_uploads")
