"""Bad input and the data tier's faults on one process cluster: ``python -m tests.bench.faults``.

One ``ProcessCluster`` (master, two aggregators, two node managers, real training of the digits MLP) on a
throwaway PostgreSQL server (``initdb``/``pg_ctl`` on a free port: the shared server is never touched)
with the Tansu broker on durable storage (its S3 engine, on a moto S3 server). In order:

* ``fuzz``: schemathesis over every REST operation from the master's own spec (schema-valid and
  schema-breaking cases, with and without a token), then hypothesis-generated messages for every gRPC
  call; ``server_errors`` = 5xx answers and gRPC statuses outside the error table, ``spec_violations`` =
  REST answers whose status, content type or body the spec does not declare;
* ``pg_restart``: PostgreSQL stopped as a crash while a batch runs, started again 5 s later;
* ``broker_restart``: the broker killed while a batch runs, started again 6 s later on the same storage;
  ``*_lost`` = evals not answered, failed, or not DONE with their metrics; ``duplicated`` = metric rows
  past one per point, attempts counted failed and FAILED batches, over both faults;
* ``overload``: the node managers stopped (so nothing trains), 20 SDK clients with 8 tasks each submit
  one-item batches back to back for ``--overload-s`` seconds against the master's admission limit
  (``max_in_flight`` 64); ``overload_accepted_lost`` = answered submissions the database does not hold
  as answered, plus rows it holds that no answer named; ``overload_rss_growth_mb`` = the master
  process's peak RSS during the run less its RSS when the run started.

Last line: ``fuzz_requests=<n> server_errors=<n> spec_violations=<n> pg_restart_lost=<n>
broker_restart_lost=<n> duplicated=<n> overload_accepted_lost=<n> overload_rss_growth_mb=<m>`` (targets:
fuzz_requests >= 5000, every count 0, overload_rss_growth_mb <= 200).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from stagetree.client.sdk import connect
from stagetree.cluster import ProcessCluster
from stagetree.proto.stagetree.v1 import master_pb2 as pb
from stagetree.proto.stagetree.v1 import master_pb2_grpc as pb_grpc
from tests.bench.record import record
from tests.e2e.conftest import E2E_CONFIG
from tests.e2e.data_tier import broker_restart, data_tier_cluster, postgres_restart
from tests.e2e.helpers import new_study
from tests.integration.master.fuzz import FuzzReport, fuzz
from tests.integration.master.grpc_fuzz import fuzz_grpc
from tests.integration.master.load import hammer

log = logging.getLogger("bench.faults")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def run_fuzz(cluster: ProcessCluster, rest_examples: int, grpc_examples: int) -> tuple[FuzzReport, FuzzReport]:
    import httpx

    alice = {"Authorization": f"Bearer {cluster.token}"}
    fixed = {"trainer": "fuzz:Net", "dataset": "d", "seed": 0}
    with httpx.Client(base_url=cluster.rest_url, timeout=30) as http:
        study = http.post("/studies", json={"name": "fuzz", "fixed": fixed}, headers=alice).json()["id"]
        item = {"client_request_id": "seed", "config": {"tuned": {"lr": 0.1}}, "step": 3}
        http.post(f"/studies/{study}/requests", json={"items": [item]}, headers=alice).raise_for_status()
    base = cluster.rest_url.removesuffix("/api/v1")
    rest = fuzz(base, cluster.token, cluster.admin_token, study, examples_per_operation=rest_examples, budget_s=900)
    user = (("authorization", f"Bearer {cluster.token}"),)
    admin = (("authorization", f"Bearer {cluster.admin_token}"),)
    with grpc.insecure_channel(cluster.target) as channel:
        stub = pb_grpc.MasterServiceStub(channel)  # type: ignore[no-untyped-call]

        def call(method: str, msg: object, as_admin: bool) -> grpc.StatusCode:
            try:
                getattr(stub, method)(msg, metadata=admin if as_admin else user, timeout=30)
            except grpc.RpcError as exc:
                return exc.code()  # type: ignore[no-any-return,attr-defined]
            return grpc.StatusCode.OK

        rpc = fuzz_grpc(call, study, fixed, examples_per_call=grpc_examples)
    return rest, rpc


async def run_overload(cluster: ProcessCluster, seconds: float) -> tuple[int, float, int, int]:
    """(accepted lost, RSS growth in MB, accepted, shed) of 20 clients past the admission limit."""
    for name in cluster.node_manager_names():
        await asyncio.to_thread(cluster.stop_service, name)
    pid = cluster.pid("master")
    assert pid is not None
    clients = [connect(cluster.target, token=cluster.token, reconnect_s=max(120.0, seconds * 2)) for _ in range(20)]
    peak = base = rss_mb(pid)
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.wait(0.2):
            peak = max(peak, rss_mb(pid))

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        fixed = json.dumps({"trainer": "overload:Net", "dataset": "d", "seed": 0})
        study = await clients[0].call(
            "CreateStudy", pb.CreateStudyRequest(name="overload", fixed_json=fixed), idempotent=False
        )
        sampler.start()
        accepted = await hammer(clients, study.id, seconds=seconds, tasks_per_client=8)
    finally:
        stop.set()
        for c in clients:
            await c.close()
    rows = cluster.query("SELECT client_request_id, id FROM requests WHERE study_id = :s", s=study.id)
    stored = {str(cid): int(rid) for cid, rid in rows}
    lost = sum(1 for cid, rid in accepted.items() if stored.get(cid) != rid) + len(set(stored) - set(accepted))
    return lost, peak - base, len(accepted), sum(c.shed for c in clients)


async def main_async(args: argparse.Namespace) -> str:
    root = Path(tempfile.mkdtemp(prefix="stagetree-bench-faults-"))
    with data_tier_cluster(root, **E2E_CONFIG) as (cluster, pg):  # type: ignore[arg-type]
        t0 = time.monotonic()
        rest, rpc = await asyncio.to_thread(run_fuzz, cluster, args.rest_examples, args.grpc_examples)
        print(f"fuzz REST  {rest}", flush=True)
        print(f"fuzz gRPC  {rpc.requests} requests, {rpc.server_errors} server errors", flush=True)
        print(f"           {'; '.join(rpc.failures[:5])}", flush=True)
        print(f"fuzz took {time.monotonic() - t0:.0f} s", flush=True)
        async with connect(cluster.target, token=cluster.token, reconnect_s=120) as client:
            pg_out = await postgres_restart(cluster, pg, client, down_s=5.0)
            print(f"pg_restart      {pg_out}", flush=True)
            br_out = await broker_restart(cluster, client, down_s=6.0)
            print(f"broker_restart  {br_out}", flush=True)
            after = await new_study(client, "after-faults")
            await asyncio.wait_for(after.eval({"lr": 0.1}, 5), 120)  # the cluster still trains
        lost, growth, accepted, shed = await run_overload(cluster, args.overload_s)
        print(
            f"overload        {accepted} accepted, {shed} shed and retried, {lost} lost, RSS +{growth:.1f} MB",
            flush=True,
        )
    return (
        f"fuzz_requests={rest.requests + rpc.requests} server_errors={rest.server_errors + rpc.server_errors} "
        f"spec_violations={rest.spec_violations} pg_restart_lost={pg_out.lost} broker_restart_lost={br_out.lost} "
        f"duplicated={pg_out.duplicated + br_out.duplicated} overload_accepted_lost={lost} "
        f"overload_rss_growth_mb={growth:.1f}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.bench.faults", description=__doc__.split("\n")[0])
    p.add_argument("--rest-examples", type=int, default=110, help="schemathesis cases per operation and mode")
    p.add_argument("--grpc-examples", type=int, default=200, help="hypothesis messages per gRPC call")
    p.add_argument("--overload-s", type=float, default=60.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    print(record("faults", asyncio.run(main_async(args))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
