"""What is running now, for the dashboard's cluster page: running batches with their plan's scope, the
slot they run on, and how far their nodes' learning curves have got. Reads only."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from sqlalchemy import func, select

from stagetree.core.lifecycle import BatchState
from stagetree.master.store import models as m
from stagetree.master.store.database import Database


@dataclass(frozen=True)
class RunningBatch:
    batch_id: int
    attempt: int
    plan_id: int
    scope: str  # whose plan: "owner:<name>" or "team:<name>"
    node_manager_id: str
    slot_id: str
    started_at: float
    stages: list[tuple[int, int, int]] = field(default_factory=list)  # (node, start, end)
    step: int = 0  # the furthest curve point on its stages (its progress, when the trainer reports one)


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
                    m.Batch.slot_id,
                    m.Batch.updated_at,
                    m.Batch.spec_json,
                )
                .join(m.Plan, m.Plan.id == m.Batch.plan_id)
                .where(m.Batch.state == BatchState.RUNNING)
                .order_by(m.Batch.id)
            ).all()
            out = []
            for bid, attempt, pid, scope, nm, slot, at, spec_json in rows:
                try:
                    stages = [(int(x["node"]), int(x["start"]), int(x["end"])) for x in json.loads(spec_json)["stages"]]
                except (ValueError, KeyError, TypeError):
                    stages = []  # a spec not rendered yet
                step = 0
                for node, start, end in stages:
                    top = s.scalar(
                        select(func.max(m.CurvePoint.step)).where(
                            m.CurvePoint.node_id == node, m.CurvePoint.step > start, m.CurvePoint.step <= end
                        )
                    )
                    if top is not None:
                        step = max(step, int(top))
                out.append(
                    RunningBatch(
                        int(bid), int(attempt), int(pid), str(scope), nm or "", slot or "", float(at), stages, step
                    )
                )
            return out
