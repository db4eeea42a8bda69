"""The node manager's Prometheus metrics (docs/metrics.md).

This module owns the node manager's metric objects and the calls its agent makes into them: a worker's
event handed to the reporter (``event``: the report rate by kind, and the bytes of each checkpoint saved)
and an attempt's end (``ended``). Slot occupancy, and GPU utilization and memory when NVML is there,
are read from the tracked node managers when scraped (``track``). ``serve`` starts the ``/metrics``
HTTP server of a standalone node manager (``STAGETREE_NM_METRICS_PORT``); in the embedded mode the
master's ``/metrics`` serves them.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import REGISTRY, Counter, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

EVENTS = Counter(
    "stagetree_nm_worker_events", "Worker events reported (metrics, checkpoints, batch ends)", ["node_manager", "kind"]
)
CHECKPOINT_BYTES = Counter(
    "stagetree_nm_checkpoint_bytes", "Bytes of the checkpoints workers saved", ["node_manager", "kind"]
)
ATTEMPTS = Counter("stagetree_nm_attempts", "Batch attempts ended, by how", ["node_manager", "status"])

_managers: weakref.WeakSet[Any] = weakref.WeakSet()


def track(nm: Any) -> None:
    """Scrapes read ``nm``'s slots (and its GPU probe) while it lives."""
    _managers.add(nm)


def untrack(nm: Any) -> None:
    """Scrapes stop reading ``nm`` (it stopped; another one may take its id)."""
    _managers.discard(nm)


def event(nm_id: str, kind: str, payload: Mapping[str, Any]) -> None:
    EVENTS.labels(nm_id, kind).inc()
    if kind == "checkpoint_saved":
        CHECKPOINT_BYTES.labels(nm_id, str(payload.get("kind", ""))).inc(float(payload.get("bytes", 0) or 0))


def ended(nm_id: str, status: str) -> None:
    ATTEMPTS.labels(nm_id, status).inc()


class _NodeManagerCollector(Collector):
    def collect(self) -> Iterator[GaugeMetricFamily]:
        slots = GaugeMetricFamily("stagetree_nm_slots", "Worker slots", labels=["node_manager"])
        busy = GaugeMetricFamily("stagetree_nm_slots_busy", "Slots running a batch attempt", labels=["node_manager"])
        queued = GaugeMetricFamily(
            "stagetree_nm_attempts_queued", "Attempts waiting for a slot", labels=["node_manager"]
        )
        util = GaugeMetricFamily(
            "stagetree_nm_gpu_utilization", "GPU utilization, 0..1 (NVML)", labels=["node_manager", "gpu"]
        )
        mem = GaugeMetricFamily(
            "stagetree_nm_gpu_memory_used_bytes", "GPU memory in use (NVML)", labels=["node_manager", "gpu"]
        )
        for nm in sorted(_managers, key=lambda n: str(n.id)):
            slots.add_metric([nm.id], len(nm.slots))
            busy.add_metric([nm.id], len(nm.slots) - len(nm._free))
            queued.add_metric([nm.id], len(nm._queue))
            if nm.probe is None:
                continue
            try:
                samples = nm.probe.sample()
            except Exception as e:  # NVML gone away: no GPU figures this scrape
                log.debug("metrics: GPU probe failed: %s", e)
                continue
            for s in samples:
                util.add_metric([nm.id, str(s.index)], float(s.utilization) / 100)
                mem.add_metric([nm.id, str(s.index)], float(s.memory_used))
        yield from (slots, busy, queued, util, mem)


REGISTRY.register(_NodeManagerCollector())


def serve(port: int, host: str = "0.0.0.0") -> int:
    """Serve ``/metrics`` on ``host:port`` (0: a free port) in a daemon thread; returns the port."""
    server, _thread = start_http_server(port, addr=host)
    return int(server.server_port)
