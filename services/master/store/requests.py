"""Requests ("the metrics of this config at this step") and the metrics that answer them.

A request is idempotent per (study, client request id). Storing metrics at a canonical point completes
every live request waiting there, in the writer's transaction (``record_metrics_in``: the ledger's
report path and the aggregator's ingest both call it).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import bindparam, func, select, tuple_, update
from sqlalchemy.orm import Session

from stagetree.core.errors import NotFound
from stagetree.core.lifecycle import FINISHED_REQUEST_STATES, LIVE_REQUEST_STATES, MAX_ERROR_CHARS, RequestState
from stagetree.master.store import models as m
from stagetree.master.store.database import BULK_ROWS, Database, insert_first_points, table
from stagetree.master.store.records import NewRequest, RequestRecord, metric_value

Points = Sequence[tuple[int, int, dict[str, float]]]  # (node, step, values) at canonical points

_R, _M = table(m.Request), table(m.Metric)
_COLS = (
    _R.c.id, _R.c.study_id, _R.c.plan_id, _R.c.node_id, _R.c.step, _R.c.state, _R.c.client_request_id, _R.c.batch_id,
    _R.c.error, _R.c.label,
)  # fmt: skip
_COL_NAMES = tuple(c.name for c in _COLS)
_OF_STUDY = select(*_COLS).where(_R.c.study_id == bindparam("study")).order_by(_R.c.id)
_BY_ID = _OF_STUDY.where(_R.c.id.in_(bindparam("ids", expanding=True)))
_BY_CLIENT = _OF_STUDY.where(_R.c.client_request_id.in_(bindparam("cids", expanding=True)))
_FINISHED = _BY_ID.where(_R.c.state.in_(FINISHED_REQUEST_STATES))
_FINISHED_AMONG = select(*_COLS).where(
    _R.c.id.in_(bindparam("ids", expanding=True)), _R.c.state.in_(FINISHED_REQUEST_STATES)
)
_METRICS_AT = select(_M.c.node_id, _M.c.step, _M.c["values"]).where(
    tuple_(_M.c.node_id, _M.c.step).in_(bindparam("keys", expanding=True))
)
_LIVE_ON = select(_R.c.id, _R.c.node_id, _R.c.step).where(
    _R.c.node_id.in_(bindparam("nodes", expanding=True)), _R.c.state.in_(LIVE_REQUEST_STATES)
)
_LIVE_AT = select(_R.c.id, _R.c.node_id, _R.c.step).where(
    tuple_(_R.c.node_id, _R.c.step).in_(bindparam("keys", expanding=True)), _R.c.state.in_(LIVE_REQUEST_STATES)
)
_MARK_DONE = (
    update(_R)
    .where(_R.c.id.in_(bindparam("ids", expanding=True)), _R.c.state.in_(LIVE_REQUEST_STATES))
    .values(state=RequestState.DONE, done_at=bindparam("t"))
    .returning(_R.c.id)
)


class RequestStore:
    def __init__(self, db: Database, *, chunk: int = 1000) -> None:
        self.db = db
        self.chunk = chunk

    # -- requests -----------------------------------------------------------------------------------

    def add_requests(self, study_id: str, plan_id: int, items: Sequence[NewRequest]) -> list[RequestRecord]:
        """Record requests (idempotent per client request id); a request whose point already has
        metrics is recorded DONE and returned with them. Returns one record per item, in order."""
        if not items:
            return []
        return self.db.retry(lambda: self._add_requests(study_id, plan_id, items))

    def _add_requests(self, study_id: str, plan_id: int, items: Sequence[NewRequest]) -> list[RequestRecord]:
        now = time.time()
        with self.db.tx("add requests") as s:
            known = self.metrics_in(s, {(it.node, it.step) for it in items})
            rows = [
                {
                    "study_id": study_id,
                    "plan_id": plan_id,
                    "node_id": it.node,
                    "step": it.step,
                    "state": RequestState.DONE if (it.node, it.step) in known else RequestState.NOT_SCHED,
                    "client_request_id": it.client_request_id,
                    "label": it.label,
                    "created_at": now,
                    "done_at": now if (it.node, it.step) in known else None,
                }
                for it in sorted(items, key=lambda it: it.client_request_id)
            ]
            written = self.db.insert_ignore(s, _R, rows, ["study_id", "client_request_id"], _COL_NAMES)
            by_client = {r.client_request_id: r for r in (_request_row(*row) for row in written)}
            resent = [it.client_request_id for it in items if it.client_request_id not in by_client]
            if resent:  # sent before: the first request answers them
                rows_before = self.db.rows(s, _BY_CLIENT, {"study": study_id, "cids": resent})
                by_client.update((r.client_request_id, r) for r in (_request_row(*row) for row in rows_before))
            later = {(r.node, r.step) for r in by_client.values() if r.state is RequestState.DONE} - known.keys()
            known.update(self.metrics_in(s, later))  # a retried request finished since its first submission
        out = []
        for it in items:
            r = by_client[it.client_request_id]
            out.append(r.with_metrics(known.get((r.node, r.step)) if r.state is RequestState.DONE else None))
        return out

    def get_requests(self, study_id: str, request_ids: Sequence[int] | None = None) -> list[RequestRecord]:
        """Requests of a study (all, or those ids), DONE ones with their metrics."""
        if request_ids is None:
            return self._read("get requests", _OF_STUDY, {"study": study_id})
        return self._read("get requests", _BY_ID, {"study": study_id, "ids": list(request_ids)})

    def by_client_ids(self, study_id: str, client_request_ids: Sequence[str]) -> dict[str, RequestRecord]:
        """The study's requests with these client request ids (without metrics)."""
        with self.db.tx("requests by client id") as s:
            rows = self.db.rows(s, _BY_CLIENT, {"study": study_id, "cids": list(client_request_ids)})
            return {r.client_request_id: r for r in (_request_row(*row) for row in rows)}

    def done_since(self, study_id: str, request_ids: Sequence[int]) -> list[RequestRecord]:
        """The requests among ``request_ids`` that are finished (DONE, CANCELLED or FAILED), with metrics."""
        return self._read("finished requests", _FINISHED, {"study": study_id, "ids": list(request_ids)})

    def finished_among(self, request_ids: Sequence[int]) -> list[RequestRecord]:
        """The finished requests among ``request_ids`` of any study, with metrics (the results hub's one
        read for every stream of a master; each stream was checked to own its ids)."""
        with self.db.tx("finished requests") as s:
            rows: list[Sequence[Any]] = []
            for i in range(0, len(request_ids), self.chunk):
                rows += self.db.rows(s, _FINISHED_AMONG, {"ids": list(request_ids[i : i + self.chunk])})
            return self._records_in(s, rows)

    def _read(self, what: str, stmt: Any, params: dict[str, Any]) -> list[RequestRecord]:
        with self.db.tx(what) as s:
            return self._records_in(s, self.db.rows(s, stmt, params))

    def _records_in(self, s: Session, rows: Sequence[Sequence[Any]]) -> list[RequestRecord]:
        """Request rows as records, the DONE ones with their metrics."""
        recs = [_request_row(*r) for r in rows]
        metrics = self.metrics_in(s, {(r.node, r.step) for r in recs if r.state is RequestState.DONE})
        return [r.with_metrics(metrics.get((r.node, r.step))) for r in recs]

    def cancel_request(self, study_id: str, request_id: int, reason: str = "") -> tuple[RequestRecord, int | None]:
        """Cancel a live request, with ``reason`` as its error (why, e.g. a policy killed it: in the same
        transaction, so no reader sees it cancelled without it). Returns it and the batch to abort (SCHED,
        and no other live request needs that batch), else None. A finished request is returned unchanged."""
        with self.db.tx("cancel request") as s:
            row = s.scalar(
                select(m.Request).where(m.Request.id == request_id, m.Request.study_id == study_id).with_for_update()
            )
            if row is None:
                raise NotFound(f"request {request_id} does not exist in study {study_id!r}")
            abort = None
            if RequestState(row.state).is_live():
                batch = row.batch_id if row.state == RequestState.SCHED else None
                row.state, row.done_at = RequestState.CANCELLED, time.time()
                if reason:
                    row.error = reason[-MAX_ERROR_CHARS:]
                s.flush()
                if batch is not None:
                    others = s.scalar(
                        select(func.count())
                        .select_from(m.Request)
                        .where(m.Request.batch_id == batch, m.Request.state.in_(LIVE_REQUEST_STATES))
                    )
                    abort = None if others else batch
            return _request_record(row), abort

    def live_requests_at(self, study_id: str, node: int, step: int) -> list[int]:
        """The study's NOT_SCHED or SCHED requests at a point."""
        with self.db.tx("live requests at") as s:
            return [
                int(i)
                for i in s.scalars(
                    select(m.Request.id).where(
                        m.Request.study_id == study_id,
                        m.Request.node_id == node,
                        m.Request.step == step,
                        m.Request.state.in_(LIVE_REQUEST_STATES),
                    )
                )
            ]

    def fail_waiting(self, request_ids: Sequence[int], error: str) -> list[int]:
        """FAIL those of these requests still NOT_SCHED, with ``error`` (work no node manager can run:
        the scheduler says why); the ids failed."""
        if not request_ids:
            return []
        now = time.time()
        with self.db.tx("fail waiting requests") as s:
            failed = [
                int(i)
                for i in s.scalars(
                    update(m.Request)
                    .where(m.Request.id.in_(list(request_ids)), m.Request.state == RequestState.NOT_SCHED)
                    .values(state=RequestState.FAILED, error=error[:MAX_ERROR_CHARS], done_at=now)
                    .returning(m.Request.id)
                    .execution_options(synchronize_session=False)
                )
            ]
        return sorted(failed)

    def request_studies(self, request_ids: Sequence[int]) -> dict[int, tuple[str, float]]:
        """Study id and arrival time of each request."""
        out: dict[int, tuple[str, float]] = {}
        ids = list(request_ids)
        with self.db.tx("request studies") as s:
            for i in range(0, len(ids), self.chunk):
                for rid, sid, created in s.execute(
                    select(m.Request.id, m.Request.study_id, m.Request.created_at).where(
                        m.Request.id.in_(ids[i : i + self.chunk])
                    )
                ):
                    out[int(rid)] = (str(sid), float(created))
        return out

    # -- metrics ------------------------------------------------------------------------------------

    def metrics_at(self, node: int, step: int) -> dict[str, float] | None:
        with self.db.tx("get metrics") as s:
            return self.metrics_in(s, {(node, step)}).get((node, step))

    def metrics_in(self, s: Session, points: set[tuple[int, int]]) -> dict[tuple[int, int], dict[str, float]]:
        """The metrics stored at ``points``, inside the caller's transaction."""
        out: dict[tuple[int, int], dict[str, float]] = {}
        pts = list(points)
        for i in range(0, len(pts), 500):
            for n, st, v in self.db.rows(s, _METRICS_AT, {"keys": pts[i : i + 500]}):
                values = json.loads(v) if isinstance(v, str) else v
                out[(int(n), int(st))] = {k: metric_value(x) for k, x in values.items()}
        return out

    def metrics_since(self, nodes: Sequence[int], since: float) -> list[tuple[int, int, float, dict[str, float]]]:
        """(node, step, recorded_at, values) of the metrics recorded on ``nodes`` after ``since``."""
        if not nodes:
            return []
        with self.db.tx("metrics since") as s:
            rows = s.execute(
                select(m.Metric.node_id, m.Metric.step, m.Metric.recorded_at, m.Metric.values).where(
                    m.Metric.node_id.in_(list(nodes)), m.Metric.recorded_at > since
                )
            ).all()
            return [
                (int(n), int(st), float(t), {k: metric_value(v) for k, v in vals.items()}) for n, st, t, vals in rows
            ]

    def record_metrics(self, node: int, step: int, values: dict[str, float]) -> list[int]:
        """Store metrics at a canonical point; the live requests waiting there become DONE (ids returned)."""
        with self.db.tx("record metrics") as s:
            return self.record_metrics_in(s, [(node, step, values)]).get((node, step), [])

    def record_metrics_in(
        self, s: Session, points: Points, now: float | None = None
    ) -> dict[tuple[int, int], list[int]]:
        """Store metrics at canonical points (the first value at a point wins) inside the caller's
        transaction; the live requests waiting there become DONE. Returns their ids per point."""
        if not points:
            return {}
        now = time.time() if now is None else now
        first = insert_first_points(self.db, s, _M, points, now, self.chunk)
        keys = sorted(first)
        # The live requests waiting at these points. A few points (a node manager's report): by point.
        # Many (the aggregator's ingest): by node, matched here, which is cheaper than a row-value IN
        # list over thousands of points.
        waiting: dict[int, tuple[int, int]] = {}
        if len(keys) < BULK_ROWS:
            for rid, n, st in self.db.rows(s, _LIVE_AT, {"keys": keys}):
                waiting[int(rid)] = (int(n), int(st))
        else:
            nodes = sorted({n for n, _ in keys})
            for i in range(0, len(nodes), self.chunk):
                for rid, n, st in self.db.rows(s, _LIVE_ON, {"nodes": nodes[i : i + self.chunk]}):
                    if (int(n), int(st)) in first:
                        waiting[int(rid)] = (int(n), int(st))
        out: dict[tuple[int, int], list[int]] = {}
        ids = sorted(waiting)
        c = s.connection()
        for i in range(0, len(ids), self.chunk):
            for rid in c.execute(_MARK_DONE, {"ids": ids[i : i + self.chunk], "t": now}).scalars():
                out.setdefault(waiting[int(rid)], []).append(int(rid))
        return out


def _request_row(
    rid: int,
    study: str,
    plan: int,
    node: int,
    step: int,
    state: str,
    cid: str,
    batch: int | None,
    error: str | None,
    label: str,
) -> RequestRecord:
    """A record from the columns of ``_COLS``."""
    st = RequestState(state)
    shown = error if st in (RequestState.FAILED, RequestState.CANCELLED) else None
    return RequestRecord(int(rid), study, int(plan), int(node), int(step), st, cid, batch, None, shown, label or "")


def _request_record(r: m.Request) -> RequestRecord:
    return _request_row(
        r.id, r.study_id, r.plan_id, r.node_id, r.step, r.state, r.client_request_id, r.batch_id, r.error, r.label
    )
