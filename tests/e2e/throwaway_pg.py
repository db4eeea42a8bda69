"""A PostgreSQL server of the test's own (``initdb`` in a temp dir, ``pg_ctl`` on a free loopback port),
for faults that stop the database: the shared server on 5432 serves every other test and is never
touched. Run as the ``postgres`` user when we are root (``initdb`` refuses root); ``fsync=off``, since
durability across a machine crash is not what these tests are about (a stopped or killed server still
recovers from its WAL)."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from stagetree.bus.tansu import free_loopback_port


def pg_bindir() -> str | None:
    """Where ``initdb`` and ``pg_ctl`` are (Debian keeps them out of PATH), or None."""
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.path.exists(f"{d}/initdb") and os.path.exists(f"{d}/pg_ctl"):
            return d
    found = shutil.which("pg_ctl")
    return os.path.dirname(found) if found else None


class ThrowawayPostgres:
    def __init__(self) -> None:
        bindir = pg_bindir()
        if bindir is None:
            raise RuntimeError("no initdb/pg_ctl found (the postgresql package; `make services` installs it)")
        self.bindir = bindir
        self.port = free_loopback_port()
        self.dir = Path(tempfile.mkdtemp(prefix="stagetree-pg-"))  # not under a root-only pytest tmp dir
        self.data = self.dir / "data"
        self.log = self.dir / "server.log"
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            shutil.chown(self.dir, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")

    @property
    def admin_url(self) -> str:
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        argv = [f"{self.bindir}/{tool}", *args]
        if self._as_postgres:
            argv = ["runuser", "-u", "postgres", "--", *argv]
        out = subprocess.run(argv, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"{tool} failed ({out.returncode}): {out.stdout[-2000:]}{out.stderr[-2000:]}")

    def start(self) -> None:
        opts = f"-p {self.port} -h 127.0.0.1 -k {self.dir} -c fsync=off -c max_connections=200"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", opts, "-w", "-t", "60", "start")

    def stop(self, mode: str = "immediate") -> float:
        """Stop the server (``immediate``: as a crash, no shutdown checkpoint); returns when it was down."""
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")
        return time.time()

    def close(self) -> None:
        with contextlib.suppress(RuntimeError):
            self.stop("fast")
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> ThrowawayPostgres:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
