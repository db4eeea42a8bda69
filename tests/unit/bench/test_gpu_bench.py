"""The GPU bench's own logic on a machine without a GPU: it says it needs one (exit 2), and its last line
reads what the phases gave (nan / false for a phase that failed or did not run)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from tests.bench import gpu

LAST_LINE = re.compile(
    r"^device=\S+ resume_exact=(true|false) mps_packing_vs_one=\S+ preempt_s=\S+ "
    r"preempt_frees_memory=(true|false) gpu_s_ratio_vs_raytune=\S+ e2e_ratio_vs_raytune=\S+ "
    r"raytune_merge_rate=\S+ nccl_batch_ok=(true|false)$"
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
    results: dict[str, dict[str, Any]] = {
        "probe": {"device": "NVIDIA H100 80GB HBM3"},
        "resume": {"resume_exact": True},
        "preempt": {"resume_exact": True, "preempt_s": 0.8123, "preempt_frees_memory": True},
        "packing": {"mps_vs_one": 2.5},
        "raytune": {"gpu_s_ratio_vs_raytune": 3.01, "e2e_ratio_vs_raytune": 3.6, "merge_rate": 3.2},
        "nccl": {"nccl_batch_ok": True},
    }
    line = gpu.last_line(gpu.figures(results))
    assert line == (
        "device=NVIDIA-H100-80GB-HBM3 resume_exact=true mps_packing_vs_one=2.50 preempt_s=0.81 "
        "preempt_frees_memory=true gpu_s_ratio_vs_raytune=3.01 e2e_ratio_vs_raytune=3.60 raytune_merge_rate=3.20 "
        "nccl_batch_ok=true"
    )
    results["preempt"]["resume_exact"] = False  # both resumes must be exact
    assert gpu.figures(results)["resume_exact"] is False


def test_the_json_holds_null_for_a_figure_not_measured(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    gpu._write(out, {"probe": {"device": "NVIDIA H100 80GB HBM3", "driver": "580.159.04"}})
    doc = json.loads(out.read_text())
    assert doc["figures"]["gpu_s_ratio_vs_raytune"] is None and doc["driver"] == "580.159.04"


@pytest.mark.parametrize("device", ["h100", "h200"])
def test_each_committed_record_has_the_last_lines_keys(device: str) -> None:
    doc = json.loads((Path(__file__).resolve().parents[2] / "bench" / "results" / f"gpu-{device}.json").read_text())
    assert set(doc["figures"]) == set(gpu.figures({}))
    assert isinstance(doc["figures"]["resume_exact"], bool) and doc["driver"] and doc["cuda_driver"]


def test_a_phase_past_its_limit_is_stopped_and_the_next_one_runs() -> None:
    import time

    t0 = time.perf_counter()
    with pytest.raises(gpu.PhaseTimeout, match="slow ran past its 1 s"), gpu.phase_limit(1.0, "slow"):
        time.sleep(30)
    assert time.perf_counter() - t0 < 10
    with gpu.phase_limit(5.0, "quick"):  # the limit ends with its phase: no alarm after it
        pass
    time.sleep(0.1)


def test_slot_occupancy_counts_a_batch_sent_ahead_once() -> None:
    from tests.bench.vs_raytune import union_seconds

    # a batch sent ahead at 8 s while the one before trains until 10 s, then trains until 15 s; a gap; one more
    assert union_seconds([(0.0, 10.0), (8.0, 15.0), (20.0, 21.0)]) == pytest.approx(16.0)
    assert union_seconds([(0.0, 10.0), (2.0, 3.0)]) == pytest.approx(10.0)
    assert union_seconds([]) == 0.0
