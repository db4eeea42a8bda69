"""``batch_slots``: the slots a batch holds, one row per rank, in place of ``batches.slot_id``.

A batch on several slots of one node manager held them as one joined text (``"g0,g1"``, rank order),
which every reader split again. Each slot is now a row ``(batch_id, rank, slot_id)``; the upgrade
copies the joined text into rows and the downgrade joins them back.

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-27
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_PAGE = 10_000


def upgrade() -> None:
    ids = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
    slots = op.create_table(
        "batch_slots",
        sa.Column("batch_id", ids, nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("slot_id", sa.String(length=128), nullable=False),
        sa.ForeignKeyConstraint(["batch_id"], ["batches.id"], name=op.f("fk_batch_slots_batch_id_batches")),
        sa.PrimaryKeyConstraint("batch_id", "rank", name=op.f("pk_batch_slots")),
    )
    assert slots is not None
    conn = op.get_bind()
    batches = sa.table("batches", sa.column("id", ids), sa.column("slot_id", sa.String()))
    last = -1
    while True:  # in pages: a long-lived database holds millions of batches
        page = conn.execute(
            sa.select(batches.c.id, batches.c.slot_id)
            .where(batches.c.id > last, batches.c.slot_id.is_not(None))
            .order_by(batches.c.id)
            .limit(_PAGE)
        ).all()
        if not page:
            break
        rows = [
            {"batch_id": bid, "rank": rank, "slot_id": slot}
            for bid, joined in page
            for rank, slot in enumerate(s for s in str(joined).split(",") if s)
        ]
        if rows:
            conn.execute(slots.insert(), rows)
        last = page[-1][0]
    # a plain DROP COLUMN (SQLite >= 3.35 has it): a batch-mode copy of ``batches`` would drop the table
    # that other tables' foreign keys point at
    op.drop_column("batches", "slot_id")


def downgrade() -> None:
    op.add_column("batches", sa.Column("slot_id", sa.String(length=128), nullable=True))
    conn = op.get_bind()
    ids = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
    slots = sa.table("batch_slots", sa.column("batch_id", ids), sa.column("rank", sa.Integer()), sa.column("slot_id"))
    batches = sa.table("batches", sa.column("id", ids), sa.column("slot_id", sa.String()))
    joined: dict[int, list[str]] = {}
    for bid, slot in conn.execute(
        sa.select(slots.c.batch_id, slots.c.slot_id).order_by(slots.c.batch_id, slots.c.rank)
    ):
        joined.setdefault(int(bid), []).append(str(slot))
    if joined:
        conn.execute(
            batches.update().where(batches.c.id == sa.bindparam("b")).values(slot_id=sa.bindparam("s")),
            [{"b": b, "s": ",".join(ss)} for b, ss in joined.items()],
        )
    op.drop_table("batch_slots")
