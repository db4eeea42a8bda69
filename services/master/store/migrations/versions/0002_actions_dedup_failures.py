"""Node-manager action outbox, applied-message ids for idempotent ingest, request failures, slot details.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "node_manager_actions",
        sa.Column("id", Id, autoincrement=True, nullable=False),
        sa.Column("node_manager_id", sa.String(length=128), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("batch_id", sa.BigInteger(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("sent_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_node_manager_actions")),
    )
    op.create_index(
        op.f("ix_node_manager_actions_node_manager_id"), "node_manager_actions", ["node_manager_id"], unique=False
    )
    op.create_table(
        "applied_messages",
        sa.Column("msg_id", sa.String(length=200), nullable=False),
        sa.Column("applied_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("msg_id", name=op.f("pk_applied_messages")),
    )
    with op.batch_alter_table("requests") as b:
        b.add_column(sa.Column("failures", sa.Integer(), nullable=False, server_default="0"))
        b.add_column(sa.Column("error", sa.Text(), nullable=True))
    with op.batch_alter_table("slots") as b:
        b.add_column(sa.Column("memory_bytes", sa.BigInteger(), nullable=False, server_default="0"))
        b.add_column(sa.Column("compute_capability", sa.String(length=16), nullable=False, server_default=""))
        b.add_column(sa.Column("share", sa.Float(), nullable=False, server_default="0"))
        b.add_column(sa.Column("cpu_cores", sa.Integer(), nullable=False, server_default="0"))
        b.add_column(sa.Column("gpu_index", sa.Integer(), nullable=False, server_default="-1"))


def downgrade() -> None:
    with op.batch_alter_table("slots") as b:
        for c in ("gpu_index", "cpu_cores", "share", "compute_capability", "memory_bytes"):
            b.drop_column(c)
    with op.batch_alter_table("requests") as b:
        b.drop_column("error")
        b.drop_column("failures")
    op.drop_table("applied_messages")
    op.drop_index(op.f("ix_node_manager_actions_node_manager_id"), table_name="node_manager_actions")
    op.drop_table("node_manager_actions")
