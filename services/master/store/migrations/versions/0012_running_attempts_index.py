"""A partial index of the running batch attempts, per node manager: a heartbeat's check of the attempts its
node manager should know (``requeue_unknown``) walked every running batch, or every attempt the node
manager ever ran, per heartbeat; it was 30% of the database's statement time at 1,600 slots
(tests.bench.scale, pg_stat_statements).

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-25
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_batch_attempts_running",
        "batch_attempts",
        ["node_manager_id"],
        unique=False,
        postgresql_where=sa.text("state = 'RUNNING'"),
        sqlite_where=sa.text("state = 'RUNNING'"),
    )


def downgrade() -> None:
    op.drop_index("ix_batch_attempts_running", table_name="batch_attempts")
