"""Fault-tolerance benchmark on the process cluster: ``python -m tests.bench.cluster``.

A 48-trial successive-halving study (rungs at steps 4, 12 and 36, eta 3) of the digits MLP, trained for
real by the fault-injecting trainer (a fixed sleep per step so a run lasts long enough to be hit), runs
three times on one ``ProcessCluster`` (master, two aggregators, two node managers with two CPU slots
each, Tansu, the local Postgres and Redis):

* ``clean``: no fault;
* ``nm_kill``: once a third of the first rung has reported, a node manager that runs a batch is killed
  with SIGKILL (its workers with it); it is started again once the master has marked it lost;
* ``master_kill``: at the same point the master is killed with SIGKILL and started again a second later.

Each run gets its own fixed part, so nothing is shared between runs. Per run: ``lost`` = evals the tuner
submitted that never got a result (plus requests the database left unfinished), ``duplicated`` = results
delivered twice for one (trial, step) plus requests recorded twice; ``same_as_clean`` = whether every
(config, step) got the metrics of the clean run (training resumed from checkpoints is deterministic).
Recovery is measured from the kill to the first ``progress`` message (its Kafka timestamp) of re-dispatched
work: batches the restarted master created (master kill), or batches created after the kill that train
a node a lost batch was training (node-manager kill).

Last line: ``faults_survived=<k>/<n> results_lost=<l> results_duplicated=<d> recovery_s_p50=<s>``
(targets: n/n, 0, 0, <= 10).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stagetree.bus.messages import TOPIC_METRICS, Progress, decode_many
from stagetree.client.driver import drive
from stagetree.client.sdk import Study, connect
from stagetree.client.spaces import GridSearchSpace
from stagetree.client.tuners import SHA
from stagetree.client.tuners.base import Action, Event, Result
from stagetree.cluster import ClusterConfig, ProcessCluster
from stagetree.nodemanager.examples.faults import ENTRY_POINT
from tests.bench.record import record

log = logging.getLogger("bench.cluster")

TRIALS, MIN_STEP, MAX_STEP, ETA = 48, 4, 36, 3
SLEEP_S = 0.08  # per step, on top of the (millisecond) real training step
FAULT_AFTER = TRIALS // 3  # results of the first rung before the fault
_background: set[asyncio.Future[None]] = set()


@dataclass
class Figures:
    name: str
    survived: bool = False
    lost: int = 0
    duplicated: int = 0
    recovery_s: float | None = None
    wall_s: float = 0.0
    results: dict[tuple[str, int], dict[str, float]] = field(default_factory=dict)
    error: str = ""


def search_space() -> GridSearchSpace:
    lrs = [round(0.005 * 1.12**i, 6) for i in range(TRIALS)]
    return GridSearchSpace({"lr": lrs})


def sql(cluster: ProcessCluster, query: str, **params: Any) -> list[Any]:
    return cluster.query(query, **params)


class Counting:
    def __init__(self) -> None:
        self.results = 0
        self.reached = asyncio.Event()

    def __call__(self, event: Event, _actions: list[Action]) -> None:
        if isinstance(event, Result):
            self.results += 1
            if self.results >= FAULT_AFTER:
                self.reached.set()


async def inject(cluster: ProcessCluster, fault: str, plan_of: Any) -> float:
    """Carry the fault out; returns when it was injected (``time.time()``)."""
    if fault == "master_kill":
        at = cluster.kill("master")
        await asyncio.sleep(1.0)
        await asyncio.to_thread(cluster.restart, "master")
        return at
    running = sql(
        cluster, "SELECT node_manager_id FROM batches WHERE state = 'RUNNING' AND plan_id = :p", p=await plan_of()
    )
    ids = {r[0] for r in running}
    victim = next((n for n in cluster.node_manager_names() if cluster.node_manager_id(n) in ids), "nm-1")
    at = cluster.kill(victim)
    task = asyncio.ensure_future(_restart_when_lost(cluster, victim))
    _background.add(task)
    task.add_done_callback(_background.discard)
    return at


async def _restart_when_lost(cluster: ProcessCluster, name: str) -> None:
    nm = cluster.node_manager_id(name)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        rows = await asyncio.to_thread(sql, cluster, "SELECT state FROM node_managers WHERE id = :n", n=nm)
        if rows and rows[0][0] == "LOST":
            break
        await asyncio.sleep(0.5)
    await asyncio.to_thread(cluster.restart, name)


async def one_run(cluster: ProcessCluster, fault: str) -> Figures:
    fig = Figures(fault)
    t0 = time.monotonic()
    tag = f"bench-{fault}-{uuid.uuid4().hex[:6]}"
    async with connect(cluster.target, token=cluster.token) as client:
        study = await Study.create(
            client,
            tag,
            trainer=ENTRY_POINT,
            dataset="sklearn-digits",
            values={"sleep_s": SLEEP_S, "tag": tag},
            tuned=["lr"],
        )
        tuner = SHA(search_space(), metric="accuracy", mode="max", eta=ETA, min_step=MIN_STEP, max_step=MAX_STEP)
        counting = Counting()
        task = asyncio.ensure_future(drive(study, tuner, on_event=counting))
        killed_at = None
        if fault != "clean":
            await asyncio.wait({task, asyncio.ensure_future(counting.reached.wait())}, return_when="FIRST_COMPLETED")

            async def plan_id() -> int:
                rows = await asyncio.to_thread(
                    sql, cluster, "SELECT DISTINCT plan_id FROM requests WHERE study_id = :s", s=study.id
                )
                return int(rows[0][0])

            killed_at = await inject(cluster, fault, plan_id)
        try:
            run = await asyncio.wait_for(task, 600)
        except Exception as e:  # the study did not survive
            fig.error = f"{type(e).__name__}: {e}"
            fig.wall_s = time.monotonic() - t0
            return fig
    fig.wall_s = time.monotonic() - t0
    submits = run.submits()
    results = [e for e in run.events() if isinstance(e, Result)]
    per_point = Counter((r.trial_id, r.step) for r in results)
    config_of = {s.trial_id: json.dumps({k: repr(v) for k, v in sorted(s.config.items())}) for s in submits}
    fig.results = {(config_of[r.trial_id], r.step): dict(r.metrics) for r in results}
    unfinished = sql(
        cluster,
        "SELECT count(*) FROM requests WHERE study_id = :s AND state NOT IN ('DONE', 'CANCELLED')",
        s=study.id,
    )[0][0]
    recorded_twice = sql(
        cluster,
        "SELECT count(*) FROM (SELECT client_request_id FROM requests WHERE study_id = :s "
        "GROUP BY client_request_id HAVING count(*) > 1) d",
        s=study.id,
    )[0][0]
    fig.lost = max(0, len(submits) - len(per_point)) + int(unfinished)
    fig.duplicated = sum(n - 1 for n in per_point.values()) + int(recorded_twice)
    fig.survived = fig.lost == 0 and fig.duplicated == 0
    if killed_at is not None:
        plan = int(sql(cluster, "SELECT DISTINCT plan_id FROM requests WHERE study_id = :s", s=study.id)[0][0])
        fig.recovery_s = recovery(cluster, fault, plan, killed_at)
    return fig


def recovery(cluster: ProcessCluster, fault: str, plan: int, killed_at: float) -> float | None:
    """Seconds from the kill to the first progress message of re-dispatched work (see the module doc)."""
    rows = sql(cluster, "SELECT id, state, spec_json, created_at FROM batches WHERE plan_id = :p", p=plan)

    def nodes(spec_json: str) -> set[int]:
        return {int(s["node"]) for s in json.loads(spec_json)["stages"]}

    after = [(int(b), nodes(spec)) for b, _, spec, created in rows if created > killed_at]
    if fault == "nm_kill":
        lost_nodes = set().union(*[nodes(spec) for _, state, spec, _ in rows if state == "LOST"])
        redone = {b for b, ns in after if ns & lost_nodes}
    else:
        redone = {b for b, _ in after}
    first = first_progress(cluster, redone)
    return None if first is None else max(0.0, first - killed_at)


def first_progress(cluster: ProcessCluster, batch_ids: set[int]) -> float | None:
    """The earliest Kafka timestamp (s) of a progress message of one of ``batch_ids``."""
    if not batch_ids:
        return None
    from kafka import KafkaConsumer, TopicPartition  # type: ignore[import-untyped]

    consumer = KafkaConsumer(bootstrap_servers=cluster.bootstrap, group_id=None, enable_auto_commit=False)
    try:
        parts = [TopicPartition(TOPIC_METRICS, p) for p in consumer.partitions_for_topic(TOPIC_METRICS) or ()]
        consumer.assign(parts)
        consumer.seek_to_beginning(*parts)
        end = consumer.end_offsets(parts)
        best: float | None = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(consumer.position(tp) < end[tp] for tp in parts):
            for records in consumer.poll(timeout_ms=500).values():
                for rec in records:
                    for msg in decode_many(rec.value):
                        if isinstance(msg, Progress) and msg.batch_id in batch_ids:
                            ts = rec.timestamp / 1000
                            best = ts if best is None else min(best, ts)
        return best
    finally:
        consumer.close()


async def bench(root: Path) -> list[Figures]:
    config = ClusterConfig(root=root, cpu_slots=2, peripheral_every_s=1.0)
    out: list[Figures] = []
    with ProcessCluster(config) as cluster:
        print(f"process cluster up: {cluster.target}, logs in {cluster.logs}", flush=True)
        for fault in ("clean", "nm_kill", "master_kill"):
            fig = await one_run(cluster, fault)
            same = fig.results == out[0].results if out and fig.results else None
            rec = "-" if fig.recovery_s is None else f"{fig.recovery_s:.2f}"
            print(
                f"{fault:<12} survived={fig.survived} lost={fig.lost} duplicated={fig.duplicated} "
                f"recovery_s={rec} wall_s={fig.wall_s:.1f} same_as_clean={same} {fig.error}",
                flush=True,
            )
            out.append(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=None, help="logs and checkpoints (default: a temporary folder)")
    ns = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    root = ns.root or Path(tempfile.mkdtemp(prefix="stagetree-bench-cluster-"))
    figs = asyncio.run(bench(root))
    faults = [f for f in figs if f.name != "clean"]
    survived = sum(f.survived for f in faults)
    lost = sum(f.lost for f in figs)
    duplicated = sum(f.duplicated for f in figs)
    recoveries = [f.recovery_s for f in faults if f.recovery_s is not None]
    p50 = f"{statistics.median(recoveries):.2f}" if recoveries else "nan"
    print(
        record(
            "cluster",
            f"faults_survived={survived}/{len(faults)} results_lost={lost} "
            f"results_duplicated={duplicated} recovery_s_p50={p50}",
        )
    )
    return 0 if survived == len(faults) and lost == 0 and duplicated == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
