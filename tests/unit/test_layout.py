"""The layout rules: core is pure, and every package under services/ ships in the wheel."""

from __future__ import annotations

import ast
import subprocess
import sys
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


def test_the_node_manager_and_the_embedded_mode_run_without_importing_torch() -> None:
    """Only worker processes need torch (seconds of import): the node manager's process, and the embedded
    mode's (master, aggregator, node manager, and what ``Embedded.start`` imports), never load it."""
    modules = [
        "stagetree.embedded",
        "stagetree.nodemanager.app",
        "stagetree.nodemanager.agent",
        "stagetree.nodemanager.workers",
        "stagetree.nodemanager.runtime.userpath",
        "stagetree.master.app",
        "stagetree.aggregator.aggregator",
        "stagetree.master.store.ingest",
        "stagetree.master.coordination",
        "stagetree.bus.inprocess",
    ]
    code = (
        f"import sys\nfor m in {modules!r}:\n    __import__(m)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:5])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout
