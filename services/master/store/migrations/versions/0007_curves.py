"""Learning curves: the step metrics trainers report, one row per (canonical node, step).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-24
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "curve_points",
        sa.Column("node_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("values", sa.JSON(), nullable=False),
        sa.Column("recorded_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["node_id"], ["nodes.id"], name=op.f("fk_curve_points_node_id_nodes")),
        sa.PrimaryKeyConstraint("node_id", "step", name=op.f("pk_curve_points")),
    )
    op.create_index(op.f("ix_curve_points_recorded_at"), "curve_points", ["recorded_at"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_curve_points_recorded_at"), table_name="curve_points")
    op.drop_table("curve_points")
