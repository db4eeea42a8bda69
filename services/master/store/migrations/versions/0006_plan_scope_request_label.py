"""Plans belong to a scope (an owner, or a team), requests carry the tuner's trial label, and a study
may ask to retry its requests' work when the user's code raised.

Plan keys now include the scope (``FixedPart.key(scope)``): plans written before this revision keep
their unscoped keys and ``scope = ''``, so no new study reuses them (nothing crosses owners by
accident); ``stagetree plan forget`` frees their bytes.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("plans") as b:
        b.add_column(sa.Column("scope", sa.String(length=160), nullable=False, server_default=""))
    with op.batch_alter_table("requests") as b:
        b.add_column(sa.Column("label", sa.String(length=128), nullable=False, server_default=""))
    with op.batch_alter_table("studies") as b:
        b.add_column(sa.Column("retry_user_errors", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("studies") as b:
        b.drop_column("retry_user_errors")
    with op.batch_alter_table("requests") as b:
        b.drop_column("label")
    with op.batch_alter_table("plans") as b:
        b.drop_column("scope")
