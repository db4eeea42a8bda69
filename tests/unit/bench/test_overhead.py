"""The figures of ``tests.bench.overhead`` from its probes' sums (no study runs here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.overhead import FIGURES, Probes, line_of, medians, thread_cpu


def test_the_platform_is_the_start_the_run_and_the_workers_beyond_train_and_evaluate(tmp_path: Path) -> None:
    p = Probes(tmp_path)
    p.marks = {"start": 3.0, "started": 3.5, "stopping": 5.5}
    p.rounds, p.round_cpu_s = 100, 0.4
    (tmp_path / "worker-11.json").write_text(json.dumps({"batches": 30, "train_s": 8.0, "eval_s": 0.5, "cpu_s": 9.1}))
    (tmp_path / "worker-12.json").write_text(json.dumps({"batches": 10, "train_s": 2.0, "eval_s": 0.1, "cpu_s": 2.3}))
    f = p.figures()
    assert f["start_cpu_s"] == pytest.approx(0.5) and f["run_cpu_s"] == pytest.approx(2.0)
    assert f["worker_overhead_s"] == pytest.approx(0.6 + 0.2)
    assert f["worker_ms_per_batch"] == pytest.approx(800 / 40)
    assert f["platform_cpu_s"] == pytest.approx(0.5 + 2.0 + 0.8)
    assert f["round_cpu_ms"] == pytest.approx(4.0) and f["batches"] == 40


def test_a_counted_function_adds_its_calls_and_a_summed_one_its_threads_cpu(tmp_path: Path) -> None:
    p = Probes(tmp_path)
    counted = p._counted(lambda n: sum(range(n)))
    summed = p._summed(lambda n: sum(range(n)), "train_s")
    assert counted(10) == 45 and counted(200_000) > 0 and p.rounds == 2
    summed(2_000_000)
    assert p._worker["train_s"] > 0.0


def test_the_last_line_has_both_trees_figures_and_their_ratio() -> None:
    one = {k: 1.0 for k in FIGURES}
    current = medians([{**one, "platform_cpu_s": 3.0}, {**one, "platform_cpu_s": 2.0}, {**one, "platform_cpu_s": 9.0}])
    assert current["platform_cpu_s"] == 3.0
    line = line_of(current, {**one, "platform_cpu_s": 4.0}, "abc123")
    words = dict(w.split("=") for w in line.split())
    assert words["platform_cpu_s"] == "3.00" and words["platform_cpu_s_baseline"] == "4.00"
    assert words["platform_vs_baseline"] == "0.750" and words["baseline"] == "abc123" and words["rounds"] == "1"
    assert "baseline" not in line_of(current, None, "")


def test_thread_cpu_names_this_thread() -> None:
    assert "MainThread" in thread_cpu()
