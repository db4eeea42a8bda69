"""A study may set how its learning curves are sampled (every k steps, at most N points a second per
batch); NULL keeps the master's defaults (``curve_every_steps``, ``curve_max_per_s`` in its settings).

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-24
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("studies") as b:
        b.add_column(sa.Column("curve_every_steps", sa.Integer(), nullable=True))
        b.add_column(sa.Column("curve_max_per_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("studies") as b:
        b.drop_column("curve_max_per_s")
        b.drop_column("curve_every_steps")
