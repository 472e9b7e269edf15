"""Blobs record their latest upload, so garbage collection can spare blobs a publish is about to reference.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("blobs") as batch:
        batch.add_column(sa.Column("uploaded_at", sa.DateTime(timezone=True), nullable=True))
    # Blobs stored before this revision were last uploaded when they were first stored.
    op.execute("UPDATE blobs SET uploaded_at = created_at")
    with op.batch_alter_table("blobs") as batch:
        batch.alter_column("uploaded_at", existing_type=sa.DateTime(timezone=True), nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("blobs") as batch:
        batch.drop_column("uploaded_at")
