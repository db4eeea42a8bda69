"""The data tier's faults as functions, shared by ``test_data_tier_faults.py`` and ``tests.bench.faults``:
a process cluster on a throwaway PostgreSQL server and a broker on durable storage (Tansu's S3 engine on
a moto S3 server), PostgreSQL stopped as a crash mid-study, the broker killed mid-study. Each fault
returns what a check needs: evals lost (not answered, failed, or not DONE in the database) and anything
applied twice (a second metric row for a point, an attempt counted as failed, a FAILED batch)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stagetree.bus.tansu import free_loopback_port
from stagetree.client.sdk import Client, Study
from stagetree.cluster import ClusterConfig, ProcessCluster
from stagetree.proto.stagetree.v1 import master_pb2 as pb
from tests.e2e.helpers import LRS, batches, new_study, plan_or_none, query, requests, wait_for
from tests.e2e.throwaway_pg import ThrowawayPostgres

BUCKET = "tansu"


@contextlib.contextmanager
def moto_s3() -> Iterator[dict[str, str]]:
    """A real S3 server (moto's, on loopback) with one bucket; yields the AWS_* environment Tansu reads."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per S3 call otherwise

    port = free_loopback_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT": f"http://127.0.0.1:{port}",
        "AWS_ALLOW_HTTP": "true",
    }
    try:
        s3 = boto3.client(
            "s3", endpoint_url=env["AWS_ENDPOINT"], aws_access_key_id="test", aws_secret_access_key="test"
        )
        s3.create_bucket(Bucket=BUCKET)
        yield env
    finally:
        server.stop()


@contextlib.contextmanager
def data_tier_cluster(root: Path, **config: Any) -> Iterator[tuple[ProcessCluster, ThrowawayPostgres]]:
    """A process cluster whose PostgreSQL and broker may be stopped: its own server, a durable broker."""
    with ThrowawayPostgres() as pg, moto_s3() as s3:
        c = ClusterConfig(
            root=root, pg_admin_url=pg.admin_url, broker_storage=f"s3://{BUCKET}/", broker_env=s3, **config
        )
        with ProcessCluster(c) as cluster:
            yield cluster, pg


@dataclass
class FaultOutcome:
    evals: int = 0
    lost: int = 0  # evals not answered, failed, or whose request is not DONE with its metrics
    duplicated: int = 0  # metric rows past one per point, attempts counted failed, FAILED batches
    waited_s: float = 0.0  # how long a client call made during the outage waited before it was answered
    # messages of the batches training at the cut that the broker took after it went down: produced in the outage
    # or after it (a node manager holds what a down broker cannot take in its own buffer, and hands it to its
    # producer, which stamps it, once the broker is back)
    produced_while_down: int = 0
    problems: list[str] = field(default_factory=list)


def _tally(cluster: ProcessCluster, study: Study, outcomes: list[Any], out: FaultOutcome) -> FaultOutcome:
    out.evals = len(outcomes)
    for o in outcomes:
        if isinstance(o, BaseException):
            out.lost += 1
            out.problems.append(f"eval: {type(o).__name__}: {o}")
    rows = requests(cluster, study)
    out.lost += sum(1 for r in rows if r.state != "DONE") + max(0, len(outcomes) - len(rows))
    plan = plan_or_none(cluster, study)
    if plan is None:
        return out
    sql = "SELECT m.node_id, m.step FROM metrics m JOIN nodes n ON n.id = m.node_id WHERE n.plan_id = :p"
    points = [(int(a), int(b)) for a, b in query(cluster, sql, p=plan)]
    out.lost += len({(int(r.node_id), int(r.step)) for r in rows if r.state == "DONE"} - set(points))
    out.duplicated += len(points) - len(set(points))
    out.duplicated += sum(int(r.failures) for r in rows)
    failed = [b.id for b in batches(cluster, plan) if b.state == "FAILED"]
    out.duplicated += len(failed)
    if out.lost or out.duplicated:
        out.problems.append(f"requests {rows}; failed batches {failed}")
    return out


def _stamped_since(cluster: ProcessCluster, batch_ids: set[int], t0: float) -> int:
    """How many messages of ``batch_ids`` on the topics carry a producer timestamp at or after ``t0``."""
    from kafka import KafkaConsumer, TopicPartition

    from stagetree.bus.messages import TOPIC_EVENTS, TOPIC_METRICS, decode_many

    consumer = KafkaConsumer(bootstrap_servers=cluster.bootstrap, group_id=None, enable_auto_commit=False)
    try:
        parts = [
            TopicPartition(t, p) for t in (TOPIC_METRICS, TOPIC_EVENTS) for p in consumer.partitions_for_topic(t) or ()
        ]
        consumer.assign(parts)
        consumer.seek_to_beginning(*parts)
        end = consumer.end_offsets(parts)
        n = 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(consumer.position(tp) < end[tp] for tp in parts):
            for records in consumer.poll(timeout_ms=500).values():
                for rec in records:
                    if t0 <= rec.timestamp / 1000:
                        n += sum(1 for m in decode_many(rec.value) if getattr(m, "batch_id", None) in batch_ids)
        return n
    finally:
        consumer.close()


async def _evals(study: Study, steps: tuple[int, ...]) -> list[asyncio.Future[dict[str, float]]]:
    return [asyncio.ensure_future(study.eval({"lr": lr}, step)) for lr in LRS[:3] for step in steps]


async def _running_batch(cluster: ProcessCluster, study: Study) -> list[int]:
    plan = await wait_for(lambda: plan_or_none(cluster, study), 30, "the study's plan")
    return list(
        await wait_for(lambda: [b.id for b in batches(cluster, plan) if b.state == "RUNNING"], 60, "a running batch")
    )


def _training(cluster: ProcessCluster, plan: int) -> list[int]:
    """The plan's running batches, once one of them trains with its node manager's producer connected: its
    ``batch_started`` reached the database through the broker, and its worker has not exited (by the node
    managers' logs: the database hears of a batch's end through the broker too, seconds late on a loaded
    machine); else none."""
    running = [b.id for b in batches(cluster, plan) if b.state == "RUNNING"]
    sql = (
        "SELECT a.batch_id FROM batch_attempts a JOIN batches b ON b.id = a.batch_id"
        " WHERE b.plan_id = :p AND b.state = 'RUNNING' AND a.started_at IS NOT NULL"
    )
    started = {int(b) for (b,) in query(cluster, sql, p=plan)}
    logs = [cluster.log(n, since_start=True) for n in cluster.node_manager_names()]

    def working(batch: int) -> bool:
        began, exited = f"worker started batch_id={batch} ", f"worker exited batch_id={batch} "
        return any(began in g and exited not in g for g in logs)

    return running if any(working(b) for b in started) else []


async def postgres_restart(
    cluster: ProcessCluster, pg: ThrowawayPostgres, client: Client, down_s: float = 5.0, timeout_s: float = 180
) -> FaultOutcome:
    """Stop PostgreSQL (as a crash) while a batch runs, ``down_s`` later start it again; a client call
    made while it is down must wait and then be answered, and every eval must be answered once."""
    study = await new_study(client, "pg-restart", sleep_s=0.1)
    evals = await _evals(study, (15, 30))
    await _running_batch(cluster, study)
    out = FaultOutcome()
    down_at = await asyncio.to_thread(pg.stop)
    call = asyncio.ensure_future(client.call("ListStudies", pb.ListStudiesRequest(), idempotent=True))
    await asyncio.sleep(down_s)
    if call.done():
        out.problems.append("a client call was answered while the database was down")
    await asyncio.to_thread(pg.start)
    await asyncio.wait_for(call, 60)
    out.waited_s = time.time() - down_at
    done = await asyncio.wait_for(asyncio.gather(*evals, return_exceptions=True), timeout_s)
    return _tally(cluster, study, list(done), out)


async def broker_restart(
    cluster: ProcessCluster, client: Client, down_s: float = 6.0, timeout_s: float = 180
) -> FaultOutcome:
    """Kill the broker while a batch runs (it goes on producing metrics and events into the void),
    ``down_s`` later start it again on the same address and storage; every eval must be answered once,
    and the batch that ran through the outage must end DONE."""
    # steps of 0.3 s: a batch trains for 4.5 or 9 s, the outage falls within one however late it is noticed
    study = await new_study(client, "broker-restart", sleep_s=0.3)
    evals = await _evals(study, (15, 30))
    plan = await wait_for(lambda: plan_or_none(cluster, study), 30, "the study's plan")
    # the broker goes down while a worker trains and reports: one that has ended, or whose node manager has not
    # reached the broker yet (its producer then waits for the broker instead of taking messages), would leave
    # nothing produced in the outage
    running = await wait_for(lambda: _training(cluster, plan), 120, "a worker training", every_s=0.05)
    down_at = await asyncio.to_thread(cluster.stop_broker)
    await asyncio.sleep(down_s)
    await asyncio.to_thread(cluster.start_broker)
    done = await asyncio.wait_for(asyncio.gather(*evals, return_exceptions=True), timeout_s)
    out = _tally(cluster, study, list(done), FaultOutcome())
    out.produced_while_down = await asyncio.to_thread(_stamped_since, cluster, set(running), down_at)
    plan = plan_or_none(cluster, study)
    states = {b.id: b.state for b in batches(cluster, plan)} if plan is not None else {}
    cut_off = [b for b in running if states.get(b) != "DONE"]
    if cut_off:
        out.lost += len(cut_off)
        out.problems.append(f"batches running through the outage did not end DONE: {cut_off} ({states})")
    return out
