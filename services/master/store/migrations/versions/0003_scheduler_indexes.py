"""Indexes for what every scheduling round reads: batch attempts by when they finished (the cost
estimator reads the ones that finished since its last look), requests by state (the round reads the
NOT_SCHED ones; without it, a scan of every request the master ever had).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(op.f("ix_batch_attempts_finished_at"), "batch_attempts", ["finished_at"], unique=False)
    op.create_index(op.f("ix_requests_state"), "requests", ["state"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_requests_state"), table_name="requests")
    op.drop_index(op.f("ix_batch_attempts_finished_at"), table_name="batch_attempts")
