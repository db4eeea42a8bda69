"""Where a worker finds the user's trainer module, answered without importing it (or torch): the node
manager's process and the embedded mode's study check use this, the workers' ``load_trainer_class`` too.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import sysconfig
from collections.abc import Mapping, Sequence

from stagetree.entrypoint_source import missing_class, module_file
from stagetree.nodemanager.slots import USER_PATH_ENV


def user_search_path(environ: Mapping[str, str] | None = None) -> list[str]:
    """Where a worker looks for the user's modules before its own path: ``STAGETREE_USER_PATH`` (the
    embedded mode's script and working directories), then ``PYTHONPATH`` (read here too, as a worker
    forked from a fork server started before it was set would not see it)."""
    env = os.environ if environ is None else environ
    out: list[str] = []
    for var in (USER_PATH_ENV, "PYTHONPATH"):
        for p in env.get(var, "").split(os.pathsep):
            if p and p not in out:
                out.append(p)
    return out


def trainer_import_problem(entry_point: str, path: Sequence[str]) -> str | None:
    """Why the workers could not import ``entry_point``'s module from ``path`` then ``sys.path``, or why
    its source defines no such class (read, not run: ``entrypoint_source``), or None (found: whether it
    imports cleanly is for the first batch to say). Imports nothing of the user's."""
    module_name, _, attr = entry_point.partition(":")
    top = module_name.split(".")[0]
    search = [*path, *(p for p in sys.path if p not in path)]
    if not top or importlib.machinery.PathFinder.find_spec(top, search) is not None:
        source = module_file(module_name, path) if attr else None
        missing = missing_class(source, attr) if source is not None else None
        return None if missing is None else f"{missing}; name a class of that module"
    if top in sys.modules or importlib.util.find_spec(top) is not None:
        return None  # installed another way (a namespace or a zip): leave it to the workers
    return (
        f"no module named {top!r} on the workers' search path {[p for p in search if p][:8]}...; put the "
        "module's directory on PYTHONPATH (or next to the script that runs stagetree in embedded mode), or "
        "install its package"
    )


# The user's modules a fork server held when it forked from a script (``workers.fork_this_process``), with
# the (mtime, size) of each one's file then: what its workers inherit imported.
_held_at_fork: dict[str, tuple[str, int, int]] = {}


def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    kinds = ("stdlib", "platstdlib", "purelib", "platlib")
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, *(paths[k] for k in kinds)}
    return tuple(os.path.join(os.path.realpath(r), "") for r in roots if r)


def _realpath(path: str, dirs: dict[str, str]) -> str:
    """``os.path.realpath(path)`` with each directory's resolved once (``dirs``): thousands of modules
    (torch's) live in a few hundred directories, and resolving each file's whole path cost 0.1 CPU-s."""
    if ".." in path or os.path.islink(path):  # "..": after a symlink it leaves the link's target
        return os.path.realpath(path)
    head, tail = os.path.split(path)
    real = dirs.get(head)
    if real is None:
        real = dirs[head] = os.path.realpath(head)
    return os.path.join(real, tail)


def users_modules() -> dict[str, tuple[str, int, int]]:
    """The imported modules that are the user's (a file outside the interpreter's and its packages'
    directories, and not this package's): name -> (file, mtime_ns, size)."""
    roots = _library_roots()
    dirs: dict[str, str] = {}
    out = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if not path or name in ("__main__", "__mp_main__") or name.split(".")[0] == "stagetree":
            continue
        real = _realpath(path, dirs)
        if real.startswith(roots):
            continue
        try:
            st = os.stat(real)
        except OSError:
            continue
        out[name] = (real, st.st_mtime_ns, st.st_size)
    return out


def note_users_modules() -> None:
    """Called in a fork server forked from a script: what its workers inherit of the user's code."""
    _held_at_fork.clear()
    _held_at_fork.update(users_modules())


def forget_edited_users_modules() -> list[str]:
    """In a worker forked from such a server: when any of the user's modules it inherited changed on disk
    since, drop them all from ``sys.modules`` (one imports another's names), so the trainer is imported as
    it is now, as a fresh interpreter would. Returns the names dropped."""
    changed = False
    for real, mtime, size in _held_at_fork.values():
        try:
            st = os.stat(real)
        except OSError:
            changed = True
            break
        if (st.st_mtime_ns, st.st_size) != (mtime, size):
            changed = True
            break
    if not changed:
        return []
    dropped = [name for name in _held_at_fork if sys.modules.pop(name, None) is not None]
    importlib.invalidate_caches()
    return dropped
