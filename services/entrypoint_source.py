"""Whether a trainer entry point's class exists, read from its module's source without importing it.

Used where the user's code can be seen before any batch runs: the SDK (the module is on its path) and
the embedded master (the workers' path is its own). Reading, not importing: the check must not run the
user's module (which may start a study itself, or import torch for seconds). A module whose names cannot
be read off its source (a star import, a module ``__getattr__``) is left to the workers.
"""

from __future__ import annotations

import ast
import importlib.machinery
import sys
from collections.abc import Sequence
from pathlib import Path


def module_file(module: str, path: Sequence[str] = ()) -> Path | None:
    """The source file of ``module`` (dotted) found on ``path`` then ``sys.path``, package by package,
    importing nothing; None when it is not a plain ``.py`` file found that way."""
    locations = [p for p in path if p]
    locations += [p for p in sys.path if p not in locations]
    spec = None
    for part in module.split("."):
        spec = importlib.machinery.PathFinder.find_spec(part, locations)
        if spec is None:
            return None
        locations = list(spec.submodule_search_locations or [])
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    return Path(spec.origin)


def _top_level_names(tree: ast.Module) -> set[str] | None:
    """Names a module defines at its top level (also under if/try/with); None when they cannot be known."""
    names: set[str] = set()
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            if node.name == "__getattr__":
                return None
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.If | ast.Try | ast.With | ast.For | ast.While):
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []):
                    stack.extend(child.body if isinstance(child, ast.ExceptHandler) else [child])
    return names


def missing_class(source: Path, attr: str) -> str | None:
    """Why ``source`` cannot provide ``attr`` (``Class`` or ``Outer.Inner``), or None when it does or
    when its names cannot be read off the source."""
    try:
        tree = ast.parse(source.read_bytes(), filename=str(source))
    except (OSError, SyntaxError, ValueError):
        return None  # unreadable here: the workers' import will say what is wrong
    names = _top_level_names(tree)
    first = attr.split(".")[0]
    if names is None or first in names:
        return None
    classes = sorted(n.name for n in tree.body if isinstance(n, ast.ClassDef))
    return f"{source} defines no {first!r}" + (f"; the classes it defines: {', '.join(classes)}" if classes else "")
