"""Releases are open until sealed; channels remember the evals they were promoted with.

Releases made before this revision were visible as soon as they existed: they become sealed, with
their present artifacts as the plan. A channel's `evals_through` becomes the newest eval of the
release it points at, so what it serves does not change.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("releases") as batch:
        batch.add_column(sa.Column("planned_artifacts", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("status", sa.String(length=16), nullable=True))
        batch.add_column(sa.Column("sealed_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("abandoned_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("abandon_reason", sa.Text(), nullable=True))
    with op.batch_alter_table("channels") as batch:
        batch.add_column(sa.Column("evals_through", sa.Integer(), nullable=True))

    conn = op.get_bind()
    names: dict[int, list[str]] = {}
    for release_id, name in conn.execute(sa.text("SELECT release_id, name FROM artifacts ORDER BY name")):
        names.setdefault(release_id, []).append(name)
    for (release_id,) in conn.execute(sa.text("SELECT id FROM releases")).all():
        conn.execute(
            sa.text("UPDATE releases SET planned_artifacts = :planned WHERE id = :id"),
            {"planned": json.dumps(names.get(release_id, [])), "id": release_id},
        )
    op.execute("UPDATE releases SET status = 'sealed', sealed_at = created_at")
    op.execute(
        "UPDATE channels SET evals_through = COALESCE((SELECT MAX(e.id) FROM eval_results e "
        "JOIN artifacts a ON a.id = e.artifact_id WHERE a.release_id = channels.release_id), 0)"
    )

    with op.batch_alter_table("releases") as batch:
        batch.alter_column("planned_artifacts", existing_type=sa.JSON(), nullable=False)
        batch.alter_column("status", existing_type=sa.String(length=16), nullable=False)
        batch.create_check_constraint("status", "status IN ('open', 'sealed', 'abandoned')")
    with op.batch_alter_table("channels") as batch:
        batch.alter_column("evals_through", existing_type=sa.Integer(), nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("channels") as batch:
        batch.drop_column("evals_through")
    with op.batch_alter_table("releases") as batch:
        batch.drop_constraint("status", type_="check")
        batch.drop_column("abandon_reason")
        batch.drop_column("abandoned_at")
        batch.drop_column("sealed_at")
        batch.drop_column("status")
        batch.drop_column("planned_artifacts")
