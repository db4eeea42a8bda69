"""Scale benchmark: ``python -m tests.bench.scale`` (Postgres, Kafka protocol, simulated GPU servers).

Three phases, each against a fresh Postgres database:

1. **Growth** (a master in this process, gRPC on loopback): ``--nms`` x ``--gpus`` simulated GPU slots are
   registered, then pending requests are submitted through gRPC (``SubmitRequests``, 100 items a call, 50
   studies) up to 1k, 10k and 100k; at each size the master's round (``decide``: snapshot, stage forest,
   critical-path order, placement on every free slot) is timed ``--rounds`` times.
   ``round_growth_exp`` is the least-squares slope of log(round p50) over log(pending).
   ``submit_vs_raw_insert``: submissions per second through gRPC (validated, planned, written) over the rate
   of a plain psycopg2 ``executemany`` of the same request rows, 100 per transaction, into a scratch copy of
   the ``requests`` table of the same database, measured in the same run (the reference moves with the
   machine as the figure does).
2. **Live** (``ProcessCluster``: master, 2 aggregators, a Tansu broker, all as processes): simulated node
   managers (``stagetree nodemanager simulate``: the real node-manager code, registration, heartbeats,
   assignment streams, events on Kafka; workers that only take time) and ``--studies`` ASHA studies driven
   through the SDK. Batches run in **real time**: ``--step-s`` seconds a step, ``--min-step`` steps to the
   first rung (so a first-rung batch takes min_step x step_s seconds; the defaults give 10 s). ``occupancy``:
   busy slot-seconds over ``min(slots, busy + waiting)`` slot-seconds, at each second while the tuners still
   had trials to start (waiting = requests submitted whose batch no worker had started yet: queued in the
   master, or sent ahead to a busy slot, see ``SchedulingSettings.lookahead_s``). ``assign_ms_p99``: a slot's
   worker ending to the next worker starting on it, counted when a request waited for every idle slot at that
   moment (``WorkForSlots``: requests waiting as above >= slots whose worker ended and whose next worker had
   not started, from the ledger's and the workers' exact times; each run of a slot names its batch and
   attempt). A slot freed with nothing left to run waits for a tuner to submit, not for the scheduler: batches
   started together end together, and a wave of 1,600 ends with the ~800 requests the tuners keep queued. The
   looser figure (any request NOT_SCHED at the last 1-second sample) is printed beside it as
   ``assign_ms_p99_any_pending``. Both are split by stage from the ledger's attempt times (``latency_stages``:
   report, round, stream, start), and the first split again by when the slot was freed: in the start wave (the
   first ``START_WAVE_BATCHES`` first-rung batch lengths, when the ends of batches that all started together
   arrive together) or after it (``wave_split``). The master's rounds are summed up from its Prometheus
   histogram (count, mean, share over 0.1 to 2.5 s). ``--dump`` writes the raw times. ``master_rss_mb``: the
   master process's peak RSS in the live run. The CPU seconds of every process of the run (Postgres included)
   are printed beside them.

3. **Memory** (a master in this process): one plan grows to each of ``--plan-sizes`` nodes (a root, 1,000
   children, the rest grandchildren, each node's config its own), with ``--points-per-node`` metric points
   each written straight to the database; at each size the master loads the plan into its cache and its
   RSS over the empty master is read. ``memory_growth_exp``: the slope of log(RSS) over log(nodes).
   Printed on the line before the last.

Last line: ``slots=<n> studies=<n> requests=<n> occupancy=<r> assign_ms_p99=<t> round_ms_p99_100k=<t>
round_growth_exp=<e> master_rss_mb=<m> submit_vs_raw_insert=<r>`` (targets: slots >= 1600, requests >=
100000, occupancy >= 0.95, assign_ms_p99 <= 500, round_growth_exp <= 1.1, master_rss_mb <= 2048,
submit_vs_raw_insert >= 0.3). ``--quick`` runs a small version of every phase (a smoke test). Only a
whole run (every phase, not ``--quick``) is kept in ``tests/bench/results/scale.json``; ``--phase`` and
``--quick`` print the same line, with the other phases' figures ``nan``.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import dataclasses
import gc
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from pydantic import SecretStr
from sqlalchemy import create_engine, text

import stagetree
from stagetree.client.spaces import LogUniform, RandomSearchSpace, Uniform
from stagetree.client.tuners import ASHA
from stagetree.client.tuners.base import Submit
from stagetree.cluster import ClusterConfig, ProcessCluster
from stagetree.core.config import Config
from stagetree.core.sequences import MultiStep
from stagetree.master.app import MasterApp
from stagetree.master.auth import Principal
from stagetree.master.coordination import InProcessCoordination
from stagetree.master.plans import config_text
from stagetree.master.settings import AuthSettings, LimitSettings, MasterSettings
from stagetree.master.store import models as m
from stagetree.master.store.database import table
from stagetree.master.store.records import NewTreeNode
from stagetree.master.store.store import Store
from stagetree.proto.stagetree.v1 import master_pb2 as pb
from stagetree.proto.stagetree.v1 import master_pb2_grpc as pb_grpc
from tests.bench import refs
from tests.bench.master import trial
from tests.bench.pipeline import fresh_database
from tests.bench.record import record

TOKEN = "bench-token"
MD = (("authorization", f"Bearer {TOKEN}"),)
CALL = 100  # items per SubmitRequests, and rows per transaction of the reference


def cpu_s(pid: int | None = None) -> float:
    """User + system CPU seconds of a process (0 when it is gone)."""
    try:
        with open(f"/proc/{pid or 'self'}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def postgres_cpu_s() -> float:
    """CPU seconds of the Postgres server on this machine: every live process named postgres, plus what
    the ended backends used (their parent, the postmaster, is charged it when it reaps them)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/comm") as f:
                if f.read().strip() != "postgres":
                    continue
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
        if int(fields[1]) == 1 or _comm(int(fields[1])) != "postgres":  # the postmaster
            total += (int(fields[13]) + int(fields[14])) / tick
    return total


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def rss_mb(pid: int | None = None) -> float:
    with open(f"/proc/{pid or 'self'}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


# -- phase 1: growth -------------------------------------------------------------------------------------


async def growth(url: str, nms: int, gpus: int, sizes: list[int], rounds: int, studies: int) -> dict[str, object]:
    settings = MasterSettings(
        database_url=url,
        auth=AuthSettings(tokens={"bench": SecretStr(TOKEN)}, admin_token=SecretStr("bench-admin")),
        limits=LimitSettings(max_batch_items=CALL),
    )
    app = MasterApp.build(settings, coordination=InProcessCoordination())
    server, port = await app.start_grpc(port=0)
    out: dict[str, object] = {}
    try:
        admin = Principal("admin", admin=True)
        for n in range(nms):
            nm = f"sim-{n}"
            app.service.register_node_manager(admin, nm, nm, [(f"gpu{g}", "A100") for g in range(gpus)])
            app.coordination.heartbeat(nm, 3600)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.MasterServiceStub(ch)
            ids = []
            for s in range(studies):
                fixed = {"trainer": f"scale{s}:Trainer", "dataset": "d", "model": "m", "seed": 0, "values": {}}
                st = await stub.CreateStudy(
                    pb.CreateStudyRequest(name=f"s{s}", fixed_json=json.dumps(fixed)), metadata=MD
                )
                ids.append(st.id)
            sem = asyncio.Semaphore(8)
            submitted, submit_s = 0, 0.0
            round_ms: dict[int, list[float]] = {}

            async def one(req: pb.SubmitRequestsRequest) -> None:
                async with sem:
                    await stub.SubmitRequests(req, metadata=MD)

            for size in sizes:
                per_study = size // studies
                calls = [
                    pb.SubmitRequestsRequest(
                        study_id=sid,
                        items=[
                            pb.SubmitItem(
                                client_request_id=f"t{i}", config_json=json.dumps({"tuned": trial(i)}), step=100
                            )
                            for i in range(b, min(b + CALL, per_study))
                        ],
                    )
                    for sid in ids
                    for b in range(submitted // studies, per_study, CALL)
                ]
                t0 = time.perf_counter()
                await asyncio.gather(*(one(c) for c in calls))
                submit_s += time.perf_counter() - t0
                submitted = per_study * studies
                times = []
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    d = app.scheduler.decide()
                    times.append((time.perf_counter() - t0) * 1000)
                    assert d.pending == submitted, (d.pending, submitted)
                round_ms[submitted] = times
                p50 = statistics.median(times)
                p99 = max(times) if len(times) < 20 else statistics.quantiles(times, n=100)[98]
                print(
                    f"growth: pending={submitted} round_ms p50={p50:.0f} p99={p99:.0f}"
                    f" runs={[round(t) for t in times]}",
                    flush=True,
                )
            out["submit_per_s"] = submitted / submit_s
        out["round_ms"] = round_ms
        out["rss_mb"] = rss_mb()
        engine = create_engine(url)
        try:
            with engine.connect() as c:  # the same rows, for the reference
                q = f"SELECT {', '.join(refs.REQUEST_COLUMNS)} FROM requests ORDER BY id LIMIT :n"
                rows = [tuple(r) for r in c.execute(text(q), {"n": min(submitted, 20_000)})]
        finally:
            engine.dispose()
        out["raw_insert_per_s"] = refs.raw_insert_rate(url, "requests", refs.REQUEST_COLUMNS, rows, CALL)
    finally:
        await server.stop(grace=None)
        app.close()
    return out


def growth_exponent(round_ms: dict[int, list[float]]) -> float:
    xs = [math.log(n) for n in sorted(round_ms)]
    ys = [math.log(statistics.median(round_ms[n])) for n in sorted(round_ms)]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


# -- phase 3: memory ------------------------------------------------------------------------------------

FAN = 1000  # children of the root; every other node is a grandchild


def _grow(store: Store, plan_id: int, parents: list[int], first: int, count: int) -> list[int]:
    """``count`` more grandchildren (numbered from ``first``), spread over ``parents``, each with a config of
    its own (``wd`` changes at step 20); returns their ids."""
    nodes = []
    for k in range(first, first + count):
        cfg = Config.of({"lr": MultiStep(0.1, [10], 0.5 + (k % FAN) / (2 * FAN)), "wd": MultiStep(0.01, [20], 1 + k)})
        nodes.append(NewTreeNode(-(k + 1), parents[k % FAN], 20, f"g{k}", config_text(cfg)))
    got = store.plans.insert_node_tree(plan_id, nodes)
    return [got[-(k + 1)] for k in range(first, first + count)]


def memory(url: str, sizes: list[int], points_per_node: int) -> dict[int, tuple[float, float, int]]:
    """The master's resident memory as one plan grows to each of ``sizes`` nodes with ``points_per_node``
    metric points each (written straight to the database, as the aggregators would), and the time to load
    the plan into the master's cache (what the first round or submission after a restart does). Returns
    nodes -> (rss over the empty master in MB, load seconds, metric points in the database)."""
    settings = MasterSettings(
        database_url=url, auth=AuthSettings(tokens={"bench": SecretStr(TOKEN)}, admin_token=SecretStr("bench-admin"))
    )
    app = MasterApp.build(settings, coordination=InProcessCoordination())
    store = app.store
    out: dict[int, tuple[float, float, int]] = {}
    try:
        fixed = json.dumps({"trainer": "memory:Net", "dataset": "", "model": "", "seed": 0, "values": {}})
        plan_id = store.plans.ensure_plan("memory-plan", fixed)
        gc.collect()
        base = rss_mb()
        (root,) = store.plans.insert_node_tree(
            plan_id, [NewTreeNode(-1, None, 0, "root", config_text(Config.of({"lr": 0.1, "wd": 0.01})))]
        ).values()
        kids = [
            NewTreeNode(
                -(i + 1),
                root,
                10,
                f"c{i}",
                config_text(Config.of({"lr": MultiStep(0.1, [10], 0.5 + i / (2 * FAN)), "wd": 0.01})),
            )
            for i in range(FAN)
        ]
        got = store.plans.insert_node_tree(plan_id, kids)
        parents = [got[-(i + 1)] for i in range(FAN)]
        have, points = 1 + FAN, 0
        metric_cols = ("node_id", "step", "values", "recorded_at")
        for size in sizes:
            t0 = time.perf_counter()
            while have < size:
                n = min(5_000, size - have)  # a larger write overflows the statement Postgres parses
                ids = _grow(store, plan_id, parents, have, n)
                rows = [(i, 20 + k, {"loss": 1.0 / (k + 1)}, 0.0) for i in ids for k in range(1, points_per_node + 1)]
                with store.db.tx("bench metrics") as s:
                    store.db.bulk_insert_ignore(
                        s, table(m.Metric), metric_cols, rows, ("node_id", "step"), chunk=10_000
                    )
                have, points = have + n, points + len(rows)
            written = time.perf_counter() - t0
            t0 = time.perf_counter()
            plan = app.service.plans.refresh(plan_id)
            load_s = time.perf_counter() - t0
            assert len(plan.nodes) == have, (len(plan.nodes), have)
            gc.collect()
            out[have] = (rss_mb() - base, load_s, points)
            print(
                f"memory: nodes={have} metric_points={points} master_rss_over_empty_mb={out[have][0]:.0f}"
                f" plan_load_s={load_s:.1f} written_in_s={written:.0f}",
                flush=True,
            )
    finally:
        app.close()
    return out


def memory_exponent(mem: dict[int, tuple[float, float, int]]) -> float:
    """Least-squares slope of log(rss over the empty master) over log(plan nodes)."""
    pts = [(math.log(n), math.log(max(v[0], 1e-3))) for n, v in sorted(mem.items())]
    mx, my = statistics.fmean(x for x, _ in pts), statistics.fmean(y for _, y in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


# -- phase 2: live ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LiveConfig:
    nms: int
    gpus: int
    fleets: int
    studies: int
    requests: int
    step_s: float
    min_step: int
    eta: int
    rungs: int
    max_concurrent: int
    api_threads: int = 0  # the master's (0: its default)
    partitions: int = 8  # of each bus topic
    dump: str = ""  # a file to write the run's raw times to


@dataclass
class Sample:
    t: float
    pending: int
    total: int
    done: int
    master_rss: float


def sampler(cluster: ProcessCluster, stop: threading.Event, out: list[Sample]) -> None:
    engine = cluster.engine()
    pid = cluster.pid("master")
    try:
        while not stop.is_set():
            t = time.time()
            with engine.connect() as c:  # by the state index and the id sequence: a scan of every request
                # each second cost the database more as the run went on
                row = c.execute(
                    text(
                        "SELECT count(*) FILTER (WHERE state = 'NOT_SCHED'), count(*),"
                        " (SELECT coalesce(max(id), 0) FROM requests)"
                        " FROM requests WHERE state IN ('NOT_SCHED', 'SCHED')"
                    )
                ).one()
            pending, live, total = int(row[0]), int(row[1]), int(row[2])
            out.append(Sample(t, pending, total, total - live, rss_mb(pid) if pid else 0.0))
            stop.wait(1.0)
    finally:
        engine.dispose()


async def drive_studies(cluster: ProcessCluster, cfg: LiveConfig, progress: list[int]) -> tuple[float, int]:
    """Run every study's ASHA to its end; returns (when the last trial was started, evals)."""
    steps = cfg.min_step * cfg.eta ** (cfg.rungs - 1)
    per_trial = sum(cfg.eta**-k for k in range(cfg.rungs))
    trials = max(1, round(cfg.requests / cfg.studies / per_trial))
    last_start = [0.0]

    async with stagetree.connect(cluster.target, token=cluster.token) as client:

        async def one(s: int) -> int:
            study = await stagetree.Study.create(
                client, f"scale-{s}", trainer=f"sim.trainer:Study{s}", tuned=["lr", "momentum"], code_version="sim"
            )
            space = RandomSearchSpace({"lr": LogUniform(1e-4, 1.0), "momentum": Uniform(0.5, 0.99)}, seed=s)
            tuner = ASHA(
                space,
                metric="loss",
                mode="min",
                eta=cfg.eta,
                min_step=cfg.min_step,
                max_step=steps,
                max_concurrent=cfg.max_concurrent,
                max_trials=trials,
            )

            def on_event(_e: object, actions: list[object]) -> None:
                submits = [a for a in actions if isinstance(a, Submit)]
                progress[0] += len(submits)
                if any(a.step == cfg.min_step for a in submits):  # a new trial
                    last_start[0] = max(last_start[0], time.time())

            run = await stagetree.drive(study, tuner, on_event=on_event)
            return len(run.trace)

        results = await asyncio.gather(*(one(s) for s in range(cfg.studies)))
    return last_start[0], sum(results)


def live(cfg: LiveConfig, root: Path) -> dict[str, object]:
    config = ClusterConfig(
        root=root,
        node_managers=0,
        aggregators=2,
        heartbeat_ttl_s=15.0,
        round_interval_s=1.0,
        peripheral_every_s=0.0,
        topic_partitions=cfg.partitions,
        # the simulated trainers' step time is known, and the master is told, as a user who knows their
        # model's step time would be (without it the first batches' ends are unknown until one has ended)
        extra_env={"STAGETREE_MASTER_SCHEDULING__DEFAULT_STEP_SECONDS": str(cfg.step_s)}
        | ({"STAGETREE_MASTER_API_THREADS": str(cfg.api_threads)} if cfg.api_threads else {}),
    )
    out: dict[str, object] = {}
    with ProcessCluster(config) as cluster:
        fleets = []
        per_fleet = math.ceil(cfg.nms / cfg.fleets)
        for f in range(cfg.fleets):
            count = min(per_fleet, cfg.nms - f * per_fleet)
            env = {k: v for k, v in os.environ.items() if not k.startswith("STAGETREE_")}
            env.update(
                STAGETREE_NM_MASTER_TARGET=cluster.target,
                STAGETREE_NM_ADMIN_TOKEN=cluster.admin_token,
                STAGETREE_NM_BUS__KAFKA_BOOTSTRAP_SERVERS=cluster.bootstrap,
                STAGETREE_NM_BUS__BATCH_MAX_AGE_S="0.1",
                STAGETREE_NM_RECONNECT_MAX_S="2",
            )
            activity = root / f"fleet-{f}.jsonl"
            log = open(root / f"fleet-{f}.log", "wb")  # noqa: SIM115  (closed after the process)
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "stagetree.cli",
                    "nodemanager",
                    "simulate",
                    "--count",
                    str(count),
                    "--gpus",
                    str(cfg.gpus),
                    "--gpu-types",
                    "A100:1.0",
                    "--step-s",
                    str(cfg.step_s),
                    "--prefix",
                    f"{cluster.id}-f{f}",
                    "--activity-out",
                    str(activity),
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            fleets.append((proc, activity, log))
        deadline = time.monotonic() + 120
        while True:
            n = cluster.query(
                "SELECT count(*) FROM slots s JOIN node_managers m ON m.id = s.node_manager_id WHERE m.state = 'ALIVE'"
            )[0][0]
            if n >= cfg.nms * cfg.gpus:
                break
            if time.monotonic() > deadline or any(p.poll() is not None for p, _, _ in fleets):
                raise RuntimeError(f"only {n} slots registered; see {root}/fleet-*.log")
            time.sleep(0.5)
        print(f"live: {cfg.nms} simulated node managers x {cfg.gpus} GPUs registered", flush=True)
        samples: list[Sample] = []
        stop = threading.Event()
        th = threading.Thread(target=sampler, args=(cluster, stop, samples), daemon=True)
        th.start()
        progress = [0]
        procs = {"master": cluster.pid("master"), "broker": cluster._broker.process.pid, "client": os.getpid()}
        procs.update({n: cluster.pid(n) for n in cluster.aggregator_names()})
        procs.update({f"fleet-{i}": p.pid for i, (p, _, _) in enumerate(fleets)})

        def cpu_now() -> dict[str, float]:
            now = {name: cpu_s(pid) for name, pid in procs.items() if pid}
            now["postgres"] = postgres_cpu_s()
            return now

        cpu0 = cpu_now()
        t0 = time.time()

        async def run() -> tuple[float, int]:
            task = asyncio.ensure_future(drive_studies(cluster, cfg, progress))
            while not task.done():
                await asyncio.wait({task}, timeout=10)
                s = samples[-1] if samples else None
                if s is not None:
                    print(
                        f"live: {time.time() - t0:5.0f}s requests={s.total} done={s.done} pending={s.pending}"
                        f" master_rss={s.master_rss:.0f}MB",
                        flush=True,
                    )
            return task.result()

        last_start, evals = asyncio.run(run())
        wall = time.time() - t0
        cpu = {k: v - cpu0.get(k, 0.0) for k, v in cpu_now().items()}
        print(
            f"live: cpu seconds over {wall:.0f} s: "
            + " ".join(f"{k}={v:.0f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])),
            flush=True,
        )
        stop.set()
        th.join()
        for proc, _, _ in fleets:
            proc.send_signal(signal.SIGTERM)
        for proc, _, log in fleets:
            proc.wait(60)
            log.close()
        intervals = []
        for _, activity, _ in fleets:
            with open(activity) as f:
                intervals += [tuple(json.loads(line)) for line in f]
        print(f"live: {len(intervals)} batch attempts ran on the simulated slots", flush=True)
        totals = cluster.query("SELECT count(*), count(*) FILTER (WHERE state = 'DONE') FROM requests")[0]
        ended = cluster.query("SELECT count(*) FROM batch_attempts WHERE finished_at IS NOT NULL")[0][0]
        points = cluster.query("SELECT count(*) FROM metrics")[0][0]
        attempts = cluster.query("SELECT batch_id, attempt, dispatched_at, sent_at, finished_at FROM batch_attempts")
        # each request's wait for a slot: from its submission to a worker starting its batch (none yet: still
        # waiting); a request answered at submission (its metrics existed) never waited
        waits = request_waits(
            cluster.query(
                "SELECT created_at, batch_id FROM requests WHERE batch_id IS NOT NULL OR state = 'NOT_SCHED'"
            ),
            intervals,
        )
        agg_rss = [rss_mb(cluster.pid(n)) for n in cluster.aggregator_names() if cluster.pid(n)]
        print("live: " + round_histogram(f"http://127.0.0.1:{cluster.http_port}/metrics"), flush=True)
    out.update(
        requests=int(totals[0]),
        done=int(totals[1]),
        evals=evals,
        wall_s=wall,
        reports_per_s=ended / wall,
        metric_points_per_s=points / wall,
        aggregator_rss_mb=max(agg_rss, default=0.0),
        master_rss_mb=max((s.master_rss for s in samples), default=0.0),
    )
    t_end = last_start or wall + t0
    slots = cfg.nms * cfg.gpus
    if cfg.dump:  # the raw times, for looking at where the waits fall
        rows = {"intervals": intervals, "attempts": attempts, "waits": waits, "samples": samples}
        with open(cfg.dump, "w") as dump_file:
            json.dump(
                {"t0": t0, "t_end": t_end} | {k: [list(_fields(r)) for r in v] for k, v in rows.items()}, dump_file
            )
    had_work = WorkForSlots(waits, intervals, slots, t0)
    out.update(occupancy_while_pending(intervals, had_work.waiting, slots, t0, t_end))
    any_pending = pending_then(samples)
    for name, counted in (("work_waiting", had_work), ("any_pending", any_pending)):
        stages = latency_stages(intervals, attempts, counted, t_end)
        ended, lat, ahead = stages.pop("ended"), stages.pop("total"), stages.pop("ahead")
        out[f"assign_ms_p50_{name}"] = statistics.median(lat) if lat else float("nan")
        out[f"assign_ms_p99_{name}"] = _p99(lat) if lat else float("nan")
        out[f"assign_samples_{name}"] = float(len(lat))
        print(
            f"live: a freed slot's wait while {name.replace('_', ' ')}, by stage (ms, p50/p99): "
            + " ".join(f"{k}={statistics.median(v):.0f}/{_p99(v):.0f}" for k, v in stages.items() if v),
            flush=True,
        )
        if name == "work_waiting":
            print("live: " + wave_split(ended, lat, t0 + START_WAVE_BATCHES * cfg.min_step * cfg.step_s), flush=True)
            print("live: " + ahead_split(lat, ahead), flush=True)
    out["assign_ms_p99"] = out["assign_ms_p99_work_waiting"]
    return out


START_WAVE_BATCHES = 3  # first-rung batch lengths from the start that wave_split reports on their own


def wave_split(ended: list[float], waits_ms: list[float], until: float) -> str:
    """The freed slots' waits before ``until`` (the start wave: every slot's first batch starts in the
    same rounds, so their ends come together: up to 622 in one second in a 30k-request run) and after it, p50/p99 each:
    where the run's p99 comes from. Printed beside ``assign_ms_p99``, which counts both."""
    parts = []
    for label, keep in (("start wave", lambda t: t < until), ("after", lambda t: t >= until)):
        xs = [w for t, w in zip(ended, waits_ms, strict=True) if keep(t)]
        parts.append(
            f"{label} n={len(xs)} p50={statistics.median(xs):.0f} p99={_p99(xs):.0f}" if xs else f"{label} n=0"
        )
    return "a freed slot's wait while work waiting, ms: " + ", ".join(parts)


def ahead_split(waits_ms: list[float], ahead: list[float]) -> str:
    """The freed slots' waits split by whether their next batch was sent before the slot freed (the
    master's lookahead) or after: where the tail comes from."""
    parts = []
    for label, flag in (("sent ahead", 1.0), ("sent after", 0.0)):
        xs = [w for w, a in zip(waits_ms, ahead, strict=True) if a == flag]
        parts.append(
            f"{label} n={len(xs)} p50={statistics.median(xs):.0f} p99={_p99(xs):.0f}" if xs else f"{label} n=0"
        )
    return "a freed slot's wait while work waiting, ms: " + ", ".join(parts)


def _fields(row: object) -> tuple[object, ...]:
    return dataclasses.astuple(row) if dataclasses.is_dataclass(row) else tuple(row)  # type: ignore[arg-type]


class WorkForSlots:
    """Whether, when a slot's worker ended at ``t``, a request waited for every idle slot: at least as many
    requests were submitted and not yet started (no worker ran their batch yet: queued in the master, or
    sent ahead to a busy slot) as slots were idle (their worker ended and the next one had not started; a
    slot that never ran is idle from the start). A slot freed when fewer requests waited than slots idled
    waits for a tuner to submit work, not for the scheduler: when a wave of 1,600 batches ends together
    with 800 requests queued, 800 of the freed slots have nothing to run until the tuners hear of the
    results and submit. Exact times: the requests' submission from the ledger, their batches' starts and
    the slots' ends from the workers' intervals. ``waits``: (submitted, started or None) per request."""

    def __init__(
        self, waits: list[tuple[float, float | None]], intervals: list[tuple[object, ...]], slots: int, t0: float
    ) -> None:
        self.submitted = sorted(float(c) for c, _ in waits)
        self.started = sorted(float(d) for _, d in waits if d is not None)
        runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for nm, slot, a, b, *_ in intervals:
            runs.setdefault((str(nm), str(slot)), []).append((float(a), float(b)))  # type: ignore[arg-type]
        starts, stops = [t0] * max(0, slots - len(runs)), []  # never used: idle all along
        for ran in runs.values():
            begun = sorted(a for a, _ in ran)
            starts.append(t0)  # idle from t0 until its first worker started
            stops.append(begun[0])
            for _, e in ran:  # then from each end until the next worker started
                i = bisect.bisect_left(begun, e)
                starts.append(e)
                if i < len(begun):
                    stops.append(begun[i])
        self.idle_from, self.idle_until = sorted(starts), sorted(stops)

    def waiting(self, t: float) -> int:
        """Requests submitted by ``t`` whose batch had not started by ``t``."""
        return bisect.bisect_right(self.submitted, t) - bisect.bisect_right(self.started, t)

    def __call__(self, t: float) -> bool:
        idle = bisect.bisect_right(self.idle_from, t) - bisect.bisect_right(self.idle_until, t)
        return self.waiting(t) >= idle > 0


def request_waits(rows: list[Any], intervals: list[tuple[object, ...]]) -> list[tuple[float, float | None]]:
    """(submitted, started) per request from the ledger's (created_at, batch id) rows: started is when a
    worker first ran its batch (any attempt; None: not yet)."""
    first: dict[int, float] = {}
    for _nm, _slot, a, _b, batch, *_ in intervals:
        b, t = int(batch), float(a)  # type: ignore[call-overload, arg-type]
        if b not in first or t < first[b]:
            first[b] = t
    return [(float(c), None if b is None else first.get(int(b))) for c, b in rows]


def pending_then(samples: list[Sample]) -> Callable[[float], bool]:
    """Whether the last 1-second sample before ``t`` saw any request NOT_SCHED (the looser criterion)."""
    times = [x.t for x in samples]

    def counted(t: float) -> bool:
        i = bisect.bisect_right(times, t) - 1
        return i >= 0 and samples[i].pending > 0

    return counted


def round_histogram(url: str) -> str:
    """The master's rounds, from its Prometheus histogram: how many, their mean, and the share of them
    longer than each of a few bounds (where a freed slot's ``round`` wait comes from)."""
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
    except OSError as e:
        return f"rounds: the master's metrics could not be read ({e})"
    buckets: dict[float, float] = {}
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("stagetree_master_round_seconds_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[math.inf if le == "+Inf" else float(le)] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("stagetree_master_round_seconds_sum "):
            total = float(line.rsplit(" ", 1)[1])
        elif line.startswith("stagetree_master_round_seconds_count "):
            count = float(line.rsplit(" ", 1)[1])
    if not count:
        return "rounds: none measured"
    over = " ".join(f">{le:g}s={1 - buckets.get(le, count) / count:.3f}" for le in (0.1, 0.25, 0.5, 1.0, 2.5))
    return f"rounds: {count:.0f}, mean {1000 * total / count:.0f} ms, share longer than: {over}"


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def latency_stages(
    intervals: list[tuple[object, ...]], attempts: list[Any], counted: Callable[[float], bool], t_end: float
) -> dict[str, list[float]]:
    """A freed slot's wait (``total``: its worker ended -> the next worker started on it), for the ends ``counted``
    says to take (``ended``: when, epoch seconds), and where it went: ``report`` (the worker ended -> the ledger
    recorded it: node manager, Kafka, aggregator), ``round`` (-> the next attempt on that slot dispatched;
    below zero when the master sent it ahead, before the slot freed), ``stream`` (-> sent on the node
    manager's assignment stream), ``start`` (-> its worker started; for an attempt sent ahead, this holds
    its wait for the slot). A slot's runs (``intervals``: node manager, slot, start, end, batch, attempt)
    are matched to their attempts (``attempts``: batch, attempt, dispatched, sent, finished)."""
    runs: dict[tuple[str, str], list[tuple[float, float, tuple[int, int]]]] = {}
    for nm, slot, a, b, batch, attempt in intervals:
        key = (int(batch), int(attempt))  # type: ignore[call-overload]
        runs.setdefault((str(nm), str(slot)), []).append((float(a), float(b), key))  # type: ignore[arg-type]
    tried = {(int(b), int(a)): (float(d), s, f) for b, a, d, s, f in attempts}
    out: dict[str, list[float]] = {"ended": [], "total": [], "report": [], "round": [], "stream": [], "start": []}
    out["ahead"] = []  # 1.0 where the next attempt was dispatched before the slot freed (lookahead), else 0.0
    for ran in runs.values():
        ran.sort()
        for prev_run, next_run in itertools.pairwise(ran):
            end = prev_run[1]
            prev_att, next_att = tried.get(prev_run[2]), tried.get(next_run[2])
            if prev_att is None or next_att is None or prev_att[2] is None or next_att[1] is None:
                continue
            if end > t_end or not counted(end):
                continue
            out["ended"].append(end)
            out["total"].append((next_run[0] - end) * 1000)
            out["report"].append((float(prev_att[2]) - end) * 1000)
            out["round"].append((next_att[0] - float(prev_att[2])) * 1000)
            out["stream"].append((float(next_att[1]) - next_att[0]) * 1000)
            out["start"].append((next_run[0] - float(next_att[1])) * 1000)
            out["ahead"].append(1.0 if next_att[0] < end else 0.0)
    return out


def occupancy_while_pending(
    intervals: list[tuple[object, ...]], waiting: Callable[[float], int], slots: int, t0: float, t_end: float
) -> dict[str, float]:
    """Occupancy while work was pending (see the module docstring): ``waiting(t)`` is how many requests
    were submitted and not started at ``t`` (``WorkForSlots.waiting``)."""
    # busy slots at each whole second from t0: a sweep over the intervals' starts and ends
    starts = sorted(float(a) for _nm, _s, a, _b, *_ in intervals)  # type: ignore[arg-type]
    ends = sorted(float(b) for _nm, _s, _a, b, *_ in intervals)  # type: ignore[arg-type]
    busy_num = busy_den = 0.0
    t = t0
    while t < t_end:
        busy = bisect.bisect_right(starts, t) - bisect.bisect_right(ends, t)  # started by t, not ended by t
        busy_num += busy
        busy_den += min(slots, busy + waiting(t))
        t += 1.0
    return {"occupancy": busy_num / busy_den if busy_den else float("nan")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nms", type=int, default=200, help="simulated node managers")
    p.add_argument("--gpus", type=int, default=8, help="GPU slots each")
    p.add_argument("--fleets", type=int, default=2, help="processes the simulated node managers are spread over")
    p.add_argument("--studies", type=int, default=50)
    p.add_argument("--requests", type=int, default=100_000, help="requests the live run's tuners make in all")
    p.add_argument("--step-s", type=float, default=0.2)
    p.add_argument("--min-step", type=int, default=50)
    p.add_argument("--eta", type=int, default=3)
    p.add_argument("--rungs", type=int, default=3)
    p.add_argument("--max-concurrent", type=int, default=0, help="per study (default: enough to fill the slots)")
    p.add_argument("--api-threads", type=int, default=0, help="the live master's API threads (default: its own)")
    p.add_argument("--dump", default="", help="write the live run's raw times (JSON) to this file")
    p.add_argument("--partitions", type=int, default=8, help="partitions of each bus topic in the live run")
    p.add_argument("--sizes", default="1000,10000,100000", help="pending requests at which rounds are timed")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--phase", choices=["all", "growth", "live", "memory"], default="all")
    p.add_argument("--plan-sizes", default="10000,100000,1000000", help="plan nodes at which memory is read")
    p.add_argument("--points-per-node", type=int, default=10, help="metric points stored per plan node")
    p.add_argument("--quick", action="store_true", help="a small run of every phase")
    ns = p.parse_args()
    if ns.quick:
        ns.nms, ns.gpus, ns.fleets, ns.studies, ns.requests = 10, 4, 1, 4, 400
        ns.step_s, ns.min_step, ns.sizes, ns.rounds = 0.05, 10, "200,1000,4000", 3
        ns.plan_sizes = "2000,5000,20000"
    sizes = [int(x) for x in ns.sizes.split(",")]
    slots = ns.nms * ns.gpus
    g: dict[str, object] = {}
    if ns.phase in ("all", "growth"):
        with fresh_database() as url:
            g = asyncio.run(growth(url, ns.nms, ns.gpus, sizes, ns.rounds, ns.studies))
        print(
            f"growth: submit_per_s={g['submit_per_s']:.0f} raw_insert_per_s={g['raw_insert_per_s']:.0f}"
            f" in_process_rss_mb={g['rss_mb']:.0f}",
            flush=True,
        )
    lv: dict[str, object] = {}
    if ns.phase in ("all", "live"):
        mc = ns.max_concurrent or max(1, math.ceil(1.5 * slots / ns.studies))
        cfg = LiveConfig(
            ns.nms,
            ns.gpus,
            ns.fleets,
            ns.studies,
            ns.requests,
            ns.step_s,
            ns.min_step,
            ns.eta,
            ns.rungs,
            mc,
            ns.api_threads,
            ns.partitions,
            ns.dump,
        )
        with tempfile.TemporaryDirectory(prefix="stagetree-scale-") as d:
            lv = live(cfg, Path(d))
        print(
            "live: " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in lv.items()),
            flush=True,
        )
    if ns.phase in ("all", "memory"):
        with fresh_database() as url:
            mem = memory(url, [int(x) for x in ns.plan_sizes.split(",")], ns.points_per_node)
        big = max(mem)
        print(
            f"memory: plan_nodes={big} metric_points={mem[big][2]} master_rss_over_empty_mb={mem[big][0]:.0f}"
            f" plan_load_s={mem[big][1]:.1f} memory_growth_exp={memory_exponent(mem):.2f}",
            flush=True,
        )
    round_ms: dict[int, list[float]] = g.get("round_ms", {})  # type: ignore[assignment]
    largest = max(round_ms) if round_ms else 0
    r99 = max(round_ms[largest]) if largest else float("nan")
    exp = growth_exponent(round_ms) if len(round_ms) >= 2 else float("nan")
    ratio = float(g["submit_per_s"]) / float(g["raw_insert_per_s"]) if g else float("nan")  # type: ignore[arg-type]
    nan = float("nan")
    occupancy, assign = lv.get("occupancy", nan), lv.get("assign_ms_p99", nan)
    line = (
        f"slots={slots} studies={ns.studies} requests={lv.get('requests', 0)} occupancy={occupancy:.3f}"
        f" assign_ms_p99={assign:.0f} round_ms_p99_100k={r99:.0f} round_growth_exp={exp:.2f}"
        f" master_rss_mb={lv.get('master_rss_mb', nan):.0f} submit_vs_raw_insert={ratio:.2f}"
    )
    if ns.phase != "all" or ns.quick:  # the recorded row is a whole run's; one phase's would blank the others
        part = "--quick" if ns.quick else f"--phase {ns.phase}"
        print(f"(not recorded: {part} measures part of the run)", flush=True)
        print(line)
        return
    print(record("scale", line))


if __name__ == "__main__":
    main()
