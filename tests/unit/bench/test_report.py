"""The benchmarks page and the README's headline block are written from the results files, never by hand:
the page on disk is what the results render to, every bench module is listed, and targets are checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench import record as rec
from tests.bench import report

HELPERS = {
    "__init__",
    "baseline",
    "refs",
    "record",
    "report",
    "proctree",
    "raytune_train",
    "raytune_workloads",
    "gpu_screenshot",
}


def test_the_page_and_the_readme_block_are_what_the_results_render_to() -> None:
    assert report.PAGE.read_text() == report.render_page(), "run: python -m tests.bench.report"
    readme = report.README.read_text()
    assert report.readme_with_headline(readme) == readme, "run: python -m tests.bench.report"


def test_every_bench_module_is_listed_and_every_listed_bench_exists() -> None:
    modules = {p.stem for p in (report.ROOT / "tests" / "bench").glob("*.py")} - HELPERS
    listed = {b.name for b in report.BENCHES}
    assert modules - listed == set(), "add the bench to tests.bench.report.BENCHES"
    assert listed - modules == set()
    assert set(report.HEADLINE) <= listed


def test_a_last_line_parses_to_typed_figures() -> None:
    got = rec.parse_line("a=1 b=0.5 c=true d=nan e=NVIDIA-H100 f=2/2 g=1,024 noise")
    assert got == {"a": 1, "b": 0.5, "c": True, "d": None, "e": "NVIDIA-H100", "f": "2/2", "g": 1024}


@pytest.mark.parametrize(
    ("target", "figures", "ok"),
    [
        ("cpu_s_ratio >= 0.9 * merge_rate", {"cpu_s_ratio": 2.0, "merge_rate": 2.1}, True),
        ("cpu_s_ratio >= 0.9 * merge_rate", {"cpu_s_ratio": 1.0, "merge_rate": 2.1}, False),
        ("cpu_s_ratio >= 0.9 * merge_rate", {"cpu_s_ratio": 1.0, "merge_rate": None}, None),
        ("not stale", {"stale": False}, True),
        ("lost == 0", {}, None),
    ],
)
def test_targets_are_checked_against_the_figures(target: str, figures: dict[str, object], ok: bool | None) -> None:
    assert report.check(target, figures) is ok


def test_record_writes_the_results_file_and_the_pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    results, page, readme = tmp_path / "results", tmp_path / "benchmarks.md", tmp_path / "README.md"
    readme.write_text(f"# x\n\n{report.START}\nold\n{report.END}\n\nrest\n")
    monkeypatch.setattr(rec, "RESULTS", results)
    monkeypatch.setattr(report, "RESULTS", results)
    monkeypatch.setattr(report, "PAGE", page)
    monkeypatch.setattr(report, "README", readme)
    monkeypatch.setattr(report, "ROOT", tmp_path)
    line = "optuna_best=0.97 stagetree_best=0.98 merge_rate=1.5 cpu_s_ratio=1.4 e2e_ratio=1.1"
    assert rec.record("vs_optuna", line) == line
    doc = json.loads((results / "vs_optuna.json").read_text())
    assert doc["line"] == line and doc["figures"]["cpu_s_ratio"] == 1.4 and doc["machine"]["cores"] >= 1
    text = page.read_text()
    assert line in text and "missed: `cpu_s_ratio >= 0.9 * merge_rate`" not in text
    assert "not measured: `cpu_s_ratio_no_sharing >= 0.9`" in text
    new_readme = readme.read_text()
    assert "old" not in new_readme and line in new_readme and new_readme.endswith("rest\n")
