"""Count the tables that map errors to gRPC status codes (or back) in a source tree: a dict literal or a
set literal with ``grpc.StatusCode.X`` among its keys or values, one per module-level or function-level
assignment. The project keeps exactly one (``stagetree.status``)."""

from __future__ import annotations

import ast
from pathlib import Path


def _mentions_status_code(node: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "StatusCode"
        for n in ast.walk(node)
    )


def count_status_tables(root: Path) -> int:
    tables = 0
    for path in sorted(root.rglob("*.py")):
        if "proto" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            value = getattr(node, "value", None) if isinstance(node, ast.Assign | ast.AnnAssign) else None
            big = isinstance(value, ast.Dict | ast.Set) and len(getattr(value, "keys", getattr(value, "elts", []))) >= 3
            if big and value is not None and _mentions_status_code(value):
                tables += 1
    return tables
