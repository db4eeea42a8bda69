"""Batched, idempotent apply of bus messages to the search-plan database: the aggregator's write side.

:class:`Ingestor` owns turning a list of decoded bus messages into database effects in ONE transaction,
with the same semantics as the master's direct path (``MasterService.report_batch`` over
``SqlStore.record_metrics`` / ``record_checkpoint`` / ``finish_batch``):

- ``metrics``: stored at the canonical point (insert-or-ignore: the first value at a point wins), and
  the live requests waiting at that point become DONE;
- ``checkpoint_saved``: recorded at the canonical point (insert-or-ignore);
- ``batch_finished`` / ``batch_failed`` / ``batch_preempted``: the attempt ends as ``finish_batch``
  ends it (bounded retries, ``max_failures``; an out-of-memory failure's error reads
  ``out of memory: ...``; a preemption first records its checkpoint and does not count as a failure);
  a report for an attempt that is not the running one is ignored;
- ``progress``, ``batch_started`` and ``gpu_telemetry`` have no database effect (counted, dropped).

Idempotence: every message with an effect inserts its ``msg_id`` into ``applied_messages`` in the same
transaction as its effect, insert-or-ignore with RETURNING, so only the ids that were new are applied
and a redelivered message changes nothing. Two aggregators that race on one id (a rebalance hands
uncommitted records to a new owner while the old one still applies them) serialize on that primary key:
the second waits for the first to commit and then finds the id taken. Ids are inserted in sorted
order so concurrent writers take those locks in one order.

Within one apply, effects run by kind in this order: metrics, checkpoints, then terminal events in the
order they came. The bus delivers a batch's messages in order (see ``stagetree.bus.messages``), so a
batch's metrics are never applied after its finish, and a finish never requeues work whose metrics
are in the same apply.

Throughput comes from set-based SQL: one statement per kind per apply, never one per point. On
Postgres the rows go in with COPY (straight into the table; when some exist already, through a
temporary table and ``INSERT ... SELECT ... ON CONFLICT DO NOTHING``); on SQLite with one prepared
statement run for every row (chunked at ``chunk`` rows).

Messages that can never apply (unknown batch or node, a step before its node's start, a value the
columns cannot hold) are logged, counted as ``rejected`` and still marked applied, so a redelivery does
not log them again.

Non-finite metric values (a diverged loss) are stored as the strings ``"NaN"``, ``"Infinity"`` and
``"-Infinity"``: Postgres's JSON type refuses the bare tokens. :func:`store.metric_value` reads them back.
"""

from __future__ import annotations

import io
import json
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from sqlalchemy import JSON, Connection, String, Table, select, update
from sqlalchemy.orm import Session

from stagetree.bus.messages import (
    BatchFailed,
    BatchFinished,
    BatchMessage,
    BatchPreempted,
    CheckpointSaved,
    Message,
    Metrics,
)
from stagetree.core.batch import Point
from stagetree.core.errors import InvalidArgument, NotFound
from stagetree.master.plans import PlanCache
from stagetree.master.store import models as m
from stagetree.master.store.store import (
    BATCH_DONE,
    FAILED,
    LIVE_STATES,
    NOT_SCHED,
    PREEMPTED,
    REQUEST_FAILED,
    RUNNING,
    SCHED,
    SqlStore,
    _table,
    json_safe_metrics,
)

log = logging.getLogger(__name__)

DONE = "DONE"  # a request's state once its metrics exist
MAX_MSG_ID = 200  # applied_messages.msg_id is String(200)
MAX_INT32 = 2**31 - 1  # metrics.step, checkpoints.step
MAX_INT64 = 2**63 - 1  # ids, checkpoint bytes
PREEMPTION_CHECKPOINT_KIND: Final = "peripheral"  # a preemption saves where it stopped, not at a branch point

_EFFECTFUL = frozenset({Metrics, CheckpointSaved, BatchFinished, BatchPreempted, BatchFailed})
_POINTED = frozenset({Metrics, CheckpointSaved, BatchPreempted})  # the kinds that carry a (node, step)
_TERMINAL = frozenset({BatchFinished, BatchPreempted, BatchFailed})
_Terminal = BatchFinished | BatchPreempted | BatchFailed
_JSON = json.JSONEncoder(
    allow_nan=False, separators=(",", ":")
)  # one encoder: json.dumps(allow_nan=...) builds one per call


@dataclass
class IngestResult:
    """What one :meth:`Ingestor.apply` changed, so the caller wakes the master only when needed."""

    applied: int = 0  # messages whose effects were applied now
    duplicates: int = 0  # already applied earlier (or twice in this list): skipped
    ignored: int = 0  # kinds with no database effect (progress, batch_started, telemetry)
    rejected: int = 0  # can never apply (unknown batch/node, bad point): logged and skipped
    points: int = 0  # metrics messages applied
    checkpoints: int = 0  # checkpoint_saved / batch_preempted checkpoints applied
    completed: list[int] = field(default_factory=list)  # request ids that became DONE
    failed_requests: list[int] = field(default_factory=list)  # request ids that became FAILED
    finished: list[int] = field(default_factory=list)  # batch ids whose running attempt ended
    requeued: list[int] = field(default_factory=list)  # request ids sent back to NOT_SCHED
    stale: int = 0  # terminal reports for an attempt that was not the running one

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
        for name in ("applied", "duplicates", "ignored", "rejected", "points", "checkpoints", "stale"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("completed", "failed_requests", "finished", "requeued"):
            getattr(self, name).extend(getattr(other, name))


def _json_text(values: dict[str, float]) -> str:
    try:
        return _JSON.encode(values)
    except ValueError:  # a non-finite value: rare, so checked only when the fast path refuses
        return _JSON.encode(json_safe_metrics(values))


def _copy_escape(text: str) -> str:
    """A value for COPY's text format (backslash escapes)."""
    if "\\" in text or "\t" in text or "\n" in text or "\r" in text:
        text = text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")
    return text


def _copy_text(table: Table, columns: tuple[str, ...], rows: list[tuple[Any, ...]]) -> str:
    """``rows`` in COPY's text format: numbers as Python prints them, strings escaped, JSON encoded."""
    kinds = []
    for c in columns:
        t = table.c[c].type
        kinds.append("j" if isinstance(t, JSON) else "s" if isinstance(t, String) else "n")
    if kinds == ["n", "n", "j", "n"]:  # metrics, the hot path: JSON from the encoder never holds \t \n \r
        return "".join(f"{a}\t{b}\t{_json_text(c).replace(chr(92), chr(92) * 2)}\t{d!r}\n" for a, b, c, d in rows)
    conv = [_json_copy if k == "j" else _copy_escape if k == "s" else repr for k in kinds]
    return "".join("\t".join([f(v) for f, v in zip(conv, r, strict=True)]) + "\n" for r in rows)


def _copy(conn: Connection, table: str, cols: str, text: str) -> None:
    cursor = conn.connection.cursor()
    try:
        cursor.copy_expert(f"COPY {table} ({cols}) FROM STDIN", io.StringIO(text))
    finally:
        cursor.close()


def _json_copy(values: dict[str, float]) -> str:
    return _copy_escape(_json_text(values))


# A message that can apply, with its canonical point (metrics, checkpoints and preemptions have one).
_Placed = tuple[BatchMessage, Point | None]
_POINT = ("node_id", "step")


class Ingestor:
    """Applies decoded bus messages to the database; thread-safe (each apply is its own transaction).

    ``plans`` canonicalizes points; pass the master's own cache in embedded mode to share it.
    ``max_failures`` is the master's retry bound (``SchedulingSettings.max_attempts``)."""

    def __init__(
        self, store: SqlStore, plans: PlanCache | None = None, *, max_failures: int = 3, chunk: int = 1000
    ) -> None:
        if max_failures < 1 or chunk < 1:
            raise InvalidArgument(f"need max_failures >= 1 and chunk >= 1, got {max_failures}, {chunk}")
        self.store = store
        self.plans = plans or PlanCache(store)
        self.max_failures = max_failures
        self.chunk = chunk
        self._plan_of_batch: dict[int, int] = {}  # immutable once a batch exists

    # -- the apply ------------------------------------------------------------------------------------

    def apply(self, messages: Sequence[Message]) -> IngestResult:
        """Apply ``messages`` (in the order consumed) in one transaction; see the module doc.

        Raises ``Conflict`` (retry: a concurrent writer or a busy/deadlocked database; nothing was
        written) or ``Unavailable`` (the database is unreachable; nothing was written)."""
        out = IngestResult()
        candidates: dict[str, BatchMessage] = {}
        for msg in messages:
            if type(msg) not in _EFFECTFUL:  # exact types: isinstance on the ABC is slow on this path
                out.ignored += 1
            elif msg.msg_id in candidates:
                out.duplicates += 1
            else:
                candidates[msg.msg_id] = msg  # type: ignore[assignment]  # an effectful kind is a BatchMessage
        if not candidates:
            return out
        placed, rejected_ids = self._place(list(candidates.values()))
        now = time.time()
        with self.store._tx("apply bus messages") as s:
            new = self._claim(s, sorted(candidates), now)
            out.duplicates += len(candidates) - len(new)
            out.rejected += sum(1 for i in rejected_ids if i in new)
            metrics: list[_Placed] = []
            saved: list[_Placed] = []
            terminals: list[_Terminal] = []
            for p in placed:
                msg = p[0]
                if msg.msg_id not in new:
                    continue
                kind = type(msg)
                if kind is Metrics:
                    metrics.append(p)
                else:
                    if kind is CheckpointSaved or kind is BatchPreempted:
                        saved.append(p)
                    if kind in _TERMINAL:
                        terminals.append(msg)  # type: ignore[arg-type]
            out.applied = len(metrics) + sum(1 for p in saved if type(p[0]) is CheckpointSaved) + len(terminals)
            self._apply_metrics(s, metrics, now, out)
            self._apply_checkpoints(s, saved, now, out)
            self._apply_terminals(s, terminals, now, out)
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
        table = _table(m.AppliedMessage)
        rows = [(i, now) for i in msg_ids]
        return set(self._insert_ignore(s, table, ("msg_id", "applied_at"), rows, ("msg_id",), returning="msg_id"))

    def _insert_ignore(
        self,
        s: Session,
        table: Table,
        columns: tuple[str, ...],
        rows: list[tuple[Any, ...]],
        key: tuple[str, ...],
        *,
        returning: str | None = None,
    ) -> list[Any]:
        """Insert-or-ignore ``rows`` (values of ``columns``, in lock order) into ``table`` in as few
        statements as the dialect allows; with ``returning``, that column of the rows inserted. A JSON
        column takes the Python value.

        Postgres: COPY into a session-local temporary table, then one ``INSERT ... SELECT ... ON
        CONFLICT DO NOTHING`` (several times faster than multi-row VALUES, which costs a parse of every
        literal). SQLite: one prepared statement run for every row."""
        if not rows:
            return []
        json_cols = [i for i, c in enumerate(columns) if isinstance(table.c[c].type, JSON)]
        if not self.store._pg:
            stmt = self.store._insert(table).on_conflict_do_nothing(index_elements=list(key))
            params = [dict(zip(columns, r, strict=True)) for r in rows]
            for d in params:
                for i in json_cols:
                    d[columns[i]] = json_safe_metrics(d[columns[i]])
            if returning is None:
                for part in _chunks(params, self.chunk):
                    s.execute(stmt, part)
                return []
            stmt = stmt.returning(table.c[returning])
            return [v for part in _chunks(params, self.chunk) for v in s.execute(stmt, part).scalars()]
        import psycopg2.errors  # the Postgres path only (the embedded mode runs without psycopg2)

        cols = ", ".join(columns)
        text = _copy_text(table, columns, rows)
        conn = s.connection()
        # Fast path: COPY straight into the table. Rows that exist already (a redelivered message, a point
        # reported twice) are rare; one makes the COPY fail, the savepoint undoes it, and the slow path
        # below skips them. Nothing in between touched the table, so every row is new when it succeeds.
        # (The savepoint is plain SQL: the COPY runs on the DBAPI cursor, which the ORM's nested
        # transactions do not see.)
        conn.exec_driver_sql("SAVEPOINT ingest_copy")
        try:
            _copy(conn, table.name, cols, text)
        except psycopg2.errors.UniqueViolation:
            conn.exec_driver_sql("ROLLBACK TO SAVEPOINT ingest_copy")
        else:
            conn.exec_driver_sql("RELEASE SAVEPOINT ingest_copy")
            return [] if returning is None else [r[columns.index(returning)] for r in rows]
        temp = f"ingest_{table.name}"
        # ON COMMIT DELETE ROWS: each transaction starts with it empty; a rollback empties it too.
        conn.exec_driver_sql(
            f"CREATE TEMP TABLE IF NOT EXISTS {temp} (LIKE {table.name} INCLUDING DEFAULTS) ON COMMIT DELETE ROWS"
        )
        _copy(conn, temp, cols, text)
        sql = (
            f"INSERT INTO {table.name} ({cols}) SELECT {cols} FROM {temp} ORDER BY {', '.join(key)} "
            f"ON CONFLICT ({', '.join(key)}) DO NOTHING"
        )
        if returning is None:
            conn.exec_driver_sql(sql)
            out: list[Any] = []
        else:
            out = [r[0] for r in conn.exec_driver_sql(f"{sql} RETURNING {returning}")]
        conn.exec_driver_sql(f"TRUNCATE {temp}")  # the next insert of this transaction starts empty
        return out

    # -- validation and canonical points (before the transaction; reads only) -------------------------

    def _place(self, messages: list[BatchMessage]) -> tuple[list[_Placed], set[str]]:
        """(message, canonical point or None) for the messages that can apply, and the ids of those
        that never can."""
        rejected: set[str] = set()
        ok: list[BatchMessage] = []
        for msg in messages:
            # the common case in one test; the reasons are worked out only for the rare bad message
            fine = type(msg) is Metrics and len(msg.msg_id) <= MAX_MSG_ID and msg.step <= MAX_INT32  # type: ignore[attr-defined]
            reason = "" if fine and "\x00" not in msg.msg_id else _invalid(msg)
            if reason:
                _reject(msg, reason)
                rejected.add(msg.msg_id)
            else:
                ok.append(msg)
        plan_of = self._plans_of({msg.batch_id for msg in ok})
        nodes_of: dict[int, set[int]] = {}
        for msg in ok:
            plan_id = plan_of.get(msg.batch_id)
            if plan_id is not None and type(msg) in _POINTED:
                nodes_of.setdefault(plan_id, set()).add(msg.node)  # type: ignore[attr-defined]
        # One refresh per plan, then the walk-free canonical() of the core plan for every point.
        plans = {pid: self.plans.ensure(pid, nodes) for pid, nodes in nodes_of.items()}
        placed: list[_Placed] = []
        for msg in ok:
            plan_id = plan_of.get(msg.batch_id)
            if plan_id is None:
                _reject(msg, f"batch {msg.batch_id} does not exist")
                rejected.add(msg.msg_id)
                continue
            point = None
            if type(msg) in _POINTED:
                try:
                    point = plans[plan_id].canonical(Point(msg.node, msg.step))  # type: ignore[attr-defined]
                except (NotFound, InvalidArgument) as e:
                    _reject(msg, e.message)
                    rejected.add(msg.msg_id)
                    continue
            placed.append((msg, point))
        return placed, rejected

    def _plans_of(self, batch_ids: Iterable[int]) -> dict[int, int]:
        missing = [b for b in batch_ids if b not in self._plan_of_batch]
        if missing:
            with self.store._tx("plans of batches") as s:
                for part in _chunks(sorted(missing), self.chunk):
                    for bid, pid in s.execute(select(m.Batch.id, m.Batch.plan_id).where(m.Batch.id.in_(part))):
                        self._plan_of_batch[int(bid)] = int(pid)
        return {b: self._plan_of_batch[b] for b in batch_ids if b in self._plan_of_batch}

    # -- effects (inside the transaction) -------------------------------------------------------------

    def _apply_metrics(self, s: Session, items: list[_Placed], now: float, out: IngestResult) -> None:
        if not items:
            return
        rows: dict[Point, tuple[Any, ...]] = {}
        for msg, point in items:
            if point not in rows:  # the first value at a point wins, as with insert-or-ignore
                rows[point] = (point[0], point[1], msg.metrics, now)  # type: ignore[attr-defined,index]
        # one lock order for concurrent writers
        ordered = [rows[k] for k in sorted(rows)]  # type: ignore[type-var]
        self._insert_ignore(s, _table(m.Metric), ("node_id", "step", "values", "recorded_at"), ordered, _POINT)
        out.points += len(items)
        # The live requests waiting at these points: read them by node (few), match points here, then
        # update by id. Portable, and cheaper than a row-value IN list over thousands of points.
        points = set(rows)
        nodes = sorted({p[0] for p in points})  # type: ignore[index]
        waiting: list[int] = []
        for part in _chunks(nodes, self.chunk):
            for rid, node, step in s.execute(
                select(m.Request.id, m.Request.node_id, m.Request.step).where(
                    m.Request.node_id.in_(part), m.Request.state.in_(LIVE_STATES)
                )
            ):
                if (int(node), int(step)) in points:
                    waiting.append(int(rid))
        for part in _chunks(sorted(waiting), self.chunk):
            done = s.execute(
                update(m.Request)
                .where(m.Request.id.in_(part), m.Request.state.in_(LIVE_STATES))
                .values(state=DONE, done_at=now)
                .returning(m.Request.id)
            ).scalars()
            out.completed.extend(int(i) for i in done)

    def _apply_checkpoints(self, s: Session, items: list[_Placed], now: float, out: IngestResult) -> None:
        if not items:
            return
        rows: dict[tuple[int, int], tuple[Any, ...]] = {}
        for msg, point in items:
            assert point is not None
            key = (point.node, point.step)
            if key in rows:
                continue
            if isinstance(msg, CheckpointSaved):
                uri, nbytes, kind = msg.uri, msg.bytes, msg.kind
            else:
                assert isinstance(msg, BatchPreempted)
                uri, nbytes, kind = msg.uri, 0, PREEMPTION_CHECKPOINT_KIND
            rows[key] = (key[0], key[1], uri, nbytes, kind, 0, now)
        columns = ("node_id", "step", "uri", "bytes", "kind", "refcount", "last_used")
        self._insert_ignore(s, _table(m.Checkpoint), columns, [rows[k] for k in sorted(rows)], _POINT)
        out.checkpoints += len(rows)

    def _apply_terminals(self, s: Session, items: list[_Terminal], now: float, out: IngestResult) -> None:
        """``SqlStore.finish_batch`` for each report, in order, inside this transaction."""
        if not items:
            return
        ids = sorted({msg.batch_id for msg in items})
        batches = {
            int(b.id): b
            for b in s.scalars(select(m.Batch).where(m.Batch.id.in_(ids)).order_by(m.Batch.id).with_for_update())
        }
        for msg in items:
            b = batches.get(msg.batch_id)
            if b is None:  # deleted since _place: nothing to end
                _reject(msg, f"batch {msg.batch_id} does not exist")
                out.rejected += 1
                out.applied -= 1
                continue
            if b.attempt != msg.attempt or b.state != RUNNING:
                log.info(
                    "stale batch report ignored",
                    extra={"batch_id": msg.batch_id, "attempt": msg.attempt, "msg_id": msg.msg_id},
                )
                out.stale += 1
                continue
            ok = isinstance(msg, BatchFinished)
            preempted = isinstance(msg, BatchPreempted)
            if isinstance(msg, BatchFailed):
                error = msg.error.replace("\x00", "")
                if msg.oom:
                    error = f"out of memory: {error}" if error else "out of memory"
                s.execute(
                    update(m.Request)
                    .where(m.Request.batch_id == b.id, m.Request.state == SCHED)
                    .values(failures=m.Request.failures + 1, error=error[-4000:] or "the batch failed")
                )
                failed = s.execute(
                    update(m.Request)
                    .where(
                        m.Request.batch_id == b.id,
                        m.Request.state == SCHED,
                        m.Request.failures >= self.max_failures,
                    )
                    .values(state=REQUEST_FAILED, done_at=now)
                    .returning(m.Request.id)
                ).scalars()
                out.failed_requests.extend(int(i) for i in failed)
            requeued = s.execute(
                update(m.Request)
                .where(m.Request.batch_id == b.id, m.Request.state == SCHED)
                .values(state=NOT_SCHED, batch_id=None)
                .returning(m.Request.id)
            ).scalars()
            out.requeued.extend(int(i) for i in requeued)
            state = BATCH_DONE if ok else (PREEMPTED if preempted else FAILED)
            b.state, b.updated_at = state, now
            s.execute(
                update(m.BatchAttempt)
                .where(m.BatchAttempt.batch_id == b.id, m.BatchAttempt.state == RUNNING)
                .values(state=state, finished_at=now)
            )
            out.finished.append(int(b.id))
            log.info(
                "batch attempt ended",
                extra={"batch_id": int(b.id), "attempt": msg.attempt, "state": state, "msg_id": msg.msg_id},
            )

    # -- housekeeping ---------------------------------------------------------------------------------

    def prune_applied(self, older_than_s: float) -> int:
        """Forget applied ids older than ``older_than_s`` seconds; returns how many. Safe once no
        redelivery can be that late (records are redelivered only until their offsets are committed)."""
        if older_than_s <= 0:
            raise InvalidArgument(f"older_than_s must be positive, got {older_than_s}")
        with self.store._tx("prune applied messages") as s:
            res = s.execute(
                _table(m.AppliedMessage).delete().where(m.AppliedMessage.applied_at < time.time() - older_than_s)
            )
            return int(res.rowcount)  # type: ignore[attr-defined]


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
    return ""


def _reject(msg: BatchMessage, reason: str) -> None:
    log.warning(
        "bus message rejected: %s",
        reason,
        extra={"msg_id": msg.msg_id, "type": msg.TYPE, "batch_id": msg.batch_id, "node_manager": msg.node_manager},
    )


def _chunks(items: Sequence[Any], n: int) -> Iterable[Sequence[Any]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]
