"""``pip install 'stagetree[all]'`` installs what every service imports: each third-party module the code
under ``services/`` imports (outside a ``try: ... except ImportError``) belongs to a distribution that the
base dependencies or the ``all`` extra (through the extras it names) require, or those require in turn.
The exceptions are the user's own tools, each behind an extra of its own, and the dev-only helpers
listed below."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# module -> why [all] need not install it
NOT_IN_ALL = {
    "optuna": "stagetree[optuna], the user's sampler (services/integrations)",
    "mlflow": "stagetree[mlflow], the user's tracker (services/integrations)",
    "cryptography": "`stagetree cluster up --tls`'s throwaway CA, a dev tool (stagetree[dev])",
    "google": "protobuf's namespace: a base dependency",
}


def _requirements(extra: str, extras: dict[str, list[str]], seen: set[str] | None = None) -> set[str]:
    seen = set() if seen is None else seen
    out: set[str] = set()
    for req in extras[extra]:
        name = re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].lower()
        if name == "stagetree":
            for inner in re.search(r"\[(.*)\]", req).group(1).split(","):  # type: ignore[union-attr]
                if inner.strip() not in seen:
                    seen.add(inner.strip())
                    out |= _requirements(inner.strip(), extras, seen)
        else:
            out.add(name.replace("_", "-"))
    return out


def _with_their_dependencies(names: set[str]) -> set[str]:
    """``names`` and what they require in turn (as installed here: pip resolves the same way)."""
    out, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in out:
            continue
        out.add(name)
        try:
            reqs = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [
            re.split(r"[\s<>=!~;\[(]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs if "extra ==" not in r
        ]
    return out


def _guarded(parents: list[ast.AST]) -> bool:
    """Whether an import sits in a ``try`` that handles its absence."""
    for p in parents:
        if isinstance(p, ast.Try):
            for h in p.handlers:
                kinds = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
                if any(isinstance(k, ast.Name) and k.id in ("ImportError", "ModuleNotFoundError") for k in kinds):
                    return True
    return False


def _third_party_imports() -> dict[str, str]:
    """Top-level module -> a file importing it unguarded."""
    found: dict[str, str] = {}

    def visit(node: ast.AST, parents: list[ast.AST], where: str) -> None:
        if isinstance(node, ast.Import | ast.ImportFrom) and not _guarded(parents):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                top = name.split(".")[0]
                if node.__dict__.get("level", 0) == 0 and top and top not in sys.stdlib_module_names:
                    found.setdefault(top, where)
        for child in ast.iter_child_nodes(node):
            visit(child, [*parents, node], where)

    for path in (ROOT / "services").rglob("*.py"):
        if "proto" not in path.relative_to(ROOT).parts:
            visit(ast.parse(path.read_text()), [], str(path.relative_to(ROOT)))
    found.pop("stagetree", None)
    found.pop("__future__", None)
    return found


def test_the_all_extra_installs_every_module_the_services_import() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {"base": project["dependencies"], **project["optional-dependencies"]}
    installed = _with_their_dependencies(_requirements("base", extras) | _requirements("all", extras))
    dists = metadata.packages_distributions()
    missing = []
    for module, where in sorted(_third_party_imports().items()):
        if module in NOT_IN_ALL:
            continue
        names = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
        if not names & installed:
            missing.append(f"{module} ({where}): none of {sorted(names)} is in [all]")
    assert not missing, "\n".join(missing)
