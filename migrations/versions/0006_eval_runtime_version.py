"""Eval results record the exact runtime that ran them (name and version, as the runtime reports it).

Results recorded before this revision keep NULL: their version was not recorded, and guessing one
would be worse than saying so.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("eval_results") as batch:
        batch.add_column(sa.Column("runtime_version", sa.String(length=200), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("eval_results") as batch:
        batch.drop_column("runtime_version")
