"""Fixtures shared by the integration suites: a fresh Postgres database per test session (dropped at the
end) and fresh SQLite files, both migrated to head by running the packaged migrations (``migrate``; an
empty database's ``upgrade`` creates the head's schema at once, which ``test_store_contract`` compares;
a fresh Postgres database is a copy of one template the migrations built);
a master app with gRPC on a free port; the Tansu Kafka-protocol broker (``tansu_broker``, from
``tests/integration/bus``); a moto S3 server (``s3``, ``tests.s3server``) and a fresh bucket per test
(``s3_bucket``)."""

from __future__ import annotations

import atexit
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from pydantic import SecretStr
from sqlalchemy import Engine, create_engine, text

from stagetree.master.app import MasterApp
from stagetree.master.coordination import InProcessCoordination
from stagetree.master.settings import AuthSettings, LimitSettings, MasterSettings
from stagetree.master.store.schema import upgrade
from stagetree.master.store.store import Store, make_engine
from tests.integration.bus.conftest import tansu_broker  # noqa: F401  (a fixture shared by every suite)
from tests.s3server import CREDENTIALS, S3Server, s3_server

# Before any worker or fork server starts (they inherit this environment), as a deployment sets them.
for _k, _v in CREDENTIALS.items():
    os.environ.setdefault(_k, _v)

PG_ADMIN_URL = os.environ.get("STAGETREE_TEST_PG_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("STAGETREE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def migrate(url: str) -> None:
    """Bring a new database to head by running every migration (not the empty database's shortcut)."""
    engine = make_engine(url)
    try:
        upgrade(engine, "0001")
        upgrade(engine)
    finally:
        engine.dispose()


def _pg_url(name: str) -> str:
    return PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name


_template: str | None = None  # a database migrated once by ``migrate``, copied by ``fresh_pg``


def _migrated_template(admin: Engine) -> str:
    """The name of this process' template database: made and migrated at its first use, dropped at exit.
    Postgres copies it in tens of milliseconds; running the migrations into each new database took ~0.4 s."""
    global _template
    if _template is None:
        name = f"stagetree_template_{uuid.uuid4().hex[:10]}"
        with admin.connect() as c:
            c.execute(text(f'CREATE DATABASE "{name}"'))
        atexit.register(_drop, name)
        migrate(_pg_url(name))
        _template = name
    return _template


def _drop(name: str, admin: Engine | None = None) -> None:
    engine = admin if admin is not None else create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        if admin is None:
            engine.dispose()


@contextmanager
def fresh_pg(*, migrated: bool = True) -> Iterator[str]:
    """A new Postgres database (dropped after): a copy of one the migrations brought to head, or empty
    when ``migrated`` is False."""
    name = f"stagetree_test_{uuid.uuid4().hex[:10]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        template = f' TEMPLATE "{_migrated_template(admin)}"' if migrated else ""
        with admin.connect() as c:
            c.execute(text(f'CREATE DATABASE "{name}"{template}'))
        try:
            yield _pg_url(name)
        finally:
            _drop(name, admin)
    finally:
        admin.dispose()


@pytest.fixture(scope="session")
def s3() -> Iterator[S3Server]:
    with s3_server() as server:
        yield server


@pytest.fixture
def s3_bucket(s3: S3Server) -> str:
    return s3.new_bucket()


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """One migrated database for the session; tests keep apart by unique names and fixed parts."""
    with fresh_pg() as url:
        yield url


@pytest.fixture(params=["postgres", "sqlite"])
def fresh_db_url(request: pytest.FixtureRequest) -> str:
    """A migrated database of its own, for tests that look at global state (scheduling rounds)."""
    return str(request.getfixturevalue(f"fresh_{request.param}_url"))


@pytest.fixture
def fresh_postgres_url() -> Iterator[str]:
    """A migrated Postgres database of this test's own: a master started on it meets no node manager
    another test registered (a new master waits one liveness TTL for those before requeueing)."""
    with fresh_pg() as url:
        yield url


@pytest.fixture
def fresh_sqlite_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    migrate(url)
    return url


@pytest.fixture(scope="session")
def sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    path: Path = tmp_path_factory.mktemp("sqlite") / "master.db"
    url = f"sqlite:///{path}"
    migrate(url)
    return url


@pytest.fixture(params=["postgres", "sqlite"])
def db_url(request: pytest.FixtureRequest) -> str:
    name = "pg_url" if request.param == "postgres" else "sqlite_url"
    return str(request.getfixturevalue(name))


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store.open(make_engine(db_url))
    yield s
    s.dispose()


@pytest.fixture
def pg_store(pg_url: str) -> Iterator[Store]:
    s = Store.open(make_engine(pg_url))
    yield s
    s.dispose()


TOKENS = {"alice": "alice-token", "bob": "bob-token", "carol": "carol-token", "dave": "dave-token"}
TEAMS = {"lab": ["carol", "dave"]}  # carol and dave share plans; alice and bob share with nobody
ADMIN_TOKEN = "admin-token"


def master_settings(database_url: str, **overrides: object) -> MasterSettings:
    return MasterSettings(
        database_url=database_url,
        auth=AuthSettings(
            tokens={k: SecretStr(v) for k, v in TOKENS.items()}, admin_token=SecretStr(ADMIN_TOKEN), teams=TEAMS
        ),
        limits=LimitSettings(max_batch_items=50),
        **overrides,  # type: ignore[arg-type]
    )


@pytest.fixture
def app(fresh_db_url: str) -> Iterator[MasterApp]:
    a = MasterApp.build(master_settings(fresh_db_url), coordination=InProcessCoordination())
    yield a
    a.close()


@pytest.fixture
async def grpc_target(app: MasterApp) -> AsyncIterator[str]:
    server, port = await app.start_grpc(port=0)
    yield f"127.0.0.1:{port}"
    await server.stop(grace=None)
