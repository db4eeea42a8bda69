"""A fresh migrated SQLite database per test, copied from one migrated once per session."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from stagetree.master.store.schema import upgrade
from stagetree.master.store.store import Store, make_engine
from tests.unit.aggregator.helpers import World, make_world


@pytest.fixture(scope="session")
def migrated_sqlite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "template.db"
    engine = make_engine(f"sqlite:///{path}")
    upgrade(engine)
    engine.dispose()
    return path


@pytest.fixture
def sqlite_url(migrated_sqlite: Path, tmp_path: Path) -> str:
    path = tmp_path / "agg.db"
    shutil.copyfile(migrated_sqlite, path)
    return f"sqlite:///{path}"


@pytest.fixture
def store(sqlite_url: str) -> Iterator[Store]:
    s = Store.open(make_engine(sqlite_url))
    yield s
    s.dispose()


@pytest.fixture
def world(store: Store) -> World:
    return make_world(store)
