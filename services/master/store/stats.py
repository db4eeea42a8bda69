"""What sharing bought a study (``core.sharing``: steps and seconds of every ended attempt of the batches
that carried its requests), read in one transaction; and the installation at a glance."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, union

from stagetree.core.lifecycle import AttemptTiming, BatchState, NodeManagerState, RequestState
from stagetree.core.sharing import EndedAttempt, SharingStats, trial_by_trial_steps, unique_steps, work_of
from stagetree.master.store import models as m
from stagetree.master.store.batches import RUNNING_SLOTS
from stagetree.master.store.database import Database, table

_R, _N, _B, _A = table(m.Request), table(m.Node), table(m.Batch), table(m.BatchAttempt)
_RQ = table(m.RequeuedRequest)


@dataclass(frozen=True)
class Overview:
    """The whole installation at a glance (what ``stagetree up`` shows on its status line)."""

    studies: int
    requests: dict[str, int]  # by state
    slots: int
    slots_busy: int  # slots running a batch (each once)
    # batches sent to a busy slot shortly before it frees (the scheduler's lookahead): they start when
    # it does, and do not make the slot any busier
    slots_sent_ahead: int = 0


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
                    .select_from(m.SlotRow)
                    .join(m.NodeManager, m.NodeManager.id == m.SlotRow.node_manager_id)
                    .where(m.NodeManager.state == NodeManagerState.ALIVE)
                )
                or 0
            )
            taken = [(nm, slot) for _b, _r, slot, nm in s.execute(RUNNING_SLOTS)]  # a batch on n slots: n
            busy = len(set(taken))
        return Overview(studies, states, slots, busy, len(taken) - busy)

    def study_stats(self, study_id: str, plan_ids: Collection[int] | None = None) -> SharingStats:
        """The study's sharing figures, over its requests on ``plan_ids`` only when given."""
        mine = _R.c.study_id == study_id
        if plan_ids is not None:
            mine = mine & _R.c.plan_id.in_(list(plan_ids))
        with self.db.tx("study stats") as s:
            reqs = s.execute(select(_R.c.state, _R.c.label, _R.c.node_id, _R.c.step).where(mine)).all()
            plans = select(_R.c.plan_id).where(mine).distinct()
            nodes = {
                int(i): (None if p is None else int(p), int(st))
                for i, p, st in s.execute(select(_N.c.id, _N.c.parent_id, _N.c.start).where(_N.c.plan_id.in_(plans)))
            }
            # the batches that carried its requests: each one's latest, and those it went back to the queue from
            carried = union(
                select(_R.c.batch_id.label("b")).where(mine, _R.c.batch_id.is_not(None)),
                select(_RQ.c.batch_id.label("b")).join(_R, _R.c.id == _RQ.c.request_id).where(mine),
            ).subquery()
            rows = s.execute(
                select(
                    _A.c.state,
                    _B.c.spec_json,
                    _A.c.reached_step,
                    _A.c.dispatched_at,
                    _A.c.started_at,
                    _A.c.finished_at,
                    _A.c.given_at,
                    _A.c.startup_s,
                    _A.c.checkpoint_s,
                    _A.c.train_s,
                )
                .join(_B, _B.c.id == _A.c.batch_id)
                .where(_A.c.batch_id.in_(select(carried.c.b)))
            ).all()
        done = [r for r in reqs if r.state == RequestState.DONE]
        work = work_of(a for row in rows if (a := _ended(row)) is not None)
        return SharingStats(
            requests=dict(Counter(str(r.state) for r in reqs)),
            # an attempt still running counts the steps its worker reported: the metrics that answered a
            # request are applied a moment before its batch's end, so stats read once a study's last
            # request is answered count the batch that answered it
            steps_executed=work.steps + sum(_running_trained(row) for row in rows),
            unique_steps=unique_steps(nodes, ((int(r.node_id), int(r.step)) for r in done)),
            trial_by_trial_steps=trial_by_trial_steps((r.label or "", int(r.step)) for r in done),
            compute_seconds=work.compute_seconds,
            queue_seconds=work.queue_seconds,
            startup_seconds=work.startup_seconds,
            checkpoint_seconds=work.checkpoint_seconds,
        )


def _span(spec_json: str) -> tuple[int, int] | None:
    """A batch spec's first step and its number of steps (None: the spec does not read)."""
    try:
        stages = json.loads(spec_json)["stages"]
        return int(stages[0]["start"]), sum(int(x["end"]) - int(x["start"]) for x in stages)
    except (ValueError, KeyError, TypeError, IndexError):
        return None


def _running_trained(row: Sequence[Any]) -> int:
    """The steps an attempt that has not ended trained so far (the furthest step its worker reported)."""
    state, spec_json, reached, _dispatched, _started, finished, *_ = row
    span = _span(spec_json)
    if finished is not None or state != BatchState.RUNNING or span is None:
        return 0
    reached = None if reached is None else int(reached)
    return EndedAttempt(BatchState.RUNNING, *span, reached, 0.0, None, 0.0).trained


def _ended(row: Sequence[Any]) -> EndedAttempt | None:
    """An ended attempt's row as the core counts it (None: its state or spec does not read, or it has
    not ended)."""
    state, spec_json, reached, dispatched, started, finished, given, startup, ckpt, train = row
    span = _span(spec_json)
    try:
        st = BatchState(state)
    except ValueError:
        return None
    if span is None or not st.is_finished() or finished is None:
        return None
    start, steps = span
    timing = None
    if given is not None and startup is not None and ckpt is not None and train is not None:
        timing = AttemptTiming(float(given), float(startup), float(ckpt), float(train))
    return EndedAttempt(
        st,
        start,
        steps,
        None if reached is None else int(reached),
        float(dispatched),
        None if started is None else float(started),
        float(finished),
        timing,
    )
