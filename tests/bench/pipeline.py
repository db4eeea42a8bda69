"""Ingest pipeline benchmark (real broker, real Postgres): ``python -m tests.bench.pipeline``.

Simulated workers (threads in node-manager processes) report one ``Metrics`` message per training step
through a node manager's ``LocalBatcher`` and ``KafkaMetricBus`` into a Tansu broker; one aggregator
process (``stagetree aggregator run``, the real CLI) applies them to a fresh Postgres database, created
and dropped like the test fixtures do. Every worker's batch is dispatched in the database first, with
requests waiting along its path, and its last message is ``batch_finished``, so the whole effect is
exercised: metrics rows, requests DONE, batches ended, nothing requeued.

Two cases, one line each:

* ``steady``: one aggregator throughout; ``ingest_points_per_s`` = points / (last commit seen - first produce);
* ``crash``: the aggregator is killed with SIGKILL mid-stream and restarted; afterwards
  ``dup_applied`` counts metric points the database saw applied more than once (a trigger in the bench
  database counts every row the aggregator tried to insert into ``metrics``; a redelivered message
  that is applied again shows up as a second try) and ``lost`` the produced messages whose msg_id never
  reached ``applied_messages`` (and the points missing from ``metrics``).

Then the demo's study in embedded mode (``tests.bench.embedded``: executed vs unique steps, and the
study's wall time over its ideal makespan with plain-loop step costs). Last line:
``ingest_points_per_s=<n> dup_applied=<k> lost=<l> embedded_steps_vs_unique=<r> embedded_overhead=<o>``
(targets: >= 20000, 0, 0, 1.00, <= 1.15), then ``ingest_vs_bare_kafka=<q>``: the steady ingest rate
over kafka-python producing and consuming bare messages on the same broker in the same run
(``tests.bench.refs``), a figure that moves less with the machine than the absolute rate.

Against another commit: ``python -m tests.bench.pipeline --baseline REF [--pairs 2] [--no-embedded]``.
``REF`` is checked out into a temporary git worktree whose ``services`` goes first on the children's
``PYTHONPATH`` as ``stagetree``, and the steady case runs ``--pairs`` times for each tree, this one first,
alternately (ABAB), on the same broker and Postgres server and with the same points. Each run is a child
process importing its own tree: a fresh database made by that tree's migrations, seeded by its store,
its aggregator (the run fails unless the aggregator's ``Ingestor`` is the file of its own tree, byte for
byte; its git revision and whether it has the one-ingest ``IngestResult.completed_by`` are printed).
``ingest_points_per_s`` is then this tree's median, and the last line adds
``ingest_points_per_s_baseline=<n> baseline=<REF> ingest_vs_baseline=<this tree / REF>`` (target >= 0.9
against the commit before the one-ingest change); every run's rate is kept in the results file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing
import os
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Engine, create_engine, text

from stagetree.bus.batcher import LocalBatcher
from stagetree.bus.kafka import KafkaBusConfig, KafkaMetricBus, ensure_topics
from stagetree.bus.messages import ALL_TOPICS, BatchFinished, BatchStarted, Metrics, make_msg_id
from stagetree.bus.tansu import TansuBroker, start_tansu
from stagetree.core.config import Config
from stagetree.master.plans import config_text
from stagetree.master.store.records import NewNode, NewRequest
from stagetree.master.store.store import Store, make_engine
from tests.bench import refs
from tests.bench.baseline import ROOT, baseline_tree, child_env, fresh_database, git
from tests.bench.record import record

GROUP = "bench-aggregators"
PARTITIONS = 8
REQUEST_EVERY = 500  # a request waits every this many steps along each worker's path

AUDIT_SQL = """
CREATE UNLOGGED TABLE bench_attempts (node_id BIGINT NOT NULL, step INTEGER NOT NULL);
CREATE FUNCTION bench_count_attempt() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO bench_attempts VALUES (NEW.node_id, NEW.step);
    RETURN NEW;
END $$;
CREATE TRIGGER bench_count_attempt BEFORE INSERT ON metrics FOR EACH ROW EXECUTE FUNCTION bench_count_attempt();
"""


@dataclass(frozen=True)
class Job:
    """One simulated worker's stage batch: train ``steps`` steps along ``node`` and report each."""

    node_manager: str
    batch_id: int
    node: int
    steps: int


@dataclass(frozen=True)
class Broker:
    """The broker a case produces to: its address, and its process (whose CPU time is counted)."""

    bootstrap: str
    pid: int

    @staticmethod
    def of(broker: TansuBroker) -> Broker:
        return Broker(broker.bootstrap, broker.process.pid)


@dataclass
class CaseResult:
    name: str
    points: int
    per_s: float
    dup_applied: int
    lost: int
    restart_s: float = 0.0


# -- the database --------------------------------------------------------------------------------------


def seed(store: Store, tag: str, workers: int, steps: int) -> list[Job]:
    """A plan with one root node per worker, requests waiting along each path, one running batch each."""
    plan_id = store.plans.ensure_plan(f"bench-{tag}", "{}")
    configs = [config_text(Config.of({"lr": 0.001 * (i + 1), "tag": tag})) for i in range(workers)]
    store.plans.insert_nodes(plan_id, [NewNode(None, 0, f"{tag}-{i}", c) for i, c in enumerate(configs)])
    nodes = [n.id for n in store.plans.load_nodes(plan_id)]
    study = store.studies.create_study(f"bench-{tag}", "pipeline", None)
    jobs = []
    for i, node in enumerate(nodes):
        nm = f"bench-{tag}-nm{i % 2}"
        store.nodes.register_node_manager(nm, "127.0.0.1:0", [(f"gpu{j}", "cpu") for j in range(workers)])
        reqs = store.requests.add_requests(
            study.id, plan_id, [NewRequest(f"{i}-{s}", node, s) for s in range(REQUEST_EVERY, steps + 1, REQUEST_EVERY)]
        )
        batch = store.ledger.dispatch(plan_id, lambda b, a: "{}", [r.id for r in reqs], nm, f"gpu{i}")
        assert batch is not None
        jobs.append(Job(nm, batch.id, node, steps))
    return jobs


def msg_ids(job: Job) -> list[str]:
    """Every id the job's worker produces with an effect (metrics and the finish)."""
    return [make_msg_id(job.node_manager, job.batch_id, 1, s) for s in range(1, job.steps + 2)]


def _like(jobs: list[Job]) -> list[str]:
    return [f"{nm}:%" for nm in sorted({j.node_manager for j in jobs})]


def applied_count(engine: Engine, jobs: list[Job]) -> int:
    with engine.connect() as c:
        return int(
            c.execute(
                text("SELECT count(*) FROM applied_messages WHERE msg_id LIKE ANY(:p)"), {"p": _like(jobs)}
            ).scalar_one()
        )


# -- the node managers ---------------------------------------------------------------------------------


def node_manager(bootstrap: str, jobs: list[Job], start_at: float) -> None:
    """A node-manager process: one thread per worker, one batcher and Kafka producer for all of them."""
    bus = KafkaMetricBus(KafkaBusConfig(bootstrap, client_id="bench-nm", linger_ms=5))
    batcher = LocalBatcher(bus, max_messages=2000, max_age_s=0.05, max_buffered=1_000_000)

    def worker(job: Job) -> None:
        common = {"node_manager": job.node_manager, "batch_id": job.batch_id, "attempt": 1}
        batcher.add(BatchStarted(msg_id=make_msg_id(job.node_manager, job.batch_id, 1, 0), **common))
        for step in range(1, job.steps + 1):
            loss = 2.0 / math.sqrt(step)
            batcher.add(
                Metrics(
                    msg_id=make_msg_id(job.node_manager, job.batch_id, 1, step),
                    node=job.node,
                    step=step,
                    metrics={"loss": loss, "accuracy": 1.0 - loss / 2.5},
                    **common,
                )
            )
        batcher.add(
            BatchFinished(
                msg_id=make_msg_id(job.node_manager, job.batch_id, 1, job.steps + 1), steps=job.steps, **common
            )
        )

    time.sleep(max(0.0, start_at - time.time()))
    threads = [threading.Thread(target=worker, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    batcher.close()
    bus.close()


def produce(bootstrap: str, jobs: list[Job], processes: int) -> tuple[float, list[multiprocessing.Process]]:
    """Start the node-manager processes; returns the time the first message is produced at."""
    ctx = multiprocessing.get_context("spawn")
    start_at = time.time() + 3.0  # let every process import and connect first (not measured)
    procs = []
    for i in range(processes):
        p = ctx.Process(target=node_manager, args=(bootstrap, jobs[i::processes], start_at), daemon=True)
        p.start()
        procs.append(p)
    return start_at, procs


# -- the aggregator ------------------------------------------------------------------------------------


@dataclass
class AggregatorProcess:
    proc: subprocess.Popen[str]
    joined: threading.Event


def aggregator_env(url: str, bootstrap: str) -> dict[str, str]:
    """The aggregator's environment: this process's (its ``PYTHONPATH`` picks the code) and its settings."""
    env = dict(os.environ)
    env.update(
        {
            "STAGETREE_AGG_DATABASE_URL": url,
            "STAGETREE_AGG_BOOTSTRAP_SERVERS": bootstrap,
            "STAGETREE_AGG_GROUP_ID": GROUP,
            "STAGETREE_AGG_INSTANCE_ID": "bench-aggregator",
            "STAGETREE_AGG_BATCH__MAX_RECORDS": "5000",
            "STAGETREE_AGG_BATCH__MAX_LATENCY_MS": "100",
            # as KafkaBusConfig.fast_rebalance: a restarted member joins in about a second
            "STAGETREE_AGG_KAFKA__SESSION_TIMEOUT_MS": "2000",
            "STAGETREE_AGG_KAFKA__HEARTBEAT_INTERVAL_MS": "300",
            "STAGETREE_AGG_KAFKA__MAX_POLL_INTERVAL_MS": "5000",
            "STAGETREE_AGG_KAFKA__FETCH_MAX_WAIT_MS": "100",
        }
    )
    return env


def start_aggregator(url: str, bootstrap: str) -> AggregatorProcess:
    """``stagetree aggregator run`` as its own process; ``joined`` is set once it owns partitions."""
    env = aggregator_env(url, bootstrap)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stagetree.aggregator.cli",
            "run",
            "--log-level",
            os.environ.get("BENCH_AGG_LOG", "ERROR"),
        ],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    joined = threading.Event()

    def watch() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if " owns " in line and not line.rstrip().endswith(" owns 0 partitions"):
                joined.set()

    threading.Thread(target=watch, daemon=True).start()
    return AggregatorProcess(proc, joined)


def stop_aggregator(agg: AggregatorProcess) -> None:
    proc = agg.proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- one case ------------------------------------------------------------------------------------------


def wait_applied(
    engine: Engine, jobs: list[Job], expected: int, timeout_s: float, at_least: int | None = None
) -> tuple[int, float]:
    """Poll until ``at_least`` (default: all ``expected``) messages are applied; returns the count and
    the wall time just before the query that saw them, an upper bound of when the last one committed
    (polled every 50 ms near the end, so the bound is tight)."""
    deadline = time.monotonic() + timeout_s
    target = expected if at_least is None else at_least
    n = 0
    while time.monotonic() < deadline:
        before = time.time()
        n = applied_count(engine, jobs)
        if n >= target:
            return n, before
        time.sleep(0.05 if n >= 0.9 * target or at_least is not None else 0.5)
    return n, time.time()


def run_case(name: str, url: str, broker: Broker, args: argparse.Namespace, crash: bool) -> CaseResult:
    store = Store.open(make_engine(url, pool_size=2))
    engine = store.db.engine
    try:
        per_worker = args.points // args.workers
        jobs = seed(store, f"{name}-{uuid.uuid4().hex[:6]}", args.workers, per_worker)
        expected_ids = {i for j in jobs for i in msg_ids(j)}
        points = per_worker * len(jobs)
        database = url.rsplit("/", 1)[1]
        cpu0 = cpu_seconds(broker, database)
        aggregator = start_aggregator(url, broker.bootstrap)
        restart_s = 0.0
        try:
            # A cluster's aggregators are up before work is dispatched: wait until it owns partitions.
            if not aggregator.joined.wait(60):
                raise RuntimeError("the aggregator did not join its group in 60 s")
            first, producers = produce(broker.bootstrap, jobs, args.processes)
            if crash:
                wait_applied(engine, jobs, len(expected_ids), 60, at_least=int(len(expected_ids) * 0.4))
                aggregator.proc.send_signal(signal.SIGKILL)  # no chance to commit offsets or leave the group
                aggregator.proc.wait()
                killed = time.monotonic()
                aggregator = start_aggregator(url, broker.bootstrap)
            done, last = wait_applied(engine, jobs, len(expected_ids), 90)
            pg_done = cpu_seconds(broker, database)["postgres"]  # while the aggregator's backend still exists
            if crash:
                restart_s = time.monotonic() - killed
            for p in producers:
                p.join(30)
        finally:
            stop_aggregator(aggregator)
        with engine.connect() as c:
            seen = {
                str(r[0])
                for r in c.execute(
                    text("SELECT msg_id FROM applied_messages WHERE msg_id LIKE ANY(:p)"), {"p": _like(jobs)}
                )
            }
            nodes = [j.node for j in jobs]
            stored = int(
                c.execute(text("SELECT count(*) FROM metrics WHERE node_id = ANY(:n)"), {"n": nodes}).scalar_one()
            )
            dup = 0
            if crash:
                dup = int(
                    c.execute(
                        text(
                            "SELECT count(*) - count(DISTINCT (node_id, step)) FROM bench_attempts "
                            "WHERE node_id = ANY(:n)"
                        ),
                        {"n": nodes},
                    ).scalar_one()
                )
            waiting = int(
                c.execute(
                    text("SELECT count(*) FROM requests WHERE node_id = ANY(:n) AND state <> 'DONE'"), {"n": nodes}
                ).scalar_one()
            )
            running = int(
                c.execute(
                    text("SELECT count(*) FROM batches WHERE id = ANY(:b) AND state <> 'DONE'"),
                    {"b": [j.batch_id for j in jobs]},
                ).scalar_one()
            )
        lost = max(len(expected_ids - seen), points - stored)
        per_s = points / (last - first) if last > first else 0.0
        cpu1 = {**cpu_seconds(broker, database), "postgres": pg_done}
        cpu = {k: (v - cpu0[k]) / points * 1e6 for k, v in cpu1.items()}
        print(
            f"{name:6s} points={points} workers={len(jobs)} node_managers={args.processes} applied={done} "
            f"seconds={last - first:.2f} points_per_s={per_s:.0f} dup_applied={dup} lost={lost} "
            f"requests_not_done={waiting} batches_not_done={running}"
            + (f" kill_to_caught_up_s={restart_s:.2f}" if crash else "")
            + " cpu_us_per_point="
            + "/".join(f"{k}:{v:.1f}" for k, v in cpu.items())
            + f" load_avg_1m={os.getloadavg()[0]:.2f}",
            flush=True,
        )
        return CaseResult(name, points, per_s, dup, lost + waiting + running, restart_s)
    finally:
        store.dispose()


def cpu_seconds(broker: Broker, database: str) -> dict[str, float]:
    """CPU seconds used so far by: this bench's finished child processes (node managers, aggregators),
    the broker, and the live Postgres processes that serve ``database`` or the whole server (writers,
    checkpointer), not other databases' backends: the machine and its Postgres are shared, and a backend
    of another database that works or ends mid-case is not this case's cost. This says what a point costs
    beside how fast it went (process start-ups included; a killed aggregator's backend is not counted)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = {"python": children.ru_utime + children.ru_stime, "broker": _proc_cpu(broker.pid), "postgres": 0.0}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            stat = (proc / "stat").read_text()
            if not stat[stat.index("(") + 1 : stat.rindex(")")].startswith("postgres"):
                continue
            title = (proc / "cmdline").read_text().replace("\0", " ")
        except OSError:
            continue
        client = "(" in title or "[local]" in title  # a backend's title names its peer; the server's own do not
        if not client or f" {database} " in title:
            out["postgres"] += _stat_cpu(stat)
    return out


def _proc_cpu(pid: int) -> float:
    try:
        return _stat_cpu(Path(f"/proc/{pid}/stat").read_text())
    except OSError:
        return 0.0


def _stat_cpu(text: str) -> float:
    fields = text.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- side by side with another commit -----------------------------------------------------------------

INGEST = "services/master/store/ingest.py"  # the aggregator's write side: the code the comparison is about
CODE_PROBE = """
import hashlib, json, os, stagetree.master.store.ingest as ingest
path = os.path.realpath(ingest.__file__)
print(json.dumps({"ingest": path, "sha1": hashlib.sha1(open(path, "rb").read()).hexdigest(),
                  "one_ingest": "completed_by" in ingest.IngestResult.__dataclass_fields__}))
"""


def aggregator_code(env: dict[str, str]) -> dict[str, object]:
    """Which ``Ingestor`` an aggregator started with ``env`` imports: its file, the file's SHA-1, and
    ``one_ingest`` (its ``IngestResult`` has ``completed_by``, which the one-ingest change added)."""
    out = subprocess.run([sys.executable, "-c", CODE_PROBE], env=env, capture_output=True, text=True, check=True)
    return dict(json.loads(out.stdout))


def steady_child(args: argparse.Namespace) -> None:
    """One steady case with whatever ``stagetree`` this process imports (``PYTHONPATH`` picks it): the
    database is created by that code's migrations and seeded by its store, and the aggregator runs it.
    The last line is the result as JSON."""
    broker = Broker(args.steady_child, args.broker_pid)
    with fresh_database() as url:
        code = aggregator_code(aggregator_env(url, broker.bootstrap))
        result = run_case("steady", url, broker, args, crash=False)
    print(json.dumps({**code, "per_s": result.per_s, "lost": result.lost, "points": result.points}), flush=True)


def _steady_in_child(side: str, python_path: str, broker: Broker, args: argparse.Namespace) -> dict[str, object]:
    env = child_env(python_path)
    cmd = [sys.executable, "-m", "tests.bench.pipeline", "--steady-child", broker.bootstrap]
    cmd += ["--broker-pid", str(broker.pid), "--points", str(args.points), "--workers", str(args.workers)]
    cmd += ["--processes", str(args.processes)]
    child = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=600)
    lines = child.stdout.rstrip().splitlines()
    if child.returncode != 0 or not lines or not lines[-1].startswith("{"):
        print(child.stdout + child.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"the {side} steady case failed (exit status {child.returncode})")
    run: dict[str, object] = json.loads(lines[-1])
    print(f"{side:8s} " + "\n".join(lines[:-1]), flush=True)
    return run


def side_by_side(broker: Broker, args: argparse.Namespace) -> tuple[list[float], list[float], int]:
    """The steady case ``--pairs`` times for this tree and for ``--baseline`` (checked out into a temporary
    git worktree whose ``services`` is put first on the children's ``PYTHONPATH`` as ``stagetree``),
    alternately, on the same broker and Postgres server (a fresh database each run). Each run checks
    that its aggregator imports the ``Ingestor`` of its own tree (path and content). Returns the rates
    of this tree, of the baseline, and the points lost over all runs."""
    with baseline_tree(args.baseline, compile_bytecode=True) as base:  # the node managers import in 3 s
        expected = {
            "current": (ROOT / INGEST, (ROOT / INGEST).read_bytes()),
            "baseline": (base.tree / INGEST, (base.tree / INGEST).read_bytes()),
        }
        print(
            f"side by side: current {git('rev-parse', '--short', 'HEAD')} ({ROOT}) against baseline "
            f"{base.commit[:7]} ({base.tree}), {args.pairs} runs each, alternately",
            flush=True,
        )
        rates: dict[str, list[float]] = {"current": [], "baseline": []}
        lost = 0
        for _ in range(args.pairs):
            for side, python_path in (("current", ""), ("baseline", base.python_path)):
                run = _steady_in_child(side, python_path, broker, args)
                path, source = expected[side]
                if run["ingest"] != str(path.resolve()) or run["sha1"] != hashlib.sha1(source).hexdigest():
                    raise SystemExit(f"the {side} aggregator imported {run['ingest']}, not {path} as committed")
                print(f"{side:8s} aggregator code: {run['ingest']} one_ingest={str(run['one_ingest']).lower()}")
                rates[side].append(float(run["per_s"]))  # type: ignore[arg-type]
                lost += int(run["lost"])  # type: ignore[call-overload]
    return rates["current"], rates["baseline"], lost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=300_000, help="metric points per case")
    parser.add_argument("--workers", type=int, default=16, help="simulated workers (one stage batch each)")
    parser.add_argument("--processes", type=int, default=2, help="node-manager processes the workers live in")
    parser.add_argument(
        "--baseline", metavar="REF", default="", help="also run the steady case on this commit, alternately"
    )
    parser.add_argument("--pairs", type=int, default=2, help="with --baseline: steady runs of each tree")
    parser.add_argument("--no-embedded", action="store_true", help="leave out the embedded study")
    parser.add_argument("--steady-child", metavar="BOOTSTRAP", default="", help=argparse.SUPPRESS)
    parser.add_argument("--broker-pid", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steady_child:
        steady_child(args)
        return
    try:
        import crc32c  # noqa: F401  (kafka-python checks record CRCs in pure Python without it)
    except ImportError:
        print("warning: the crc32c package is missing; kafka-python falls back to pure-Python CRCs", flush=True)
    figures = ""
    with start_tansu() as tansu, fresh_database() as url:
        broker = Broker.of(tansu)
        config = KafkaBusConfig.fast_rebalance(broker.bootstrap)
        ensure_topics(config, ALL_TOPICS, partitions=PARTITIONS)
        if args.baseline:
            current, baseline, steady_lost = side_by_side(broker, args)
            ingest, ingest_baseline = statistics.median(current), statistics.median(baseline)
            steady = CaseResult("steady", args.points, ingest, 0, steady_lost)
            figures = (
                f" ingest_points_per_s_baseline={ingest_baseline:.0f} baseline={args.baseline}"
                f" ingest_vs_baseline={ingest / ingest_baseline:.3f}"
            )
        else:
            steady = run_case("steady", url, broker, args, crash=False)
        with create_engine(url).begin() as c:
            c.execute(text(AUDIT_SQL))
        crash = run_case("crash", url, broker, args, crash=True)
        kafka_ref = refs.kafka_rate(broker.bootstrap)
        print(f"reference (same run): bare_kafka_produce_consume_per_s={kafka_ref:.0f}", flush=True)
    embedded = "" if args.no_embedded else " " + embedded_figures()
    extra = {"side_by_side": {"current": current, "baseline": baseline}} if args.baseline else None
    print(
        record(
            "pipeline",
            f"ingest_points_per_s={steady.per_s:.0f} dup_applied={steady.dup_applied + crash.dup_applied} "
            f"lost={steady.lost + crash.lost}{embedded} ingest_vs_bare_kafka={steady.per_s / kafka_ref:.3f}" + figures,
            extra=extra,
        )
    )


def embedded_figures() -> str:
    """``tests.bench.embedded`` in a child process; returns its last line."""
    print("embedded: the demo's study (wider MLP) in embedded mode, then its ideal makespan", flush=True)
    child = subprocess.run(
        [sys.executable, "-m", "tests.bench.embedded"], capture_output=True, text=True, check=False, timeout=900
    )
    lines = child.stdout.rstrip().splitlines()
    if child.returncode != 0 or not lines or not lines[-1].startswith("embedded_steps_vs_unique="):
        print(child.stdout + child.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"the embedded run failed (exit status {child.returncode})")
    print("\n".join(lines[:-1]), flush=True)
    return lines[-1]


if __name__ == "__main__":
    main()
