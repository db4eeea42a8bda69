"""What each batch attempt trained and where its worker's time went, for the studies' stats.

``batch_attempts.reached_step``: the furthest step the attempt's worker said it trained to (progress,
metrics, checkpoints), so an attempt that did not run to its end (lost with its node manager, preempted,
failed) counts the steps it trained. ``given_at``, ``startup_s``, ``checkpoint_s``, ``train_s``: the worker's
own measure of its time (its ``batch_timing`` event), so training time is counted apart from the time the
batch waited for its slot, the worker's start-up and checkpoint I/O. ``requeued_requests``: the batches that
carried a request before it went back to the queue (a request's ``batch_id`` names only its latest). NULL
and no rows for what ran before this revision: those attempts count as before (their requests' batches,
from their start to their end).

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-27
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS = ("given_at", "startup_s", "checkpoint_s", "train_s")


def upgrade() -> None:
    op.add_column("batch_attempts", sa.Column("reached_step", sa.Integer(), nullable=True))
    for name in _COLUMNS:
        op.add_column("batch_attempts", sa.Column(name, sa.Float(), nullable=True))
    ids = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
    op.create_table(
        "requeued_requests",
        sa.Column("request_id", ids, nullable=False),
        sa.Column("batch_id", ids, nullable=False),
        sa.ForeignKeyConstraint(["request_id"], ["requests.id"], name=op.f("fk_requeued_requests_request_id_requests")),
        sa.ForeignKeyConstraint(["batch_id"], ["batches.id"], name=op.f("fk_requeued_requests_batch_id_batches")),
        sa.PrimaryKeyConstraint("request_id", "batch_id", name=op.f("pk_requeued_requests")),
    )


def downgrade() -> None:
    op.drop_table("requeued_requests")
    with op.batch_alter_table("batch_attempts") as batch:
        for name in ("reached_step", *_COLUMNS):
            batch.drop_column(name)
