"""The aggregator's Prometheus metrics (docs/metrics.md).

This module owns the aggregator's metric families: its running totals (``AggregatorStats``: records
polled, messages applied, metric points written, requests completed, database transactions) as counters,
whose rates are the ingest rates, and the consumer lag the polling thread last saw. ``track`` an
aggregator and the values are read from it when scraped; ``serve`` starts the ``/metrics`` HTTP server of
a standalone aggregator (``STAGETREE_AGG_METRICS_PORT``). In the embedded mode the master's ``/metrics``
serves them.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# AggregatorStats field -> (metric name without _total, help)
COUNTERS: dict[str, tuple[str, str]] = {
    "records": ("stagetree_aggregator_records", "Records polled from the bus (malformed ones included)"),
    "applied": ("stagetree_aggregator_messages_applied", "Messages whose effects were written"),
    "points": ("stagetree_aggregator_metric_points", "Metric points written to the store"),
    "completed": ("stagetree_aggregator_requests_completed", "Requests completed"),
    "batches": ("stagetree_aggregator_transactions", "Database transactions committed"),
    "duplicates": ("stagetree_aggregator_duplicates", "Redelivered messages skipped"),
    "poison": ("stagetree_aggregator_poison", "Messages the database refused (logged, skipped)"),
}

_aggregators: weakref.WeakSet[Any] = weakref.WeakSet()


def track(aggregator: Any) -> None:
    """Scrapes read ``aggregator.stats`` (and its ``name``) while it lives."""
    _aggregators.add(aggregator)


class _AggregatorCollector(Collector):
    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        live = sorted(_aggregators, key=lambda a: str(a.name))
        for field, (name, text) in COUNTERS.items():
            fam = CounterMetricFamily(name, text, labels=["aggregator"])
            for a in live:
                fam.add_metric([str(a.name)], float(getattr(a.stats, field)))
            yield fam
        lag = GaugeMetricFamily(
            "stagetree_aggregator_consumer_lag",
            "Most records not yet polled on any owned partition",
            labels=["aggregator"],
        )
        for a in live:
            if a.stats.lag is not None:
                lag.add_metric([str(a.name)], float(a.stats.lag))
        yield lag


REGISTRY.register(_AggregatorCollector())


def serve(port: int, host: str = "0.0.0.0") -> int:
    """Serve ``/metrics`` on ``host:port`` (0: a free port) in a daemon thread; returns the port."""
    server, _thread = start_http_server(port, addr=host)
    return int(server.server_port)
