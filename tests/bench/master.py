"""Master benchmark (Postgres): ``python -m tests.bench.master``.

Submits 10,000 requests (50 studies of 200 trials, batches of 100) through gRPC to a master on
loopback, times a scheduling round over the 10,000 pending requests (snapshot to dispatch decisions),
then the latency of evaluations answered from stored metrics. Last line:
``submit_per_s=<n> round_ms_10k=<t> cached_eval_p99_ms=<p> submit_vs_raw_insert=<r> round_10k_x_loop_rate=<k>``
(targets: >= 2000, <= 250, <= 20). The two last fields tie the absolute figures to same-run references
(``tests.bench.refs``): submissions over a plain psycopg2 insert of the same request rows, and the round's
time in iterations of a fixed Python loop (a machine-independent size of the round).

Against another commit: ``python -m tests.bench.master --baseline REF [--pairs 3]`` times the round alone
for this tree and for ``REF`` (a temporary git worktree first on the children's ``PYTHONPATH``,
``tests.bench.baseline``), alternately, each run a child process with a fresh database made by its own
tree's migrations and the same 10,000 submissions; a run fails unless its scheduling loop is its tree's
file. Last line: ``round_ms_10k=<t> round_ms_10k_baseline=<t> baseline=<REF> round_vs_baseline=<r>``
(target <= 1.1 against 02172b5, the code before the pure round), kept as
``results/master_vs_baseline.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
from pydantic import SecretStr
from sqlalchemy import create_engine, text

from stagetree.master.app import MasterApp
from stagetree.master.auth import Principal
from stagetree.master.coordination import InProcessCoordination
from stagetree.master.settings import AuthSettings, LimitSettings, MasterSettings
from stagetree.proto.stagetree.v1 import master_pb2 as pb
from stagetree.proto.stagetree.v1 import master_pb2_grpc as pb_grpc
from tests.bench import refs
from tests.bench.baseline import ROOT, baseline_tree, child_env, fresh_database, git
from tests.bench.record import record

TOKEN = "bench-token"
MD = (("authorization", f"Bearer {TOKEN}"),)


def trial(i: int) -> dict[str, object]:
    return {"lr": {"kind": "multistep", "init": 0.01 * (1 + i // 20), "milestones": [5 * (1 + i % 20)], "gamma": 0.5}}


async def submit_all(stub: pb_grpc.MasterServiceStub, studies: int, trials: int, batch: int, step: int) -> float:
    ids = []
    for s in range(studies):
        fixed = {"trainer": f"bench{s}:Trainer", "dataset": "d", "model": "m", "seed": 0, "values": {}}
        st = await stub.CreateStudy(pb.CreateStudyRequest(name=f"s{s}", fixed_json=json.dumps(fixed)), metadata=MD)
        ids.append(st.id)
    calls = [
        pb.SubmitRequestsRequest(
            study_id=sid,
            items=[
                pb.SubmitItem(client_request_id=f"t{i}", config_json=json.dumps({"tuned": trial(i)}), step=step)
                for i in range(b, b + batch)
            ],
        )
        for sid in ids
        for b in range(0, trials, batch)
    ]
    sem = asyncio.Semaphore(8)

    async def one(req: pb.SubmitRequestsRequest) -> None:
        async with sem:
            await stub.SubmitRequests(req, metadata=MD)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(c) for c in calls))
    return studies * trials / (time.perf_counter() - t0)


async def cached_evals(app: MasterApp, stub: pb_grpc.MasterServiceStub, n: int, step: int) -> float:
    fixed = {"trainer": "bench:Cached", "dataset": "d", "model": "m", "seed": 0, "values": {}}
    st = await stub.CreateStudy(pb.CreateStudyRequest(name="cached", fixed_json=json.dumps(fixed)), metadata=MD)
    cfg = json.dumps({"tuned": trial(0)})
    first = await stub.SubmitRequests(
        pb.SubmitRequestsRequest(
            study_id=st.id, items=[pb.SubmitItem(client_request_id="seed", config_json=cfg, step=step)]
        ),
        metadata=MD,
    )
    r = first.results[0]
    app.store.requests.record_metrics(r.node, r.step, {"loss": 0.5})
    lat = []
    for i in range(n):
        t0 = time.perf_counter()
        res = await stub.SubmitRequests(
            pb.SubmitRequestsRequest(
                study_id=st.id, items=[pb.SubmitItem(client_request_id=f"c{i}", config_json=cfg, step=step)]
            ),
            metadata=MD,
        )
        lat.append((time.perf_counter() - t0) * 1000)
        assert res.results[0].state == pb.DONE
    return statistics.quantiles(lat, n=100)[98]


@asynccontextmanager
async def serving(url: str, batch: int) -> AsyncIterator[tuple[MasterApp, pb_grpc.MasterServiceStub]]:
    """A master on ``url`` with gRPC on a free loopback port, and a stub authenticated as the bench."""
    settings = MasterSettings(
        database_url=url,
        auth=AuthSettings(tokens={"bench": SecretStr(TOKEN)}, admin_token=SecretStr("bench-admin")),
        limits=LimitSettings(max_batch_items=batch),
    )
    app = MasterApp.build(settings, coordination=InProcessCoordination())
    server, port = await app.start_grpc(port=0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            yield app, pb_grpc.MasterServiceStub(ch)
    finally:
        await server.stop(grace=None)
        app.close()


def time_rounds(app: MasterApp, pending: int, runs: int = 5) -> list[float]:
    """The master's own round over ``pending`` requests, up to the dispatch decisions (it writes
    nothing), ``runs`` times on a node manager of 16 free slots; milliseconds each."""
    admin = Principal("admin", admin=True)
    app.service.register_node_manager(admin, "bench-nm", "local", [(f"g{i}", "a100") for i in range(16)])
    app.coordination.heartbeat("bench-nm", 600)
    rounds = []
    for _ in range(runs):
        t0 = time.perf_counter()
        d = app.scheduler.decide()
        rounds.append((time.perf_counter() - t0) * 1000)
        # ``Decided.decision`` here; a ``Decision`` whose ``result`` holds them before the pure round
        dispatches = (d.decision if hasattr(d, "decision") else d.result).dispatches
        assert d.pending == pending and len(dispatches) == 16, (d.pending, len(dispatches))
    return rounds


async def bench(url: str, studies: int, trials: int, batch: int) -> str:
    async with serving(url, batch) as (app, stub):
        submit_rate = await submit_all(stub, studies, trials, batch, step=100)
        rounds = time_rounds(app, studies * trials)
        round_ms = statistics.median(rounds)
        if os.environ.get("STAGETREE_BENCH_PROFILE"):
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            app.scheduler.decide()
            prof.disable()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(18)
        p99 = await cached_evals(app, stub, 300, step=100)
    engine = create_engine(url)
    try:
        with engine.connect() as c:  # the rows the submissions wrote, for the same-run reference
            q = f"SELECT {', '.join(refs.REQUEST_COLUMNS)} FROM requests ORDER BY id LIMIT 10000"
            rows = [tuple(r) for r in c.execute(text(q))]
    finally:
        engine.dispose()
    raw = refs.raw_insert_rate(url, "requests", refs.REQUEST_COLUMNS, rows, batch)
    loop_rate = refs.python_rate()
    print(f"pending={studies * trials} round_runs_ms={[round(r, 1) for r in rounds]}")
    print(f"references (same run): raw_insert_per_s={raw:.0f} python_loop_per_s={loop_rate:.0f}")
    # The ratios move less with the machine than the absolute figures (tests.bench.refs).
    return (
        f"submit_per_s={submit_rate:.0f} round_ms_10k={round_ms:.1f} cached_eval_p99_ms={p99:.2f}"
        f" submit_vs_raw_insert={submit_rate / raw:.3f} round_10k_x_loop_rate={round_ms * loop_rate / 1000:.0f}"
    )


async def rounds_only(url: str, studies: int, trials: int, batch: int) -> list[float]:
    async with serving(url, batch) as (app, stub):
        await submit_all(stub, studies, trials, batch, step=100)
        return time_rounds(app, studies * trials)


def round_child(ns: argparse.Namespace) -> None:
    """The rounds alone with whatever ``stagetree`` this process imports; the last line is JSON: the
    rounds' milliseconds and the file the scheduling loop came from."""
    import stagetree.master.scheduling as scheduling

    with fresh_database() as url:
        rounds = asyncio.run(rounds_only(url, ns.studies, ns.trials, ns.batch))
    print(json.dumps({"rounds_ms": rounds, "code": os.path.realpath(scheduling.__file__)}), flush=True)


def side_by_side(ns: argparse.Namespace) -> str:
    """The round at 10k pending for this tree and for ``ns.baseline``, ``ns.pairs`` times each, alternately
    (ABAB), each run a child process with a fresh database. The figure per tree is the median of every
    round it timed."""
    with baseline_tree(ns.baseline) as base:
        trees = {"current": ("", ROOT), "baseline": (base.python_path, base.tree)}
        print(f"side by side: current {git('rev-parse', '--short', 'HEAD')} against {ns.baseline} ({base.commit[:7]})")
        rounds: dict[str, list[float]] = {side: [] for side in trees}
        for i in range(ns.pairs):
            for side in trees if i % 2 == 0 else reversed(trees):
                python_path, tree = trees[side]
                cmd = [sys.executable, "-m", "tests.bench.master", "--round-child", "--studies", str(ns.studies)]
                cmd += ["--trials", str(ns.trials), "--batch", str(ns.batch)]
                out = subprocess.run(cmd, cwd=ROOT, env=child_env(python_path), capture_output=True, text=True)
                lines = out.stdout.strip().splitlines()
                if out.returncode != 0 or not lines:
                    raise SystemExit(f"the {side} rounds failed ({out.returncode}):\n{out.stderr[-4000:]}")
                run = json.loads(lines[-1])
                if not run["code"].startswith(str(tree.resolve()) + os.sep):
                    raise SystemExit(f"the {side} run imported {run['code']}, not the code of {tree}")
                rounds[side] += run["rounds_ms"]
                print(f"{side:8s} round_runs_ms={[round(r, 1) for r in run['rounds_ms']]}", flush=True)
    current, baseline = (statistics.median(rounds[side]) for side in trees)
    return (
        f"round_ms_10k={current:.1f} round_ms_10k_baseline={baseline:.1f} baseline={ns.baseline}"
        f" round_vs_baseline={current / baseline:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--studies", type=int, default=50)
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--baseline", metavar="REF", default="", help="time only the round, beside this commit's")
    parser.add_argument("--pairs", type=int, default=3, help="with --baseline: child runs of each tree")
    parser.add_argument("--round-child", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.round_child:
        round_child(ns)
    elif ns.baseline:
        command = f"python -m tests.bench.master --baseline {ns.baseline} --pairs {ns.pairs}"
        print(record("master_vs_baseline", side_by_side(ns), command=command))
    else:
        with fresh_database() as url:
            line = asyncio.run(bench(url, ns.studies, ns.trials, ns.batch))
        print(record("master", line))


if __name__ == "__main__":
    main()
