"""The cluster path of a node manager built from its settings: with Kafka bootstrap servers set, a
batch's events reach a real Kafka-protocol broker (Tansu) as bus messages, keyed by batch, in order."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import pytest

from stagetree.bus.kafka import KafkaBusConfig, KafkaMetricBus, ensure_topics
from stagetree.bus.messages import ALL_TOPICS, BatchMessage, Curve
from stagetree.bus.tansu import TansuBroker
from stagetree.nodemanager.app import build_node_manager
from stagetree.nodemanager.examples.digits import digits_batch
from stagetree.nodemanager.gpu import StaticGpuProbe
from stagetree.nodemanager.link import RUN, Assignment
from stagetree.nodemanager.reporting import BusReporter
from stagetree.nodemanager.settings import BusSettings
from tests.integration.nodemanager.helpers import nm_settings, until
from tests.unit.nodemanager.fakes import FakeLink

pytestmark = pytest.mark.timeout(600)


async def test_batch_events_reach_kafka_keyed_by_batch_and_in_order(tansu_broker: TansuBroker, tmp_path: Path) -> None:
    config = KafkaBusConfig.fast_rebalance(tansu_broker.bootstrap)
    await asyncio.to_thread(ensure_topics, config, ALL_TOPICS, 4)
    bus = BusSettings(kafka_bootstrap_servers=tansu_broker.bootstrap, batch_max_age_s=0.05)
    settings = nm_settings("unused:1", tmp_path, bus=bus)
    link = FakeLink()
    nm = build_node_manager(settings, link=link, probe=StaticGpuProbe())
    assert isinstance(nm.reporter, BusReporter) and isinstance(nm.reporter.bus, KafkaMetricBus)
    stop = asyncio.Event()
    task = asyncio.create_task(nm.run(stop))
    batch_id = int(time.time() * 1000) % 1_000_000_000
    spec = digits_batch([(1, 0, 6, {"lr": 0.1})], batch_id=batch_id, evals=[(1, 3), (1, 6)], saves=[(1, 6)])
    try:
        await until(nm.connected.is_set, 30, "the node manager to connect")
        link.feed.put_nowait(Assignment(batch_id, 1, RUN, json.dumps(spec.to_json())))
        # known_attempts keeps an attempt after it ends: a batch this short can start and end
        # between two polls of running().
        await until(lambda: (batch_id, 1) in nm.known_attempts(), 30, "the node manager to take the batch")
        await until(lambda: nm.running() == [], 60, "the batch to end")
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)  # closing the reporter flushes the batcher to Kafka

    def consume() -> list[tuple[str, str, BatchMessage]]:
        bus = KafkaMetricBus(config)
        got: list[tuple[str, str, BatchMessage]] = []
        with bus, bus.subscribe(list(ALL_TOPICS), f"nm-test-{uuid.uuid4().hex}") as consumer:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not any(m.TYPE == "batch_finished" for _, _, m in got):
                for r in consumer.poll(timeout_s=0.2):
                    m = r.message
                    if isinstance(m, BatchMessage) and m.node_manager == settings.node_manager_id:
                        got.append((r.topic, r.key or "", m))
        return got

    got = await asyncio.to_thread(consume)
    assert {key for _, key, _ in got} == {str(batch_id)}
    assert all(topic == type(m).TOPIC and m.batch_id == batch_id and m.attempt == 1 for topic, _, m in got)
    by_topic: dict[str, list[str]] = {}
    for topic, _, m in got:
        by_topic.setdefault(topic, []).append(m.TYPE)
    seen = [m.TYPE for _, _, m in sorted(got, key=lambda t: int(t[2].msg_id.rsplit(":", 1)[1]))]
    assert seen[0] == "batch_started" and seen[-1] == "batch_finished"
    assert [m.step for _, _, m in got if m.TYPE == "metrics"] == [3, 6]  # type: ignore[attr-defined]
    curve = [(s, v) for _, _, m in got if isinstance(m, Curve) for s, v in zip(m.steps, m.values, strict=True)]
    assert [s for s, _ in curve] == [1, 2, 3, 4, 5, 6] and all("train_loss" in v for _, v in curve)  # step metrics
    for types in by_topic.values():  # each topic keeps the batch's order
        assert types == [t for t in seen if t in types]
