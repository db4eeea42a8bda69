"""Another commit's code beside this tree's, for the benches that compare the two side by side.

``baseline_tree(ref)`` checks ``ref`` out into a temporary git worktree and yields a ``Baseline`` whose
``python_path`` is a directory holding one entry, ``stagetree``, a link to that worktree's ``services``.
A child process with that directory first on its ``PYTHONPATH`` imports the baseline's ``stagetree``
(the editable install's finder comes after the path entries) while ``tests`` stays this tree's, so the
same bench code drives both. ``child_env`` builds such an environment; ``python_path=""`` is this tree.
The worktree is removed when the block ends. ``fresh_database`` gives each run, of either tree, a new
database made by the migrations of the ``stagetree`` that process imports.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import create_engine, text

ROOT = Path(__file__).resolve().parents[2]
ADMIN_URL = os.environ.get("STAGETREE_BENCH_PG_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test")


@dataclass(frozen=True)
class Baseline:
    ref: str
    commit: str  # the full hash ``ref`` named
    tree: Path  # the worktree's root
    python_path: str  # the directory to put first on a child's PYTHONPATH


def git(*argv: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *argv], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def installed_bytecode(tree: Path = ROOT) -> None:
    """Write the bytecode of ``tree``'s ``stagetree`` as pip does when it installs the package, so that a
    bench that counts a process's start-up does not count compiling the package's sources (an
    environment with ``PYTHONDONTWRITEBYTECODE`` set, as CI machines often have, compiles them again in
    every process: 0.19-0.23 CPU-s to compile the 144 modules the embedded mode imports, on a two-core VM)."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "services")], check=True)


@contextmanager
def baseline_tree(ref: str, compile_bytecode: bool = False) -> Iterator[Baseline]:
    """``ref`` checked out beside this tree for as long as the block runs. ``compile_bytecode`` writes its
    bytecode first, as this tree has it, when a bench times imports."""
    commit = git("rev-parse", "--verify", f"{ref}^{{commit}}")
    where = Path(tempfile.mkdtemp(prefix="stagetree-baseline-"))
    tree = where / "tree"
    try:
        git("worktree", "add", "--detach", str(tree), commit)
        if compile_bytecode:
            installed_bytecode(tree)
        shim = where / "path"
        shim.mkdir()
        (shim / "stagetree").symlink_to(tree / "services")
        yield Baseline(ref, commit, tree, str(shim))
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
        shutil.rmtree(where, ignore_errors=True)


def child_env(python_path: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process' environment) with ``python_path`` first on ``PYTHONPATH``."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (python_path, env.get("PYTHONPATH", "")) if p)
    return env


@contextmanager
def fresh_database() -> Iterator[str]:
    """A new database on the bench's PostgreSQL server, migrated to head by the ``stagetree`` this process
    imports; dropped at the end."""
    from stagetree.master.store.schema import upgrade
    from stagetree.master.store.store import make_engine

    name = f"stagetree_bench_{uuid.uuid4().hex[:8]}"
    admin = create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        url = ADMIN_URL.rsplit("/", 1)[0] + "/" + name
        engine = make_engine(url)
        upgrade(engine)
        engine.dispose()
        yield url
    finally:
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
