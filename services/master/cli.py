"""Command line of the master: ``db upgrade``, ``db check`` and ``serve`` (argparse).

``main(argv)`` is meant to be mounted by the project's main CLI (``stagetree master db upgrade --url ...``);
it prints and returns an exit status instead of raising.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from stagetree import logs
from stagetree.core.errors import StagetreeError
from stagetree.envcheck import unknown_variables

URL_DEFAULT = (
    "default: the master's STAGETREE_MASTER_DATABASE_URL, or the file STAGETREE_MASTER_DATABASE_URL_FILE names"
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stagetree master", description="stagetree master")
    sub = p.add_subparsers(dest="command", required=True)
    db = sub.add_parser("db", help="database schema")
    dbsub = db.add_subparsers(dest="db_command", required=True)
    up = dbsub.add_parser("upgrade", help="apply the packaged migrations")
    up.add_argument(
        "--url", default=None, help=f"SQLAlchemy URL, e.g. postgresql+psycopg2://user@host/db ({URL_DEFAULT})"
    )
    up.add_argument("--revision", default="head")
    chk = dbsub.add_parser("check", help="exit 1 unless the schema is current")
    chk.add_argument("--url", default=None, help=URL_DEFAULT)
    sub.add_parser("serve", help="run the master (settings from STAGETREE_MASTER_* variables)")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    logs.configure(logging.INFO)
    from stagetree.master.store.schema import check_schema, head_revision, upgrade
    from stagetree.master.store.store import make_engine

    try:
        if ns.command == "db":
            engine = make_engine(ns.url or _settings_url())
            try:
                if ns.db_command == "upgrade":
                    upgrade(engine, ns.revision)
                    print(f"database at revision {head_revision() if ns.revision == 'head' else ns.revision}")
                else:
                    check_schema(engine)
                    print("database schema is current")
            finally:
                engine.dispose()
            return 0
        return _serve()
    except StagetreeError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 1


def _settings_url() -> str:
    """The master's own database URL (``STAGETREE_MASTER_DATABASE_URL`` or its ``_FILE``: a password stays
    off the command line, where ``ps`` shows it)."""
    from stagetree.master.settings import MasterSettings

    return MasterSettings().database_url


def _serve() -> int:
    from stagetree.master.app import MasterApp
    from stagetree.master.settings import MasterSettings

    bad = unknown_variables(MasterSettings, "STAGETREE_MASTER_", os.environ)
    if bad:
        print("error: " + "\n       ".join(bad), file=sys.stderr)
        return 2
    app = MasterApp.build(MasterSettings())

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await app.run(stop)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
