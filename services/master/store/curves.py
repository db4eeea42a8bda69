"""Learning curves: the step metrics trainers report, stored once per canonical plan point.

A point ``(node, step)`` holds the metrics reported after ``step`` steps on the path through ``node``;
the first value at a point wins, so a redelivered or re-trained point changes nothing. A trial's curve
is never stored as such: it is read along its path (``path_points``), the shared prefix's points from
the ancestors, then its own.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import ColumnElement, and_, func, or_, select, tuple_
from sqlalchemy.orm import Session

from stagetree.master.store import models as m
from stagetree.master.store.database import Database, insert_first_points, table
from stagetree.master.store.records import metric_value

CurveRows = Sequence[tuple[int, int, dict[str, float]]]  # (node, step, values) at canonical points
Point = tuple[int, int, dict[str, float]]

_C = table(m.CurvePointRow)


def _values(v: Any) -> dict[str, float]:
    d = json.loads(v) if isinstance(v, str) else v
    return {str(k): metric_value(x) for k, x in d.items()}


class CurveStore:
    def __init__(self, db: Database, *, chunk: int = 1000) -> None:
        self.db = db
        self.chunk = chunk

    def record(self, points: CurveRows) -> int:
        with self.db.tx("record curve points") as s:
            return self.record_in(s, points)

    def record_in(self, s: Session, points: CurveRows, now: float | None = None) -> int:
        """Store curve points (the first at a point wins) inside the caller's transaction; returns how
        many distinct points were offered."""
        if not points:
            return 0
        now = time.time() if now is None else now
        return len(insert_first_points(self.db, s, _C, points, now, self.chunk))

    def path_points(
        self, segments: Sequence[tuple[int, int, int]], start: int = 0, end: int | None = None
    ) -> list[Point]:
        """The points along a path ``[(node, from_step, to_step), ...]`` (``SearchPlan.path``): on each
        node the steps in ``(from_step, to_step]``, limited to ``[start, end]``, in step order."""
        conds = []
        for node, a, b in segments:
            lo, hi = max(a + 1, start), b if end is None else min(b, end)
            if lo <= hi:
                conds.append(and_(_C.c.node_id == node, _C.c.step >= lo, _C.c.step <= hi))
        if not conds:
            return []
        out: list[Point] = []
        with self.db.tx("read a curve") as s:
            for i in range(0, len(conds), 200):
                stmt = select(_C.c.node_id, _C.c.step, _C.c["values"]).where(or_(*conds[i : i + 200]))
                out.extend((int(n), int(st), _values(v)) for n, st, v in s.execute(stmt))
        out.sort(key=lambda p: p[1])
        return out

    def node_points(
        self, nodes: Sequence[int], start: int = 0, end: int | None = None, since: float | None = None
    ) -> dict[int, list[Point]]:
        """Each node's own points (steps in ``[start, end]``; recorded after ``since`` if given), in step
        order."""
        out: dict[int, list[Point]] = {n: [] for n in nodes}
        ids = sorted(set(nodes))
        with self.db.tx("read curves") as s:
            for i in range(0, len(ids), self.chunk):
                where = [_C.c.node_id.in_(ids[i : i + self.chunk]), _C.c.step >= start]
                if end is not None:
                    where.append(_C.c.step <= end)
                if since is not None:
                    where.append(_C.c.recorded_at > since)
                stmt = select(_C.c.node_id, _C.c.step, _C.c["values"]).where(*where).order_by(_C.c.node_id, _C.c.step)
                for n, st, v in s.execute(stmt):
                    out[int(n)].append((int(n), int(st), _values(v)))
        return out

    def sample_names(self, nodes: Sequence[int]) -> list[str]:
        """The metric names of the latest point recorded on ``nodes`` (what a curve of them can show)."""
        ids = sorted(set(nodes))
        if not ids:
            return []
        with self.db.tx("curve metric names") as s:
            stmt = (
                select(_C.c["values"])
                .where(_C.c.node_id.in_(ids[: self.chunk]))
                .order_by(_C.c.recorded_at.desc(), _C.c.step.desc())
            )
            row = s.execute(stmt.limit(1)).first()
        return sorted(_values(row[0])) if row is not None else []

    def point_counts(self, nodes: Sequence[int], since: float | None = None) -> dict[int, int]:
        """How many points (recorded after ``since``) each node has (none: absent)."""
        out: dict[int, int] = {}
        ids = sorted(set(nodes))
        with self.db.tx("count curve points") as s:
            for i in range(0, len(ids), self.chunk):
                where: list[ColumnElement[bool]] = [_C.c.node_id.in_(ids[i : i + self.chunk])]
                if since is not None:
                    where.append(_C.c.recorded_at > since)
                stmt = select(_C.c.node_id, func.count()).where(*where).group_by(_C.c.node_id)
                out.update((int(n), int(c)) for n, c in s.execute(stmt))
        return out

    def series(
        self,
        budgets: Mapping[int, int],
        metric: str,
        since: float | None = None,
        counts: Mapping[int, int] | None = None,
    ) -> dict[int, list[tuple[int, float]]]:
        """Each node's ``(step, value)`` points of ``metric``, thinned in the database to about its budget
        (``budgets``: node -> at most this many points, 0 for all): the points whose step is a multiple
        of the node's stride (``counts``: its points, ``point_counts`` when not given), and its first and
        last. The database picks the rows by their key and reads the value out of the JSON column of
        those only (no document is parsed here): what keeps a study of 200,000 points answering in a
        fraction of a second (``tests.bench.dashboard``'s ``study_page_ms``)."""
        got = self._series(budgets, metric, since, counts, timed=False)
        return {n: [(st, v) for st, (v, _t) in sorted(points.items())] for n, points in got.items()}

    def timed_series(
        self,
        budgets: Mapping[int, int],
        metric: str,
        since: float | None = None,
        counts: Mapping[int, int] | None = None,
    ) -> dict[int, list[tuple[int, float, float]]]:
        """``series`` with each point's recording time: ``(step, value, recorded_at)`` (a wall-time axis)."""
        got = self._series(budgets, metric, since, counts, timed=True)
        return {n: [(st, v, t) for st, (v, t) in sorted(points.items())] for n, points in got.items()}

    def _series(
        self,
        budgets: Mapping[int, int],
        metric: str,
        since: float | None,
        counts: Mapping[int, int] | None,
        *,
        timed: bool,
    ) -> dict[int, dict[int, tuple[float, float]]]:
        counts = self.point_counts(list(budgets), since) if counts is None else counts
        by_stride: dict[int, list[int]] = {}
        for n, b in budgets.items():
            c = counts.get(n, 0)
            if c:
                by_stride.setdefault(1 if b <= 0 or c <= b else -(-c // max(1, b - 1)), []).append(n)
        v = _C.c["values"][metric].as_float()
        cols = [_C.c.node_id, _C.c.step, v, _C.c.recorded_at] if timed else [_C.c.node_id, _C.c.step, v]
        got: dict[int, dict[int, tuple[float, float]]] = {n: {} for n in budgets}

        def keep(rows: Sequence[Sequence[Any]]) -> None:
            for row in rows:
                got[int(row[0])][int(row[1])] = (float(row[2]), float(row[3]) if timed else 0.0)

        with self.db.tx("read curves") as s:
            for stride, group in sorted(by_stride.items()):
                ids = sorted(group)
                for i in range(0, len(ids), self.chunk):
                    part = ids[i : i + self.chunk]
                    where: list[ColumnElement[bool]] = [_C.c.node_id.in_(part)]
                    if since is not None:
                        where.append(_C.c.recorded_at > since)
                    picks = [*where, v.is_not(None)]
                    if stride > 1:
                        picks.append(_C.c.step % stride == 0)
                    keep(self._triples(s, select(*cols).where(*picks)))
                    if stride > 1:  # and each node's first and last point
                        ends = s.execute(
                            select(_C.c.node_id, func.min(_C.c.step), func.max(_C.c.step))
                            .where(*where)
                            .group_by(_C.c.node_id)
                        ).all()
                        keys = [(int(n), int(a)) for n, a, _ in ends] + [(int(n), int(b)) for n, _, b in ends]
                        for k in range(0, len(keys), 500):
                            stmt = select(*cols).where(
                                tuple_(_C.c.node_id, _C.c.step).in_(keys[k : k + 500]), v.is_not(None)
                            )
                            keep(s.execute(stmt).all())
        return got

    def _triples(self, s: Session, stmt: Any) -> Sequence[Sequence[Any]]:
        """The rows of ``stmt`` (a few columns). On SQLite as one row, a JSON array of arrays: the
        sqlite3 module releases and retakes the GIL at every row it steps, which beside a busy thread
        costs more than the query (the reason ``Database.rows`` exists; that one caches prebuilt
        statements, and these are built per call)."""
        if self.db.is_postgres:
            return s.execute(stmt).all()
        sub = stmt.subquery()
        agg = select(func.json_group_array(func.json_array(*sub.c))).select_from(sub)
        rows: list[list[Any]] = json.loads(s.execute(agg).scalar_one())
        return rows

    def counts(self, nodes: Sequence[int]) -> dict[int, int]:
        """How many points each node holds (nodes with none are absent)."""
        out: dict[int, int] = {}
        ids = sorted(set(nodes))
        with self.db.tx("count curve points") as s:
            for i in range(0, len(ids), self.chunk):
                stmt = (
                    select(_C.c.node_id, func.count())
                    .where(_C.c.node_id.in_(ids[i : i + self.chunk]))
                    .group_by(_C.c.node_id)
                )
                out.update((int(n), int(c)) for n, c in s.execute(stmt))
        return out

    def points_since(self, nodes: Sequence[int], since: float) -> list[tuple[int, int, float, dict[str, float]]]:
        """(node, step, recorded_at, values) of the points recorded on ``nodes`` after ``since`` (the same
        shape as ``RequestStore.metrics_since``: what the policies read for intermediate metrics)."""
        if not nodes:
            return []
        out: list[tuple[int, int, float, dict[str, float]]] = []
        ids = sorted(set(nodes))
        with self.db.tx("curve points since") as s:
            for i in range(0, len(ids), self.chunk):
                stmt = select(_C.c.node_id, _C.c.step, _C.c.recorded_at, _C.c["values"]).where(
                    _C.c.node_id.in_(ids[i : i + self.chunk]), _C.c.recorded_at > since
                )
                out.extend((int(n), int(st), float(t), _values(v)) for n, st, t, v in s.execute(stmt))
        return out
