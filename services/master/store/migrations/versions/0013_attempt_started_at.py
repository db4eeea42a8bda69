"""When a batch attempt's worker started (``batch_attempts.started_at``), from its ``batch_started`` event.

A round may send a slot its next batch before the slot frees (``SchedulingSettings.lookahead_s``); the
node manager holds it until then. From the dispatch or the send to the end is then the wait plus the run,
and the cost estimator, which learns seconds per step from finished attempts, must take the run alone.
NULL where no start was heard (attempts of before this revision, or reported straight to the master):
the estimator then takes the send, as before.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-26
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("batch_attempts", sa.Column("started_at", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batch_attempts") as batch:
        batch.drop_column("started_at")
