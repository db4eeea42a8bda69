"""The pool's pings, against the real Postgres: a connection that sat idle is pinged and replaced when its
server side went away; one in steady use is not pinged, so its loss fails one transaction, and the pool
replaces the rest."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import create_engine, text

from stagetree.core.errors import Unavailable
from stagetree.master.store import database
from stagetree.master.store.database import Database, make_engine
from tests.integration.conftest import PG_ADMIN_URL


def _backend_pid(db: Database) -> int:
    with db.tx("pid") as s:
        return int(s.execute(text("SELECT pg_backend_pid()")).scalar_one())


def _terminate(pid: int) -> None:
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as c:
            assert c.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid}).scalar_one()
    finally:
        admin.dispose()
    time.sleep(0.1)


@contextmanager
def _one_connection_pool(pg_url: str, monkeypatch: pytest.MonkeyPatch, ping_idle_s: float) -> Iterator[Database]:
    monkeypatch.setattr(database, "PING_IDLE_S", ping_idle_s)
    db = Database(make_engine(pg_url, pool_size=1), check=False)
    try:
        yield db
    finally:
        db.dispose()


def test_an_idle_connection_whose_backend_died_is_replaced_before_use(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _one_connection_pool(pg_url, monkeypatch, 0.2) as db:
        pid = _backend_pid(db)
        _terminate(pid)
        time.sleep(0.3)  # idle past PING_IDLE_S: the checkout pings, finds it dead, connects again
        assert _backend_pid(db) != pid


def test_a_connection_in_steady_use_is_not_pinged_and_its_loss_fails_one_transaction(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _one_connection_pool(pg_url, monkeypatch, 60.0) as db:
        pid = _backend_pid(db)
        _terminate(pid)
        with pytest.raises(Unavailable):  # no ping: the transaction meets the dead connection
            _backend_pid(db)
        assert _backend_pid(db) != pid  # the pool dropped it: the next one connects again
