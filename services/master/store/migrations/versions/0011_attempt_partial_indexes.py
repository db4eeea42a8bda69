"""Two partial indexes of batch attempts, each of a few rows where their readers scanned the cluster's whole
history (a cost that grew with it; tests.bench.scale): the attempts not yet sent, per node manager (an
assignment stream's look), and the ones that ran out of memory, by finish time (every round's look).

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-24
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_batch_attempts_unsent",
        "batch_attempts",
        ["node_manager_id"],
        unique=False,
        postgresql_where=sa.text("sent_at IS NULL"),
        sqlite_where=sa.text("sent_at IS NULL"),
    )
    op.create_index(
        "ix_batch_attempts_oom",
        "batch_attempts",
        ["finished_at"],
        unique=False,
        postgresql_where=sa.text("state = 'OUT_OF_MEMORY'"),
        sqlite_where=sa.text("state = 'OUT_OF_MEMORY'"),
    )


def downgrade() -> None:
    op.drop_index("ix_batch_attempts_oom", table_name="batch_attempts")
    op.drop_index("ix_batch_attempts_unsent", table_name="batch_attempts")
