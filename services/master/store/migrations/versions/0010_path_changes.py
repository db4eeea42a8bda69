"""Batches on several slots: the catalog keeps how many ranks wrote each checkpoint (1 for the rows of
before), and ``path_changes`` records each batch attempt that resumed a checkpoint written by another
number of ranks (issue 22: the plan records that its path changed there).

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-25
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints") as b:
        b.add_column(sa.Column("ranks", sa.Integer(), server_default="1", nullable=False))
    op.create_table(
        "path_changes",
        sa.Column("batch_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("node_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("uri", sa.Text(), nullable=False),
        sa.Column("from_ranks", sa.Integer(), nullable=False),
        sa.Column("to_ranks", sa.Integer(), nullable=False),
        sa.Column("node_manager_id", sa.String(length=128), nullable=False),
        sa.Column("recorded_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["batch_id"], ["batches.id"], name=op.f("fk_path_changes_batch_id_batches")),
        sa.ForeignKeyConstraint(["node_id"], ["nodes.id"], name=op.f("fk_path_changes_node_id_nodes")),
        sa.PrimaryKeyConstraint("batch_id", "attempt", name=op.f("pk_path_changes")),
    )
    op.create_index(op.f("ix_path_changes_node_id"), "path_changes", ["node_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_path_changes_node_id"), table_name="path_changes")
    op.drop_table("path_changes")
    with op.batch_alter_table("checkpoints") as b:
        b.drop_column("ranks")
