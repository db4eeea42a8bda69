"""The soft state of each study's scheduling policies (Hermes quanta, POP curves and kills), so that it
survives a change of leading master.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "policy_states",
        sa.Column("study_id", sa.String(length=32), nullable=False),
        sa.Column("state", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["study_id"], ["studies.id"], name=op.f("fk_policy_states_study_id_studies")),
        sa.PrimaryKeyConstraint("study_id", name=op.f("pk_policy_states")),
    )


def downgrade() -> None:
    op.drop_table("policy_states")
