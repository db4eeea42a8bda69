"""What sharing bought a study (``core.sharing``), read in one transaction."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

from sqlalchemy import func, select

from stagetree.core.lifecycle import BatchState, NodeManagerState, RequestState
from stagetree.core.sharing import SharingStats, trial_by_trial_steps, unique_steps
from stagetree.master.store import models as m
from stagetree.master.store.database import Database, table

_R, _N, _B, _A = table(m.Request), table(m.Node), table(m.Batch), table(m.BatchAttempt)


@dataclass(frozen=True)
class Overview:
    """The whole installation at a glance (what ``stagetree up`` shows on its status line)."""

    studies: int
    requests: dict[str, int]  # by state
    slots: int
    slots_busy: int


class StatsReader:
    def __init__(self, db: Database) -> None:
        self.db = db

    def overview(self) -> Overview:
        with self.db.tx("overview") as s:
            studies = int(s.scalar(select(func.count()).select_from(m.Study)) or 0)
            states = {str(st): int(n) for st, n in s.execute(select(_R.c.state, func.count()).group_by(_R.c.state))}
            slots = int(
                s.scalar(
                    select(func.count())
                    .select_from(m.Slot)
                    .join(m.NodeManager, m.NodeManager.id == m.Slot.node_manager_id)
                    .where(m.NodeManager.state == NodeManagerState.ALIVE)
                )
                or 0
            )
            running = s.scalars(select(_B.c.slot_id).where(_B.c.state == BatchState.RUNNING, _B.c.slot_id.is_not(None)))
            busy = sum(len(str(slot).split(",")) for slot in running)  # a batch on several slots: "a,b"
        return Overview(studies, states, slots, busy)

    def study_stats(self, study_id: str) -> SharingStats:
        with self.db.tx("study stats") as s:
            reqs = s.execute(
                select(_R.c.state, _R.c.label, _R.c.node_id, _R.c.step, _R.c.batch_id).where(_R.c.study_id == study_id)
            ).all()
            plans = select(_R.c.plan_id).where(_R.c.study_id == study_id).distinct()
            nodes = {
                int(i): (None if p is None else int(p), int(st))
                for i, p, st in s.execute(select(_N.c.id, _N.c.parent_id, _N.c.start).where(_N.c.plan_id.in_(plans)))
            }
            done = [r for r in reqs if r.state == RequestState.DONE]
            batch_ids = sorted({int(r.batch_id) for r in done if r.batch_id is not None})
            specs = s.scalars(select(_B.c.spec_json).where(_B.c.id.in_(batch_ids), _B.c.state == BatchState.DONE))
            executed = sum(int(st["end"]) - int(st["start"]) for spec in specs for st in json.loads(spec)["stages"])
            seconds = s.scalar(
                select(
                    func.coalesce(func.sum(_A.c.finished_at - func.coalesce(_A.c.sent_at, _A.c.dispatched_at)), 0.0)
                ).where(_A.c.batch_id.in_(batch_ids), _A.c.state == BatchState.DONE)
            )
        return SharingStats(
            requests=dict(Counter(str(r.state) for r in reqs)),
            steps_executed=executed,
            unique_steps=unique_steps(nodes, ((int(r.node_id), int(r.step)) for r in done)),
            trial_by_trial_steps=trial_by_trial_steps((r.label or "", int(r.step)) for r in done),
            compute_seconds=float(seconds or 0.0),
        )
