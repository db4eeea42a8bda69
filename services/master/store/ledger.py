"""The batch ledger: batches, their attempts, and the one adapter that persists how an attempt ended.

Every end of an attempt (a worker's terminal event, ingested by ``store.ingest.Ingestor`` from the bus
or a node manager's direct report, a lost node manager, an abort) goes through
:meth:`BatchLedger.end_attempts_in`, which reads the batch heads and the requests each batch carries,
asks the core's pure ``lifecycle.end_attempt`` what to do, and writes that decision: the rules of a
batch's life live in ``stagetree.core.lifecycle`` alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence

from sqlalchemy import ColumnElement, bindparam, case, insert, or_, select, text, tuple_, update
from sqlalchemy.orm import Session

from stagetree.core.errors import InvalidArgument
from stagetree.core.lifecycle import (
    AssignmentKind,
    AttemptDecision,
    AttemptEnd,
    AttemptTiming,
    BatchHead,
    BatchState,
    CarriedRequest,
    NodeManagerState,
    Outcome,
    RequestState,
    RetryPolicy,
    after,
    end_attempt,
)
from stagetree.master.store import models as m
from stagetree.master.store.checkpoints import CheckpointCatalog
from stagetree.master.store.curves import CurveStore
from stagetree.master.store.database import Database, table
from stagetree.master.store.nodes import LOST, enqueue_action
from stagetree.master.store.paths import PathChangeStore
from stagetree.master.store.records import BatchRecord, DispatchItem, LoggedLine
from stagetree.master.store.requests import RequestStore

log = logging.getLogger(__name__)

DEFAULT_RETRY = RetryPolicy()

_B, _A, _R, _BS = table(m.Batch), table(m.BatchAttempt), table(m.Request), table(m.BatchSlot)
_NM = table(m.NodeManager)
_RQ, _HP, _LL = table(m.RequeuedRequest), table(m.HostProblem), table(m.LogLineRow)
# the node manager and plan of attempts that found their host cannot run the plan's trainer
_WHERE_RAN = (
    select(_A.c.batch_id, _A.c.attempt, _A.c.node_manager_id, _B.c.plan_id)
    .join(_B, _B.c.id == _A.c.batch_id)
    .where(_A.c.batch_id.in_(bindparam("ids", expanding=True)))
)
_HEADS = (
    select(_B.c.id, _B.c.attempt, _B.c.state)
    .where(_B.c.id.in_(bindparam("ids", expanding=True)))
    .order_by(_B.c.id)
    .with_for_update()
)
_CARRIED = (
    select(_R.c.batch_id, _R.c.id, _R.c.failures, table(m.Study).c.retry_user_errors)
    .join(table(m.Study), table(m.Study).c.id == _R.c.study_id)
    .where(_R.c.batch_id.in_(bindparam("ids", expanding=True)), _R.c.state == RequestState.SCHED)
)
_END_BATCHES = (
    update(_B)
    .where(_B.c.id.in_(bindparam("ids", expanding=True)))
    .values(state=bindparam("st"), updated_at=bindparam("t"))
)
_END_ATTEMPTS = (
    update(_A)
    .where(_A.c.batch_id.in_(bindparam("ids", expanding=True)), _A.c.state == BatchState.RUNNING)
    .values(state=bindparam("st"), finished_at=bindparam("t"))
)
_COUNT_FAILURE = (
    update(_R)
    .where(_R.c.id.in_(bindparam("ids", expanding=True)))
    .values(failures=_R.c.failures + 1, error=bindparam("error"))
)
_FAIL = (
    update(_R)
    .where(_R.c.id.in_(bindparam("ids", expanding=True)), _R.c.state == RequestState.SCHED)
    .values(state=RequestState.FAILED, done_at=bindparam("t"))
)
_REQUEUE = (
    update(_R)
    .where(_R.c.id.in_(bindparam("ids", expanding=True)), _R.c.state == RequestState.SCHED)
    .values(state=RequestState.NOT_SCHED, batch_id=None)
)
_CLAIM_MANY = (
    update(_R)
    .where(_R.c.id.in_(bindparam("ids", expanding=True)), _R.c.state == RequestState.NOT_SCHED)
    .returning(_R.c.batch_id)
)
_NEW_BATCHES = insert(_B).returning(_B.c.id, sort_by_parameter_order=True)  # ids in the rows' order
_NEW_BATCHES_WITH_IDS = insert(_B)
_NEXT_BATCH_IDS = text("SELECT nextval(pg_get_serial_sequence('batches', 'id')) FROM generate_series(1, :n)")
_DROP_BATCH = _B.delete().where(_B.c.id == bindparam("b"))
_SET_SPEC = update(_B).where(_B.c.id == bindparam("b")).values(spec_json=bindparam("spec"))
_NEW_ATTEMPT = insert(_A)
_NEW_SLOTS = insert(_BS)
_STARTED = (
    update(_A)
    .where(_A.c.batch_id == bindparam("b"), _A.c.attempt == bindparam("a"), _A.c.started_at.is_(None))
    .values(started_at=bindparam("t"))
)
_REACHED = (
    update(_A)
    .where(
        _A.c.batch_id == bindparam("b"),
        _A.c.attempt == bindparam("a"),
        or_(_A.c.reached_step.is_(None), _A.c.reached_step < bindparam("s")),
    )
    .values(reached_step=bindparam("s"))
)
_TIMING = (
    update(_A)
    .where(_A.c.batch_id == bindparam("b"), _A.c.attempt == bindparam("a"))
    .values(
        given_at=bindparam("given"),
        startup_s=bindparam("startup"),
        checkpoint_s=bindparam("ckpt"),
        train_s=bindparam("train"),
    )
)


class BatchLedger:
    """Batches and attempts: dispatch, the end of attempts (``end_attempts_in``), and what they ran."""

    def __init__(
        self,
        db: Database,
        requests: RequestStore,
        checkpoints: CheckpointCatalog,
        curves: CurveStore | None = None,
        paths: PathChangeStore | None = None,
    ) -> None:
        self.db = db
        self.requests = requests
        self.checkpoints = checkpoints
        self.curves = CurveStore(db) if curves is None else curves
        self.paths = PathChangeStore(db) if paths is None else paths

    # -- the start and the end of attempts ------------------------------------------------------------

    def mark_started_in(self, s: Session, attempts: Sequence[tuple[int, int, float | None]], now: float) -> None:
        """Record that these (batch, attempt, when or None) workers started: when they say, else ``now``,
        and never after ``now`` (a node manager's clock ahead of this one's). The first word wins, so a
        redelivered ``batch_started`` changes nothing. Unknown pairs are ignored."""
        rows: dict[tuple[int, int], float] = {}
        for b, a, t in attempts:
            rows.setdefault((b, a), now if t is None else min(t, now))
        if rows:
            s.connection().execute(_STARTED, [{"b": b, "a": a, "t": t} for (b, a), t in sorted(rows.items())])

    def mark_reached_in(self, s: Session, reached: Sequence[tuple[int, int, int]]) -> None:
        """Record the furthest step these (batch, attempt, step) attempts said they trained to (a step
        below what is recorded changes nothing, so any order and any redelivery give the same row)."""
        furthest: dict[tuple[int, int], int] = {}
        for b, a, step in reached:
            furthest[(b, a)] = max(step, furthest.get((b, a), step))
        if furthest:
            s.connection().execute(_REACHED, [{"b": b, "a": a, "s": st} for (b, a), st in sorted(furthest.items())])

    def record_timing_in(self, s: Session, timings: Sequence[tuple[int, int, AttemptTiming]]) -> None:
        """Record these (batch, attempt)'s workers' measure of their time (the last word wins: an attempt
        reports it once, a redelivery says the same)."""
        rows = {(b, a): t for b, a, t in timings}
        if rows:
            s.connection().execute(
                _TIMING,
                [
                    {
                        "b": b,
                        "a": a,
                        "given": t.given_at,
                        "startup": t.startup_s,
                        "ckpt": t.checkpoint_s,
                        "train": t.train_s,
                    }
                    for (b, a), t in sorted(rows.items())
                ],
            )

    def record_log_lines_in(self, s: Session, lines: Sequence[LoggedLine]) -> int:
        """Keep the text lines of these attempts (insert-or-ignore on (batch, attempt, seq): a redelivered
        line is the same row; lines of an attempt that does not exist are dropped). Returns how many were
        offered for existing attempts. The bounds are the message's (``bus.messages.LogLine``)."""
        keys = sorted({(ln.batch_id, ln.attempt) for ln in lines})
        if not keys:
            return 0
        known = {
            (int(b), int(a))
            for b, a in s.execute(
                select(_A.c.batch_id, _A.c.attempt).where(tuple_(_A.c.batch_id, _A.c.attempt).in_(keys))
            )
        }
        rows: dict[tuple[int, int, int], dict[str, object]] = {}
        for ln in lines:
            if (ln.batch_id, ln.attempt) in known:
                rows.setdefault(
                    (ln.batch_id, ln.attempt, ln.seq),
                    {
                        "batch_id": ln.batch_id,
                        "attempt": ln.attempt,
                        "seq": ln.seq,
                        "node_id": ln.node,
                        "step": ln.step,
                        "at": ln.at,
                        "line": ln.line,
                    },
                )
        self.db.insert_ignore(s, _LL, [rows[k] for k in sorted(rows)], ["batch_id", "attempt", "seq"])
        return len(rows)

    def end_attempts_in(
        self,
        s: Session,
        ends: Sequence[AttemptEnd],
        policy: RetryPolicy,
        now: float | None = None,
        heads: dict[int, BatchHead | None] | None = None,
    ) -> list[AttemptDecision]:
        """Decide (``lifecycle.end_attempt``) and persist the ends of attempts, in order, inside the
        caller's transaction. An end of an unknown batch, or of an attempt that is not the running one,
        is stale and changes nothing. One statement per kind of change, whatever the number of ends.
        ``heads``: the batches' heads when the caller has read (and locked) them already."""
        if not ends:
            return []
        now = time.time() if now is None else now
        heads = self.heads_in(s, [e.batch_id for e in ends]) if heads is None else dict(heads)
        live = [b for b, h in heads.items() if h is not None and h.state is BatchState.RUNNING]
        carried: dict[int, list[CarriedRequest]] = {}
        for bid, rid, failures, retry in self.db.rows(s, _CARRIED, {"ids": live}) if live else ():
            carried.setdefault(int(bid), []).append(CarriedRequest(int(rid), int(failures or 0), bool(retry)))
        decisions = []
        for e in ends:
            d = end_attempt(heads[e.batch_id], e, sorted(carried.pop(e.batch_id, []), key=lambda r: r.id), policy)
            heads[e.batch_id] = after(heads[e.batch_id], d)
            decisions.append(d)
        self._persist(s, decisions, now)
        return decisions

    def heads_in(self, s: Session, batch_ids: Iterable[int]) -> dict[int, BatchHead | None]:
        """The current attempt and state of each batch (None: no such batch), rows locked for the
        caller's transaction in id order (one lock order for concurrent writers)."""
        ids = sorted(set(batch_ids))
        heads: dict[int, BatchHead | None] = dict.fromkeys(ids)
        for bid, att, st in self.db.rows(s, _HEADS, {"ids": ids}) if ids else ():
            heads[int(bid)] = BatchHead(int(att), BatchState(st))
        return heads

    def _persist(self, s: Session, decisions: Sequence[AttemptDecision], now: float) -> None:
        c = s.connection()
        ended: dict[BatchState, list[int]] = {}
        by_error: dict[str, list[int]] = {}
        failed: list[int] = []
        requeued: list[int] = []
        carried_before: list[tuple[int, int]] = []  # (request, batch) of the requests requeued
        for d in decisions:
            if d.stale:
                log.info("stale batch report ignored", extra={"batch_id": d.batch_id, "attempt": d.attempt})
                continue
            assert d.batch_state is not None
            log.info(
                "batch attempt ended",
                extra={
                    "batch_id": d.batch_id,
                    "attempt": d.attempt,
                    "state": str(d.batch_state),
                    "failed": len(d.failed),
                    "requeued": len(d.requeued),
                    "error": d.error.split("\n", 1)[0][:200],
                },
            )
            ended.setdefault(d.batch_state, []).append(d.batch_id)
            if d.counted:
                by_error.setdefault(d.error, []).extend(d.counted)
            failed.extend(d.failed)
            requeued.extend(d.requeued)
            carried_before.extend((r, d.batch_id) for r in d.requeued)
        for error, ids in by_error.items():
            c.execute(_COUNT_FAILURE, {"ids": sorted(ids), "error": error})
        if failed:
            c.execute(_FAIL, {"ids": sorted(failed), "t": now})
        if requeued:
            c.execute(_REQUEUE, {"ids": sorted(requeued)})
            self.db.bulk_insert_ignore(
                s, _RQ, ("request_id", "batch_id"), sorted(carried_before), ("request_id", "batch_id")
            )
        for state, ids in ended.items():
            c.execute(_END_BATCHES, {"ids": ids, "st": state, "t": now})
            c.execute(_END_ATTEMPTS, {"ids": ids, "st": state, "t": now})
        self._record_host_problems(s, [d for d in decisions if d.exclude_host and not d.stale], now)

    def _record_host_problems(self, s: Session, decisions: Sequence[AttemptDecision], now: float) -> None:
        """Keep each attempt's node manager from its plan's next batches, with the reason (the first one
        stays: the node manager is kept away until it registers again, ``NodeRegistry``)."""
        if not decisions:
            return
        why = {(d.batch_id, d.attempt): d.error for d in decisions}
        rows = {
            (int(plan), str(nm)): why[(int(b), int(a))]
            for b, a, nm, plan in self.db.rows(s, _WHERE_RAN, {"ids": sorted({d.batch_id for d in decisions})})
            if (int(b), int(a)) in why
        }
        self.db.bulk_insert_ignore(
            s,
            _HP,
            ("plan_id", "node_manager_id", "error", "at"),
            [(plan, nm, error, now) for (plan, nm), error in sorted(rows.items())],
            ("plan_id", "node_manager_id"),
        )
        for plan, nm in sorted(rows):
            log.warning(
                "node manager cannot run the plan's trainer; its work goes elsewhere",
                extra={"node_manager_id": nm, "plan_id": plan, "error": rows[(plan, nm)].split("\n", 1)[0][:200]},
            )

    def end_batches(self, batch_ids: Iterable[int], outcome: Outcome, *, what: str) -> list[int]:
        """End the running attempts of these batches with ``outcome`` (LOST, ABORTED); returns the
        batches that were running."""
        with self.db.tx(what) as s:
            return self._end_running_in(s, list(batch_ids), outcome)

    def _end_running_in(self, s: Session, batch_ids: list[int], outcome: Outcome) -> list[int]:
        if not batch_ids:
            return []
        heads = self.heads_in(s, batch_ids)
        ends = [AttemptEnd(b, h.attempt, outcome) for b, h in heads.items() if h is not None]
        return [d.batch_id for d in self.end_attempts_in(s, ends, DEFAULT_RETRY, heads=heads) if not d.stale]

    def abort_batch(self, batch_id: int) -> str | None:
        """End a running batch no live request needs and queue the order to stop it for its node
        manager (returned, to be woken)."""
        with self.db.tx("abort batch") as s:
            b = s.get(m.Batch, batch_id, with_for_update=True)
            if b is None or b.state != BatchState.RUNNING:
                return None
            if b.node_manager_id:
                enqueue_action(s, b.node_manager_id, AssignmentKind.ABORT, batch_id, b.attempt)
            self._end_running_in(s, [batch_id], Outcome.ABORTED)
            return b.node_manager_id

    def preempt_batch(self, batch_id: int) -> bool:
        """Ask the batch's node manager to preempt it (the batch stays RUNNING until it reports). Returns
        False when the batch is not running."""
        with self.db.tx("preempt batch") as s:
            b = s.get(m.Batch, batch_id)
            if b is None or b.state != BatchState.RUNNING or not b.node_manager_id:
                return False
            enqueue_action(s, b.node_manager_id, AssignmentKind.PREEMPT, batch_id, b.attempt)
            return True

    def mark_lost(
        self, nm_id: str, state: NodeManagerState = LOST, seen: tuple[NodeManagerState, float] | None = None
    ) -> list[int] | None:
        """The node manager stopped heartbeating: its running batches are LOST and their requests go back
        to NOT_SCHED (the next round rebuilds them from the latest checkpoint), and it is in ``state``
        (``LEFT`` for one that said it left). Returns the batch ids.

        ``seen``: the (state, last heartbeat) the caller judged it by. When the row no longer holds them (it
        registered or heartbeated since), nothing changes and None is returned: that registration's list
        of the attempts it runs decides what is requeued, not a judgement made before it."""
        with self.db.tx("mark node manager lost") as s:
            row = update(m.NodeManager).where(m.NodeManager.id == nm_id)
            if seen is not None:
                row = row.where(m.NodeManager.state == seen[0], m.NodeManager.last_heartbeat == seen[1])
            changed = s.execute(row.values(state=state)).rowcount  # type: ignore[attr-defined]
            if seen is not None and not changed:
                return None
            ids = s.scalars(select(_B.c.id).where(_B.c.node_manager_id == nm_id, _B.c.state == BatchState.RUNNING))
            return self._end_running_in(s, [int(b) for b in ids], Outcome.LOST)

    def requeue_unknown(
        self, nm_id: str, known: Iterable[tuple[int, int]], sent_before: float | None = None
    ) -> list[int]:
        """A node manager listed the attempts it knows (registering, or in a heartbeat): its running
        batches whose current attempt was sent to it (before ``sent_before``, when given: later ones may
        still be on their way) but is not in ``known`` are LOST and their requests NOT_SCHED (a restarted
        process never runs them; an assignment lost in a broken stream never arrives). Unsent attempts
        stay: its stream sends them. Returns the batch ids."""
        return self.requeue_unknown_many([(nm_id, known)], sent_before).get(nm_id, [])

    def requeue_unknown_many(
        self, listed: Sequence[tuple[str, Iterable[tuple[int, int]]]], sent_before: float | None = None
    ) -> dict[str, list[int]]:
        """``requeue_unknown`` for several node managers' lists in one transaction (the heartbeats that
        arrived together); the batch ids requeued, per node manager that had any."""
        keep = {nm: {(int(b), int(a)) for b, a in known} for nm, known in listed}
        if not keep:
            return {}
        sent = _A.c.sent_at.is_not(None) if sent_before is None else _A.c.sent_at < sent_before
        with self.db.tx("requeue unknown attempts") as s:
            return self._requeue_unlisted_in(s, keep, sent)

    def _requeue_unlisted_in(
        self, s: Session, keep: dict[str, set[tuple[int, int]]], *where: ColumnElement[bool]
    ) -> dict[str, list[int]]:
        """End LOST the running attempts of these node managers (and ``where``) that their lists in
        ``keep`` do not hold; the batch ids requeued, per node manager that had any."""
        # driven by the running attempts (a partial index, per node manager), not the batches' history
        rows = s.execute(
            select(_A.c.node_manager_id, _B.c.id, _B.c.attempt)
            .join(_B, (_A.c.batch_id == _B.c.id) & (_A.c.attempt == _B.c.attempt))
            .where(
                _A.c.node_manager_id.in_(sorted(keep)),
                _A.c.state == BatchState.RUNNING,
                _B.c.node_manager_id == _A.c.node_manager_id,
                _B.c.state == BatchState.RUNNING,
                *where,
            )
        ).all()
        lost: dict[str, list[int]] = {}
        for nm, b, a in rows:
            if (int(b), int(a)) not in keep[nm]:
                lost.setdefault(nm, []).append(int(b))
        ended = set(self._end_running_in(s, sorted(b for ids in lost.values() for b in ids), Outcome.LOST))
        return {nm: out for nm, ids in lost.items() if (out := sorted(b for b in ids if b in ended))}

    def leave(self, nm_id: str, known: Iterable[tuple[int, int]]) -> list[int] | None:
        """A node manager stopped gracefully (``LEFT``: rounds give its slots no work; a registration
        makes it ``ALIVE`` again). Its running attempts it does not list in ``known``, sent or not, are
        LOST and their requests NOT_SCHED at once; the listed ones end by their reports (or by
        ``requeue_lost`` a heartbeat TTL later). The batch ids requeued; None when it is not registered."""
        keep = {nm_id: {(int(b), int(a)) for b, a in known}}
        with self.db.tx("node manager leaves") as s:
            found = s.execute(
                update(m.NodeManager)
                .where(m.NodeManager.id == nm_id)
                .values(state=NodeManagerState.LEFT, last_heartbeat=time.time())
                .returning(m.NodeManager.id)
            ).first()
            if found is None:
                return None
            return self._requeue_unlisted_in(s, keep).get(nm_id, [])

    # -- dispatch -------------------------------------------------------------------------------------

    def dispatch(
        self, plan_id: int, spec_for: Callable[[int, int], str], request_ids: Sequence[int], nm_id: str, *slot_ids: str
    ) -> BatchRecord | None:
        """``dispatch_many`` of one batch on ``slot_ids`` of ``nm_id`` (rank order)."""
        return self.dispatch_many([DispatchItem(plan_id, spec_for, request_ids, nm_id, tuple(slot_ids))])[0]

    def dispatch_many(self, items: Sequence[DispatchItem]) -> list[BatchRecord | None]:
        """Create each batch and its first attempt on a slot and mark its requests SCHED, all in one
        transaction (a round's dispatches commit together). ``spec_for(batch_id, attempt) -> str``
        renders a spec. An item none of whose requests is still NOT_SCHED (another round or a cancel got
        there first), or whose node manager is no longer ``ALIVE`` (it left or was lost since the round
        read it), gets None and writes nothing."""
        if not items:
            return []
        if any(not it.slot_ids for it in items):
            raise InvalidArgument("dispatch_many: every batch needs at least one slot")
        # A handful of statements for the whole round, not four per batch: a round places up to a few
        # hundred batches, and their round trips were half its time on a busy database (tests.bench.scale)
        with self.db.tx("dispatch batches") as s:
            c = s.connection()
            # the node managers' rows held against a leave (``leave``) until this commits: a leave then
            # sees these attempts, or they see its LEFT
            alive_q = select(_NM.c.id).where(
                _NM.c.id.in_(sorted({it.node_manager_id for it in items})), _NM.c.state == NodeManagerState.ALIVE
            )
            if self.db.is_postgres:
                alive_q = alive_q.with_for_update(read=True)
            alive = {str(i) for (i,) in c.execute(alive_q)}
            todo = [it for it in items if it.node_manager_id in alive]
            placed = iter(self._dispatch_in(s, todo) if todo else [])
            return [next(placed) if it.node_manager_id in alive else None for it in items]

    def _dispatch_in(self, s: Session, items: Sequence[DispatchItem]) -> list[BatchRecord | None]:
        now = time.time()
        out: list[BatchRecord | None] = []
        c = s.connection()
        rows = [
            {"plan_id": it.plan_id, "state": BatchState.RUNNING, "attempt": 1, "spec_json": ""}
            | {"node_manager_id": it.node_manager_id, "created_at": now, "updated_at": now}
            for it in items
        ]
        written: dict[int, str] = {}  # batch id -> the spec its row was inserted with
        if self.db.is_postgres:
            # the ids first, so each row goes in with its spec (which names its batch id): an UPDATE per
            # batch afterwards left a dead row version per dispatch
            bids = sorted(int(i) for (i,) in c.execute(_NEXT_BATCH_IDS, {"n": len(items)}))
            for row, it, bid in zip(rows, items, bids, strict=True):
                row["id"] = bid
                row["spec_json"] = written[bid] = it.spec_for(bid, 1)
            c.execute(_NEW_BATCHES_WITH_IDS, rows)
        else:
            bids = [int(r[0]) for r in c.execute(_NEW_BATCHES, rows)]
        owner = {rid: bid for it, bid in zip(items, bids, strict=True) for rid in it.request_ids}
        claimed: set[int] = set()
        if owner:
            claim = _CLAIM_MANY.values(state=RequestState.SCHED, batch_id=case(owner, value=_R.c.id))
            claimed = {int(b) for (b,) in c.execute(claim, {"ids": sorted(owner)})}
        specs, attempts, slots, dropped = [], [], [], []
        for it, bid in zip(items, bids, strict=True):
            if it.request_ids and bid not in claimed:  # all taken meanwhile: not needed
                dropped.append({"b": bid})
                out.append(None)
                continue
            spec = written.get(bid)
            if spec is None:
                spec = it.spec_for(bid, 1)
                specs.append({"b": bid, "spec": spec})
            # the attempt names rank 0's slot: its GPU type is the batch's (finished_attempts joins it)
            attempts.append(
                {"batch_id": bid, "attempt": 1, "node_manager_id": it.node_manager_id}
                | {"slot_id": it.slot_ids[0], "state": BatchState.RUNNING, "dispatched_at": now}
            )
            slots += [{"batch_id": bid, "rank": r, "slot_id": slot} for r, slot in enumerate(it.slot_ids)]
            out.append(BatchRecord(bid, it.plan_id, BatchState.RUNNING, 1, spec, it.node_manager_id, it.slot_ids))
        if dropped:
            c.execute(_DROP_BATCH, dropped)
        if specs:
            c.execute(_SET_SPEC, specs)
        if attempts:
            c.execute(_NEW_ATTEMPT, attempts)
        if slots:
            c.execute(_NEW_SLOTS, slots)
        return out
