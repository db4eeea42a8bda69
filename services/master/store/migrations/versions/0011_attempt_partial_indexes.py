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


# (name, column, the rows it holds)
INDEXES = (
    ("ix_batch_attempts_unsent", "node_manager_id", "sent_at IS NULL"),
    ("ix_batch_attempts_oom", "finished_at", "state = 'OUT_OF_MEMORY'"),
)


def upgrade() -> None:
    for name, column, where in INDEXES:
        op.create_index(
            name,
            "batch_attempts",
            [column],
            unique=False,
            postgresql_where=sa.text(where),
            sqlite_where=sa.text(where),
        )


def downgrade() -> None:
    for name, _, _ in reversed(INDEXES):
        op.drop_index(name, table_name="batch_attempts")
