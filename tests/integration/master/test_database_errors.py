"""``Database.translate`` against the real databases: only a database that cannot be reached (or is out of
resources for now) is ``Unavailable``; a statement over one of its limits is ``ResourceExhausted`` and is
not retried; a busy or deadlocked database is ``Conflict``; any other refusal is not retriable."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from stagetree.core.errors import Conflict, ResourceExhausted, StagetreeError, Unavailable
from stagetree.master.store.database import Database, make_engine
from tests.integration.conftest import PG_ADMIN_URL


@pytest.fixture
def pg(pg_url: str) -> Iterator[Database]:
    db = Database(make_engine(pg_url, pool_size=1), check=False)
    yield db
    db.dispose()


def _run(db: Database, sql: str, **params: object) -> None:
    with db.tx("probe") as s:
        s.execute(text(sql), params)


def test_a_statement_too_complex_for_postgres_is_resource_exhausted_not_unavailable(pg: Database) -> None:
    deep = "[" * 200_000 + "]" * 200_000  # the jsonb parser runs out of stack: SQLSTATE 54001
    with pytest.raises(ResourceExhausted, match=r"54001") as got:
        _run(pg, "SELECT CAST(:doc AS jsonb)", doc=deep)
    assert not got.value.retriable
    _run(pg, "SELECT 1")  # the connection is still good


@pytest.mark.parametrize(
    ("sqlstate", "expected"),
    [
        ("40001", Conflict),  # serialization failure
        ("40P01", Conflict),  # deadlock detected
        ("55P03", Conflict),  # lock not available
        ("53300", Unavailable),  # too many connections
        ("57P03", Unavailable),  # cannot connect now (starting up)
        ("54000", ResourceExhausted),  # program limit exceeded
        ("55000", StagetreeError),  # object not in prerequisite state: neither busy nor down
    ],
)
def test_postgres_operational_errors_by_sqlstate(pg: Database, sqlstate: str, expected: type[StagetreeError]) -> None:
    with pytest.raises(StagetreeError) as got:
        _run(pg, f"DO $$ BEGIN RAISE EXCEPTION 'probe' USING ERRCODE = '{sqlstate}'; END $$")
    assert type(got.value) is expected, got.value
    assert got.value.retriable == (expected in (Conflict, Unavailable))


def test_a_postgres_that_does_not_answer_is_unavailable() -> None:
    url = PG_ADMIN_URL.replace(":5432/", ":1/")  # nothing listens on port 1
    db = Database(make_engine(url, pool_size=1), check=False)
    try:
        with pytest.raises(Unavailable, match="unreachable"):
            _run(db, "SELECT 1")
    finally:
        db.dispose()


def test_sqlite_limits_are_resource_exhausted_and_an_unopenable_file_is_unavailable(tmp_path: Path) -> None:
    db = Database(make_engine(f"sqlite:///{tmp_path / 'x.db'}"), check=False)
    try:
        deep = "SELECT " + "(" * 5_000 + "1" + ")" * 5_000  # over SQLite's expression depth
        with pytest.raises(ResourceExhausted):
            _run(db, deep)
        with pytest.raises(ResourceExhausted, match="too many columns"):  # over SQLite's 2,000 columns
            _run(db, "SELECT " + ", ".join(["1"] * 3_000))
        _run(db, "SELECT 1")
    finally:
        db.dispose()
    gone = Database(make_engine(f"sqlite:///{tmp_path / 'missing' / 'x.db'}"), check=False)
    try:
        with pytest.raises(Unavailable):
            _run(gone, "SELECT 1")
    finally:
        gone.dispose()


def _execute_values(db: Database, sql: str, rows: list[tuple[object, ...]]) -> None:
    """A statement on psycopg2's own cursor, as ``Database.insert_ignore`` sends one on Postgres."""
    from psycopg2.extras import execute_values

    with db.tx("probe") as s:
        cur = s.connection().connection.cursor()
        try:
            execute_values(cur, sql, rows)
        finally:
            cur.close()


@pytest.mark.parametrize(
    ("sqlstate", "expected"),
    [("40P01", Conflict), ("40001", Conflict), ("53300", Unavailable), ("55000", StagetreeError)],
)
def test_errors_from_psycopg2s_own_cursor_are_translated_as_sqlalchemys_are(
    pg: Database, sqlstate: str, expected: type[StagetreeError]
) -> None:
    """A deadlock on an ``execute_values`` is a ``Conflict`` that ``Database.retry`` runs again, not a raw
    driver error that fails the call."""
    raise_it = f"DO $$ BEGIN RAISE EXCEPTION 'probe' USING ERRCODE = '{sqlstate}'; END $$; SELECT 1 WHERE false AND %s"
    with pytest.raises(StagetreeError) as got:
        _execute_values(pg, raise_it, [(True,)])
    assert type(got.value) is expected, got.value
    assert got.value.retriable == (expected in (Conflict, Unavailable))
    _run(pg, "SELECT 1")  # the session rolled back; the connection is still good


def test_a_unique_violation_on_psycopg2s_own_cursor_is_a_conflict_and_is_retried(pg: Database) -> None:
    _run(pg, "CREATE TEMP TABLE IF NOT EXISTS probe_keys (k int PRIMARY KEY)")
    _run(pg, "DELETE FROM probe_keys")
    _run(pg, "INSERT INTO probe_keys VALUES (1)")
    with pytest.raises(Conflict, match="concurrent writer"):
        _execute_values(pg, "INSERT INTO probe_keys (k) VALUES %s", [(1,)])
    tries: list[int] = []

    def insert_once_free() -> None:
        tries.append(1)
        if len(tries) == 2:
            _run(pg, "DELETE FROM probe_keys")  # the other writer's row went away meanwhile
        _execute_values(pg, "INSERT INTO probe_keys (k) VALUES %s", [(1,)])

    pg.retry(insert_once_free)
    assert len(tries) == 2
