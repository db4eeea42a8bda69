"""What the batch ledger wrote, read: batches, what their attempts trained and how long they took, the
text lines their trainers logged, and the hosts that cannot run a plan's trainer.

Reads only; every write to batches and attempts goes through ``store.ledger.BatchLedger``.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Container, Iterable, Sequence
from typing import Any

from sqlalchemy import bindparam, func, select, tuple_
from sqlalchemy.orm import Session

from stagetree.core.errors import NotFound
from stagetree.core.lifecycle import BatchState
from stagetree.core.sharing import EndedAttempt
from stagetree.master.store import models as m
from stagetree.master.store.database import Database, table
from stagetree.master.store.records import BatchRecord, FinishedAttempt, LoggedLine

_B, _A, _R, _HP = table(m.Batch), table(m.BatchAttempt), table(m.Request), table(m.HostProblem)
_RQ, _LL = table(m.RequeuedRequest), table(m.LogLineRow)
_LOG_LINES = (
    select(_LL.c.batch_id, _LL.c.attempt, _LL.c.seq, _LL.c.node_id, _LL.c.step, _LL.c.at, _LL.c.line)
    .where(_LL.c.batch_id.in_(bindparam("ids", expanding=True)))
    .order_by(_LL.c.batch_id, _LL.c.attempt, _LL.c.seq)
)
_BS = table(m.BatchSlot)
_HOST_PROBLEMS = select(_HP.c.plan_id, _HP.c.node_manager_id, _HP.c.error)
_RUNNING = select(_B.c.id, _B.c.plan_id, _B.c.state, _B.c.attempt, _B.c.spec_json, _B.c.node_manager_id).where(
    _B.c.state == BatchState.RUNNING
)
_SLOTS_OF = select(_BS.c.batch_id, _BS.c.rank, _BS.c.slot_id).where(
    _BS.c.batch_id.in_(bindparam("ids", expanding=True))
)
# the slots of every running batch, with its node manager
RUNNING_SLOTS = (
    select(_BS.c.batch_id, _BS.c.rank, _BS.c.slot_id, _B.c.node_manager_id)
    .join(_B, _B.c.id == _BS.c.batch_id)
    .where(_B.c.state == BatchState.RUNNING)
)
_IDS_PER_READ = 1000


def slots_in(db: Database, s: Session, batch_ids: Collection[int]) -> dict[int, tuple[str, ...]]:
    """The slots each of these batches holds, in rank order (a batch with none is left out)."""
    ids = sorted(set(batch_ids))
    rows: list[Sequence[Any]] = []
    for i in range(0, len(ids), _IDS_PER_READ):
        rows += db.rows(s, _SLOTS_OF, {"ids": ids[i : i + _IDS_PER_READ]})
    return _by_rank((bid, rank, slot) for bid, rank, slot in rows)


def running_slots_in(db: Database, s: Session) -> dict[int, tuple[str, ...]]:
    """The slots of every running batch, in rank order."""
    return _by_rank((bid, rank, slot) for bid, rank, slot, _nm in db.rows(s, RUNNING_SLOTS))


def _by_rank(rows: Iterable[tuple[Any, Any, Any]]) -> dict[int, tuple[str, ...]]:
    ranked: dict[int, list[tuple[int, str]]] = {}
    for bid, rank, slot in rows:
        ranked.setdefault(int(bid), []).append((int(rank), str(slot)))
    return {bid: tuple(slot for _, slot in sorted(rs)) for bid, rs in ranked.items()}


class BatchReader:
    """Batches and their attempts, read."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def host_problems_in(self, s: Session) -> dict[int, dict[str, str]]:
        """Per plan, the node managers that cannot run its trainer and why."""
        out: dict[int, dict[str, str]] = {}
        for plan, nm, error in self.db.rows(s, _HOST_PROBLEMS):
            out.setdefault(int(plan), {})[str(nm)] = str(error)
        return out

    def get_batch(self, batch_id: int) -> BatchRecord:
        with self.db.tx("get batch") as s:
            b = s.get(m.Batch, batch_id)
            if b is None:
                raise NotFound(f"batch {batch_id} does not exist")
            return _batch_record(b, slots_in(self.db, s, [batch_id]))

    def plan_of_batch(self, batch_id: int) -> int:
        """The plan a batch belongs to (it never changes)."""
        return self.get_batch(batch_id).plan_id

    def plans_of_batches(self, batch_ids: Sequence[int]) -> dict[int, int]:
        """The plan of each of these batches that exists."""
        out: dict[int, int] = {}
        ids = sorted(batch_ids)
        with self.db.tx("plans of batches") as s:
            for i in range(0, len(ids), 1000):
                for bid, pid in s.execute(select(_B.c.id, _B.c.plan_id).where(_B.c.id.in_(ids[i : i + 1000]))):
                    out[int(bid)] = int(pid)
        return out

    def running_batches(self) -> list[BatchRecord]:
        with self.db.tx("load running batches") as s:
            return self.running_in(s)

    def running_in(self, s: Session) -> list[BatchRecord]:
        slots = running_slots_in(self.db, s)
        return [
            BatchRecord(int(i), int(p), BatchState(st), a, spec, nm, slots.get(int(i), ()))
            for i, p, st, a, spec, nm in self.db.rows(s, _RUNNING)
        ]

    def running_batch_info(self) -> list[tuple[BatchRecord, float, list[str]]]:
        """Every running batch with when its current attempt was dispatched and the studies of the
        requests it serves."""
        with self.db.tx("running batch info") as s:
            rows = s.execute(
                select(m.Batch, m.BatchAttempt.dispatched_at)
                .join(
                    m.BatchAttempt,
                    (m.BatchAttempt.batch_id == m.Batch.id) & (m.BatchAttempt.attempt == m.Batch.attempt),
                )
                .where(m.Batch.state == BatchState.RUNNING)
            ).all()
            studies: dict[int, list[str]] = {}
            ids = [int(b.id) for b, _ in rows]
            for i in range(0, len(ids), 1000):
                for bid, sid in s.execute(
                    select(_R.c.batch_id, _R.c.study_id).where(_R.c.batch_id.in_(ids[i : i + 1000])).order_by(_R.c.id)
                ):
                    studies.setdefault(int(bid or 0), []).append(str(sid))
            slots = slots_in(self.db, s, ids)
            return [(_batch_record(b, slots), float(t), studies.get(int(b.id), [])) for b, t in rows]

    def request_log_lines(self, request_id: int) -> list[LoggedLine]:
        """The text lines logged by the trainers of every batch that carried the request (those that sent
        it back to the queue, then the one that holds it now), in the order the batches ran, each
        attempt's in its order (``seq``). Empty for an unknown request."""
        with self.db.tx("request log lines") as s:
            earlier = s.scalars(select(_RQ.c.batch_id).where(_RQ.c.request_id == request_id)).all()
            now = s.scalar(select(_R.c.batch_id).where(_R.c.id == request_id))
            ids = sorted({int(b) for b in earlier} | ({int(now)} if now is not None else set()))
            if not ids:
                return []
            return [
                LoggedLine(int(b), int(a), int(q), int(n), int(st), float(at), str(line))
                for b, a, q, n, st, at, line in s.execute(_LOG_LINES, {"ids": ids})
            ]

    def attempt_log_lines(self, batch_id: int, attempt: int) -> list[LoggedLine]:
        """The text lines one batch attempt's trainer logged, in their order (``seq``)."""
        with self.db.tx("attempt log lines") as s:
            return [
                LoggedLine(int(b), int(a), int(q), int(n), int(st), float(at), str(line))
                for b, a, q, n, st, at, line in s.execute(_LOG_LINES, {"ids": [batch_id]})
                if int(a) == attempt
            ]

    def executed_steps(self, plan_id: int | None = None) -> int:
        """Training steps of every ended batch attempt (of one plan, or all): all of a batch's when it ran
        to its end, else up to the furthest step its worker reported (``core.sharing.EndedAttempt``): what
        the platform actually trained, to compare with the unique steps of the plans."""
        with self.db.tx("executed steps") as s:
            q = (
                select(_A.c.state, _B.c.spec_json, _A.c.reached_step)
                .join(_B, _B.c.id == _A.c.batch_id)
                .where(_A.c.state != BatchState.RUNNING)
            )
            if plan_id is not None:
                q = q.where(_B.c.plan_id == plan_id)
            total = 0
            for state, spec, reached in s.execute(q):
                stages = json.loads(spec)["stages"]
                start, steps = int(stages[0]["start"]), sum(int(st["end"]) - int(st["start"]) for st in stages)
                total += EndedAttempt(BatchState(state), start, steps, reached, 0.0, None, 0.0).trained
            return total

    def finished_attempts(
        self,
        since: float,
        limit: int = 1000,
        state: BatchState = BatchState.DONE,
        skip: Container[tuple[int, int]] = (),
    ) -> list[FinishedAttempt]:
        """Attempts that ran to their end (or ended in ``state``: OUT_OF_MEMORY) and finished at or after
        ``since`` (by the clock of whoever recorded it), oldest first: the latest ``limit`` of them, less
        the (batch, attempt) pairs in ``skip`` (the caller has them: their specs are not read again; the
        cost learner reads every second, and a busy cluster finishes thousands of attempts a minute)."""
        a, b, sl = m.BatchAttempt, m.Batch, m.SlotRow
        with self.db.tx("finished attempts") as s:
            keys = s.execute(
                select(a.batch_id, a.attempt)
                .where(a.finished_at >= since, a.state == state)
                .order_by(a.finished_at.desc())
                .limit(limit)
            ).all()
            wanted = sorted(k for k in {(int(bid), int(att)) for bid, att in keys} if k not in skip)
            rows: list[Any] = []
            for i in range(0, len(wanted), 500):
                rows += s.execute(
                    select(
                        a.batch_id,
                        a.attempt,
                        b.spec_json,
                        func.coalesce(a.started_at, a.sent_at, a.dispatched_at),
                        a.finished_at,
                        sl.gpu_type,
                    )
                    .join(b, b.id == a.batch_id)
                    .outerjoin(sl, (sl.node_manager_id == a.node_manager_id) & (sl.slot_id == a.slot_id))
                    .where(tuple_(a.batch_id, a.attempt).in_(wanted[i : i + 500]))
                ).all()
            rows.sort(key=lambda r: -float(r[4] or 0.0))
        return [
            FinishedAttempt(int(bid), int(att), spec, float(end) - float(began), float(end), gpu or "")
            for bid, att, spec, began, end, gpu in reversed(rows)
            if end is not None
        ]


def _batch_record(b: m.Batch, slots: dict[int, tuple[str, ...]]) -> BatchRecord:
    bid = int(b.id)
    return BatchRecord(
        bid, int(b.plan_id), BatchState(b.state), b.attempt, b.spec_json, b.node_manager_id, slots.get(bid, ())
    )
