"""A partial index of the attempts not yet sent, per node manager: an assignment stream's look reads those
few, where it scanned every attempt the node manager had ever run (a cost that grew with the cluster's
history; tests.bench.scale).

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


def downgrade() -> None:
    op.drop_index("ix_batch_attempts_unsent", table_name="batch_attempts")
