"""The services' Prometheus metrics: every family is documented in docs/metrics.md, the standalone
``/metrics`` servers of the node manager and the aggregator answer, and the hooks count what they see."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from prometheus_client import REGISTRY

from stagetree.aggregator import metrics as agg_metrics
from stagetree.master import metrics as master_metrics
from stagetree.nodemanager import metrics as nm_metrics

DOC = Path(__file__).resolve().parents[3] / "docs" / "metrics.md"


class _Fake:
    """A stand-in for a tracked service object (hashable and weakly referenceable, as they are)."""

    def __init__(self, **attrs: object) -> None:
        self.__dict__.update(attrs)


KEEP: list[_Fake] = []  # tracked through weak references: keep them alive for the test module


def _families() -> set[str]:
    return {m.name for m in REGISTRY.collect() if m.name.startswith("stagetree_")}


def test_every_metric_is_documented() -> None:
    KEEP.append(_Fake(id="nm-doc", slots=[1], _free={}, _queue=[], probe=None))
    nm_metrics.track(KEEP[-1])
    names = _families()
    assert len(names) >= 20
    documented = set(re.findall(r"`(stagetree_[a-z_]+)`", DOC.read_text()))
    missing = {n for n in names if n not in documented and n.removesuffix("_total") not in documented}
    assert not missing, f"add these to docs/metrics.md: {sorted(missing)}"


def _get(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return str(r.read().decode())


def test_standalone_servers_serve_the_hooks_counts() -> None:
    nm_metrics.event("nm-unit", "checkpoint_saved", {"bytes": 1234, "kind": "central"})
    nm_metrics.event("nm-unit", "metrics", {})
    nm_metrics.ended("nm-unit", "finished")
    stats = SimpleNamespace(records=7, applied=5, points=3, completed=1, batches=2, duplicates=0, poison=0, lag=4)
    KEEP.append(_Fake(name="agg-unit", stats=stats))
    agg_metrics.track(KEEP[-1])
    port = nm_metrics.serve(0, "127.0.0.1")
    text = _get(port)
    assert 'stagetree_nm_checkpoint_bytes_total{kind="central",node_manager="nm-unit"} 1234.0' in text
    assert 'stagetree_nm_worker_events_total{kind="metrics",node_manager="nm-unit"} 1.0' in text
    assert 'stagetree_nm_attempts_total{node_manager="nm-unit",status="finished"} 1.0' in text
    text = _get(agg_metrics.serve(0, "127.0.0.1"))
    assert 'stagetree_aggregator_messages_applied_total{aggregator="agg-unit"} 5.0' in text
    assert 'stagetree_aggregator_consumer_lag{aggregator="agg-unit"} 4.0' in text


def test_assignment_latency_counts_only_this_masters_dispatches() -> None:
    before = REGISTRY.get_sample_value("stagetree_master_assignment_latency_seconds_count") or 0.0
    master_metrics.observe_round(0.01, [10_001, 10_002])
    master_metrics.taken([10_001, 99_999])
    master_metrics.taken([10_001])  # taken twice: counted once
    after = REGISTRY.get_sample_value("stagetree_master_assignment_latency_seconds_count") or 0.0
    assert after - before == 1


class _BusyProbe:
    """A probe whose GPU runs at 75 % with 3 GiB in use (what NVML would say)."""

    def sample(self) -> list[Any]:
        from stagetree.nodemanager.gpu import GpuSample

        return [GpuSample(0, 75.0, 3 << 30, 80 << 30)]


def test_gpu_utilization_and_memory_come_from_the_probe() -> None:
    KEEP.append(_Fake(id="nm-gpu", slots=[1, 2], _free={"a": 1}, _queue=[], probe=_BusyProbe()))
    nm_metrics.track(KEEP[-1])
    get = REGISTRY.get_sample_value
    assert get("stagetree_nm_gpu_utilization", {"node_manager": "nm-gpu", "gpu": "0"}) == 0.75
    assert get("stagetree_nm_gpu_memory_used_bytes", {"node_manager": "nm-gpu", "gpu": "0"}) == 3 << 30
    assert get("stagetree_nm_slots_busy", {"node_manager": "nm-gpu"}) == 1
