"""Artifacts record the hardware they do not run on, with the reason (resolve's 404 names it).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Artifacts published before this revision carry no reasons: an empty mapping, never NULL.
    with op.batch_alter_table("artifacts") as batch:
        batch.add_column(sa.Column("unsupported", sa.JSON(), nullable=False, server_default=sa.text("'{}'")))
    with op.batch_alter_table("artifacts") as batch:
        batch.alter_column("unsupported", server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("artifacts") as batch:
        batch.drop_column("unsupported")
