"""The master's Prometheus metrics (docs/metrics.md), served at ``GET /metrics`` of its REST server.

This module owns the master's metric objects and the few calls the service makes into them: a round's
duration (``observe_round``), a batch attempt dispatched and then taken by its node manager
(``dispatched`` / ``taken``: the assignment latency), reports applied (``reported``). Requests by state,
slots and checkpoint bytes are read from the store when scraped (``track`` the app), so nothing has to
keep them up to date. ``exposition()`` is the text every scrape returns: the process's registry, which
in the embedded mode also holds the node manager's and the aggregator's metrics.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import REGISTRY, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

ROUND_SECONDS = Histogram(
    "stagetree_master_round_seconds",
    "Duration of one scheduling round (read the plan, decide, dispatch)",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
DISPATCHED = Counter("stagetree_master_batches_dispatched", "Batch attempts dispatched to a slot")
SENT_AHEAD = Counter(
    "stagetree_master_batches_sent_ahead",
    "Of those, the ones sent to a busy slot about to free (SchedulingSettings.lookahead_s)",
)
QUIET_WAKEUPS = Counter(
    "stagetree_master_round_wakeups_skipped",
    "Wake-ups of the scheduling loop after a round that left nothing to do that found no work pending (no round)",
)
ASSIGNMENT_LATENCY = Histogram(
    "stagetree_master_assignment_latency_seconds",
    "From a batch attempt's dispatch to its node manager taking the assignment (this master's dispatches)",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
REPORTS = Counter("stagetree_master_reports", "Batch attempt reports applied by the master (gRPC report path)")

_MAX_WAITING = 10_000
_dispatched_at: OrderedDict[int, float] = OrderedDict()  # batch id -> when this master dispatched it
_store: weakref.ref[Any] | None = None  # the store scrapes read (the latest master built here)


def observe_round(seconds: float, dispatched: Iterable[int], ahead: int = 0) -> None:
    """One round: how long, the batches it dispatched, and how many of them went to busy slots."""
    ROUND_SECONDS.observe(seconds)
    SENT_AHEAD.inc(ahead)
    now = time.monotonic()
    for batch_id in dispatched:
        DISPATCHED.inc()
        _dispatched_at[batch_id] = now
        if len(_dispatched_at) > _MAX_WAITING:  # never taken (a lost node manager): forget the oldest
            _dispatched_at.popitem(last=False)


def observe_quiet_wakeup() -> None:
    QUIET_WAKEUPS.inc()


def taken(batch_ids: Iterable[int]) -> None:
    now = time.monotonic()
    for batch_id in batch_ids:
        t = _dispatched_at.pop(batch_id, None)
        if t is not None:
            ASSIGNMENT_LATENCY.observe(now - t)


def reported(n: int) -> None:
    REPORTS.inc(n)


def track(store: Any) -> None:
    """Scrapes read requests by state, slots and checkpoint bytes from ``store`` while it lives (one
    master per process: the latest one built)."""
    global _store
    _store = weakref.ref(store)


class _StoreCollector(Collector):
    def collect(self) -> Iterator[GaugeMetricFamily]:
        requests = GaugeMetricFamily("stagetree_master_requests", "Requests by state", labels=["state"])
        slots = GaugeMetricFamily("stagetree_master_slots", "Slots registered by live node managers")
        busy = GaugeMetricFamily("stagetree_master_slots_busy", "Slots running a batch attempt")
        ckpt = GaugeMetricFamily("stagetree_master_checkpoint_bytes", "Bytes of the checkpoints in the catalog")
        store = _store() if _store is not None else None
        if store is None:
            return
        try:
            ov = store.stats.overview()
            held = store.checkpoints.checkpoint_bytes()
        except Exception as e:  # a closed store (a master being shut down): nothing this scrape
            log.debug("metrics: store not readable: %s", e)
            return
        for state, n in sorted(ov.requests.items()):
            requests.add_metric([state], n)
        slots.add_metric([], ov.slots)
        busy.add_metric([], ov.slots_busy)
        ckpt.add_metric([], held)
        yield from (requests, slots, busy, ckpt)


REGISTRY.register(_StoreCollector())


def exposition() -> tuple[bytes, str]:
    """The scrape's body and content type."""
    from prometheus_client import CONTENT_TYPE_LATEST

    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
