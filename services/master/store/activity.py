"""What ran, runs and changed, as the dashboard reads it. Reads only.

- running batches with their plan's scope, slot, current attempt (and whether its worker has started:
  a batch sent to a busy slot ahead of time has not) and how far its nodes' curves have got;
- the requests each batch carries (which study and trial a slot works for);
- attempt intervals over a time window (the slots' utilisation history) and a batch's attempts;
- a study's request times (its duration, a trial's rung times) and the cheap versions that the event
  stream and the dashboard's caches compare to tell whether a study's requests, a plan's curves or its
  checkpoints and evaluations changed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import and_, func, or_, select

from stagetree.core.lifecycle import BatchState, RequestState
from stagetree.master.store import models as m
from stagetree.master.store.batches import running_slots_in
from stagetree.master.store.database import Database
from stagetree.master.store.records import RequestRecord

CHUNK = 1000


@dataclass(frozen=True)
class RunningBatch:
    batch_id: int
    attempt: int
    plan_id: int
    scope: str  # whose plan: "owner:<name>" or "team:<name>"
    node_manager_id: str
    slot_ids: tuple[str, ...]  # the slots it holds there, in rank order
    started_at: float  # when the batch was last updated (dispatched, or its attempt changed)
    stages: list[tuple[int, int, int]] = field(default_factory=list)  # (node, start, end)
    step: int = 0  # the furthest curve point on its stages (its progress, when the trainer reports one)
    worker_started_at: float | None = None  # when its current attempt's worker started; None: not yet


@dataclass(frozen=True)
class AttemptRow:
    batch_id: int
    attempt: int
    plan_id: int
    node_manager_id: str
    slot_ids: tuple[str, ...]  # rank order
    state: str
    dispatched_at: float
    started_at: float | None
    finished_at: float | None


@dataclass(frozen=True)
class StudyTimes:
    first_request_at: float | None
    last_request_at: float | None
    last_done_at: float | None


class ActivityReader:
    def __init__(self, db: Database) -> None:
        self.db = db

    def running_batches(self) -> list[RunningBatch]:
        with self.db.tx("running batches") as s:
            rows = s.execute(
                select(
                    m.Batch.id,
                    m.Batch.attempt,
                    m.Batch.plan_id,
                    m.Plan.scope,
                    m.Batch.node_manager_id,
                    m.Batch.updated_at,
                    m.Batch.spec_json,
                    m.BatchAttempt.started_at,
                )
                .join(m.Plan, m.Plan.id == m.Batch.plan_id)
                .outerjoin(
                    m.BatchAttempt,
                    and_(m.BatchAttempt.batch_id == m.Batch.id, m.BatchAttempt.attempt == m.Batch.attempt),
                )
                .where(m.Batch.state == BatchState.RUNNING)
                .order_by(m.Batch.id)
            ).all()
            slots = running_slots_in(self.db, s)
            out = []
            for bid, attempt, pid, scope, nm, at, spec_json, worker_at in rows:
                try:
                    stages = [(int(x["node"]), int(x["start"]), int(x["end"])) for x in json.loads(spec_json)["stages"]]
                except (ValueError, KeyError, TypeError):
                    stages = []  # a spec not rendered yet
                step = 0
                for node, start, end in stages:
                    top = s.scalar(
                        select(func.max(m.CurvePointRow.step)).where(
                            m.CurvePointRow.node_id == node, m.CurvePointRow.step > start, m.CurvePointRow.step <= end
                        )
                    )
                    if top is not None:
                        step = max(step, int(top))
                out.append(
                    RunningBatch(
                        int(bid),
                        int(attempt),
                        int(pid),
                        str(scope),
                        nm or "",
                        slots.get(int(bid), ()),
                        float(at),
                        stages,
                        step,
                        None if worker_at is None else float(worker_at),
                    )
                )
            return out

    def batch_requests(self, batch_ids: Sequence[int]) -> dict[int, list[tuple[int, str, str]]]:
        """batch -> the ``(request id, study id, label)`` of the requests it carries."""
        out: dict[int, list[tuple[int, str, str]]] = {}
        ids = sorted(set(batch_ids))
        with self.db.tx("requests of batches") as s:
            for i in range(0, len(ids), CHUNK):
                stmt = select(m.Request.batch_id, m.Request.id, m.Request.study_id, m.Request.label).where(
                    m.Request.batch_id.in_(ids[i : i + CHUNK])
                )
                for b, rid, sid, label in s.execute(stmt.order_by(m.Request.id)):
                    out.setdefault(int(b or 0), []).append((int(rid), str(sid), str(label or "")))
        return out

    def attempts(self, batch_ids: Sequence[int]) -> list[AttemptRow]:
        """Every attempt of the batches, in batch and attempt order."""
        ids = sorted(set(batch_ids))
        out: list[AttemptRow] = []
        with self.db.tx("attempts of batches") as s:
            for i in range(0, len(ids), CHUNK):
                stmt = (
                    select(
                        m.BatchAttempt.batch_id,
                        m.BatchAttempt.attempt,
                        m.Batch.plan_id,
                        m.BatchAttempt.node_manager_id,
                        m.BatchAttempt.slot_id,
                        m.BatchAttempt.state,
                        m.BatchAttempt.dispatched_at,
                        m.BatchAttempt.started_at,
                        m.BatchAttempt.finished_at,
                    )
                    .join(m.Batch, m.Batch.id == m.BatchAttempt.batch_id)
                    .where(m.BatchAttempt.batch_id.in_(ids[i : i + CHUNK]))
                    .order_by(m.BatchAttempt.batch_id, m.BatchAttempt.attempt)
                )
                held: dict[int, list[str]] = {}
                for b, slot in s.execute(
                    select(m.BatchSlot.batch_id, m.BatchSlot.slot_id)
                    .where(m.BatchSlot.batch_id.in_(ids[i : i + CHUNK]))
                    .order_by(m.BatchSlot.batch_id, m.BatchSlot.rank)
                ):
                    held.setdefault(int(b), []).append(str(slot))
                for b, a, p, nm, sl, st, d, t0, t1 in s.execute(stmt):
                    slots = tuple(held.get(int(b), [str(sl)]))
                    out.append(AttemptRow(int(b), int(a), int(p), str(nm), slots, str(st), float(d), _f(t0), _f(t1)))
        return out

    def intervals(self, since: float) -> list[tuple[str, str, float, float | None]]:
        """``(node manager, slot, started, finished)`` of the attempts whose worker ran at some time after
        ``since`` (finished None: still running). An attempt on several slots is one row per slot."""
        with self.db.tx("attempt intervals") as s:
            stmt = (
                select(
                    m.BatchAttempt.node_manager_id,
                    # the batch's slots (``batch_slots``); the attempt's row names only its rank 0's
                    func.coalesce(m.BatchSlot.slot_id, m.BatchAttempt.slot_id),
                    m.BatchAttempt.started_at,
                    m.BatchAttempt.finished_at,
                )
                .outerjoin(m.BatchSlot, m.BatchSlot.batch_id == m.BatchAttempt.batch_id)
                .where(
                    m.BatchAttempt.started_at.is_not(None),
                    or_(m.BatchAttempt.finished_at > since, m.BatchAttempt.state == BatchState.RUNNING),
                )
            )
            return [(str(nm), str(slot), float(t0 or 0.0), _f(t1)) for nm, slot, t0, t1 in s.execute(stmt)]

    def study_times(self, study_ids: Sequence[str]) -> dict[str, StudyTimes]:
        """When each study's first and last requests were made, and its last one finished."""
        out: dict[str, StudyTimes] = {}
        ids = sorted(set(study_ids))
        with self.db.tx("study times") as s:
            for i in range(0, len(ids), CHUNK):
                stmt = (
                    select(
                        m.Request.study_id,
                        func.min(m.Request.created_at),
                        func.max(m.Request.created_at),
                        func.max(m.Request.done_at),
                    )
                    .where(m.Request.study_id.in_(ids[i : i + CHUNK]))
                    .group_by(m.Request.study_id)
                )
                for sid, a, b, c in s.execute(stmt):
                    out[str(sid)] = StudyTimes(_f(a), _f(b), _f(c))
        return out

    def request_heads(self, study_id: str) -> list[RequestRecord]:
        """A study's requests without their metrics or errors (what a stage tree is drawn from: a read
        of 10,000 requests with their metrics costs several times as much)."""
        with self.db.tx("request heads") as s:
            stmt = select(
                m.Request.id,
                m.Request.plan_id,
                m.Request.node_id,
                m.Request.step,
                m.Request.state,
                m.Request.client_request_id,
                m.Request.batch_id,
                m.Request.label,
            ).where(m.Request.study_id == study_id)
            return [
                RequestRecord(int(i), study_id, int(p), int(n), int(st), RequestState(state), cid, b, label=label or "")
                for i, p, n, st, state, cid, b, label in s.execute(stmt.order_by(m.Request.id))
            ]

    def request_times(self, study_id: str) -> dict[int, tuple[float, float | None]]:
        """request -> (made, finished) of a study's requests."""
        with self.db.tx("request times") as s:
            stmt = select(m.Request.id, m.Request.created_at, m.Request.done_at).where(m.Request.study_id == study_id)
            return {int(r): (float(c), _f(d)) for r, c, d in s.execute(stmt)}

    def request_version(self, study_id: str) -> tuple[tuple[Any, ...], ...]:
        """What changes whenever a request of the study changes (the dashboard's caches and the event
        stream compare it): per state, how many, the latest id, batch and finish time, the failed
        attempts counted and the errors set. Each change a request can go through moves one of these:
        a new one (the count, the id), a dispatch (a later batch: batch ids only grow), an answer,
        failure or cancellation (the count, a finish time), a requeue (the counts), an error said later
        (the errors), a forgotten plan (the counts). A few milliseconds for 10,000 requests."""
        r = m.Request
        with self.db.tx("request version") as s:
            stmt = (
                select(
                    r.state,
                    func.count(),
                    func.max(r.id),
                    func.max(r.batch_id),
                    func.max(r.done_at),
                    func.sum(r.failures),
                    func.count(r.error),
                    func.sum(func.length(r.error)),
                )
                .where(r.study_id == study_id)
                .group_by(r.state)
                .order_by(r.state)
            )
            return tuple(tuple(row) for row in s.execute(stmt))

    def curve_version(self, plan_id: int) -> tuple[int, float | None]:
        """What changes whenever the plan's curve points change: how many there are and when the latest
        was recorded (a point is never rewritten: the first value at a point wins; points go only with
        what a forgotten plan computed, which the count shows)."""
        c = m.CurvePointRow
        with self.db.tx("curve version") as s:
            n, latest = s.execute(
                select(func.count(), func.max(c.recorded_at))
                .select_from(c)
                .join(m.Node, m.Node.id == c.node_id)
                .where(m.Node.plan_id == plan_id)
            ).one()
            return int(n or 0), _f(latest)

    def plan_marks_version(self, plan_id: int) -> tuple[Any, ...]:
        """What changes whenever the plan's checkpoints, evaluations or path changes do (what a stage tree
        marks on its nodes): how many of each, and the checkpoints' steps and nodes summed (a checkpoint
        deleted and another saved between two reads still moves them)."""
        n = m.Node
        with self.db.tx("plan marks version") as s:
            ck = s.execute(
                select(func.count(), func.sum(m.Checkpoint.step), func.sum(m.Checkpoint.node_id))
                .select_from(m.Checkpoint)
                .join(n, n.id == m.Checkpoint.node_id)
                .where(n.plan_id == plan_id)
            ).one()
            mets = s.scalar(
                select(func.count()).select_from(m.Metric).join(n, n.id == m.Metric.node_id).where(n.plan_id == plan_id)
            )
            paths = s.scalar(
                select(func.count())
                .select_from(m.PathChange)
                .join(n, n.id == m.PathChange.node_id)
                .where(n.plan_id == plan_id)
            )
            return (*tuple(ck), int(mets or 0), int(paths or 0))

    def latest_curve_time(self) -> float:
        """When the latest curve point of all was recorded (0 without any), by the clock of whoever wrote
        it (an aggregator's): where a study's stream starts comparing from."""
        with self.db.tx("latest curve point") as s:
            return _f(s.scalar(select(func.max(m.CurvePointRow.recorded_at)))) or 0.0

    def curve_points_since(self, plan_ids: Sequence[int], since: float) -> float | None:
        """When the latest curve point on the plans was recorded, if after ``since`` (None otherwise).
        Reads only the points recorded after ``since`` (an index on the time), whoever's they are."""
        if not plan_ids:
            return None
        with self.db.tx("curve points since") as s:
            recent = s.execute(
                select(m.CurvePointRow.node_id, func.max(m.CurvePointRow.recorded_at))
                .where(m.CurvePointRow.recorded_at > since)
                .group_by(m.CurvePointRow.node_id)
            ).all()
            if not recent:
                return None
            latest = dict(recent)
            nodes = sorted(int(n) for n in latest)
            mine: list[float] = []
            for i in range(0, len(nodes), CHUNK):
                stmt = select(m.Node.id).where(m.Node.id.in_(nodes[i : i + CHUNK]), m.Node.plan_id.in_(plan_ids))
                mine.extend(float(latest[n]) for n in s.scalars(stmt))
            return max(mine, default=None)


def _f(x: object) -> float | None:
    return None if x is None else float(x)  # type: ignore[arg-type]
