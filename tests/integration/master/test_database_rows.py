"""``Database.rows`` on SQLite reads a select as one JSON array (``json_group_array``): the rows must be
the plain read's, floats exact to the last bit, NULLs kept, on every dialect the store runs on."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Column, Float, Integer, MetaData, String, Table, create_engine, insert, select

from stagetree.master.store.database import Database, _aggregate

META = MetaData()
T = Table("t", META, Column("id", Integer, primary_key=True), Column("x", Float), Column("s", String(20)))
SELECT = select(T.c.id, T.c.x, T.c.s).order_by(T.c.id)


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Database]:
    path: Path = tmp_path_factory.mktemp("rows") / "rows.db"
    engine = create_engine(f"sqlite:///{path}")
    META.create_all(engine)
    yield Database(engine, check=False)
    engine.dispose()


def _read(db: Database, xs: list[float | None]) -> tuple[list[tuple[object, ...]], list[tuple[object, ...]]]:
    with db.tx("rows") as s:
        s.execute(T.delete())
        if xs:
            s.execute(insert(T), [{"id": i, "x": x, "s": f"r{i}"} for i, x in enumerate(xs)])
        got = [tuple(r) for r in db.rows(s, SELECT)]
        plain = [tuple(r) for r in s.execute(SELECT).all()]
    return got, plain


INTS = select(T.c.id, T.c.s).order_by(T.c.id)


@settings(max_examples=30, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(xs=st.lists(st.floats(allow_nan=False, allow_infinity=False) | st.none(), min_size=1, max_size=20))
def test_rows_are_the_plain_reads_floats_exact(db: Database, xs: list[float | None]) -> None:
    got, plain = _read(db, xs)  # a select with a float column: read the plain way, every bit kept
    assert got == plain
    assert all(type(g[1]) is float or g[1] is None for g in got)
    assert _aggregate(SELECT) is None and _aggregate(INTS) is not None
    with db.tx("ints") as s:  # integers and text through the aggregate: the same rows
        assert [tuple(r) for r in db.rows(s, INTS)] == [tuple(r) for r in s.execute(INTS).all()]
