"""Schema versioning: applying the packaged Alembic migrations and refusing to run on an old schema.

Migrations ship inside the wheel (``migrations/``) and are applied by an explicit step,
``stagetree master db upgrade --url URL``; a service that opens a database whose revision is not the head
raises ``FailedPrecondition`` carrying that exact command.

Reading the revision and comparing it with the head takes plain SQL and the names of the migration files
(``NNNN_<what>.py``, revision ``NNNN``): Alembic (with Mako and Pygments, some 0.3 s of imports) is loaded
only to migrate. An empty database at ``upgrade`` to the head gets the models' tables at once
(``create_all``) and the head's revision, the schema the migrations build (tested on SQLite and Postgres).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Column, Engine, MetaData, PrimaryKeyConstraint, String, Table, insert, inspect, select

from stagetree.core.errors import FailedPrecondition

if TYPE_CHECKING:
    from alembic.config import Config as AlembicConfig

log = logging.getLogger(__name__)

MIGRATIONS = Path(__file__).parent / "migrations"
# Alembic's table of the applied revision, as Alembic creates it
VERSION = Table(
    "alembic_version",
    MetaData(),
    Column("version_num", String(32), nullable=False),
    PrimaryKeyConstraint("version_num", name="alembic_version_pkc"),
)
_REVISION_FILE = re.compile(r"(\d{4})_\w+\.py")


def alembic_config(url: str = "") -> AlembicConfig:
    from alembic.config import Config as AlembicConfig

    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    if url:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def head_revision() -> str:
    """The newest packaged migration's revision, from the file names (each revision follows the one
    numbered before it)."""
    numbers = [m.group(1) for p in (MIGRATIONS / "versions").iterdir() if (m := _REVISION_FILE.fullmatch(p.name))]
    assert numbers, "the packaged migrations have no head"
    return max(numbers)


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        if not inspect(conn).has_table(VERSION.name):
            return None
        rows = conn.execute(select(VERSION.c.version_num)).scalars().all()
    if len(rows) > 1:
        raise FailedPrecondition(f"the database is at several revisions at once ({', '.join(sorted(rows))})")
    return rows[0] if rows else None


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Apply the migrations up to ``revision`` on ``engine``'s database."""
    head = head_revision()
    target = head if revision == "head" else revision
    current = current_revision(engine)
    if current == target:
        return
    if current is None and target == head and _create_empty(engine, head):
        log.info("database created", extra={"revision": head, "db": engine.url.render_as_string(True)})
        return
    from alembic import command

    cfg = alembic_config()
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)
    log.info("database upgraded", extra={"revision": revision, "db": engine.url.render_as_string(True)})


def _create_empty(engine: Engine, head: str) -> bool:
    """The head's schema in one transaction where the database has no table yet; False otherwise."""
    from stagetree.master.store.models import Base

    with engine.begin() as conn:
        if inspect(conn).get_table_names():
            return False
        Base.metadata.create_all(conn)
        VERSION.create(conn)
        conn.execute(insert(VERSION).values(version_num=head))
    return True


def upgrade_command(engine: Engine) -> str:
    return f"stagetree master db upgrade --url {engine.url.render_as_string(hide_password=True)}"


def check_schema(engine: Engine) -> None:
    """Raise ``FailedPrecondition`` (with the command that fixes it) unless the schema is at head."""
    current = current_revision(engine)
    head = head_revision()
    if current != head:
        raise FailedPrecondition(
            f"the database schema is at revision {current or 'none (empty database)'}, this master needs {head}; "
            f"upgrade it first: {upgrade_command(engine)}"
        )
