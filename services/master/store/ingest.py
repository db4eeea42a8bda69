"""Batched, idempotent apply of bus messages to the search-plan database: the aggregator's write side.

:class:`Ingestor` turns a list of decoded bus messages into database effects in ONE transaction,
for both transports of a worker's events: the aggregator's bus records and the node manager's direct
``ReportBatch`` (whose ``events`` are the same encoded messages) both end here, through the store roles:

- ``metrics``: stored at the canonical point (the first value at a point wins), and the live requests
  waiting there become DONE (``RequestStore.record_metrics_in``);
- ``curve``: learning-curve points, each stored at its canonical point (the first value wins:
  ``CurveStore.record_in``);
- ``checkpoint_saved``: recorded at the canonical point with the number of ranks that wrote it
  (``CheckpointCatalog.record_in``);
- ``rescaled``: the batch resumed a checkpoint written by another number of ranks; recorded once per
  attempt at the canonical point as the plan's path change (``PathChangeStore.record_in``; the worker
  emits it once its restore succeeded, see ``store.paths`` for why the worker's word is taken);
- ``batch_finished`` / ``batch_failed`` / ``batch_preempted``: the attempt ends through
  ``BatchLedger.end_attempts_in``, which the core's ``lifecycle.end_attempt`` decides (bounded
  retries; a preemption first records its checkpoint and is no failure; a report for an attempt that
  is not the running one changes nothing);
- ``batch_started``: the attempt's ``started_at``, the node manager's time in the message (else now, and
  never later than now) (``BatchLedger.mark_started_in``; the first word wins, so it needs no claim
  below): a batch sent ahead of its slot's end waits on the node manager; the cost estimator must learn
  from the run alone, and the scheduler estimates when a slot frees from it;
- ``progress``, ``metrics``, ``checkpoint_saved`` and ``batch_preempted``: the furthest step the attempt
  trained to (``BatchLedger.mark_reached_in``, a maximum: no claim needed), so the stats count what an
  attempt that did not run to its end, or whose end is not applied yet, trained; not written for an
  attempt that finishes in the same apply (all its steps count then);
- ``batch_timing``: the worker's measure of the attempt's time (``BatchLedger.record_timing_in``; the
  same values again on a redelivery, so no claim either);
- ``log_line``: a text line the trainer logged, kept with its batch attempt
  (``BatchLedger.record_log_lines_in``; one row per (batch, attempt, seq), and ``seq`` is bounded by the
  message, so an attempt keeps at most ``core.loglines.MAX_LINES`` lines);
- ``gpu_telemetry`` has no database effect (counted, dropped).

Idempotence: every message with an effect inserts its ``msg_id`` into ``applied_messages`` in the same
transaction as its effect, insert-or-ignore returning the ids that were new, so a redelivered message
changes nothing. Two aggregators that race on one id serialize on that primary key. Ids are inserted
in sorted order so concurrent writers take those locks in one order.

Within one apply, effects run by kind: checkpoints, metrics, then terminal events in the order they
came. The bus delivers a batch's messages in order, so a batch's metrics are never applied after its
finish, and a finish never requeues work whose metrics are in the same apply.

Messages that can never apply (unknown batch or node, a step before its node's start, a value the
columns cannot hold) are logged, counted as ``rejected`` and still marked applied, so a redelivery does
not log them again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from sqlalchemy.orm import Session

from stagetree.bus.messages import (
    BatchFailed,
    BatchFinished,
    BatchMessage,
    BatchPreempted,
    BatchStarted,
    BatchTiming,
    CheckpointSaved,
    Curve,
    LogLine,
    Message,
    Metrics,
    Progress,
    Rescaled,
)
from stagetree.core.batch import Point
from stagetree.core.errors import InvalidArgument, NotFound, StagetreeError
from stagetree.core.lifecycle import AttemptEnd, AttemptTiming, Outcome, RankChange, RetryPolicy
from stagetree.core.searchplan import SearchPlan
from stagetree.master.plans import PlanCache
from stagetree.master.store import models as m
from stagetree.master.store.curves import CurveRows
from stagetree.master.store.database import table
from stagetree.master.store.records import LoggedLine
from stagetree.master.store.store import Store

log = logging.getLogger(__name__)

MAX_MSG_ID = 200  # applied_messages.msg_id is String(200)
MAX_INT32 = 2**31 - 1  # metrics.step, checkpoints.step
MAX_INT64 = 2**63 - 1  # ids, checkpoint bytes
PREEMPTION_CHECKPOINT_KIND = "peripheral"  # a preemption saves where it stopped, not at a branch point

_EFFECTFUL = frozenset({Metrics, Curve, CheckpointSaved, Rescaled, BatchFinished, BatchPreempted, BatchFailed, LogLine})
_POINTED = frozenset({Metrics, CheckpointSaved, Rescaled, BatchPreempted})  # the kinds that carry a (node, step)
_NODED = frozenset({Metrics, Curve, CheckpointSaved, Rescaled, BatchPreempted})  # the kinds that name a node
_Terminal = BatchFinished | BatchPreempted | BatchFailed


@dataclass
class IngestResult:
    """What one :meth:`Ingestor.apply` changed, so the caller wakes the master only when needed."""

    applied: int = 0  # messages whose effects were applied now
    duplicates: int = 0  # already applied earlier (or twice in this list): skipped
    ignored: int = 0  # kinds with no database effect (telemetry)
    started: int = 0  # batch_started messages (their attempts' started_at, where not set yet)
    progress: int = 0  # progress messages (their attempts' furthest step)
    timings: int = 0  # batch_timing messages (their workers' measure of their time)
    rejected: int = 0  # can never apply (unknown batch/node, bad point): logged and skipped
    points: int = 0  # metrics messages applied
    curve_points: int = 0  # learning-curve points offered by the curve messages applied
    checkpoints: int = 0  # checkpoint_saved / batch_preempted checkpoints applied
    path_changes: int = 0  # rescaled messages applied (resumes on another number of ranks)
    log_lines: int = 0  # log_line messages applied (text lines of existing attempts)
    completed: list[int] = field(default_factory=list)  # request ids that became DONE
    failed_requests: list[int] = field(default_factory=list)  # request ids that became FAILED
    finished: list[int] = field(default_factory=list)  # batch ids whose running attempt ended
    requeued: list[int] = field(default_factory=list)  # request ids sent back to NOT_SCHED
    stale: int = 0  # terminal reports for an attempt that was not the running one
    completed_by: dict[str, list[int]] = field(default_factory=dict)  # metrics msg_id -> the requests it made DONE
    rejected_why: dict[str, StagetreeError] = field(default_factory=dict)  # msg_id -> why it can never apply

    @property
    def results_changed(self) -> bool:
        """Some requests finished (DONE or FAILED): wake ``CH_RESULTS``."""
        return bool(self.completed or self.failed_requests)

    @property
    def round_needed(self) -> bool:
        """A slot freed, work was requeued or a checkpoint appeared: wake ``CH_ROUND``."""
        return bool(self.finished or self.requeued or self.checkpoints)

    def merge(self, other: IngestResult) -> None:
        """Add ``other``'s counts and ids to this one (for applies split in parts)."""
        counts = (
            *("applied", "duplicates", "ignored", "started", "progress", "timings"),
            *("rejected", "points", "curve_points", "checkpoints"),
        )
        for name in (*counts, "stale", "path_changes", "log_lines"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("completed", "failed_requests", "finished", "requeued"):
            getattr(self, name).extend(getattr(other, name))
        self.completed_by.update(other.completed_by)
        self.rejected_why.update(other.rejected_why)


# A message that can apply, with its canonical point (metrics, checkpoints and preemptions have one).
_Placed = tuple[BatchMessage, Point | None]


class Ingestor:
    """Applies decoded bus messages to the database; thread-safe (each apply is its own transaction).

    Writes through the store's ledger, requests and checkpoint roles. ``plans`` canonicalizes points;
    pass the master's own cache in embedded mode to share it. ``max_failures`` is the master's retry
    bound (``SchedulingSettings.max_attempts``)."""

    def __init__(
        self, store: Store, plans: PlanCache | None = None, *, max_failures: int = 3, chunk: int = 1000
    ) -> None:
        if max_failures < 1 or chunk < 1:
            raise InvalidArgument(f"need max_failures >= 1 and chunk >= 1, got {max_failures}, {chunk}")
        self.db = store.db
        self.ledger, self.batches = store.ledger, store.batches
        self.requests = store.requests
        self.checkpoints = store.checkpoints
        self.curves = store.curves
        self.paths = store.paths
        self.plans = plans or PlanCache(store.plans)
        self.policy = RetryPolicy(max_failures)
        self.chunk = chunk

    # -- the apply ------------------------------------------------------------------------------------

    def apply(self, messages: Sequence[Message]) -> IngestResult:
        """Apply ``messages`` (in the order consumed) in one transaction; see the module doc.

        Raises ``Conflict`` (retry: a concurrent writer or a busy/deadlocked database; nothing was
        written) or ``Unavailable`` (the database is unreachable; nothing was written)."""
        out = IngestResult()
        candidates: dict[str, BatchMessage] = {}
        started: list[tuple[int, int, float | None]] = []
        reached: list[tuple[int, int, int]] = []
        timings: list[tuple[int, int, AttemptTiming]] = []
        finishing: set[tuple[int, int]] = set()
        for msg in messages:
            if isinstance(msg, BatchMessage) and msg.batch_id > MAX_INT64:
                pass  # can never apply: an effectful kind is rejected below, the others dropped here
            elif isinstance(msg, (Progress, Metrics, CheckpointSaved, BatchPreempted)) and msg.step <= MAX_INT32:
                reached.append((msg.batch_id, msg.attempt, msg.step))  # metrics at a step: the worker got there
            elif isinstance(msg, BatchTiming):
                timings.append(
                    (
                        msg.batch_id,
                        msg.attempt,
                        AttemptTiming(msg.given_at, msg.startup_s, msg.checkpoint_s, msg.train_s),
                    )
                )
            elif isinstance(msg, BatchFinished):
                finishing.add((msg.batch_id, msg.attempt))
            if isinstance(msg, BatchStarted):
                if msg.batch_id <= MAX_INT64:
                    started.append((msg.batch_id, msg.attempt, msg.started_at))
                out.started += 1
            elif isinstance(msg, Progress):
                out.progress += 1
            elif isinstance(msg, BatchTiming):
                out.timings += 1
            elif type(msg) not in _EFFECTFUL:
                out.ignored += 1
            elif msg.msg_id in candidates:
                out.duplicates += 1
            else:
                candidates[msg.msg_id] = msg  # type: ignore[assignment]  # an effectful kind is a BatchMessage
        reached = [r for r in reached if (r[0], r[1]) not in finishing]  # all its steps count
        now = time.time()
        if not candidates:
            if started or reached or timings:
                with self.db.tx("record batch starts and progress") as s:
                    self.ledger.mark_started_in(s, started, now)
                    self.ledger.mark_reached_in(s, reached)
                    self.ledger.record_timing_in(s, timings)
            return out
        placed, rejected_ids, curves = self._place(list(candidates.values()))
        with self.db.tx("apply bus messages") as s:
            self.ledger.mark_started_in(s, started, now)
            self.ledger.mark_reached_in(s, reached)
            self.ledger.record_timing_in(s, timings)
            new = self._claim(s, sorted(candidates), now)
            out.duplicates += len(candidates) - len(new)
            out.rejected += sum(1 for i in rejected_ids if i in new)
            out.rejected_why = {i: why for i, why in rejected_ids.items() if i in new}
            metrics: list[tuple[int, int, dict[str, float]]] = []
            metric_ids: list[str] = []
            saved: list[tuple[int, int, str, int, str, int]] = []
            rescaled: list[tuple[int, int, RankChange]] = []
            curve: list[tuple[int, int, dict[str, float]]] = []
            lines: list[LoggedLine] = []
            ends: list[AttemptEnd] = []
            for msg, point in placed:
                if msg.msg_id not in new:
                    continue
                if isinstance(msg, Metrics):
                    assert point is not None
                    metrics.append((point.node, point.step, msg.metrics))
                    metric_ids.append(msg.msg_id)
                elif isinstance(msg, Curve):
                    curve.extend(curves[msg.msg_id])
                    out.applied += 1
                elif isinstance(msg, CheckpointSaved):
                    assert point is not None
                    saved.append((point.node, point.step, msg.uri, msg.bytes, msg.kind, msg.ranks))
                    out.applied += 1
                elif isinstance(msg, Rescaled):
                    assert point is not None
                    change = RankChange(point.node, point.step, msg.uri, msg.from_ranks, msg.to_ranks)
                    rescaled.append((msg.batch_id, msg.attempt, change))
                    out.applied += 1
                elif isinstance(msg, LogLine):
                    lines.append(LoggedLine(msg.batch_id, msg.attempt, msg.seq, msg.node, msg.step, msg.at, msg.line))
                    out.applied += 1
                if isinstance(msg, BatchPreempted):
                    assert point is not None
                    saved.append((point.node, point.step, msg.uri, 0, PREEMPTION_CHECKPOINT_KIND, msg.ranks))
                if isinstance(msg, _Terminal):
                    ends.append(_end_of(msg))
            out.applied += len(metrics) + len(ends)
            out.points += len(metrics)
            self.checkpoints.record_in(s, saved, now)
            out.path_changes += self.paths.record_in(s, rescaled, now)
            out.curve_points += self.curves.record_in(s, curve, now)
            out.log_lines += self.ledger.record_log_lines_in(s, lines)
            out.checkpoints += len({(n, st) for n, st, *_ in saved})
            done_at = self.requests.record_metrics_in(s, metrics, now)
            for ids in done_at.values():
                out.completed.extend(ids)
            for msg_id, (node, step, _) in zip(metric_ids, metrics, strict=True):
                if done := done_at.get((node, step)):
                    out.completed_by[msg_id] = list(done)
            for d in self.ledger.end_attempts_in(s, ends, self.policy, now):
                if d.stale:
                    out.stale += 1
                    continue
                out.finished.append(d.batch_id)
                out.failed_requests.extend(d.failed)
                out.requeued.extend(d.requeued)
        if out.applied or out.rejected:
            log.debug(
                "applied bus messages",
                extra={
                    "applied": out.applied,
                    "duplicates": out.duplicates,
                    "rejected": out.rejected,
                    "points": out.points,
                    "completed": len(out.completed),
                    "finished": len(out.finished),
                },
            )
        return out

    def _claim(self, s: Session, msg_ids: list[str], now: float) -> set[str]:
        """Insert the ids not applied yet; returns those (the others were applied before)."""
        rows = [(i, now) for i in msg_ids]
        columns, key = ("msg_id", "applied_at"), ("msg_id",)
        tbl = table(m.AppliedMessage)
        return set(self.db.bulk_insert_ignore(s, tbl, columns, rows, key, returning="msg_id", chunk=self.chunk))

    # -- validation and canonical points (before the transaction; reads only) -------------------------

    def _place(
        self, messages: list[BatchMessage]
    ) -> tuple[list[_Placed], dict[str, StagetreeError], dict[str, CurveRows]]:
        """(message, canonical point or None) for the messages that can apply, why each of those that
        never can cannot (by id), and the canonical points of each curve message."""
        rejected: dict[str, StagetreeError] = {}
        ok: list[BatchMessage] = []
        for msg in messages:
            reason = _invalid(msg)
            if reason:
                rejected[msg.msg_id] = _reject(msg, InvalidArgument(reason))
            else:
                ok.append(msg)
        plan_of = self.batches.plans_of_batches(sorted({msg.batch_id for msg in ok}))
        nodes_of: dict[int, set[int]] = {}
        for msg in ok:
            plan_id = plan_of.get(msg.batch_id)
            if plan_id is not None and type(msg) in _NODED:
                nodes_of.setdefault(plan_id, set()).add(msg.node)  # type: ignore[attr-defined]
        # One refresh per plan, then the walk-free canonical() of the core plan for every point.
        plans = {pid: self.plans.ensure(pid, nodes) for pid, nodes in nodes_of.items()}
        placed: list[_Placed] = []
        curves: dict[str, CurveRows] = {}
        for msg in ok:
            plan_id = plan_of.get(msg.batch_id)
            if plan_id is None:
                rejected[msg.msg_id] = _reject(msg, NotFound(f"batch {msg.batch_id} does not exist"))
                continue
            point = None
            if type(msg) in _POINTED:
                try:
                    point = plans[plan_id].canonical(Point(msg.node, msg.step))  # type: ignore[attr-defined]
                except (NotFound, InvalidArgument) as e:
                    rejected[msg.msg_id] = _reject(msg, e)
                    continue
            if isinstance(msg, Curve):
                try:
                    curves[msg.msg_id] = _canonical_curve(plans[plan_id], msg)
                except (NotFound, InvalidArgument) as e:
                    rejected[msg.msg_id] = _reject(msg, e)
                    continue
            placed.append((msg, point))
        return placed, rejected, curves

    # -- housekeeping ---------------------------------------------------------------------------------

    def prune_applied(self, older_than_s: float) -> int:
        """Forget applied ids older than ``older_than_s`` seconds; returns how many. Safe once no
        redelivery can be that late (records are redelivered only until their offsets are committed)."""
        if older_than_s <= 0:
            raise InvalidArgument(f"older_than_s must be positive, got {older_than_s}")
        with self.db.tx("prune applied messages") as s:
            tbl = table(m.AppliedMessage)
            res = s.execute(tbl.delete().where(tbl.c.applied_at < time.time() - older_than_s))
            return int(res.rowcount)  # type: ignore[attr-defined]


def _canonical_curve(plan: SearchPlan, msg: Curve) -> CurveRows:
    """The curve's points at their canonical nodes (a point at a node's start step is its parent's)."""
    out = []
    for step, values in zip(msg.steps, msg.values, strict=True):
        if step > MAX_INT32:
            raise InvalidArgument(f"curve step {step} is out of range")
        out.append((plan.canonical(Point(msg.node, step)).node, step, dict(values)))
    return out


def _end_of(msg: _Terminal) -> AttemptEnd:
    if isinstance(msg, BatchFinished):
        return AttemptEnd(msg.batch_id, msg.attempt, Outcome.SUCCEEDED)
    if isinstance(msg, BatchPreempted):
        return AttemptEnd(msg.batch_id, msg.attempt, Outcome.PREEMPTED)
    outcome = Outcome.of_report(False, oom=msg.oom, user_error=msg.user_error, host_problem=msg.host_problem)
    return AttemptEnd(msg.batch_id, msg.attempt, outcome, msg.error)


def _invalid(msg: BatchMessage) -> str:
    """Why ``msg`` cannot be written (a value its columns cannot hold), or ''."""
    if len(msg.msg_id) > MAX_MSG_ID or "\x00" in msg.msg_id:
        return f"msg_id is over {MAX_MSG_ID} characters or holds a NUL"
    if msg.batch_id > MAX_INT64:
        return f"batch_id {msg.batch_id} is out of range"
    step = getattr(msg, "step", 0)
    if step > MAX_INT32 or getattr(msg, "node", 0) > MAX_INT64:
        return f"point ({getattr(msg, 'node', 0)}, {step}) is out of range"
    if getattr(msg, "bytes", 0) > MAX_INT64:
        return "checkpoint bytes out of range"
    if "\x00" in getattr(msg, "uri", ""):
        return "checkpoint uri holds a NUL"
    if "\x00" in getattr(msg, "line", ""):
        return "log line holds a NUL"
    return ""


def _reject(msg: BatchMessage, why: StagetreeError) -> StagetreeError:
    log.warning(
        "bus message rejected: %s",
        why.message,
        extra={"msg_id": msg.msg_id, "type": msg.TYPE, "batch_id": msg.batch_id, "node_manager": msg.node_manager},
    )
    return why
