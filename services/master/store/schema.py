"""Schema versioning: applying the packaged Alembic migrations and refusing to run on an old schema.

Migrations ship inside the wheel (``migrations/``) and are applied by an explicit step,
``stagetree master db upgrade --url URL``; a service that opens a database whose revision is not the head
raises ``FailedPrecondition`` carrying that exact command.
"""

from __future__ import annotations

import logging
from pathlib import Path

from alembic import command
from alembic.config import Config as AlembicConfig
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

from stagetree.core.errors import FailedPrecondition

log = logging.getLogger(__name__)

MIGRATIONS = Path(__file__).parent / "migrations"


def alembic_config(url: str = "") -> AlembicConfig:
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    if url:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "the packaged migrations have no head"
    return head


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Apply the migrations up to ``revision`` on ``engine``'s database."""
    cfg = alembic_config()
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)
    log.info("database upgraded", extra={"revision": revision, "db": engine.url.render_as_string(True)})


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
