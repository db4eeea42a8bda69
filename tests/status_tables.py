"""How many places under a source tree define a table of gRPC status codes (``count_status_tables``).

The project keeps one (``stagetree.status``); a second is the drift the "one ledger" issue removed.
A table is a dict literal with ``StatusCode.X`` in a key or value (``{StatusCode.X: cls}``,
``{cls: Status(StatusCode.X, 404)}``), or a set, tuple or list literal listing two or more codes (a
set of retried codes classifies errors as surely as a dict does). A place is one module, so a module
that derives its reverse direction next to its table counts once. Shared with the benchmarks.
"""

from __future__ import annotations

import ast
from pathlib import Path


def _is_status_code(node: ast.AST) -> bool:
    """``grpc.StatusCode.X`` or ``StatusCode.X`` (``from grpc import StatusCode``)."""
    if not isinstance(node, ast.Attribute):
        return False
    owner = node.value
    return (isinstance(owner, ast.Name) and owner.id == "StatusCode") or (
        isinstance(owner, ast.Attribute) and owner.attr == "StatusCode"
    )


def _mentions_status_code(node: ast.AST | None) -> bool:
    return node is not None and any(_is_status_code(n) for n in ast.walk(node))


def _is_table(node: ast.AST) -> bool:
    if isinstance(node, ast.Dict):
        return any(_mentions_status_code(n) for n in [*node.keys, *node.values])  # a key is None for **
    if isinstance(node, ast.Set | ast.Tuple | ast.List):
        return sum(_is_status_code(elt) for elt in node.elts) >= 2
    return False


def status_tables(root: Path) -> list[Path]:
    """The modules under ``root`` that define at least one status-code table, sorted."""
    return sorted(
        path
        for path in root.rglob("*.py")
        if any(_is_table(node) for node in ast.walk(ast.parse(path.read_text(), filename=str(path))))
    )


def count_status_tables(root: Path) -> int:
    """How many modules under ``root`` define a status-code table (1 is the goal: ``services/status.py``)."""
    return len(status_tables(root))
