"""The trainer's code version: what ties a study's results to the code that produced them.

A plan is keyed by the fixed part, and the fixed part holds a ``code_version``: by default a digest of the
source of the module that defines the trainer class plus any files or directories the user lists (the
helpers the trainer imports, e.g. ``code=["my_project/"]``). Editing any of them gives a new version, so a
new plan: no metric or checkpoint of the old code is reused. An explicit version (a git commit, a
release tag) replaces the digest.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Iterable
from pathlib import Path

from stagetree.core.entrypoints import check_entry_point
from stagetree.core.errors import InvalidArgument
from stagetree.entrypoint_source import missing_class

SKIP_DIRS = frozenset({"__pycache__", ".git", ".hg", ".svn", ".mypy_cache", ".pytest_cache", ".ruff_cache"})
PREFIX = "src-"


def trainer_source(trainer: str) -> Path | None:
    """The file that defines the trainer entry point ``"package.module:Class"``, found the way an import
    from this process would (None when this process cannot see it, e.g. the code lives only on the
    cluster)."""
    module = trainer.partition(":")[0]
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return None
    return Path(spec.origin)


def check_trainer(trainer: str) -> str:
    """The entry point, checked before any call: its form (``core.entrypoints``), and, where this process
    sees the module's source, that the module defines the class (read, not imported)."""
    check_entry_point(trainer, "trainer")
    source = trainer_source(trainer)
    problem = missing_class(source, trainer.partition(":")[2]) if source is not None else None
    if problem is not None:
        raise InvalidArgument(f"trainer {trainer!r}: {problem}; name a class of that module")
    return trainer


def code_digest(trainer: str, code: Iterable[str | os.PathLike[str]] = ()) -> str | None:
    """``src-<hex>`` over the trainer's module source and every file under ``code``; None when the
    trainer's module cannot be found from here."""
    source = trainer_source(trainer)
    if source is None:
        return None
    h = hashlib.sha256()
    _add(h, "trainer", source)
    for entry in code:
        path = Path(entry)
        if path.is_file():
            _add(h, path.name, path)
        elif path.is_dir():
            for f in sorted(_files(path)):
                _add(h, f.relative_to(path).as_posix(), f)
        else:
            raise InvalidArgument(f"code: {str(entry)!r} is neither a file nor a directory")
    return PREFIX + h.hexdigest()[:16]


def _files(root: Path) -> Iterable[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")]
        for name in filenames:
            if not name.startswith(".") and not name.endswith((".pyc", ".pyo")):
                yield Path(dirpath) / name


def _add(h: hashlib._Hash, name: str, path: Path) -> None:
    h.update(name.encode() + b"\0")
    h.update(path.read_bytes())
    h.update(b"\0")
