"""The checkpoint catalog: which model states exist at which canonical points, their uris and sizes.

Deleting a checkpoint forgets it here and queues its deletion on the live node managers through the
outbox (``nodes.enqueue_action``); whichever gets there first deletes, the others find nothing. The
points of a pack (a batch's in-memory snapshots, ``runtime.state``) share its uri: its files are
deleted with the last of its points.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from sqlalchemy import BigInteger, any_, bindparam, func, select, tuple_
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Session

from stagetree.core.batch import Point
from stagetree.core.lifecycle import AssignmentKind
from stagetree.master.store import models as m
from stagetree.master.store.database import Database, table
from stagetree.master.store.nodes import ALIVE, enqueue_action

Saved = Sequence[tuple[int, int, str, int, str, int]]  # (node, step, uri, bytes, kind, ranks) at canonical points

_C, _N = table(m.Checkpoint), table(m.Node)
_OF_PLANS = (
    select(_N.c.plan_id, _C.c.node_id, _C.c.step, _C.c.uri)
    .join(_N, _N.c.id == _C.c.node_id)
    .where(_N.c.plan_id.in_(bindparam("plans", expanding=True)))
)

_ON_NODES = select(_C.c.node_id, _C.c.step, _C.c.uri).where(_C.c.node_id.in_(bindparam("nodes", expanding=True)))
_ON_NODES_PG = select(_C.c.node_id, _C.c.step, _C.c.uri).where(
    _C.c.node_id == any_(bindparam("nodes", type_=ARRAY(BigInteger)))
)
_NODES_PER_READ = 500  # an IN list of 500 parameters stays under SQLite's variable limit and parses fast


class CheckpointCatalog:
    def __init__(self, db: Database) -> None:
        self.db = db

    def record_checkpoint(self, node: int, step: int, uri: str, nbytes: int, kind: str, ranks: int = 1) -> None:
        with self.db.tx("record checkpoint") as s:
            self.record_in(s, [(node, step, uri, nbytes, kind, ranks)])

    def record_in(self, s: Session, saved: Saved, now: float | None = None) -> None:
        """Record checkpoints (insert-or-ignore: the first at a point wins) inside the caller's transaction."""
        if not saved:
            return
        now = time.time() if now is None else now
        first: dict[tuple[int, int], tuple[str, int, str, int]] = {}
        for n, st, uri, nb, kind, ranks in saved:
            first.setdefault((n, st), (uri, nb, kind, ranks))
        rows = [
            {"node_id": n, "step": st, "uri": uri, "bytes": nb, "kind": kind, "refcount": 0, "last_used": now}
            | {"ranks": ranks}
            for (n, st), (uri, nb, kind, ranks) in sorted(first.items())
        ]
        self.db.insert_ignore(s, _C, rows, ["node_id", "step"])

    def checkpoint_bytes(self) -> int:
        """Bytes held by every recorded checkpoint (what the checkpoint budget limits)."""
        with self.db.tx("checkpoint bytes") as s:
            return int(s.scalar(select(func.coalesce(func.sum(m.Checkpoint.bytes), 0))) or 0)

    def checkpoint_records(self) -> dict[int, list[tuple[Point, str, int, str, float]]]:
        """Per plan: (point, uri, bytes, kind, last used) of every checkpoint."""
        out: dict[int, list[tuple[Point, str, int, str, float]]] = {}
        with self.db.tx("load checkpoint records") as s:
            for pid, n, st, uri, nb, kind, used in s.execute(
                select(_N.c.plan_id, _C.c.node_id, _C.c.step, _C.c.uri, _C.c.bytes, _C.c.kind, _C.c.last_used).join(
                    _N, _N.c.id == _C.c.node_id
                )
            ):
                out.setdefault(int(pid), []).append((Point(int(n), int(st)), uri, int(nb), kind, float(used)))
        return out

    def checkpoints(self, plan_id: int) -> dict[Point, str]:
        """Checkpoint uri per canonical point of a plan."""
        return self.checkpoints_of([plan_id]).get(plan_id, {})

    def checkpoints_of(self, plan_ids: Sequence[int]) -> dict[int, dict[Point, str]]:
        """Checkpoint uri per canonical point, per plan, in one query."""
        if not plan_ids:
            return {}
        with self.db.tx("load checkpoints") as s:
            return self.checkpoints_in(s, plan_ids)

    def checkpoints_in(self, s: Session, plan_ids: Sequence[int]) -> dict[int, dict[Point, str]]:
        out: dict[int, dict[Point, str]] = {}
        if not plan_ids:
            return out
        for pid, n, st, uri in self.db.rows(s, _OF_PLANS, {"plans": list(plan_ids)}):
            out.setdefault(int(pid), {})[Point(int(n), int(st))] = uri
        return out

    def checkpoints_on(self, s: Session, nodes: Sequence[int]) -> dict[int, dict[Point, str]]:
        """Checkpoint uri per point on ``nodes`` (any plan), per node: what a round needs for the paths of
        its pending work, read in time proportional to them rather than to every checkpoint of the plans
        (which grows with everything the plans ever trained). One ``= ANY(array)`` on Postgres."""
        out: dict[int, dict[Point, str]] = {}
        if not nodes:
            return out
        if self.db.is_postgres:
            rows = list(self.db.rows(s, _ON_NODES_PG, {"nodes": list(nodes)}))
        else:
            rows = []
            for i in range(0, len(nodes), _NODES_PER_READ):
                rows += self.db.rows(s, _ON_NODES, {"nodes": list(nodes[i : i + _NODES_PER_READ])})
        for n, st, uri in rows:
            out.setdefault(int(n), {})[Point(int(n), int(st))] = uri
        return out

    def referenced(self, uris: Sequence[str]) -> set[str]:
        """Which of ``uris`` some checkpoint row still names (a pack whose other points are kept)."""
        if not uris:
            return set()
        with self.db.tx("checkpoint uris in use") as s:
            return {str(u) for u in s.scalars(select(_C.c.uri).where(_C.c.uri.in_(sorted(set(uris)))))}

    def delete_checkpoints(self, points: Sequence[Point]) -> dict[str, list[str]]:
        """Forget these checkpoints and queue their deletion on every live node manager (the store is
        shared; whichever gets there first deletes, the others find nothing). Returns uris per manager."""
        if not points:
            return {}
        keys = [(p.node, p.step) for p in points]
        with self.db.tx("delete checkpoints") as s:
            where = tuple_(_C.c.node_id, _C.c.step).in_(keys)
            found = sorted({str(u) for u in s.scalars(select(_C.c.uri).where(where))})
            if not found:
                return {}
            s.execute(_C.delete().where(where))
            # a pack holds many points under one uri: its files go with the last of them
            kept = set(s.scalars(select(_C.c.uri).where(_C.c.uri.in_(found))))
            uris = [u for u in found if u not in kept]
            if not uris:
                return {}
            nms = [str(n) for n in s.scalars(select(m.NodeManager.id).where(m.NodeManager.state == ALIVE))]
            for nm in nms:
                enqueue_action(s, nm, AssignmentKind.DELETE_CHECKPOINTS, uris=uris)
            return {nm: uris for nm in nms}
