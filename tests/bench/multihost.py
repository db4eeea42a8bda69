"""Off one host: ``python -m tests.bench.multihost`` (root: it makes network namespaces).

The namespace cluster of ``tests.e2e.multihost``: three node managers, each on its own host (a network
namespace with its own directories), the master, an aggregator, Tansu and a moto S3 server on the bridge,
checkpoints in ``s3://``. A 48-trial successive-halving study (rungs 4, 12, 36, eta 3) of the digits MLP,
trained for real, runs once per scenario, each with its own fixed part:

* ``clean``: no fault;
* ``partition_long``: once a third of the first rung has reported, the host of a running batch loses its
  link for the heartbeat TTL plus 4 s; its work is requeued elsewhere; then the link returns;
* ``partition_short``: the same, for a third of the TTL (nothing must be requeued);
* ``netem``: 30 ms latency and 2 % loss on one host's link for the whole run (skipped, with the reason,
  where the kernel has no ``sch_netem``).

Per run: ``lost`` = evals the tuner submitted that got no result plus requests left unfinished;
``duplicated`` = results delivered twice for one (trial, step). ``cross_host_resumes`` counts batches
that started from a checkpoint another host wrote (the writer's batch is in the key). ``stale`` counts the
reports the ledger refused as stale (an attempt lost with its host). Before the study, one checkpoint
(torch tensors, ``--ckpt-mb``) is written and read through the local store and through S3 side by side,
``--repeats`` times interleaved; medians are printed with their ratio to the local store's.

Last line: ``hosts=<n> checkpoint_store=s3 cross_host_resumes=<n> partitions_survived=<k>/<n>
results_lost=<n> results_duplicated=<n> stale_reports_rejected=<n>`` (targets: hosts >= 3,
cross_host_resumes >= 1, every partition survived, 0 lost, 0 duplicated).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from stagetree.client.driver import drive
from stagetree.client.sdk import Study, connect
from stagetree.client.tuners import SHA
from stagetree.client.tuners.base import Action, Event, Result
from stagetree.cluster import ProcessCluster
from stagetree.nodemanager.examples.faults import ENTRY_POINT
from stagetree.nodemanager.runtime.checkpoints import CheckpointStore, LocalCheckpointStore, open_checkpoint_store
from tests.bench.cluster import ETA, FAULT_AFTER, MAX_STEP, MIN_STEP, SLEEP_S, search_space
from tests.bench.record import record
from tests.e2e import netns
from tests.e2e.multihost import HEARTBEAT_TTL_S, MultiHost, multihost
from tests.s3server import CREDENTIALS

log = logging.getLogger("bench.multihost")

_WRITER = re.compile(r"-b(\d+)a\d+$")


@dataclass
class Run:
    name: str
    ran: bool = True
    lost: int = 0
    duplicated: int = 0
    wall_s: float = 0.0
    note: str = ""

    @property
    def survived(self) -> bool:
        return self.ran and self.lost == 0 and self.duplicated == 0 and not self.note.startswith("error")


class Counting:
    def __init__(self) -> None:
        self.results = 0
        self.reached = asyncio.Event()

    def __call__(self, event: Event, _actions: list[Action]) -> None:
        if isinstance(event, Result):
            self.results += 1
            if self.results >= FAULT_AFTER:
                self.reached.set()


def _running_host(mh: MultiHost, study: Study) -> str | None:
    rows = mh.cluster.query(
        "SELECT DISTINCT b.node_manager_id FROM batches b JOIN requests r ON r.plan_id = b.plan_id "
        "WHERE r.study_id = :s AND b.state = 'RUNNING'",
        s=study.id,
    )
    ids = {r[0] for r in rows}
    return next((n for n in mh.cluster.node_manager_names() if mh.cluster.node_manager_id(n) in ids), None)


async def _partition(mh: MultiHost, study: Study, seconds: float) -> str:
    name = await asyncio.to_thread(_running_host, mh, study) or mh.cluster.node_manager_names()[0]
    host = mh.hosts[name]
    mh.lab.partition(host)
    await asyncio.sleep(seconds)
    mh.lab.heal(host)
    return name


async def one_run(mh: MultiHost, scenario: str) -> Run:
    run = Run(scenario)
    if scenario == "netem":
        why = mh.lab.netem(mh.hosts[mh.cluster.node_manager_names()[-1]], delay_ms=30, loss_pct=2.0)
        if why:
            return Run(scenario, ran=False, note=f"skipped: {why}")
    t0 = time.monotonic()
    tag = f"mh-{scenario}-{uuid.uuid4().hex[:6]}"
    async with connect(mh.cluster.target, token=mh.cluster.token) as client:
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
        if scenario.startswith("partition"):
            await asyncio.wait({task, asyncio.ensure_future(counting.reached.wait())}, return_when="FIRST_COMPLETED")
            seconds = HEARTBEAT_TTL_S + 4 if scenario == "partition_long" else HEARTBEAT_TTL_S / 3
            run.note = f"cut {await _partition(mh, study, seconds)} for {seconds:.1f} s"
        try:
            driven = await asyncio.wait_for(task, 900)
        except Exception as e:
            run.note = f"error: {type(e).__name__}: {e}"
            run.wall_s = time.monotonic() - t0
            return run
    run.wall_s = time.monotonic() - t0
    results = [e for e in driven.events() if isinstance(e, Result)]
    per_point = Counter((r.trial_id, r.step) for r in results)
    unfinished = mh.cluster.query(
        "SELECT count(*) FROM requests WHERE study_id = :s AND state NOT IN ('DONE', 'CANCELLED')", s=study.id
    )[0][0]
    run.lost = max(0, len(driven.submits()) - len(per_point)) + int(unfinished)
    run.duplicated = sum(n - 1 for n in per_point.values())
    return run


def cross_host_resumes(cluster: ProcessCluster) -> int:
    """Batches that started from a checkpoint written by a batch of another node manager."""
    rows = cluster.query("SELECT id, node_manager_id, spec_json FROM batches")
    nm_of = {int(i): nm for i, nm, _ in rows}
    n = 0
    for _i, nm, spec in rows:
        uri = (json.loads(spec or "{}").get("source") or {}).get("uri") or ""
        m = _WRITER.search(uri)
        if m and nm_of.get(int(m.group(1))) not in (None, nm):
            n += 1
    return n


def checkpoint_times(mh: MultiHost, root: Path, mb: int, repeats: int) -> str:
    """Median put/open times of one checkpoint: local store, s3 (upload, cold download, cached open)."""
    import torch

    tensors = {f"w{i}": torch.randn(mb * 1024 * 1024 // 4 // 8) for i in range(8)}

    def write(d: Path) -> None:
        torch.save(tensors, d / "state.pt")

    local = LocalCheckpointStore(root / "bench-local")
    times: dict[str, list[float]] = {k: [] for k in ("local_put", "local_open", "s3_put", "s3_get", "s3_cached")}

    def read(store: CheckpointStore, uri: str) -> None:
        with store.open(uri) as d:
            (d / "state.pt").read_bytes()

    run = uuid.uuid4().hex[:8]
    for i in range(repeats):  # interleaved, so a slow moment hits both stores
        s3 = open_checkpoint_store(f"s3://{mh.bucket}/bench", s3_endpoint_url=mh.s3.url, cache_dir=root / f"cw{run}{i}")
        cold = open_checkpoint_store(
            f"s3://{mh.bucket}/bench", s3_endpoint_url=mh.s3.url, cache_dir=root / f"cr{run}{i}"
        )
        t = time.perf_counter()
        local_uri = local.put(f"b{run}/{i}", write).uri
        times["local_put"].append(time.perf_counter() - t)
        t = time.perf_counter()
        s3_uri = s3.put(f"b{run}/{i}", write).uri
        times["s3_put"].append(time.perf_counter() - t)
        t = time.perf_counter()
        read(local, local_uri)
        times["local_open"].append(time.perf_counter() - t)
        t = time.perf_counter()
        read(cold, s3_uri)  # another host: downloads
        times["s3_get"].append(time.perf_counter() - t)
        t = time.perf_counter()
        read(s3, s3_uri)  # the writing host: its cache
        times["s3_cached"].append(time.perf_counter() - t)
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    return (
        f"checkpoint {mb} MiB, median of {repeats}: "
        f"put local {med['local_put']:.1f} ms | s3 {med['s3_put']:.1f} ms (x{med['s3_put'] / med['local_put']:.2f}); "
        f"open local {med['local_open']:.1f} ms | s3 download {med['s3_get']:.1f} ms "
        f"(x{med['s3_get'] / med['local_open']:.2f}) | s3 cached {med['s3_cached']:.1f} ms "
        f"(x{med['s3_cached'] / med['local_open']:.2f})"
    )


async def bench(root: Path, hosts: int, mb: int, repeats: int, scenarios: list[str]) -> str:
    with multihost(root, hosts=hosts, aggregators=1) as mh:
        print(f"namespace cluster up: {hosts} hosts on {mh.lab.gateway}/24, s3://{mh.bucket}", flush=True)
        print(await asyncio.to_thread(checkpoint_times, mh, root, mb, repeats), flush=True)
        runs = []
        for scenario in scenarios:
            run = await one_run(mh, scenario)
            state = f"survived={run.survived}" if run.ran else "not run"
            print(
                f"{scenario:<16} {state} lost={run.lost} duplicated={run.duplicated} "
                f"wall_s={run.wall_s:.1f} {run.note}",
                flush=True,
            )
            runs.append(run)
        faults = [r for r in runs if r.name != "clean" and r.ran]
        return (
            f"hosts={hosts} checkpoint_store=s3 cross_host_resumes={cross_host_resumes(mh.cluster)} "
            f"partitions_survived={sum(r.survived for r in faults)}/{len(faults)} "
            f"results_lost={sum(r.lost for r in runs)} results_duplicated={sum(r.duplicated for r in runs)} "
            f"stale_reports_rejected={mh.stale_reports()}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=None, help="logs and work directories (default: a temp folder)")
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--ckpt-mb", type=int, default=16, help="size of the checkpoint timed local vs s3")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--scenarios", default="clean,partition_long,partition_short,netem", help="comma-separated, in order"
    )
    ns = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    why = netns.unavailable()
    if why:
        print(f"cannot make network namespaces: {why}", file=sys.stderr)
        return 2
    root = ns.root or Path(tempfile.mkdtemp(prefix="stagetree-bench-multihost-"))
    root.mkdir(parents=True, exist_ok=True)
    for k, v in CREDENTIALS.items():  # moto takes any; this process times the s3 store itself
        os.environ.setdefault(k, v)
    line = asyncio.run(bench(root, ns.hosts, ns.ckpt_mb, ns.repeats, ns.scenarios.split(",")))
    print(record("multihost", line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
