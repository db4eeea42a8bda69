"""The layout rules: core is pure, and every package under services/ ships in the wheel."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ROOT / "services"
FORBIDDEN = {"sqlalchemy", "grpc", "fastapi", "kafka", "redis", "pynvml", "torch", "psycopg2", "uvicorn", "alembic"}
OTHER_SERVICES = {"master", "nodemanager", "aggregator", "client", "proto", "bus"}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def test_core_imports_no_io_library_and_no_other_service() -> None:
    offenders = []
    for path in sorted((SERVICES / "core").rglob("*.py")):
        for mod in imported_modules(path):
            top = mod.split(".")[0]
            if top in FORBIDDEN:
                offenders.append(f"{path.relative_to(ROOT)} imports {mod}")
            parts = mod.split(".")
            if top == "stagetree" and len(parts) > 1 and parts[1] in OTHER_SERVICES:
                offenders.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not offenders, "\n".join(offenders)


def test_every_package_is_listed_in_pyproject() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(["stagetree", *p.parent.relative_to(SERVICES).parts]).rstrip(".")
        for p in SERVICES.rglob("__init__.py")
        if "migrations" not in p.parts
    }
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"
