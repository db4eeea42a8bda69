"""``host_problems``: the node managers that cannot run a plan's trainer, and why.

A worker that cannot import the trainer's module (it is not installed on its host) reports a host
problem; the plan's batches then avoid that node manager until it registers again, and its requests fail
with the node managers' reasons once none that is alive can run it.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-27
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    ids = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
    op.create_table(
        "host_problems",
        sa.Column("plan_id", ids, nullable=False),
        sa.Column("node_manager_id", sa.String(length=128), nullable=False),
        sa.Column("error", sa.Text(), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["plan_id"], ["plans.id"], name=op.f("fk_host_problems_plan_id_plans")),
        sa.PrimaryKeyConstraint("plan_id", "node_manager_id", name=op.f("pk_host_problems")),
    )
    op.create_index(op.f("ix_host_problems_node_manager_id"), "host_problems", ["node_manager_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_host_problems_node_manager_id"), table_name="host_problems")
    op.drop_table("host_problems")
