"""The one database object every role of the store shares: transactions, error translation, retries and
the few dialect-specific writes (Postgres for the cluster, SQLite for the embedded mode).

Nothing above the store sees SQLAlchemy exceptions: ``IntegrityError`` and a busy or deadlocked
database become ``Conflict`` (retriable), a lost or unreachable database ``Unavailable`` (retriable), a
statement over one of the database's limits ``ResourceExhausted`` (not retriable: the same statement
fails again). Postgres errors are told apart by SQLSTATE, SQLite's by their result code
(:func:`operational_error`).
"""

from __future__ import annotations

import io
import json
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar, cast

from sqlalchemy import JSON, Engine, Float, String, Table, create_engine, event, func, select
from sqlalchemy.exc import DBAPIError, DisconnectionError, IntegrityError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from stagetree.core.errors import Conflict, ResourceExhausted, StagetreeError, Unavailable
from stagetree.master.store.records import json_safe_metrics
from stagetree.master.store.schema import check_schema

T = TypeVar("T")
SQLITE_TURN_TIMEOUT_S = 30.0  # as long as SQLite's own busy timeout (make_engine)
_JSON = json.JSONEncoder(allow_nan=False, separators=(",", ":"))


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
    engine = create_engine(url, pool_size=pool_size, max_overflow=2 * pool_size, executemany_mode="values_plus_batch")
    _ping_when_idle(engine)
    return engine


def _aggregate(stmt: Any) -> Any:
    """``stmt``'s rows as one JSON array of arrays, or None when it selects a float (see ``Database.rows``)."""
    sub = stmt.subquery()
    if any(isinstance(col.type, Float) for col in sub.c):
        return None
    return select(func.json_group_array(func.json_array(*sub.c))).select_from(sub)


PING_IDLE_S = 1.0  # a pooled connection unused this long is pinged before it is handed out


def _ping_when_idle(engine: Engine) -> None:
    """Ping a pooled connection before use only when it sat idle ``PING_IDLE_S`` or more: one that failed
    meanwhile (the server restarted, a proxy dropped it) is replaced, not handed to a transaction. SQLAlchemy's
    ``pool_pre_ping`` pings on every checkout: a fifth of all statements a busy master sent was that
    ``SELECT 1`` (tests.bench.scale). A connection in steady use is not pinged; if its server goes away
    between two uses, that transaction fails as any in flight would (``Unavailable``), and the pool drops
    every connection opened before the failure."""

    @event.listens_for(engine, "connect")
    @event.listens_for(engine, "checkin")
    def _used(_dbapi_conn: Any, record: Any) -> None:
        record.info["used_at"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _ping(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        if time.monotonic() - record.info.get("used_at", float("-inf")) < PING_IDLE_S:
            return
        try:
            cur = dbapi_conn.cursor()
            try:
                cur.execute("SELECT 1")
            finally:
                cur.close()
        except Exception as e:  # any failure: the pool invalidates it and checks out another
            raise DisconnectionError(f"pooled connection failed its ping: {e}") from e


# SQLSTATE classes or codes (PostgreSQL's appendix A) of an OperationalError, by what a retry can do
_PG_BUSY = ("40", "55P03")  # serialization failure, deadlock; lock not available
# connection exception, insufficient resources (disk full, too many connections), operator intervention
# (shutdown, cannot connect now, statement cancelled), I/O error
_PG_DOWN = ("08", "53", "57", "58030")
_PG_LIMIT = ("54",)  # program limit exceeded: statement too complex, too many columns or arguments, row too big
# SQLite result codes (``sqlite3.Error.sqlite_errorname``, extended codes included by prefix)
_SQLITE_BUSY = ("SQLITE_BUSY", "SQLITE_LOCKED")
_SQLITE_DOWN = ("SQLITE_CANTOPEN", "SQLITE_IOERR", "SQLITE_FULL", "SQLITE_NOMEM", "SQLITE_PROTOCOL")
_SQLITE_LIMIT_MESSAGES = ("too many", "too large", "too big", "stack overflow")


def operational_error(what: str, orig: BaseException | None) -> StagetreeError:
    """The domain error for a driver's OperationalError: only a database that cannot be reached (or is
    out of resources for now) is ``Unavailable``; a statement over a database limit is ``ResourceExhausted``,
    and an error of neither kind is not retriable (the same statement would fail again)."""
    text = str(orig).strip()
    pgcode = str(getattr(orig, "pgcode", None) or "")
    name = str(getattr(orig, "sqlite_errorname", None) or "")
    if not pgcode and not name:  # no answer from a server at all: a connection failure
        if "locked" in text:
            return Conflict(f"{what}: the database is busy; retry")
        return Unavailable(f"{what}: the database is unreachable: {text}; check the database URL")
    code = f"{pgcode or name}: {text}"
    if pgcode.startswith(_PG_BUSY) or name.startswith(_SQLITE_BUSY):
        return Conflict(f"{what}: the database is busy ({code}); retry")
    if pgcode.startswith(_PG_DOWN) or name.startswith(_SQLITE_DOWN):
        return Unavailable(f"{what}: the database is unavailable ({code}); retry")
    if pgcode.startswith(_PG_LIMIT) or (name == "SQLITE_ERROR" and any(m in text for m in _SQLITE_LIMIT_MESSAGES)):
        return ResourceExhausted(
            f"{what}: the statement is over a limit of the database ({code}); send less in one call"
        )
    return StagetreeError(f"{what}: the database refused the statement ({code})")


def _driver_error(what: str, e: BaseException) -> StagetreeError | None:
    """The domain error for an error psycopg2 raised itself (not through SQLAlchemy), by the same rules
    as ``translate``'s: an integrity error is ``Conflict`` and an operational one (a deadlock, a lost
    connection) goes by its SQLSTATE; anything else (None) is a bug, raised as it is."""
    if not type(e).__module__.startswith("psycopg2"):
        return None
    import psycopg2

    if isinstance(e, psycopg2.IntegrityError):
        return Conflict(f"{what}: a concurrent writer changed the same rows; retry ({e})")
    if isinstance(e, (psycopg2.OperationalError, psycopg2.InterfaceError)):
        return operational_error(what, e)
    return None


def table(model: Any) -> Table:
    """A model's table, typed as such (``__table__`` is declared as a ``FromClause``)."""
    return cast(Table, model.__table__)


AGGREGATES_KEPT = 256  # one-row forms of selects kept (the prebuilt ones number a few dozen)


class Database:
    """Transactions over one engine, for every role of the store (``check``: refuse an old schema)."""

    def __init__(self, engine: Engine, *, check: bool = True) -> None:
        self.engine = engine
        self.is_postgres = engine.dialect.name == "postgresql"
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        # id of a select -> (that select, its one-row form) on SQLite; the select is kept and compared, so
        # a statement built per call whose id is reused later never gets another statement's form
        self._aggregates: dict[int, tuple[Any, Any]] = {}
        self._ignore_stmts: dict[tuple[str, tuple[str, ...], tuple[str, ...]], Any] = {}
        # SQLite has one writer at a time and its busy handler waits by sleeping (1, 2, 5, ... 100 ms),
        # so threads of one process that queue on it lose most of their time asleep. They take turns on
        # this lock instead (the busy timeout still bounds the wait; other processes still rely on SQLite).
        self._turn = None if self.is_postgres else threading.RLock()
        if check:
            with self.translate("check schema"):
                check_schema(engine)

    def dispose(self) -> None:
        self.engine.dispose()

    # -- transactions ---------------------------------------------------------------------------

    @contextmanager
    def tx(self, what: str) -> Iterator[Session]:
        """One transaction, committed when the block ends; ``what`` names it in errors."""
        if self._turn is None:
            with self.translate(what), self._sessions.begin() as s:
                yield s
            return
        if not self._turn.acquire(timeout=SQLITE_TURN_TIMEOUT_S):
            raise Conflict(f"{what}: the database is busy; retry")
        try:
            with self.translate(what), self._sessions.begin() as s:
                yield s
        finally:
            self._turn.release()

    @contextmanager
    def translate(self, what: str) -> Iterator[None]:
        try:
            yield
        except IntegrityError as e:
            raise Conflict(f"{what}: a concurrent writer changed the same rows; retry ({e.orig})") from e
        except OperationalError as e:
            if e.connection_invalidated:
                raise Unavailable(f"{what}: lost the database connection; retry") from e
            raise operational_error(what, e.orig) from e
        except DBAPIError as e:
            if e.connection_invalidated:
                raise Unavailable(f"{what}: lost the database connection; retry") from e
            raise
        except Exception as e:  # psycopg2's own, from the statements sent on its cursor (execute_values, COPY)
            translated = _driver_error(what, e)
            if translated is None:
                raise
            raise translated from e

    @staticmethod
    def retry(fn: Callable[[], T], attempts: int = 8) -> T:
        """Run an idempotent write again when a concurrent writer made the database give up on it."""
        for i in range(attempts):
            try:
                return fn()
            except Conflict:
                if i == attempts - 1:
                    raise
                time.sleep(random.uniform(0.001, 0.01) * (i + 1))
        raise AssertionError("unreachable")

    # -- reads and writes the dialects do differently ---------------------------------------------

    def rows(self, s: Session, stmt: Any, params: dict[str, Any] | None = None) -> Sequence[Sequence[Any]]:
        """The rows of a prebuilt select. On SQLite, a select of integers and text comes back as one row, a
        JSON array of arrays (``json_group_array``), which skips SQLAlchemy's per-row result processing:
        2,000 rows in a fraction of the time (``tests.bench.sqlite_rows``); a JSON column comes back as its
        text. A select with a float column is read the plain way: JSON would carry a REAL in 15 digits, and
        sending it exactly (17 digits by ``printf``) costs more than the aggregate saves (the same bench)."""
        c = s.connection()
        if self.is_postgres:
            return c.execute(stmt, params or {}).all()
        cached = self._aggregates.get(id(stmt))
        if cached is not None and cached[0] is stmt:
            agg = cached[1]
        else:
            agg = _aggregate(stmt)
            if len(self._aggregates) >= AGGREGATES_KEPT:  # statements built per call: keep the cache bounded
                self._aggregates.pop(next(iter(self._aggregates)))
            self._aggregates[id(stmt)] = (stmt, agg)
        if agg is None:
            return c.execute(stmt, params or {}).all()
        rows: list[list[Any]] = json.loads(c.execute(agg, params or {}).scalar_one())
        return rows

    def insert(self, tbl: Any) -> Any:
        """The dialect's INSERT (it has ``on_conflict_do_nothing``)."""
        if self.is_postgres:
            from sqlalchemy.dialects.postgresql import insert as pg_insert

            return pg_insert(tbl)
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        return sqlite_insert(tbl)

    def insert_ignore(
        self,
        s: Session,
        tbl: Table,
        rows: list[dict[str, Any]],
        conflict: list[str],
        returning: Sequence[str] = (),
    ) -> list[tuple[Any, ...]]:
        """Insert rows, skipping those whose ``conflict`` key exists, in as few round trips as possible:
        psycopg2's ``execute_values`` (pages of multi-row VALUES) on Postgres; a cached ``executemany``
        on SQLite (in-process, so round trips are free). A JSON column takes the Python value. With
        ``returning``, those columns of the rows it inserted (not of those it skipped), so that a caller
        reads back only what another writer had written first."""
        if not rows:
            return []
        json_cols = [c for c in rows[0] if isinstance(tbl.c[c].type, JSON)]
        if not self.is_postgres:
            key = (tbl.name, tuple(conflict), tuple(returning))
            stmt = self._ignore_stmts.get(key)
            if stmt is None:
                stmt = self.insert(tbl).on_conflict_do_nothing(index_elements=conflict)
                if returning:
                    stmt = stmt.returning(*(tbl.c[c] for c in returning))
                self._ignore_stmts[key] = stmt
            if json_cols:
                rows = [{**r, **{c: json_safe_metrics(r[c]) for c in json_cols}} for r in rows]
            result = s.connection().execute(stmt, rows)
            return [tuple(r) for r in result] if returning else []
        from psycopg2.extras import Json, execute_values

        cols = list(rows[0])
        if json_cols:  # psycopg2 adapts no dict by itself
            rows = [{**r, **{c: Json(r[c], dumps=_json_text) for c in json_cols}} for r in rows]
        sql = f"INSERT INTO {tbl.name} ({', '.join(cols)}) VALUES %s ON CONFLICT ({', '.join(conflict)}) DO NOTHING"
        if returning:
            sql += f" RETURNING {', '.join(returning)}"
        template = "(" + ", ".join(f"%({c})s" for c in cols) + ")"
        cur = s.connection().connection.cursor()
        try:
            got = execute_values(cur, sql, rows, template=template, page_size=1000, fetch=bool(returning))
        finally:
            cur.close()
        return [tuple(r) for r in got] if returning else []

    def bulk_insert_ignore(
        self,
        s: Session,
        tbl: Table,
        columns: tuple[str, ...],
        rows: list[tuple[Any, ...]],
        key: tuple[str, ...],
        *,
        returning: str | None = None,
        chunk: int = 1000,
    ) -> list[Any]:
        """Insert-or-ignore many ``rows`` (values of ``columns``, in lock order); with ``returning``, that
        column of the rows inserted.

        Postgres: COPY (the aggregator's ingest of thousands of points per transaction: several times
        faster than multi-row VALUES, which parses every literal; ``tests.bench.pipeline``'s
        ``ingest_points_per_s``). Straight into the table when every row is new; when some exist
        already (a redelivered message), through a session-local temporary table and ``INSERT ...
        SELECT ... ON CONFLICT DO NOTHING``. SQLite: one prepared statement run for every row."""
        if not rows:
            return []
        if not self.is_postgres:
            json_cols = [c for c in columns if isinstance(tbl.c[c].type, JSON)]
            stmt = self.insert(tbl).on_conflict_do_nothing(index_elements=list(key))
            params = [dict(zip(columns, r, strict=True)) for r in rows]
            for d in params:
                for c in json_cols:
                    d[c] = json_safe_metrics(d[c])
            if returning is None:
                for i in range(0, len(params), chunk):
                    s.execute(stmt, params[i : i + chunk])
                return []
            stmt = stmt.returning(tbl.c[returning])
            return [v for i in range(0, len(params), chunk) for v in s.execute(stmt, params[i : i + chunk]).scalars()]
        import psycopg2.errors  # the Postgres path only (the embedded mode runs without psycopg2)

        cols = ", ".join(columns)
        text = _copy_text(tbl, columns, rows)
        conn = s.connection()
        # Rows that exist already are rare; one makes the COPY fail, the savepoint undoes it, and the
        # slow path below skips them. (The savepoint is plain SQL: the COPY runs on the DBAPI cursor,
        # which the ORM's nested transactions do not see.)
        conn.exec_driver_sql("SAVEPOINT bulk_copy")
        try:
            _copy(conn, tbl.name, cols, text)
        except psycopg2.errors.UniqueViolation:
            conn.exec_driver_sql("ROLLBACK TO SAVEPOINT bulk_copy")
        else:
            conn.exec_driver_sql("RELEASE SAVEPOINT bulk_copy")
            return [] if returning is None else [r[columns.index(returning)] for r in rows]
        temp = f"ingest_{tbl.name}"
        # ON COMMIT DELETE ROWS: each transaction starts with it empty; a rollback empties it too.
        conn.exec_driver_sql(
            f"CREATE TEMP TABLE IF NOT EXISTS {temp} (LIKE {tbl.name} INCLUDING DEFAULTS) ON COMMIT DELETE ROWS"
        )
        _copy(conn, temp, cols, text)
        sql = (
            f"INSERT INTO {tbl.name} ({cols}) SELECT {cols} FROM {temp} ORDER BY {', '.join(key)} "
            f"ON CONFLICT ({', '.join(key)}) DO NOTHING"
        )
        if returning is None:
            conn.exec_driver_sql(sql)
            out: list[Any] = []
        else:
            out = [r[0] for r in conn.exec_driver_sql(f"{sql} RETURNING {returning}")]
        conn.exec_driver_sql(f"TRUNCATE {temp}")  # the next insert of this transaction starts empty
        return out


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


def _copy_text(tbl: Table, columns: tuple[str, ...], rows: list[tuple[Any, ...]]) -> str:
    """``rows`` in COPY's text format: numbers as Python prints them, strings escaped, JSON encoded."""
    kinds = []
    for c in columns:
        t = tbl.c[c].type
        kinds.append("j" if isinstance(t, JSON) else "s" if isinstance(t, String) else "n")
    conv = [_json_copy if k == "j" else _copy_escape if k == "s" else repr for k in kinds]
    return "".join("\t".join([f(v) for f, v in zip(conv, r, strict=True)]) + "\n" for r in rows)


def _json_copy(values: dict[str, float]) -> str:
    return _copy_escape(_json_text(values))


def _copy(conn: Any, tbl: str, cols: str, text: str) -> None:
    cursor = conn.connection.cursor()
    try:
        cursor.copy_expert(f"COPY {tbl} ({cols}) FROM STDIN", io.StringIO(text))
    finally:
        cursor.close()


BULK_ROWS = 64  # from this many rows a point write goes through Database.bulk_insert_ignore (COPY on Postgres)


def insert_first_points(
    db: Database,
    s: Session,
    tbl: Table,
    points: Sequence[tuple[int, int, dict[str, float]]],
    now: float,
    chunk: int,
) -> dict[tuple[int, int], dict[str, float]]:
    """Write ``(node, step, values)`` into a point table (``node_id, step, values, recorded_at``; metrics
    and curve points) inside the caller's transaction; the first value at a point wins, here and against
    the rows there. Returns the distinct points offered, with the values written for them."""
    first: dict[tuple[int, int], dict[str, float]] = {}
    for n, st, v in points:
        first.setdefault((n, st), v)
    keys = sorted(first)  # one lock order for concurrent writers
    if len(keys) >= BULK_ROWS:
        rows = [(n, st, first[(n, st)], now) for n, st in keys]
        db.bulk_insert_ignore(
            s, tbl, ("node_id", "step", "values", "recorded_at"), rows, ("node_id", "step"), chunk=chunk
        )
    else:
        dicts = [{"node_id": n, "step": st, "values": first[(n, st)], "recorded_at": now} for n, st in keys]
        db.insert_ignore(s, tbl, dicts, ["node_id", "step"])
    return first
