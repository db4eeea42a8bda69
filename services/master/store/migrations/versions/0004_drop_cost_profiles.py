"""Drop ``cost_profiles``: the live cost estimator (``master.costs``) learns step costs from finished
attempts, and nothing but tests ever wrote or read this table.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.drop_table("cost_profiles")


def downgrade() -> None:
    op.create_table(
        "cost_profiles",
        sa.Column("plan_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("gpu_type", sa.String(length=64), nullable=False),
        sa.Column("step_seconds", sa.Float(), nullable=False),
        sa.Column("peak_memory_bytes", sa.BigInteger(), nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["plan_id"], ["plans.id"], name=op.f("fk_cost_profiles_plan_id_plans")),
        sa.PrimaryKeyConstraint("plan_id", "gpu_type", name=op.f("pk_cost_profiles")),
    )
