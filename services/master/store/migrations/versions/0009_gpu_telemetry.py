"""The latest GPU telemetry sample per (node manager, GPU), written by the aggregators so the master's
dashboard shows it in cluster mode (the aggregators and the master are separate processes).

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-24
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "gpu_telemetry",
        sa.Column("node_manager", sa.String(length=128), nullable=False),
        sa.Column("gpu_index", sa.Integer(), nullable=False),
        sa.Column("sample", sa.JSON(), nullable=False),
        sa.Column("ts", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("node_manager", "gpu_index", name=op.f("pk_gpu_telemetry")),
    )
    op.create_index(op.f("ix_gpu_telemetry_ts"), "gpu_telemetry", ["ts"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_gpu_telemetry_ts"), table_name="gpu_telemetry")
    op.drop_table("gpu_telemetry")
