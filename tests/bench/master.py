"""Master benchmark (Postgres): ``python -m tests.bench.master``.

Submits 10,000 requests (50 studies of 200 trials, batches of 100) through gRPC to a master on
loopback, times a scheduling round over the 10,000 pending requests (snapshot to dispatch decisions),
then the latency of evaluations answered from stored metrics. Last line:
``submit_per_s=<n> round_ms_10k=<t> cached_eval_p99_ms=<p> submit_vs_raw_insert=<r> round_10k_x_loop_rate=<k>``
(targets: >= 2000, <= 250, <= 20). The two last fields tie the absolute figures to same-run references
(``tests.bench.refs``): submissions over a plain psycopg2 insert of the same request rows, and the round's
time in iterations of a fixed Python loop (a machine-independent size of the round).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import uuid

import grpc
from pydantic import SecretStr
from sqlalchemy import create_engine, text

from stagetree.master.app import MasterApp
from stagetree.master.auth import Principal
from stagetree.master.coordination import InProcessCoordination
from stagetree.master.settings import AuthSettings, LimitSettings, MasterSettings
from stagetree.master.store.schema import upgrade
from stagetree.master.store.store import make_engine
from stagetree.proto.stagetree.v1 import master_pb2 as pb
from stagetree.proto.stagetree.v1 import master_pb2_grpc as pb_grpc
from tests.bench import refs
from tests.bench.record import record

ADMIN_URL = os.environ.get("STAGETREE_BENCH_PG_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test")
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


async def bench(url: str, studies: int, trials: int, batch: int) -> str:
    settings = MasterSettings(
        database_url=url,
        auth=AuthSettings(tokens={"bench": SecretStr(TOKEN)}, admin_token=SecretStr("bench-admin")),
        limits=LimitSettings(max_batch_items=batch),
    )
    app = MasterApp.build(settings, coordination=InProcessCoordination())
    server, port = await app.start_grpc(port=0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.MasterServiceStub(ch)
            submit_rate = await submit_all(stub, studies, trials, batch, step=100)
            admin = Principal("admin", admin=True)
            app.service.register_node_manager(admin, "bench-nm", "local", [(f"g{i}", "a100") for i in range(16)])
            app.coordination.heartbeat("bench-nm", 600)
            rounds = []
            for _ in range(5):  # the master's own round, up to the dispatch decisions (it writes nothing)
                t0 = time.perf_counter()
                d = app.scheduler.decide()
                rounds.append((time.perf_counter() - t0) * 1000)
                assert d.pending == studies * trials and len(d.decision.dispatches) == 16
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
    finally:
        await server.stop(grace=None)
        app.close()
    print(f"pending={studies * trials} round_runs_ms={[round(r, 1) for r in rounds]}")
    print(f"references (same run): raw_insert_per_s={raw:.0f} python_loop_per_s={loop_rate:.0f}")
    # The ratios move less with the machine than the absolute figures (tests.bench.refs).
    return (
        f"submit_per_s={submit_rate:.0f} round_ms_10k={round_ms:.1f} cached_eval_p99_ms={p99:.2f}"
        f" submit_vs_raw_insert={submit_rate / raw:.3f} round_10k_x_loop_rate={round_ms * loop_rate / 1000:.0f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--studies", type=int, default=50)
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--batch", type=int, default=100)
    ns = parser.parse_args()
    name = f"stagetree_bench_{uuid.uuid4().hex[:8]}"
    admin = create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))
    url = ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    try:
        engine = make_engine(url)
        upgrade(engine)
        engine.dispose()
        line = asyncio.run(bench(url, ns.studies, ns.trials, ns.batch))
    finally:
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
    print(record("master", line))


if __name__ == "__main__":
    main()
