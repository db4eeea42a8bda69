"""Command line of the aggregator: ``stagetree aggregator run`` (settings from ``STAGETREE_AGG_*``).

``main(argv)`` is mounted by the project's main CLI; it prints and returns an exit status instead of
raising. SIGTERM and SIGINT stop the loop gracefully: the current batch is applied, its offsets
committed, and the consumer leaves its group so the partitions move at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from types import FrameType

from stagetree import logs
from stagetree.aggregator.settings import AggregatorSettings
from stagetree.core.errors import StagetreeError
from stagetree.envcheck import unknown_variables

log = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stagetree aggregator", description="stagetree aggregator: Kafka -> database")
    sub = p.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="consume the bus and apply it to the database until SIGTERM")
    run_p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    logs.configure(ns.log_level)
    bad = unknown_variables(AggregatorSettings, "STAGETREE_AGG_", os.environ)
    if bad:
        print("error: " + "\n       ".join(bad), file=sys.stderr)
        return 2
    try:
        return run(AggregatorSettings())
    except StagetreeError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 1


def run(settings: AggregatorSettings) -> int:
    """Build the aggregator from ``settings`` and consume until SIGTERM/SIGINT; returns 0."""
    from stagetree.aggregator.aggregator import Aggregator
    from stagetree.bus.kafka import KafkaBusConfig, KafkaMetricBus, ensure_topics
    from stagetree.master.service import NoWakeups, Wakeups
    from stagetree.master.store.ingest import Ingestor
    from stagetree.master.store.store import Store, make_engine

    k = settings.kafka
    config = KafkaBusConfig(
        settings.bootstrap_servers,
        client_id=k.client_id,
        session_timeout_ms=k.session_timeout_ms,
        heartbeat_interval_ms=k.heartbeat_interval_ms,
        max_poll_interval_ms=k.max_poll_interval_ms,
        request_timeout_ms=k.request_timeout_ms,
        fetch_max_wait_ms=k.fetch_max_wait_ms,
        auto_offset_reset=k.auto_offset_reset,
    )
    if k.create_topics:
        ensure_topics(config, settings.topics, partitions=k.topic_partitions)
    store = Store.open(make_engine(settings.database_url, pool_size=settings.db_pool_size))  # refuses an old schema
    wakeups: Wakeups
    if settings.redis_url:
        from stagetree.master.coordination import RedisCoordination

        wakeups = RedisCoordination(settings.redis_url)
    else:
        log.warning("no redis_url: the master is not woken and picks results up on its round timer")
        wakeups = NoWakeups()
    name = settings.instance_id or f"{socket.gethostname()}:{os.getpid()}"
    bus = KafkaMetricBus(config)
    aggregator = Aggregator(
        bus,
        Ingestor(store, max_failures=settings.max_failures),
        wakeups,
        topics=settings.topics,
        group=settings.group_id,
        max_records=settings.batch.max_records,
        max_latency_s=settings.batch.max_latency_ms / 1000,
        poll_timeout_s=settings.batch.poll_timeout_ms / 1000,
        applied_retention_s=settings.applied_retention_s,
        name=name,
        telemetry=store.telemetry,  # the latest GPU samples, for the master's dashboard
    )

    def _stop(signum: int, _frame: FrameType | None) -> None:
        log.info("stopping on signal", extra={"signal": signal.Signals(signum).name, "aggregator": name})
        aggregator.stop(timeout_s=0)

    def _assigned(partitions: frozenset[tuple[str, int]]) -> None:
        # Readiness for supervisors and tests: this member holds partitions and consumes.
        print(f"aggregator {name} owns {len(partitions)} partitions", flush=True)

    aggregator.on_assignment = _assigned
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    if settings.metrics_port is not None:
        from stagetree.aggregator import metrics

        port = metrics.serve(settings.metrics_port, settings.metrics_host)
        print(f"aggregator {name} metrics at http://{settings.metrics_host}:{port}/metrics", flush=True)
    # Readiness line for process supervisors and tests (logs may be configured away).
    print(f"aggregator {name} consuming {','.join(settings.topics)} as group {settings.group_id}", flush=True)
    try:
        aggregator.run()
    finally:
        bus.close()
        store.dispose()
        close = getattr(wakeups, "close", None)
        if close is not None:
            close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
