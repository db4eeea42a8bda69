"""The master's persistent store: every read and write of the search-plan database.

``SqlStore`` is one adapter over two dialects, Postgres (cluster mode, psycopg2) and SQLite (embedded
mode); the same contract suite runs against both. It owns transactions and the translation of
database errors into the domain error tree (``IntegrityError`` -> ``Conflict`` or ``AlreadyExists``,
a lost connection -> ``Unavailable``); nothing above it sees SQLAlchemy exceptions.

The store never walks the search plan itself: the use-case layer walks an in-memory core
``SearchPlan`` and asks the store to write what it decided. Concurrent writers are reconciled by the
unique constraints (``insert_nodes`` and ``add_requests`` are insert-or-ignore, then read back).
"""

from __future__ import annotations

import json
import logging
import math
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from sqlalchemy import (
    JSON,
    Engine,
    Table,
    bindparam,
    create_engine,
    delete,
    event,
    func,
    insert,
    select,
    tuple_,
    update,
)
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from stagetree.core.batch import Point
from stagetree.core.errors import AlreadyExists, Conflict, InvalidArgument, NotFound, StagetreeError, Unavailable
from stagetree.master.store import models as m
from stagetree.master.store.schema import check_schema

log = logging.getLogger(__name__)
T = TypeVar("T")

NOT_SCHED, SCHED, DONE, CANCELLED = "NOT_SCHED", "SCHED", "DONE", "CANCELLED"
LIVE_STATES = (NOT_SCHED, SCHED)
REQUEST_FAILED = "FAILED"  # a request whose work failed more than the retry limit
FINISHED_STATES = (DONE, CANCELLED, REQUEST_FAILED)  # a request in one of these has its answer
RUNNING, BATCH_DONE, FAILED, LOST, ABORTED = "RUNNING", "DONE", "FAILED", "LOST", "ABORTED"
PREEMPTED = "PREEMPTED"
ALIVE = "ALIVE"
# node-manager actions (the outbox sent on the assignment stream; RUN attempts come from batch_attempts)
RUN, ABORT, PREEMPT, DELETE_CHECKPOINTS = "RUN", "ABORT", "PREEMPT", "DELETE_CHECKPOINTS"


@dataclass(frozen=True)
class StudyRecord:
    id: str
    owner: str
    name: str
    fixed_json: str | None
    created_at: float


@dataclass(frozen=True)
class NodeRecord:
    id: int
    parent: int | None
    start: int
    config_json: str


@dataclass(frozen=True)
class NewNode:
    parent: int | None
    start: int
    branch_digest: str
    config_json: str


@dataclass(frozen=True)
class NewTreeNode:
    """A node to write whose parent may itself be new: ``parent`` is a database id (> 0), a ``ref`` of an
    earlier node of the same write (< 0), or None for a root."""

    ref: int  # < 0, unique within one write
    parent: int | None
    start: int
    branch_digest: str
    config_json: str


@dataclass(frozen=True)
class FinishedAttempt:
    """A batch attempt that ran to its end: what the cost estimator learns from."""

    batch_id: int
    attempt: int
    spec_json: str
    seconds: float  # from the node manager taking it (or its dispatch) to its end
    finished_at: float
    gpu_type: str  # of its slot ("" when the slot is no longer registered)


@dataclass(frozen=True)
class NewRequest:
    client_request_id: str
    node: int
    step: int


@dataclass(frozen=True)
class RequestRecord:
    id: int
    study_id: str
    plan_id: int
    node: int
    step: int
    state: str
    client_request_id: str
    batch_id: int | None
    metrics: dict[str, float] | None = None
    error: str | None = None


@dataclass(frozen=True)
class SlotInfo:
    """A slot as a node manager registers it (the GPU's details come from NVML; a CPU slot has none)."""

    id: str
    gpu_type: str = "cpu"
    memory_bytes: int = 0
    compute_capability: str = ""
    share: float = 0.0
    cpu_cores: int = 0
    gpu_index: int = -1


@dataclass(frozen=True)
class NodeManagerRecord:
    id: str
    address: str
    state: str
    last_heartbeat: float
    slots: tuple[tuple[str, str], ...]  # (slot id, gpu type)
    slot_infos: tuple[SlotInfo, ...] = ()


@dataclass(frozen=True)
class DispatchItem:
    """One batch for ``SqlStore.dispatch_many``; ``spec_for(batch_id, attempt) -> str`` renders its spec."""

    plan_id: int
    spec_for: Callable[[int, int], str]
    request_ids: Sequence[int]
    node_manager_id: str
    slot_id: str


@dataclass(frozen=True)
class BatchRecord:
    id: int
    plan_id: int
    state: str
    attempt: int
    spec_json: str
    node_manager_id: str | None
    slot_id: str | None


@dataclass(frozen=True)
class BatchReportIn:
    """One batch attempt's report, as ``SqlStore.report_batch`` takes it."""

    batch_id: int
    attempt: int
    ok: bool
    metrics: Sequence[tuple[int, int, dict[str, float]]]  # (node, step, values) at canonical points
    checkpoints: Sequence[tuple[int, int, str, int, str]]  # (node, step, uri, bytes, kind)
    error: str = ""
    preempted: bool = False
    max_failures: int = 3


@dataclass(frozen=True)
class RoundReads:
    """What a scheduling round reads (``SqlStore.round_reads``)."""

    node_managers: list[NodeManagerRecord]
    busy: set[tuple[str, str]]  # (node manager, slot) running a batch
    policy_studies: list[tuple[str, str]]  # (study id, fixed json) with policies and live requests
    pending: dict[int, list[tuple[int, Point]]]  # per plan: (request id, point) of NOT_SCHED requests
    running: list[BatchRecord]
    checkpoints: dict[int, dict[Point, str]]  # per pending plan: checkpoint uri per point


@dataclass(frozen=True)
class Assignment:
    """One message of a node manager's assignment stream: RUN a batch attempt, or a control action."""

    batch_id: int
    attempt: int
    spec_json: str
    kind: str = RUN
    checkpoint_uris: tuple[str, ...] = ()
    slot_id: str = ""  # RUN: the slot the master placed the batch on


class _Q:
    """The statements of the hot paths (a batch's report, a scheduling round's reads, a result stream's
    reads), built once with bind parameters. Building a statement and its cache key costs more than
    executing it on SQLite (measured: an ORM-built UPDATE 170-300 us, this one 40 us), and the master
    runs these hundreds of times a second under load. They run on the session's connection (Core): no
    ORM object is loaded or synchronized."""

    R = cast(Table, m.Request.__table__)
    B = cast(Table, m.Batch.__table__)
    A = cast(Table, m.BatchAttempt.__table__)
    M = cast(Table, m.Metric.__table__)
    NA = cast(Table, m.NodeManagerAction.__table__)
    C = cast(Table, m.Checkpoint.__table__)
    N = cast(Table, m.Node.__table__)
    S = cast(Table, m.Study.__table__)
    SL = cast(Table, m.Slot.__table__)
    NM = cast(Table, m.NodeManager.__table__)

    batch_states = (
        select(B.c.id, B.c.attempt, B.c.state)
        .where(B.c.id.in_(bindparam("ids", expanding=True)))
        .order_by(B.c.id)
        .with_for_update()
    )
    sched_of_many = select(R.c.batch_id, R.c.id).where(
        R.c.batch_id.in_(bindparam("ids", expanding=True)), R.c.state == SCHED
    )
    live_at = select(R.c.id, R.c.node_id, R.c.step).where(
        tuple_(R.c.node_id, R.c.step).in_(bindparam("keys", expanding=True)), R.c.state.in_(LIVE_STATES)
    )
    mark_done = update(R).where(R.c.id.in_(bindparam("ids", expanding=True))).values(state=DONE, done_at=bindparam("t"))
    end_batches = (
        update(B)
        .where(B.c.id.in_(bindparam("ids", expanding=True)))
        .values(state=bindparam("st"), updated_at=bindparam("t"))
    )
    end_attempts = (
        update(A)
        .where(A.c.batch_id.in_(bindparam("ids", expanding=True)), A.c.state == RUNNING)
        .values(state=bindparam("st"), finished_at=bindparam("t"))
    )
    unsched = (
        update(R)
        .where(R.c.batch_id.in_(bindparam("ids", expanding=True)), R.c.state == SCHED)
        .values(state=NOT_SCHED, batch_id=None)
    )
    claim = (
        update(R)
        .where(R.c.id.in_(bindparam("ids", expanding=True)), R.c.state == NOT_SCHED)
        .values(state=SCHED, batch_id=bindparam("bid"))
    )
    metrics_at = select(M.c.node_id, M.c.step, M.c["values"]).where(
        tuple_(M.c.node_id, M.c.step).in_(bindparam("keys", expanding=True))
    )
    pending = select(R.c.id, R.c.plan_id, R.c.node_id, R.c.step).where(R.c.state == NOT_SCHED)
    new_batch = insert(B).returning(B.c.id)
    drop_batch = delete(B).where(B.c.id == bindparam("b"))
    set_spec = update(B).where(B.c.id == bindparam("b")).values(spec_json=bindparam("spec"))
    new_attempt = insert(A)
    claim_attempts = (
        update(A)
        .where(A.c.node_manager_id == bindparam("nm"), A.c.state == RUNNING, A.c.sent_at.is_(None))
        .values(sent_at=bindparam("t"))
        .returning(A.c.batch_id, A.c.attempt, A.c.slot_id)
    )
    specs = select(B.c.id, B.c.spec_json).where(B.c.id.in_(bindparam("ids", expanding=True)))
    claim_actions = (
        update(NA)
        .where(NA.c.node_manager_id == bindparam("nm"), NA.c.sent_at.is_(None))
        .values(sent_at=bindparam("t"))
        .returning(NA.c.id, NA.c.kind, NA.c.batch_id, NA.c.attempt, NA.c.payload)
    )
    policy_studies = select(S.c.id, S.c.fixed_json).where(
        S.c.fixed_json.like('%"policies"%'),
        select(R.c.id).where(R.c.study_id == S.c.id, R.c.state.in_(LIVE_STATES)).exists(),
    )
    slots = select(
        SL.c.node_manager_id,
        SL.c.slot_id,
        SL.c.gpu_type,
        SL.c.memory_bytes,
        SL.c.compute_capability,
        SL.c.share,
        SL.c.cpu_cores,
        SL.c.gpu_index,
    ).order_by(SL.c.slot_id)
    node_managers = select(NM.c.id, NM.c.address, NM.c.state, NM.c.last_heartbeat).order_by(NM.c.id)
    checkpoints_of = (
        select(N.c.plan_id, C.c.node_id, C.c.step, C.c.uri)
        .join(N, N.c.id == C.c.node_id)
        .where(N.c.plan_id.in_(bindparam("plans", expanding=True)))
    )
    running = select(
        B.c.id, B.c.plan_id, B.c.state, B.c.attempt, B.c.spec_json, B.c.node_manager_id, B.c.slot_id
    ).where(B.c.state == RUNNING)
    busy = select(B.c.node_manager_id, B.c.slot_id).where(B.c.state == RUNNING, B.c.node_manager_id.is_not(None))
    request_cols = (
        R.c.id, R.c.study_id, R.c.plan_id, R.c.node_id, R.c.step, R.c.state, R.c.client_request_id, R.c.batch_id,
        R.c.error,
    )  # fmt: skip
    requests_of = select(*request_cols).where(R.c.study_id == bindparam("study")).order_by(R.c.id)
    requests_by_id = (
        select(*request_cols)
        .where(R.c.study_id == bindparam("study"), R.c.id.in_(bindparam("ids", expanding=True)))
        .order_by(R.c.id)
    )
    finished = select(
        R.c.id,
        R.c.study_id,
        R.c.plan_id,
        R.c.node_id,
        R.c.step,
        R.c.state,
        R.c.client_request_id,
        R.c.batch_id,
        R.c.error,
    ).where(
        R.c.study_id == bindparam("study"),
        R.c.id.in_(bindparam("ids", expanding=True)),
        R.c.state.in_(FINISHED_STATES),
    )


STUDY_CACHE_SIZE = 10_000
SQLITE_TURN_TIMEOUT_S = 30.0  # as long as SQLite's own busy timeout (make_engine)


def make_engine(url: str, *, pool_size: int = 10) -> Engine:
    """An engine for ``url`` with the per-dialect settings the master relies on (no connection yet)."""
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        return engine
    # execute_batch for the remaining executemany calls (UPDATEs): pages of statements, not a round trip each
    return create_engine(
        url,
        pool_size=pool_size,
        max_overflow=2 * pool_size,
        pool_pre_ping=True,
        executemany_mode="values_plus_batch",
    )


class SqlStore:
    """The search-plan database (Postgres or SQLite) behind the master's use cases."""

    def __init__(self, engine: Engine, *, check: bool = True) -> None:
        self.engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        self._pg = engine.dialect.name == "postgresql"
        self._plan_ids: dict[str, int] = {}
        self._plan_fixed: dict[int, tuple[str, str]] = {}
        self._studies: dict[str, StudyRecord] = {}
        self._ignore_stmts: dict[tuple[str, tuple[str, ...]], Any] = {}
        self._aggregates: dict[int, Any] = {}  # id of a _Q statement -> its one-row form (SQLite)
        self._batch_plans: dict[int, int] = {}
        # SQLite has one writer at a time and its busy handler waits by sleeping (1, 2, 5, ... 100 ms),
        # so threads of one process that queue on it lose most of their time asleep. They take turns on
        # this lock instead (the busy timeout still bounds the wait; other processes still rely on SQLite).
        self._turn = threading.RLock() if not self._pg else None
        if check:
            with self._translate("check schema"):
                check_schema(engine)

    # -- plumbing -------------------------------------------------------------------------------

    def _insert(self, table: Any) -> Any:
        if self._pg:
            from sqlalchemy.dialects.postgresql import insert as pg_insert

            return pg_insert(table)
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        return sqlite_insert(table)

    def _rows(self, s: Session, stmt: Any, params: dict[str, Any] | None = None) -> Sequence[Sequence[Any]]:
        """The rows of a prebuilt ``_Q`` select. On SQLite they come back as one row, a JSON array of
        arrays (``json_group_array``): Python's sqlite3 releases the GIL around every row it steps,
        and each step then waits for the GIL again behind whatever other thread runs (measured: 2,000
        rows in 1 ms alone, in 1 s beside one busy thread). Selected values must be integers or
        text (JSON renders a REAL in 15 digits; a JSON column comes back as its text)."""
        c = s.connection()
        if self._pg:
            return c.execute(stmt, params or {}).all()
        agg = self._aggregates.get(id(stmt))
        if agg is None:
            sub = stmt.subquery()
            agg = self._aggregates[id(stmt)] = select(func.json_group_array(func.json_array(*sub.c))).select_from(sub)
        rows: list[list[Any]] = json.loads(c.execute(agg, params or {}).scalar_one())
        return rows

    def _insert_ignore(self, s: Session, table: Any, rows: list[dict[str, Any]], conflict: list[str]) -> None:
        """Insert rows, skipping those whose ``conflict`` key exists, in as few round trips as possible:
        psycopg2's ``execute_values`` (pages of multi-row VALUES, no per-call SQL compilation) on
        Postgres; a cached ``executemany`` on SQLite (in-process, so round trips are free)."""
        if not rows:
            return
        if not self._pg:
            key = (table.name, tuple(conflict))
            stmt = self._ignore_stmts.get(key)
            if stmt is None:
                stmt = self._ignore_stmts[key] = self._insert(table).on_conflict_do_nothing(index_elements=conflict)
            s.connection().execute(stmt, rows)
            return
        from psycopg2.extras import Json, execute_values

        cols = list(rows[0])
        json_cols = [c for c in cols if isinstance(table.c[c].type, JSON)]
        if json_cols:  # psycopg2 adapts no dict by itself
            rows = [{**r, **{c: Json(r[c], dumps=_compact_json) for c in json_cols}} for r in rows]
        sql = f"INSERT INTO {table.name} ({', '.join(cols)}) VALUES %s ON CONFLICT ({', '.join(conflict)}) DO NOTHING"
        template = "(" + ", ".join(f"%({c})s" for c in cols) + ")"
        cur = s.connection().connection.cursor()
        try:
            execute_values(cur, sql, rows, template=template, page_size=1000)
        finally:
            cur.close()

    @contextmanager
    def _translate(self, what: str) -> Iterator[None]:
        try:
            yield
        except IntegrityError as e:
            raise Conflict(f"{what}: a concurrent writer changed the same rows; retry ({e.orig})") from e
        except OperationalError as e:
            if self._is_busy(e):
                raise Conflict(f"{what}: the database is busy; retry") from e
            raise Unavailable(f"{what}: the database is unreachable: {e.orig}; check the database URL") from e
        except DBAPIError as e:
            if e.connection_invalidated:
                raise Unavailable(f"{what}: lost the database connection; retry") from e
            raise

    def _retry(self, fn: Callable[[], T], attempts: int = 8) -> T:
        """Run an idempotent write again when a concurrent writer made the database give up on it."""
        for i in range(attempts):
            try:
                return fn()
            except Conflict:
                if i == attempts - 1:
                    raise
                time.sleep(random.uniform(0.001, 0.01) * (i + 1))
        raise AssertionError("unreachable")

    @staticmethod
    def _is_busy(e: OperationalError) -> bool:
        return "locked" in str(e.orig) or "deadlock" in str(e.orig)

    @contextmanager
    def _tx(self, what: str) -> Iterator[Session]:
        if self._turn is None:
            with self._translate(what), self._sessions.begin() as s:
                yield s
            return
        if not self._turn.acquire(timeout=SQLITE_TURN_TIMEOUT_S):
            raise Conflict(f"{what}: the database is busy; retry")
        try:
            with self._translate(what), self._sessions.begin() as s:
                yield s
        finally:
            self._turn.release()

    def dispose(self) -> None:
        self.engine.dispose()

    # -- studies --------------------------------------------------------------------------------

    def create_study(self, owner: str, name: str, fixed_json: str | None) -> StudyRecord:
        rec = StudyRecord(uuid.uuid4().hex, owner, name, fixed_json, time.time())
        try:
            with self._tx("create study") as s:
                s.add(m.Study(id=rec.id, owner=owner, name=name, fixed_json=fixed_json, created_at=rec.created_at))
        except Conflict as e:
            raise AlreadyExists(f"study {name!r} already exists for {owner!r}; pick another name") from e
        return rec

    def get_study(self, study_id: str) -> StudyRecord:
        got = self._studies.get(study_id)
        if got is not None:  # a study never changes once created
            return got
        with self._tx("get study") as s:
            row = s.get(m.Study, study_id)
            if row is None:
                raise NotFound(f"study {study_id!r} does not exist")
            got = StudyRecord(row.id, row.owner, row.name, row.fixed_json, row.created_at)
        if len(self._studies) >= STUDY_CACHE_SIZE:
            self._studies.clear()
        self._studies[study_id] = got
        return got

    def list_studies(self, owner: str) -> list[StudyRecord]:
        with self._tx("list studies") as s:
            rows = s.scalars(select(m.Study).where(m.Study.owner == owner).order_by(m.Study.created_at)).all()
            return [StudyRecord(r.id, r.owner, r.name, r.fixed_json, r.created_at) for r in rows]

    # -- plans and nodes ------------------------------------------------------------------------

    def ensure_plan(self, key: str, fixed_json: str) -> int:
        """The id of the plan with this key, created if needed (plans are never deleted, so ids are
        remembered)."""
        known = self._plan_ids.get(key)
        if known is not None:
            return known
        pid = self._ensure_plan(key, fixed_json)
        self._plan_ids[key] = pid
        return pid

    def _ensure_plan(self, key: str, fixed_json: str) -> int:
        with self._tx("ensure plan") as s:
            pid = s.scalar(select(m.Plan.id).where(m.Plan.key == key))
            if pid is not None:
                return int(pid)
            s.execute(
                self._insert(m.Plan.__table__)
                .values(key=key, fixed_json=fixed_json, created_at=time.time())
                .on_conflict_do_nothing(index_elements=["key"])
            )
            return int(s.scalar(select(m.Plan.id).where(m.Plan.key == key)))  # type: ignore[arg-type]

    def plan_ids_by_key(self, keys: Iterable[str]) -> dict[str, int]:
        with self._tx("find plans") as s:
            rows = s.execute(select(m.Plan.key, m.Plan.id).where(m.Plan.key.in_(list(keys)))).all()
            return {k: int(i) for k, i in rows}

    def plan_fixed(self, plan_id: int) -> tuple[str, str]:
        """(key, fixed part JSON) of a plan."""
        got = self._plan_fixed.get(plan_id)
        if got is not None:  # a plan's key and fixed part never change
            return got
        with self._tx("get plan") as s:
            row = s.get(m.Plan, plan_id)
            if row is None:
                raise NotFound(f"plan {plan_id} does not exist")
            got = self._plan_fixed[plan_id] = (row.key, row.fixed_json)
            return got

    def plan_of_batch(self, batch_id: int) -> int:
        """The plan a batch belongs to (it never changes: asked once per batch, then remembered)."""
        pid = self._batch_plans.get(batch_id)
        if pid is None:
            pid = self.get_batch(batch_id).plan_id
            self._remember_batch_plan(batch_id, pid)
        return pid

    def _remember_batch_plan(self, batch_id: int, plan_id: int) -> None:
        if len(self._batch_plans) >= 100_000:  # keep the newest half
            for k in list(self._batch_plans)[:50_000]:
                del self._batch_plans[k]
        self._batch_plans[batch_id] = plan_id

    def load_nodes(self, plan_id: int, after: int = 0) -> list[NodeRecord]:
        """Nodes of a plan with id above ``after``, parents before children (ids grow)."""
        with self._tx("load nodes") as s:
            rows = s.execute(
                select(m.Node.id, m.Node.parent_id, m.Node.start, m.Node.config_json)
                .where(m.Node.plan_id == plan_id, m.Node.id > after)
                .order_by(m.Node.id)
            ).all()
            return [NodeRecord(int(i), None if p is None else int(p), st, cj) for i, p, st, cj in rows]

    def insert_nodes(self, plan_id: int, nodes: Sequence[NewNode]) -> None:
        """Insert-or-ignore: a node another writer created first under the same key is kept."""
        if not nodes:
            return
        rows = [
            {
                "plan_id": plan_id,
                "parent_id": n.parent,
                "parent_key": n.parent or 0,
                "start": n.start,
                "branch_digest": n.branch_digest,
                "config_json": n.config_json,
            }
            for n in nodes
        ]
        # one global order of rows so that concurrent writers take row locks in the same order
        rows.sort(key=lambda r: (r["parent_key"], r["start"], r["branch_digest"]))
        stmt = self._insert(m.Node.__table__).on_conflict_do_nothing(
            index_elements=["plan_id", "parent_key", "start", "branch_digest"]
        )

        def write() -> None:
            with self._tx("insert nodes") as s:
                s.execute(stmt, rows)

        self._retry(write)

    def insert_node_tree(self, plan_id: int, nodes: Sequence[NewTreeNode]) -> dict[int, int]:
        """Insert-or-ignore a forest of new nodes (parents before children) in one transaction, one
        statement pair per depth level; returns ``ref -> database id`` of the nodes now in the database
        with the caller's config. Where another master wrote a node under the same key first with a
        different config, that node is kept and the caller's subtree below it is not written (it was
        placed relative to the caller's config): the caller walks again."""
        if not nodes:
            return {}
        depth: dict[int, int] = {}
        levels: list[list[NewTreeNode]] = []
        for n in nodes:
            d = depth[n.parent] + 1 if n.parent is not None and n.parent < 0 else 0
            depth[n.ref] = d
            if d == len(levels):
                levels.append([])
            levels[d].append(n)

        def write() -> dict[int, int]:
            ids: dict[int, int] = {}
            foreign: set[int] = set()  # refs whose key holds another writer's config
            with self._tx("insert nodes") as s:
                for level in levels:
                    rows: list[dict[str, Any]] = []
                    for n in level:
                        if n.parent is not None and n.parent in foreign:
                            foreign.add(n.ref)
                            continue
                        parent = ids[n.parent] if n.parent is not None and n.parent < 0 else n.parent
                        rows.append(
                            {
                                "plan_id": plan_id,
                                "parent_id": parent,
                                "parent_key": parent or 0,
                                "start": n.start,
                                "branch_digest": n.branch_digest,
                                "config_json": n.config_json,
                                "_ref": n.ref,
                            }
                        )
                    # one global order of rows so that concurrent writers take row locks in the same order
                    if not rows:
                        break
                    rows.sort(key=lambda r: (r["parent_key"], r["start"], r["branch_digest"]))
                    self._insert_ignore(
                        s,
                        m.Node.__table__,
                        [{k: v for k, v in r.items() if k != "_ref"} for r in rows],
                        ["plan_id", "parent_key", "start", "branch_digest"],
                    )
                    keys = {(r["parent_key"], r["start"], r["branch_digest"]): r for r in rows}
                    for i, pk, st, dg, cj in s.execute(
                        select(
                            m.Node.id, m.Node.parent_key, m.Node.start, m.Node.branch_digest, m.Node.config_json
                        ).where(
                            m.Node.plan_id == plan_id,
                            tuple_(m.Node.parent_key, m.Node.start, m.Node.branch_digest).in_(list(keys)),
                        )
                    ):
                        r = keys[(pk, st, dg)]
                        if cj == r["config_json"]:
                            ids[r["_ref"]] = int(i)
                        else:
                            foreign.add(r["_ref"])
            return ids

        return self._retry(write)

    # -- requests -------------------------------------------------------------------------------

    def add_requests(self, study_id: str, plan_id: int, items: Sequence[NewRequest]) -> list[RequestRecord]:
        """Record requests (idempotent per client request id); a request whose point already has
        metrics is recorded DONE and returned with them. Returns one record per item, in order."""
        if not items:
            return []
        return self._retry(lambda: self._add_requests(study_id, plan_id, items))

    def _add_requests(self, study_id: str, plan_id: int, items: Sequence[NewRequest]) -> list[RequestRecord]:
        now = time.time()
        with self._tx("add requests") as s:
            points = {(it.node, it.step) for it in items}
            known = self._metrics_at(s, points)
            rows = [
                {
                    "study_id": study_id,
                    "plan_id": plan_id,
                    "node_id": it.node,
                    "step": it.step,
                    "state": DONE if (it.node, it.step) in known else NOT_SCHED,
                    "client_request_id": it.client_request_id,
                    "created_at": now,
                    "done_at": now if (it.node, it.step) in known else None,
                }
                for it in sorted(items, key=lambda it: it.client_request_id)
            ]
            self._insert_ignore(s, m.Request.__table__, rows, ["study_id", "client_request_id"])
            by_client = self._requests_by_client(s, study_id, [it.client_request_id for it in items])
            later = {(r.node, r.step) for r in by_client.values() if r.state == DONE} - known.keys()
            known.update(self._metrics_at(s, later))  # a retried request finished since its first submission
        out = []
        for it in items:
            r = by_client[it.client_request_id]
            out.append(_with_metrics(r, known.get((r.node, r.step)) if r.state == DONE else None))
        return out

    def _requests_by_client(self, s: Session, study_id: str, client_ids: list[str]) -> dict[str, RequestRecord]:
        rows = s.execute(
            select(m.Request).where(m.Request.study_id == study_id, m.Request.client_request_id.in_(client_ids))
        ).scalars()
        return {r.client_request_id: _request_record(r) for r in rows}

    def _metrics_at(self, s: Session, points: set[tuple[int, int]]) -> dict[tuple[int, int], dict[str, float]]:
        if not points:
            return {}
        out: dict[tuple[int, int], dict[str, float]] = {}
        pts = list(points)
        for i in range(0, len(pts), 500):
            for n, st, v in self._rows(s, _Q.metrics_at, {"keys": pts[i : i + 500]}):
                values = json.loads(v) if isinstance(v, str) else v
                out[(int(n), int(st))] = {k: metric_value(x) for k, x in values.items()}
        return out

    def get_requests(self, study_id: str, request_ids: Sequence[int] | None = None) -> list[RequestRecord]:
        """Requests of a study (all, or those ids), DONE ones with their metrics."""
        with self._tx("get requests") as s:
            if request_ids is None:
                rows = self._rows(s, _Q.requests_of, {"study": study_id})
            else:
                rows = self._rows(s, _Q.requests_by_id, {"study": study_id, "ids": list(request_ids)})
            recs = [_request_row(*r) for r in rows]
            metrics = self._metrics_at(s, {(r.node, r.step) for r in recs if r.state == DONE})
        return [_with_metrics(r, metrics.get((r.node, r.step))) for r in recs]

    def cancel_request(self, study_id: str, request_id: int) -> tuple[RequestRecord, int | None]:
        """Cancel a live request. Returns it and the batch to abort (SCHED, and no other live request
        needs that batch), else None. A finished request is returned unchanged."""
        with self._tx("cancel request") as s:
            row = s.scalar(
                select(m.Request).where(m.Request.id == request_id, m.Request.study_id == study_id).with_for_update()
            )
            if row is None:
                raise NotFound(f"request {request_id} does not exist in study {study_id!r}")
            abort = None
            if row.state in LIVE_STATES:
                batch = row.batch_id if row.state == SCHED else None
                row.state = CANCELLED
                row.done_at = time.time()
                s.flush()
                if batch is not None:
                    others = s.scalar(
                        select(func.count())
                        .select_from(m.Request)
                        .where(m.Request.batch_id == batch, m.Request.state.in_(LIVE_STATES))
                    )
                    abort = None if others else batch
            return _request_record(row), abort

    def metrics_at(self, node: int, step: int) -> dict[str, float] | None:
        with self._tx("get metrics") as s:
            return self._metrics_at(s, {(node, step)}).get((node, step))

    def record_metrics(self, plan_id: int, node: int, step: int, values: dict[str, float]) -> list[int]:
        """Store metrics at a canonical point; the live requests waiting there become DONE (ids returned)."""
        with self._tx("record metrics") as s:
            return self._record_metrics_in(s, [(node, step, values)]).get((node, step), [])

    def record_checkpoint(self, node: int, step: int, uri: str, nbytes: int, kind: str) -> None:
        with self._tx("record checkpoint") as s:
            self._record_checkpoints_in(s, [(node, step, uri, nbytes, kind)])

    def report_batch(
        self,
        batch_id: int,
        attempt: int,
        ok: bool,
        metrics: Sequence[tuple[int, int, dict[str, float]]],
        checkpoints: Sequence[tuple[int, int, str, int, str]],
        *,
        error: str = "",
        preempted: bool = False,
        max_failures: int = 3,
    ) -> tuple[list[int], list[int]]:
        """What a batch attempt produced and how it ended, in one transaction: its checkpoints
        ``(node, step, uri, bytes, kind)`` and metrics ``(node, step, values)`` at canonical points, then
        ``finish_batch``. Returns the requests completed and the requests requeued."""
        report = BatchReportIn(batch_id, attempt, ok, metrics, checkpoints, error, preempted, max_failures)
        got = self.report_batches([report])[0]
        if isinstance(got, StagetreeError):
            raise got
        return got

    def report_batches(self, reports: Sequence[BatchReportIn]) -> list[tuple[list[int], list[int]] | StagetreeError]:
        """``report_batch`` of several batches in one transaction, with as many statements as for one
        (a node manager's batches often end together, and their reports arrive together). Each gets
        its (completed, requeued) requests, or NotFound when its batch does not exist (the others
        are applied all the same)."""
        out: list[tuple[list[int], list[int]] | StagetreeError] = []
        with self._tx("report batches") as s:
            ids = sorted({r.batch_id for r in reports})
            states = {int(b): (int(a), st) for b, a, st in self._rows(s, _Q.batch_states, {"ids": ids})}
            present = set(states)
            known = [r for r in reports if r.batch_id in present]
            self._record_checkpoints_in(s, [ck for r in known for ck in r.checkpoints])
            done_at = self._record_metrics_in(s, [p for r in known for p in r.metrics])
            ending: dict[str, list[int]] = {}
            for r in known:
                if states.pop(r.batch_id, None) != (r.attempt, RUNNING):  # popped: a repeat in the group is stale
                    log.info("stale batch report ignored", extra={"batch_id": r.batch_id, "attempt": r.attempt})
                    continue
                if not r.ok and not r.preempted:
                    self._count_failure_in(s, r.batch_id, r.error, r.max_failures)
                end = BATCH_DONE if r.ok else (PREEMPTED if r.preempted else FAILED)
                ending.setdefault(end, []).append(r.batch_id)
            ended = [b for bids in ending.values() for b in bids]
            requeued: dict[int, list[int]] = {}
            for b, rid in self._rows(s, _Q.sched_of_many, {"ids": ended}) if ended else ():
                requeued.setdefault(int(b), []).append(int(rid))
            for end, bids in ending.items():
                self._end_batches(s, bids, end)
        for r in reports:
            if r.batch_id not in present:
                out.append(NotFound(f"batch {r.batch_id} does not exist"))
                continue
            done = sorted({i for n, st, _ in r.metrics for i in done_at.get((n, st), ())})
            out.append((done, requeued.pop(r.batch_id, [])))  # popped: a repeat in the group requeued nothing
        return out

    def _record_metrics_in(
        self, s: Session, points: Sequence[tuple[int, int, dict[str, float]]]
    ) -> dict[tuple[int, int], list[int]]:
        """Store metrics at canonical points; the live requests waiting there become DONE (their ids,
        per point)."""
        if not points:
            return {}
        now = time.time()
        rows = [{"node_id": n, "step": st, "values": json_safe_metrics(v), "recorded_at": now} for n, st, v in points]
        self._insert_ignore(s, m.Metric.__table__, rows, ["node_id", "step"])
        keys = list({(n, st) for n, st, _ in points})
        out: dict[tuple[int, int], list[int]] = {}
        for i in range(0, len(keys), 500):
            for rid, n, st in self._rows(s, _Q.live_at, {"keys": keys[i : i + 500]}):
                out.setdefault((int(n), int(st)), []).append(int(rid))
        ids = [i for got in out.values() for i in got]
        c = s.connection()
        for i in range(0, len(ids), 1000):
            c.execute(_Q.mark_done, {"ids": ids[i : i + 1000], "t": now})
        return out

    def _record_checkpoints_in(self, s: Session, ckpts: Sequence[tuple[int, int, str, int, str]]) -> None:
        if not ckpts:
            return
        now = time.time()
        rows = [
            {"node_id": n, "step": st, "uri": uri, "bytes": nb, "kind": kind, "refcount": 0, "last_used": now}
            for n, st, uri, nb, kind in ckpts
        ]
        self._insert_ignore(s, m.Checkpoint.__table__, rows, ["node_id", "step"])

    def checkpoint_bytes(self) -> int:
        """Bytes held by every recorded checkpoint (what the checkpoint budget limits)."""
        with self._tx("checkpoint bytes") as s:
            return int(s.scalar(select(func.coalesce(func.sum(m.Checkpoint.bytes), 0))) or 0)

    def checkpoint_records(self) -> dict[int, list[tuple[Point, str, int, str, float]]]:
        """Per plan: (point, uri, bytes, kind, last used) of every checkpoint."""
        out: dict[int, list[tuple[Point, str, int, str, float]]] = {}
        with self._tx("load checkpoint records") as s:
            for pid, n, st, uri, nb, kind, used in s.execute(
                select(
                    m.Node.plan_id,
                    m.Checkpoint.node_id,
                    m.Checkpoint.step,
                    m.Checkpoint.uri,
                    m.Checkpoint.bytes,
                    m.Checkpoint.kind,
                    m.Checkpoint.last_used,
                ).join(m.Node, m.Node.id == m.Checkpoint.node_id)
            ):
                out.setdefault(int(pid), []).append((Point(int(n), int(st)), uri, int(nb), kind, float(used)))
        return out

    def checkpoints(self, plan_id: int) -> dict[Point, str]:
        """Checkpoint uri per canonical point of a plan."""
        return self.checkpoints_of([plan_id]).get(plan_id, {})

    def checkpoints_of(self, plan_ids: Sequence[int]) -> dict[int, dict[Point, str]]:
        """Checkpoint uri per canonical point, per plan, in one query."""
        if not plan_ids:
            return {}
        with self._tx("load checkpoints") as s:
            return self._checkpoints_in(s, plan_ids)

    def _checkpoints_in(self, s: Session, plan_ids: Sequence[int]) -> dict[int, dict[Point, str]]:
        out: dict[int, dict[Point, str]] = {}
        if not plan_ids:
            return out
        for pid, n, st, uri in self._rows(s, _Q.checkpoints_of, {"plans": list(plan_ids)}):
            out.setdefault(int(pid), {})[Point(int(n), int(st))] = uri
        return out

    def plan_state(self, plan_id: int) -> tuple[dict[int, dict[str, int]], dict[int, list[int]], dict[int, list[int]]]:
        """Per node: request counts by state; checkpoint steps; metric steps (for the plan view)."""
        with self._tx("plan state") as s:
            counts: dict[int, dict[str, int]] = {}
            for node, state, n in s.execute(
                select(m.Request.node_id, m.Request.state, func.count())
                .where(m.Request.plan_id == plan_id)
                .group_by(m.Request.node_id, m.Request.state)
            ):
                counts.setdefault(int(node), {})[state] = int(n)
            ckpts: dict[int, list[int]] = {}
            for node, step in s.execute(
                select(m.Checkpoint.node_id, m.Checkpoint.step)
                .join(m.Node, m.Node.id == m.Checkpoint.node_id)
                .where(m.Node.plan_id == plan_id)
            ):
                ckpts.setdefault(int(node), []).append(int(step))
            mets: dict[int, list[int]] = {}
            for node, step in s.execute(
                select(m.Metric.node_id, m.Metric.step)
                .join(m.Node, m.Node.id == m.Metric.node_id)
                .where(m.Node.plan_id == plan_id)
            ):
                mets.setdefault(int(node), []).append(int(step))
            return counts, ckpts, mets

    def study_plan_ids(self, study_id: str) -> list[int]:
        with self._tx("study plans") as s:
            return [
                int(p) for p in s.scalars(select(m.Request.plan_id).where(m.Request.study_id == study_id).distinct())
            ]

    # -- node managers --------------------------------------------------------------------------

    def register_node_manager(self, nm_id: str, address: str, slots: Sequence[SlotInfo | tuple[str, str]]) -> None:
        infos = [s if isinstance(s, SlotInfo) else SlotInfo(s[0], s[1]) for s in slots]
        now = time.time()
        with self._tx("register node manager") as s:
            row = s.get(m.NodeManager, nm_id, with_for_update=True)
            if row is None:
                s.add(m.NodeManager(id=nm_id, address=address, state=ALIVE, registered_at=now, last_heartbeat=now))
            else:
                row.address, row.state, row.last_heartbeat = address, ALIVE, now
            s.flush()
            s.query(m.Slot).filter(m.Slot.node_manager_id == nm_id).delete()
            s.add_all(
                m.Slot(
                    node_manager_id=nm_id,
                    slot_id=i.id,
                    gpu_type=i.gpu_type,
                    memory_bytes=i.memory_bytes,
                    compute_capability=i.compute_capability,
                    share=i.share,
                    cpu_cores=i.cpu_cores,
                    gpu_index=i.gpu_index,
                )
                for i in infos
            )

    def heartbeat(self, nm_id: str) -> None:
        with self._tx("heartbeat") as s:
            res = s.execute(
                update(m.NodeManager).where(m.NodeManager.id == nm_id).values(last_heartbeat=time.time(), state=ALIVE)
            )
            if res.rowcount == 0:  # type: ignore[attr-defined]
                raise NotFound(f"node manager {nm_id!r} is not registered; register it first")

    def node_managers(self) -> list[NodeManagerRecord]:
        with self._tx("list node managers") as s:
            return self._node_managers_in(s)

    @staticmethod
    def _node_managers_in(s: Session) -> list[NodeManagerRecord]:
        # plain column rows, not ORM objects: every scheduling round reads these
        infos: dict[str, list[SlotInfo]] = {}
        c = s.connection()
        for nm_id, sid, gpu, mem, cc, share, cores, index in c.execute(_Q.slots):
            infos.setdefault(nm_id, []).append(SlotInfo(sid, gpu, mem, cc, share, cores, index))
        out = []
        for nm_id, address, state, beat in c.execute(_Q.node_managers):
            mine = tuple(infos.get(nm_id, ()))
            slots = tuple((i.id, i.gpu_type) for i in mine)
            out.append(NodeManagerRecord(nm_id, address, state, beat, slots, mine))
        return out

    def round_reads(self) -> RoundReads:
        """Everything a scheduling round reads, in one transaction (one turn on SQLite, not six)."""
        with self._tx("round reads") as s:
            nms = self._node_managers_in(s)
            busy = self._busy_slots_in(s)
            policies = self._policy_studies_in(s)
            pending = self._pending_in(s)
            running = self._running_batches_in(s)
            ckpts = self._checkpoints_in(s, sorted(pending))
        return RoundReads(nms, busy, policies, pending, running, ckpts)

    def mark_lost(self, nm_id: str) -> list[int]:
        """The node manager stopped heartbeating: its running batches are LOST and their requests go back
        to NOT_SCHED (the next round rebuilds them from the latest checkpoint). Returns the batch ids."""
        with self._tx("mark node manager lost") as s:
            s.execute(update(m.NodeManager).where(m.NodeManager.id == nm_id).values(state=LOST))
            ids = [
                int(b)
                for b in s.scalars(select(m.Batch.id).where(m.Batch.node_manager_id == nm_id, m.Batch.state == RUNNING))
            ]
            self._end_batches(s, ids, LOST)
            return ids

    def requeue_unknown(self, nm_id: str, known: Iterable[tuple[int, int]]) -> list[int]:
        """A node manager registered listing the attempts it knows: its running batches whose current
        attempt was sent to it but is not in ``known`` are LOST and their requests NOT_SCHED (a restarted
        process never runs them; an assignment lost in a broken stream never arrives). Unsent attempts
        stay: its new stream sends them. Returns the batch ids."""
        keep = {(int(b), int(a)) for b, a in known}
        with self._tx("requeue unknown attempts") as s:
            rows = s.execute(
                select(m.Batch.id, m.Batch.attempt)
                .join(
                    m.BatchAttempt,
                    (m.BatchAttempt.batch_id == m.Batch.id) & (m.BatchAttempt.attempt == m.Batch.attempt),
                )
                .where(
                    m.Batch.node_manager_id == nm_id,
                    m.Batch.state == RUNNING,
                    m.BatchAttempt.state == RUNNING,
                    m.BatchAttempt.sent_at.is_not(None),
                )
            ).all()
            ids = [int(b) for b, a in rows if (int(b), int(a)) not in keep]
            self._end_batches(s, ids, LOST)
            return ids

    def _end_batches(self, s: Session, ids: list[int], state: str) -> None:
        if not ids:
            return
        now = time.time()
        c = s.connection()
        c.execute(_Q.end_batches, {"ids": ids, "st": state, "t": now})
        c.execute(_Q.end_attempts, {"ids": ids, "st": state, "t": now})
        c.execute(_Q.unsched, {"ids": ids})

    # -- scheduling -----------------------------------------------------------------------------

    def pending(self) -> dict[int, list[tuple[int, Point]]]:
        """(request id, point) of every NOT_SCHED request, per plan."""
        with self._tx("load pending") as s:
            return self._pending_in(s)

    def _pending_in(self, s: Session) -> dict[int, list[tuple[int, Point]]]:
        out: dict[int, list[tuple[int, Point]]] = {}
        for rid, pid, node, step in self._rows(s, _Q.pending):
            out.setdefault(pid, []).append((rid, Point(node, step)))
        return out

    def running_batches(self) -> list[BatchRecord]:
        with self._tx("load running batches") as s:
            return self._running_batches_in(s)

    def _running_batches_in(self, s: Session) -> list[BatchRecord]:
        return [
            BatchRecord(int(i), int(p), st, a, spec, nm, slot)
            for i, p, st, a, spec, nm, slot in self._rows(s, _Q.running)
        ]

    def get_batch(self, batch_id: int) -> BatchRecord:
        with self._tx("get batch") as s:
            b = s.get(m.Batch, batch_id)
            if b is None:
                raise NotFound(f"batch {batch_id} does not exist")
            return _batch_record(b)

    def dispatch(
        self, plan_id: int, spec_for: Any, request_ids: Sequence[int], nm_id: str, slot_id: str
    ) -> BatchRecord | None:
        """Create a batch and its first attempt on a slot and mark its requests SCHED, in one transaction.
        ``spec_for(batch_id, attempt) -> str`` renders the spec. Returns None (and writes nothing) when
        none of the requests is still NOT_SCHED (another round or a cancel got there first)."""
        return self.dispatch_many([DispatchItem(plan_id, spec_for, request_ids, nm_id, slot_id)])[0]

    def dispatch_many(self, items: Sequence[DispatchItem]) -> list[BatchRecord | None]:
        """``dispatch`` for each item, all in one transaction (a round's dispatches commit together, not
        one transaction per batch). An item none of whose requests is still NOT_SCHED gets None."""
        if not items:
            return []
        now = time.time()
        out: list[BatchRecord | None] = []
        with self._tx("dispatch batches") as s:
            c = s.connection()
            for it in items:
                nm, slot = it.node_manager_id, it.slot_id
                bid = int(
                    c.execute(
                        _Q.new_batch,
                        {
                            "plan_id": it.plan_id,
                            "state": RUNNING,
                            "attempt": 1,
                            "spec_json": "",
                            "node_manager_id": nm,
                            "slot_id": slot,
                            "created_at": now,
                            "updated_at": now,
                        },
                    ).scalar_one()
                )
                if it.request_ids and c.execute(_Q.claim, {"ids": list(it.request_ids), "bid": bid}).rowcount == 0:
                    c.execute(_Q.drop_batch, {"b": bid})  # taken meanwhile (another round, a cancel): not needed
                    out.append(None)
                    continue
                spec = it.spec_for(bid, 1)
                c.execute(_Q.set_spec, {"b": bid, "spec": spec})
                c.execute(
                    _Q.new_attempt,
                    {
                        "batch_id": bid,
                        "attempt": 1,
                        "node_manager_id": nm,
                        "slot_id": slot,
                        "state": RUNNING,
                        "dispatched_at": now,
                    },
                )
                out.append(BatchRecord(bid, it.plan_id, RUNNING, 1, spec, nm, slot))
        for rec in out:
            if rec is not None:
                self._remember_batch_plan(rec.id, rec.plan_id)
        return out

    def take_assignments(self, nm_id: str) -> list[Assignment]:
        """Running attempts for this node manager not yet sent, then its queued control actions; each is
        marked sent exactly once even when two streams (or two masters) race for it."""
        now = time.time()
        with self._tx("take assignments") as s:
            c = s.connection()
            # each row is claimed by one UPDATE only (sent_at IS NULL is checked again under its lock)
            claimed = sorted(c.execute(_Q.claim_attempts, {"nm": nm_id, "t": now}).all())
            specs = dict(c.execute(_Q.specs, {"ids": [bid for bid, _, _ in claimed]}).all()) if claimed else {}
            actions = sorted(c.execute(_Q.claim_actions, {"nm": nm_id, "t": now}).all())
        out = [Assignment(int(bid), int(att), specs[bid], slot_id=slot or "") for bid, att, slot in claimed]
        for _id, kind, bid, att, payload in actions:
            uris = tuple(str(u) for u in (payload or {}).get("uris", ()))
            out.append(Assignment(int(bid), int(att), "", kind, uris))
        return out

    def _enqueue_action(
        self, s: Session, nm_id: str, kind: str, batch_id: int = 0, attempt: int = 0, uris: Sequence[str] = ()
    ) -> None:
        s.add(
            m.NodeManagerAction(
                node_manager_id=nm_id,
                kind=kind,
                batch_id=batch_id,
                attempt=attempt,
                payload={"uris": list(uris)},
                created_at=time.time(),
            )
        )

    def delete_checkpoints(self, points: Sequence[Point]) -> dict[str, list[str]]:
        """Forget these checkpoints and queue their deletion on every live node manager (the store is
        shared; whichever gets there first deletes, the others find nothing). Returns uris per manager."""
        if not points:
            return {}
        with self._tx("delete checkpoints") as s:
            keys = [(p.node, p.step) for p in points]
            uris = [
                str(u)
                for u in s.scalars(
                    select(m.Checkpoint.uri).where(tuple_(m.Checkpoint.node_id, m.Checkpoint.step).in_(keys))
                )
            ]
            if not uris:
                return {}
            s.execute(_table(m.Checkpoint).delete().where(tuple_(m.Checkpoint.node_id, m.Checkpoint.step).in_(keys)))
            nms = [str(n) for n in s.scalars(select(m.NodeManager.id).where(m.NodeManager.state == ALIVE))]
            for nm in nms:
                self._enqueue_action(s, nm, DELETE_CHECKPOINTS, uris=uris)
            return {nm: uris for nm in nms}

    def finish_batch(
        self,
        batch_id: int,
        attempt: int,
        ok: bool,
        *,
        error: str = "",
        preempted: bool = False,
        max_failures: int = 3,
    ) -> list[int]:
        """A batch attempt ended. Its requests that got no metrics go back to NOT_SCHED (returned) so the
        next round serves them from the latest checkpoint, except after a failure that is their
        ``max_failures``-th: those become FAILED with ``error``. A preemption is not a failure. A report
        for an attempt that is not the running one is ignored (it was lost, aborted or already reported)."""
        return self.report_batch(
            batch_id, attempt, ok, [], [], error=error, preempted=preempted, max_failures=max_failures
        )[1]

    @staticmethod
    def _count_failure_in(s: Session, batch_id: int, error: str, max_failures: int) -> None:
        """A failed attempt counts against each request it carried; those at ``max_failures`` fail."""
        s.execute(
            update(m.Request)
            .where(m.Request.batch_id == batch_id, m.Request.state == SCHED)
            .values(failures=m.Request.failures + 1, error=error[-4000:] or "the batch failed")
        )
        s.execute(
            update(m.Request)
            .where(m.Request.batch_id == batch_id, m.Request.state == SCHED, m.Request.failures >= max_failures)
            .values(state=REQUEST_FAILED, done_at=time.time())
        )

    def abort_batch(self, batch_id: int) -> str | None:
        """End a running batch no live request needs and queue the order to stop it for its node
        manager (returned, to be woken)."""
        with self._tx("abort batch") as s:
            b = s.get(m.Batch, batch_id, with_for_update=True)
            if b is None or b.state != RUNNING:
                return None
            if b.node_manager_id:
                self._enqueue_action(s, b.node_manager_id, ABORT, batch_id, b.attempt)
            self._end_batches(s, [batch_id], ABORTED)
            return b.node_manager_id

    def preempt_batch(self, batch_id: int) -> bool:
        """Ask the batch's node manager to preempt it (the batch stays RUNNING until it reports). Returns
        False when the batch is not running."""
        with self._tx("preempt batch") as s:
            b = s.get(m.Batch, batch_id)
            if b is None or b.state != RUNNING or not b.node_manager_id:
                return False
            self._enqueue_action(s, b.node_manager_id, PREEMPT, batch_id, b.attempt)
            return True

    def executed_steps(self, plan_id: int | None = None) -> int:
        """Training steps of every batch that ran to its end (of one plan, or all): what the platform
        actually trained, to compare with the unique steps of the plans."""
        with self._tx("executed steps") as s:
            q = select(m.Batch.spec_json).where(m.Batch.state == BATCH_DONE)
            if plan_id is not None:
                q = q.where(m.Batch.plan_id == plan_id)
            total = 0
            for spec in s.scalars(q):
                total += sum(int(st["end"]) - int(st["start"]) for st in json.loads(spec)["stages"])
            return total

    def finished_attempts(self, since: float, limit: int = 1000) -> list[FinishedAttempt]:
        """Attempts that ran to their end and finished at or after ``since`` (by the clock of whoever
        recorded it), oldest first: the latest ``limit`` of them."""
        a, b, sl = m.BatchAttempt, m.Batch, m.Slot
        with self._tx("finished attempts") as s:
            rows = s.execute(
                select(a.batch_id, a.attempt, b.spec_json, a.sent_at, a.dispatched_at, a.finished_at, sl.gpu_type)
                .join(b, b.id == a.batch_id)
                .outerjoin(sl, (sl.node_manager_id == a.node_manager_id) & (sl.slot_id == a.slot_id))
                .where(a.finished_at >= since, a.state == BATCH_DONE)
                .order_by(a.finished_at.desc())
                .limit(limit)
            ).all()
        return [
            FinishedAttempt(
                int(bid), int(att), spec, float(end) - float(disp if sent is None else sent), float(end), gpu or ""
            )
            for bid, att, spec, sent, disp, end, gpu in reversed(rows)
            if end is not None
        ]

    def busy_slots(self) -> set[tuple[str, str]]:
        with self._tx("busy slots") as s:
            return self._busy_slots_in(s)

    def _busy_slots_in(self, s: Session) -> set[tuple[str, str]]:
        return {(str(a), str(b)) for a, b in self._rows(s, _Q.busy)}

    def cost_profile(self, plan_id: int, gpu_type: str) -> float | None:
        with self._tx("cost profile") as s:
            row = s.get(m.CostProfile, (plan_id, gpu_type))
            return None if row is None else row.step_seconds

    def set_cost_profile(self, plan_id: int, gpu_type: str, step_seconds: float, peak_memory_bytes: int = 0) -> None:
        if not step_seconds > 0:
            raise InvalidArgument(f"step_seconds must be positive, got {step_seconds}")
        with self._tx("set cost profile") as s:
            row = s.get(m.CostProfile, (plan_id, gpu_type), with_for_update=True)
            if row is None:
                s.add(
                    m.CostProfile(
                        plan_id=plan_id,
                        gpu_type=gpu_type,
                        step_seconds=step_seconds,
                        peak_memory_bytes=peak_memory_bytes,
                        samples=1,
                        updated_at=time.time(),
                    )
                )
            else:
                row.step_seconds, row.peak_memory_bytes = step_seconds, peak_memory_bytes
                row.samples += 1
                row.updated_at = time.time()

    def done_since(self, study_id: str, request_ids: Sequence[int]) -> list[RequestRecord]:
        """The requests among ``request_ids`` that are finished (DONE, CANCELLED or FAILED), with metrics."""
        with self._tx("finished requests") as s:
            rows = self._rows(s, _Q.finished, {"study": study_id, "ids": list(request_ids)})
            recs = [_request_row(*r) for r in rows]
            metrics = self._metrics_at(s, {(r.node, r.step) for r in recs if r.state == DONE})
        return [_with_metrics(r, metrics.get((r.node, r.step))) for r in recs]

    # -- study policies (stagetree.master.policies) --------------------------------------------------

    def policy_studies(self) -> list[tuple[str, str]]:
        """(study id, fixed json) of the studies that chose policies and have live requests."""
        with self._tx("policy studies") as s:
            return self._policy_studies_in(s)

    @staticmethod
    def _policy_studies_in(s: Session) -> list[tuple[str, str]]:
        return [(str(i), str(f)) for i, f in s.connection().execute(_Q.policy_studies)]

    def request_studies(self, request_ids: Sequence[int]) -> dict[int, tuple[str, float]]:
        """Study id and arrival time of each request."""
        out: dict[int, tuple[str, float]] = {}
        ids = list(request_ids)
        with self._tx("request studies") as s:
            for i in range(0, len(ids), 1000):
                for rid, sid, created in s.execute(
                    select(m.Request.id, m.Request.study_id, m.Request.created_at).where(
                        m.Request.id.in_(ids[i : i + 1000])
                    )
                ):
                    out[int(rid)] = (str(sid), float(created))
        return out

    def running_batch_info(self) -> list[tuple[BatchRecord, float, list[str]]]:
        """Every running batch with when its current attempt was dispatched and the studies of the
        requests it serves."""
        with self._tx("running batch info") as s:
            rows = s.execute(
                select(m.Batch, m.BatchAttempt.dispatched_at)
                .join(
                    m.BatchAttempt,
                    (m.BatchAttempt.batch_id == m.Batch.id) & (m.BatchAttempt.attempt == m.Batch.attempt),
                )
                .where(m.Batch.state == RUNNING)
            ).all()
            studies: dict[int, list[str]] = {}
            ids = [int(b.id) for b, _ in rows]
            for i in range(0, len(ids), 1000):
                for bid, sid in s.execute(
                    select(m.Request.batch_id, m.Request.study_id)
                    .where(m.Request.batch_id.in_(ids[i : i + 1000]))
                    .order_by(m.Request.id)
                ):
                    studies.setdefault(int(bid or 0), []).append(str(sid))
            return [(_batch_record(b), float(t), studies.get(int(b.id), [])) for b, t in rows]

    def live_requests_at(self, study_id: str, node: int, step: int) -> list[int]:
        """The study's NOT_SCHED or SCHED requests at a point."""
        with self._tx("live requests at") as s:
            return [
                int(i)
                for i in s.scalars(
                    select(m.Request.id).where(
                        m.Request.study_id == study_id,
                        m.Request.node_id == node,
                        m.Request.step == step,
                        m.Request.state.in_(LIVE_STATES),
                    )
                )
            ]

    def set_request_error(self, request_ids: Sequence[int], error: str) -> None:
        """Say why requests ended (e.g. a policy cancelled them); their state is left as it is."""
        if not request_ids:
            return
        with self._tx("set request error") as s:
            s.execute(update(m.Request).where(m.Request.id.in_(list(request_ids))).values(error=error[-4000:]))

    def metrics_since(self, nodes: Sequence[int], since: float) -> list[tuple[int, int, float, dict[str, float]]]:
        """(node, step, recorded_at, values) of the metrics recorded on ``nodes`` after ``since``."""
        if not nodes:
            return []
        with self._tx("metrics since") as s:
            rows = s.execute(
                select(m.Metric.node_id, m.Metric.step, m.Metric.recorded_at, m.Metric.values).where(
                    m.Metric.node_id.in_(list(nodes)), m.Metric.recorded_at > since
                )
            ).all()
            return [
                (int(n), int(st), float(t), {k: metric_value(v) for k, v in vals.items()}) for n, st, t, vals in rows
            ]


def _request_row(
    rid: int, study: str, plan: int, node: int, step: int, state: str, cid: str, batch: int | None, error: str | None
) -> RequestRecord:
    """A record from the columns of ``_Q.request_cols``."""
    failed = state in (REQUEST_FAILED, CANCELLED)  # why it failed, or why a policy cancelled it
    return RequestRecord(
        int(rid), study, int(plan), int(node), int(step), state, cid, batch, None, error if failed else None
    )


def _request_record(r: m.Request) -> RequestRecord:
    return RequestRecord(
        int(r.id),
        r.study_id,
        int(r.plan_id),
        int(r.node_id),
        r.step,
        r.state,
        r.client_request_id,
        r.batch_id,
        None,
        r.error if r.state in (REQUEST_FAILED, CANCELLED) else None,  # why it failed, or why a policy cancelled it
    )


def _compact_json(v: Any) -> str:
    return json.dumps(v, separators=(",", ":"))


def metric_value(v: float | str) -> float:
    """A stored metric value as a float: non-finite values (a diverged loss) are stored as the strings
    ``"NaN"``, ``"Infinity"`` and ``"-Infinity"``, since Postgres's JSON type refuses the bare tokens."""
    return float(v)


def json_safe_metrics(values: dict[str, float]) -> dict[str, float | str]:
    """``values`` with each non-finite value as the string :func:`metric_value` reads back."""
    if all(math.isfinite(v) for v in values.values()):
        return values  # type: ignore[return-value]
    return {
        k: v if math.isfinite(v) else ("NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity"))
        for k, v in values.items()
    }


def _with_metrics(r: RequestRecord, metrics: dict[str, float] | None) -> RequestRecord:
    if metrics is None:
        return r
    return RequestRecord(
        r.id, r.study_id, r.plan_id, r.node, r.step, r.state, r.client_request_id, r.batch_id, dict(metrics), r.error
    )


def _table(model: Any) -> Table:
    """A model's table, typed as such (``__table__`` is declared as a ``FromClause``)."""
    table: Table = model.__table__
    return table


def _batch_record(b: m.Batch) -> BatchRecord:
    return BatchRecord(int(b.id), int(b.plan_id), b.state, b.attempt, b.spec_json, b.node_manager_id, b.slot_id)
