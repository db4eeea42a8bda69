"""``stagetree aggregator run`` as a process, started the way an operator starts it: it waits for its
partitions, applies what node managers publish, and on SIGTERM commits and leaves its group."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import uuid

from stagetree.bus.batcher import LocalBatcher
from stagetree.bus.kafka import KafkaBusConfig, KafkaMetricBus, ensure_topics
from stagetree.bus.messages import ALL_TOPICS, Message
from stagetree.bus.tansu import TansuBroker
from stagetree.core.lifecycle import BatchState, RequestState
from stagetree.master.store.store import Store
from tests.unit.aggregator.fakes import wait_for
from tests.unit.aggregator.helpers import make_world


def test_the_command_applies_the_bus_and_stops_gracefully_on_sigterm(
    tansu_broker: TansuBroker, pg_url: str, pg_store: Store
) -> None:
    config = KafkaBusConfig.fast_rebalance(tansu_broker.bootstrap)
    ensure_topics(config, ALL_TOPICS, partitions=4)
    world = make_world(pg_store)
    batch, reqs = world.dispatch([(world.root, 5), (world.root, 10)])
    group = f"cli-{uuid.uuid4().hex}"
    env = dict(os.environ)
    env.update(
        {
            "STAGETREE_AGG_DATABASE_URL": pg_url,
            "STAGETREE_AGG_BOOTSTRAP_SERVERS": tansu_broker.bootstrap,
            "STAGETREE_AGG_GROUP_ID": group,
            "STAGETREE_AGG_KAFKA__SESSION_TIMEOUT_MS": "2000",
            "STAGETREE_AGG_KAFKA__HEARTBEAT_INTERVAL_MS": "300",
            "STAGETREE_AGG_KAFKA__MAX_POLL_INTERVAL_MS": "5000",
            # the shared broker's topics hold other tests' records too: start at their end
            "STAGETREE_AGG_KAFKA__AUTO_OFFSET_RESET": "latest",
        }
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "stagetree.cli", "aggregator", "run", "--log-level", "WARNING"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout or []], daemon=True).start()
    try:
        while True:  # readiness: the line saying it owns partitions
            line = lines.get(timeout=30)
            if " owns " in line and " owns 0 " not in line:
                break
        msgs: list[Message] = [world.metrics(batch.id, world.root, s) for s in range(1, 11)]
        msgs.append(world.finished(batch.id, 10))
        with KafkaMetricBus(config) as bus, LocalBatcher(bus, max_messages=4, max_age_s=0.02) as batcher:
            for m in msgs:
                batcher.add(m)
        wait_for(
            lambda: world.store.batches.get_batch(batch.id).state == BatchState.DONE, timeout_s=30, what="the batch"
        )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert world.request_states([r.id for r in reqs]) == [RequestState.DONE, RequestState.DONE]
    with KafkaMetricBus(config) as bus, bus.subscribe(ALL_TOPICS, group) as successor:
        # it left the group with everything committed: a successor finds nothing of this batch
        left = []
        wait_for(lambda: bool(left.extend(successor.poll(timeout_s=0.05)) or successor.assignment()), what="a join")
        left += successor.poll(timeout_s=0.5)
    assert [r for r in left if getattr(r.message, "batch_id", None) == batch.id] == []
