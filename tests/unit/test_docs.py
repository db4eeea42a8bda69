"""The user documentation stays true: its links resolve, its marked code runs, its variables exist.

* Every relative link in README.md and docs/*.md points to an existing file (and an anchor ``#x`` of a
  link into a page to one of its headings).
* A ```python block right after a ``<!-- test -->`` line runs, in page order, in one namespace per page
  (a later block uses what an earlier one defined): as a doctest when it starts with ``>>>``, else as a
  script. Only blocks that need no running server are marked; every other ```python block must still
  compile (top-level ``await`` allowed).
* Every ``STAGETREE_MASTER_*`` / ``STAGETREE_AGG_*`` / ``STAGETREE_NM_*`` variable they name is a field
  of that service's settings class, and every other ``STAGETREE_*`` name occurs in the code or in
  ``deploy/``.
"""

from __future__ import annotations

import ast
import doctest
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
PAGE_IDS = [str(p.relative_to(ROOT)) for p in PAGES]

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
BLOCK = re.compile(r"(?P<mark><!-- test -->\n)?```python\n(?P<code>.*?)```", re.S)
ENV = re.compile(r"\bSTAGETREE_[A-Z0-9_]*[A-Z0-9]\b(?!_\*)")  # not a prefix such as STAGETREE_NM_*


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_anchor(h) for h in re.findall(r"(?m)^#+ (.*)$", text)}


def test_there_is_a_page_per_topic_and_the_readme_links_each() -> None:
    readme = (ROOT / "README.md").read_text()
    for topic in ("trainers", "policies", "deployment", "rest-ci"):
        assert (DOCS / f"{topic}.md").is_file(), f"docs/{topic}.md is missing"
    for page in DOCS.glob("*.md"):
        assert f"(docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_relative_links_point_to_existing_files(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not broken, "\n".join(broken)


def _blocks(page: Path) -> list[tuple[bool, str, int]]:
    text = page.read_text()
    return [(bool(m["mark"]), m["code"], text.count("\n", 0, m.start("code")) + 1) for m in BLOCK.finditer(text)]


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_marked_python_blocks_run_and_the_others_compile(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # what a block writes stays in this test
    name = str(page.relative_to(ROOT))
    namespace: dict[str, Any] = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    for marked, code, line in _blocks(page):
        where = f"{name}:{line}"
        if not marked:
            compile(code, where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
        elif code.lstrip().startswith(">>>"):
            test = doctest.DocTestParser().get_doctest(code, namespace, where, name, line - 1)
            runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
            out: list[str] = []
            runner.run(test, out=out.append, clear_globs=False)
            assert not runner.failures, "".join(out)
            namespace.update(test.globs)  # the doctest ran in a copy
        else:
            exec(compile(code, where, "exec", dont_inherit=True), namespace)


def _settings_fields() -> dict[str, set[str]]:
    from stagetree.aggregator.settings import AggregatorSettings
    from stagetree.master.settings import MasterSettings
    from stagetree.nodemanager.settings import NodeManagerSettings

    def names(model: type[BaseModel], prefix: str) -> set[str]:
        out: set[str] = set()
        for field, info in model.model_fields.items():
            ann = info.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                out |= names(ann, f"{prefix}{field.upper()}__")
            out.add(f"{prefix}{field.upper()}")
        return out

    return {
        "STAGETREE_MASTER_": names(MasterSettings, "STAGETREE_MASTER_"),
        "STAGETREE_AGG_": names(AggregatorSettings, "STAGETREE_AGG_"),
        "STAGETREE_NM_": names(NodeManagerSettings, "STAGETREE_NM_"),
    }


def test_every_variable_the_docs_name_exists() -> None:
    fields = _settings_fields()
    elsewhere = "\n".join(
        p.read_text(errors="replace") for d in ("services", "deploy") for p in (ROOT / d).rglob("*") if p.is_file()
    )
    unknown = []
    for page in PAGES:
        for var in sorted(set(ENV.findall(page.read_text()))):
            prefix = next((p for p in fields if var.startswith(p)), None)
            if prefix is not None:  # a setting, or its file variant (stagetree.filevars)
                ok = var in fields[prefix] or var.removesuffix("_FILE") in fields[prefix]
            else:
                ok = re.search(rf"\b{var}\b", elsewhere) is not None
            if not ok:
                unknown.append(f"{page.relative_to(ROOT)}: {var}")
    assert not unknown, "names no settings field or code knows:\n" + "\n".join(unknown)


def _leaf_fields() -> set[str]:
    """Every setting a variable sets: the fields of the settings classes, nested groups spelled out."""
    groups = {g for names in _settings_fields().values() for n in names for g in [n.rsplit("__", 1)[0]] if "__" in n}
    return {n for names in _settings_fields().values() for n in names if n not in groups}


def test_every_setting_of_every_service_is_in_a_settings_table() -> None:
    rows = "\n".join(line for line in (DOCS / "deployment.md").read_text().splitlines() if line.startswith("| `"))
    missing = sorted(n for n in _leaf_fields() if not re.search(rf"`{n}`", rows))
    assert not missing, "settings without a row in docs/deployment.md's tables:\n" + "\n".join(missing)
