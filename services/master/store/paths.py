"""Path changes: where a plan's training resumed a checkpoint on another number of ranks.

A batch on ``n`` slots may resume a checkpoint that ``k != n`` ranks wrote when its trainer is
``rescalable`` (``nodemanager.runtime.state``); every rank then continues from rank 0's random streams,
so what the plan computes from that point on is a valid run but not the bit-exact one. The worker says
so once its restore succeeded (the ``rescaled`` event: the bus message of that name, or the ``rescaled``
field of a direct ``ReportBatch``), and both report paths record it here, in the transaction of the rest
of the report. The worker's word is taken rather than the master's guess from the spec and the catalog:
only the worker has read the checkpoint, and only its successful restore means the batch ran on it.

One row per batch attempt (insert-or-ignore on the primary key), so a report delivered twice, or a
redelivered message, records it once; the node manager is the attempt's, from the ledger.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, select, tuple_
from sqlalchemy.orm import Session

from stagetree.core.lifecycle import RankChange
from stagetree.master.store import models as m
from stagetree.master.store.database import Database, table

_P, _A = table(m.PathChange), table(m.BatchAttempt)
_OF_NODES = (
    select(_P)
    .where(_P.c.node_id.in_(bindparam("nodes", expanding=True)))
    .order_by(_P.c.node_id, _P.c.step, _P.c.batch_id, _P.c.attempt)
)


@dataclass(frozen=True)
class PathChange:
    """One recorded resume on another number of ranks, at a canonical point of the plan."""

    node: int
    step: int
    from_ranks: int
    to_ranks: int
    batch_id: int
    attempt: int
    node_manager: str
    uri: str
    recorded_at: float

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "step": self.step,
            "from_ranks": self.from_ranks,
            "to_ranks": self.to_ranks,
            "batch_id": self.batch_id,
            "attempt": self.attempt,
            "node_manager": self.node_manager,
            "uri": self.uri,
            "recorded_at": self.recorded_at,
        }


AttemptRescale = tuple[int, int, RankChange]  # (batch id, attempt, the resume at a canonical point)


class PathChangeStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    def record_in(self, s: Session, changes: Sequence[AttemptRescale], now: float | None = None) -> int:
        """Record resumes on another number of ranks inside the caller's transaction (the first report of
        an attempt wins; a batch that does not exist records nothing). Returns how many were offered."""
        if not changes:
            return 0
        now = time.time() if now is None else now
        keys = sorted({(b, a) for b, a, _ in changes})
        nm_of = {
            (int(b), int(a)): str(nm)
            for b, a, nm in s.execute(
                select(_A.c.batch_id, _A.c.attempt, _A.c.node_manager_id).where(
                    tuple_(_A.c.batch_id, _A.c.attempt).in_(keys)
                )
            )
        }
        rows: dict[tuple[int, int], dict[str, Any]] = {}
        for b, a, r in changes:
            if (b, a) not in nm_of or (b, a) in rows:
                continue
            rows[(b, a)] = {
                "batch_id": b,
                "attempt": a,
                "node_id": r.node,
                "step": r.step,
                "uri": r.uri,
                "from_ranks": r.from_ranks,
                "to_ranks": r.to_ranks,
                "node_manager_id": nm_of[(b, a)],
                "recorded_at": now,
            }
        self.db.insert_ignore(s, _P, [rows[k] for k in sorted(rows)], ["batch_id", "attempt"])
        return len(rows)

    def of_nodes(self, node_ids: Sequence[int]) -> dict[int, list[PathChange]]:
        """The path changes recorded at these nodes, by node, in step order."""
        out: dict[int, list[PathChange]] = {}
        if not node_ids:
            return out
        with self.db.tx("path changes") as s:
            for r in s.execute(_OF_NODES, {"nodes": list(node_ids)}):
                c = PathChange(
                    int(r.node_id),
                    int(r.step),
                    int(r.from_ranks),
                    int(r.to_ranks),
                    int(r.batch_id),
                    int(r.attempt),
                    str(r.node_manager_id),
                    str(r.uri),
                    float(r.recorded_at),
                )
                out.setdefault(c.node, []).append(c)
        return out
