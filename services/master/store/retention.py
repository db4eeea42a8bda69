"""What deleting a study or forgetting a plan removes, each in one transaction.

- ``delete_study``: the study, its requests (with the record of the batches that carried them before a
  requeue) and its policy state. Its plans stay: they belong to the scope (the owner or the team), and
  other studies of that scope may use them; ``forget_plan`` frees them.
- ``forget_plan``: what a plan computed, i.e. its checkpoints (their files are deleted by the live node
  managers, through the outbox), its metrics and learning curves, the path changes recorded on it and
  the text lines its batches' trainers logged (they say how what is forgotten was computed), and the
  finished requests those metrics answered. The plan
  row and its nodes stay (plans are never deleted, so caches of plan ids stay true); the next eval on it
  trains again. Refused while a request on it is live: cancel those first.

The caller cancels a study's live requests (``MasterService.cancel``, which also aborts their batches)
before ``delete_study``; a request still live then is refused the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import ColumnElement, CursorResult, delete, func, select
from sqlalchemy.orm import Session

from stagetree.core.errors import FailedPrecondition, NotFound
from stagetree.core.lifecycle import LIVE_REQUEST_STATES, AssignmentKind
from stagetree.master.store import models as m
from stagetree.master.store.database import Database
from stagetree.master.store.nodes import ALIVE, enqueue_action


@dataclass(frozen=True)
class Forgotten:
    """What ``forget_plan`` removed."""

    checkpoints: int
    bytes_freed: int
    metrics: int
    requests: int


class Retention:
    def __init__(self, db: Database) -> None:
        self.db = db

    def delete_study(self, study_id: str) -> int:
        """Delete a study whose requests are all finished; returns how many requests went with it."""
        with self.db.tx("delete study") as s:
            if s.get(m.Study, study_id, with_for_update=True) is None:
                raise NotFound(f"study {study_id!r} does not exist")
            _refuse_live(s, m.Request.study_id == study_id, f"study {study_id!r}")
            ids = select(m.Request.id).where(m.Request.study_id == study_id).scalar_subquery()
            s.execute(delete(m.RequeuedRequest).where(m.RequeuedRequest.request_id.in_(ids)))
            n = _count(s.execute(delete(m.Request).where(m.Request.study_id == study_id)))
            s.execute(delete(m.PolicyState).where(m.PolicyState.study_id == study_id))
            s.execute(delete(m.Study).where(m.Study.id == study_id))
            return n

    def forget_plan(self, plan_id: int) -> Forgotten:
        with self.db.tx("forget plan") as s:
            if s.get(m.Plan, plan_id, with_for_update=True) is None:
                raise NotFound(f"plan {plan_id} does not exist")
            _refuse_live(s, m.Request.plan_id == plan_id, f"plan {plan_id}")
            nodes = select(m.Node.id).where(m.Node.plan_id == plan_id).scalar_subquery()
            ckpts = s.execute(select(m.Checkpoint.uri, m.Checkpoint.bytes).where(m.Checkpoint.node_id.in_(nodes))).all()
            if ckpts:
                uris = sorted({str(u) for u, _ in ckpts})  # a pack's points share one uri
                for nm in s.scalars(select(m.NodeManager.id).where(m.NodeManager.state == ALIVE)):
                    enqueue_action(s, str(nm), AssignmentKind.DELETE_CHECKPOINTS, uris=uris)
                s.execute(delete(m.Checkpoint).where(m.Checkpoint.node_id.in_(nodes)))
            metrics = _count(s.execute(delete(m.Metric).where(m.Metric.node_id.in_(nodes))))
            s.execute(delete(m.CurvePointRow).where(m.CurvePointRow.node_id.in_(nodes)))
            s.execute(delete(m.PathChange).where(m.PathChange.node_id.in_(nodes)))
            batches = select(m.Batch.id).where(m.Batch.plan_id == plan_id).scalar_subquery()
            s.execute(delete(m.LogLineRow).where(m.LogLineRow.batch_id.in_(batches)))
            ids = select(m.Request.id).where(m.Request.plan_id == plan_id).scalar_subquery()
            s.execute(delete(m.RequeuedRequest).where(m.RequeuedRequest.request_id.in_(ids)))
            requests = _count(s.execute(delete(m.Request).where(m.Request.plan_id == plan_id)))
            return Forgotten(len(ckpts), sum(int(b) for _, b in ckpts), metrics, requests)


def _refuse_live(s: Session, where: ColumnElement[bool], what: str) -> None:
    live = s.scalar(select(func.count()).select_from(m.Request).where(where, m.Request.state.in_(LIVE_REQUEST_STATES)))
    if live:
        raise FailedPrecondition(
            f"{what} has {live} live request(s) (waiting or running); cancel them or let them finish first"
        )


def _count(result: object) -> int:
    """Rows a DELETE removed."""
    return int(result.rowcount) if isinstance(result, CursorResult) else 0
