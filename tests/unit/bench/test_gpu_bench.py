"""The GPU bench's own logic on a machine without a GPU: it says it needs one (exit 2), and its last line
reads what the phases gave (nan / false for a phase that failed or did not run)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from tests.bench import gpu

LAST_LINE = re.compile(
    r"^device=\S+ resume_exact=(true|false) mps_packing_vs_one=\S+ preempt_s=\S+ "
    r"preempt_frees_memory=(true|false) gpu_s_ratio_vs_raytune=\S+$"
)


def test_without_a_gpu_it_says_so_and_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(gpu, "has_gpu", lambda: False)
    assert gpu.main([]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().err
    assert gpu.main(["--phases", "resume,warp"]) == 2  # a phase it does not know


def test_figures_from_the_phases() -> None:
    f = gpu.figures({})
    assert f["device"] == "unknown" and f["resume_exact"] is False and math.isnan(f["preempt_s"])
    assert LAST_LINE.match(gpu.last_line(f))
    results = {
        "probe": {"device": "NVIDIA H100 80GB HBM3"},
        "resume": {"resume_exact": True},
        "preempt": {"resume_exact": True, "preempt_s": 0.8123, "preempt_frees_memory": True},
        "packing": {"mps_vs_one": 2.5},
        "raytune": {"gpu_s_ratio_vs_raytune": 3.01},
    }
    line = gpu.last_line(gpu.figures(results))
    assert line == (
        "device=NVIDIA-H100-80GB-HBM3 resume_exact=true mps_packing_vs_one=2.50 preempt_s=0.81 "
        "preempt_frees_memory=true gpu_s_ratio_vs_raytune=3.01"
    )
    results["preempt"]["resume_exact"] = False  # both resumes must be exact
    assert gpu.figures(results)["resume_exact"] is False


def test_the_json_holds_null_for_a_figure_not_measured(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    gpu._write(out, {"probe": {"device": "NVIDIA H100 80GB HBM3", "driver": "580.159.04"}})
    doc = json.loads(out.read_text())
    assert doc["figures"]["gpu_s_ratio_vs_raytune"] is None and doc["driver"] == "580.159.04"


def test_the_committed_h100_record_has_the_last_lines_keys() -> None:
    doc = json.loads((Path(__file__).resolve().parents[2] / "bench" / "results" / "gpu-h100.json").read_text())
    assert set(doc["figures"]) == set(gpu.figures({}))
    assert isinstance(doc["figures"]["resume_exact"], bool) and doc["driver"] and doc["cuda_driver"]
