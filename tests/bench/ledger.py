"""Ledger benchmark: ``python -m tests.bench.ledger [--batches N] [--seed S]``.

One mixed sequence of batch reports (successes, user failures, out-of-memory failures, preemptions,
reports delivered twice, reports for an attempt that is not the running one, late reports of batches
that ended) is applied through both write paths into fresh SQLite databases:

- the gRPC path: ``ReportBatch`` calls over a real channel to a master on loopback;
- the bus path: the same facts as bus messages (encoded and decoded as the bus carries them) through the
  aggregator's ``Ingestor``.

Between reports, the requests sent back to the queue are dispatched again the same way in both
databases (sorted by id, three to a batch), so both see the same batch ids. The two databases must end
in the same state (requests, batches, attempts, metrics, checkpoints, curve points). Also measured: the largest class
under ``services/master/store/`` and the number of error-to-status tables in ``services/``. Last line:
``same_state=<true|false> report_paths=2 store_max_class_lines=<n> status_tables=<n>``.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import random
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from pydantic import SecretStr

from stagetree.bus.messages import Message, decode, encode
from stagetree.master.app import MasterApp
from stagetree.master.coordination import InProcessCoordination
from stagetree.master.settings import AuthSettings, MasterSettings, SchedulingSettings
from stagetree.master.store.ingest import Ingestor
from stagetree.master.store.schema import upgrade
from stagetree.master.store.store import Store, make_engine
from stagetree.proto.stagetree.v1 import master_pb2 as pb
from stagetree.proto.stagetree.v1 import master_pb2_grpc as pb_grpc
from tests.bench.record import record
from tests.status_tables import count_status_tables
from tests.unit.aggregator.helpers import BRANCH, World, make_world

ROOT = Path(__file__).resolve().parents[2]
ADMIN = "ledger-admin"
MAX_ATTEMPTS = 2  # low, so some requests run out of retries


@dataclass(frozen=True)
class Report:
    """What one attempt of one batch reports: metrics and checkpoints at points, then how it ended."""

    batch_id: int
    attempt: int
    end: str  # finished | failed | oom | preempted
    metrics: list[tuple[int, int, dict[str, float]]] = field(default_factory=list)
    checkpoints: list[tuple[int, int, str, int, str]] = field(default_factory=list)
    curve: list[tuple[int, int, dict[str, float]]] = field(default_factory=list)


def script(world: World, n_batches: int, seed: int, send: Callable[[list[Report]], None]) -> None:
    """Drive one world: dispatch, then report each running batch's fate; ``send`` applies reports."""
    rng = random.Random(seed)
    points = [(world.root, s) for s in range(1, BRANCH + 1)] + [(world.child, s) for s in range(BRANCH + 1, 100)]
    running: dict[int, list[tuple[int, int]]] = {}  # batch id -> points it carries
    ended: list[Report] = []  # reports already applied, for late redeliveries
    batches = 0
    while True:
        if batches < n_batches:
            world.requests([rng.choice(points) for _ in range(rng.randint(1, 3))])
        pending = sorted({rid for rid, _ in world.store.rounds.pending().get(world.plan_id, [])})
        by_id = {r.id: (r.node, r.step) for r in world.store.requests.get_requests(world.study, pending)}
        for i in range(0, len(pending), 3):
            ids = pending[i : i + 3]
            running[world.dispatch_ids(ids).id] = [by_id[r] for r in ids]
            batches += 1
        if not running:
            if batches >= n_batches:
                return
            continue  # every new request was answered from stored metrics: ask more
        bid = rng.choice(sorted(running))
        carried = running.pop(bid)
        fate = rng.choices(["finished", "failed", "oom", "preempted"], weights=[4, 3, 1, 2])[0]
        metrics = [(n, s, {"loss": round(1.0 / (s + bid), 6)}) for n, s in carried]
        curve = [(n, s, {"train_loss": round(2.0 / (s + bid), 6)}) for n, s in carried]
        ckpts = [(world.child, BRANCH, f"file:///ckpt/{world.child}/{BRANCH}", 1024, "central")]
        if fate == "finished":
            report = Report(bid, 1, fate, metrics, ckpts, curve)
        elif fate == "preempted":
            report = Report(bid, 1, fate, metrics[:1], [(world.root, 5, "file:///pre/5", 0, "peripheral")], curve[:1])
        else:
            report = Report(bid, 1, fate, metrics[:1], curve=curve[:1])
        sequence = [report]
        twist = rng.random()
        if twist < 0.15:
            sequence = [report, report]  # delivered twice
        elif twist < 0.3:
            sequence = [Report(bid, 2, "finished"), report]  # an attempt that is not the running one
        elif twist < 0.4 and ended:
            sequence = [report, rng.choice(ended)]  # a late report of a batch that ended before
        send(sequence)
        ended.append(report)


# -- the two paths -------------------------------------------------------------------------------------


def _proto(r: Report) -> pb.ReportBatchRequest:
    return pb.ReportBatchRequest(
        batch_id=r.batch_id,
        attempt=r.attempt,
        ok=r.end == "finished",
        metrics=[pb.MetricPoint(node=n, step=s, values=v) for n, s, v in r.metrics],
        curve=[pb.MetricPoint(node=n, step=s, values=v) for n, s, v in r.curve],
        checkpoints=[pb.CheckpointPoint(node=n, step=s, uri=u, bytes=b, kind=k) for n, s, u, b, k in r.checkpoints],
        error="boom" if r.end in ("failed", "oom") else "",
        oom=r.end == "oom",
        preempted=r.end == "preempted",
    )


def bus_path(world: World, n_batches: int, seed: int) -> None:
    ing = Ingestor(world.store, max_failures=MAX_ATTEMPTS)
    sent: dict[int, list[Message]] = {}  # id of a report -> its messages: a redelivery carries the same ids

    def send(seq: list[Report]) -> None:
        for r in seq:
            msgs = sent.get(id(r))
            if msgs is None:
                msgs = sent[id(r)] = _messages(world, r)
            ing.apply([decode(encode(m)) for m in msgs])

    script(world, n_batches, seed, send)


def _messages(world: World, r: Report) -> list[Message]:
    out: list[Message] = [world.checkpoint(r.batch_id, n, s, attempt=r.attempt) for n, s, *_ in r.checkpoints]
    if r.end == "preempted":
        out = []  # the preemption carries its own checkpoint
    by_node: dict[int, list[tuple[int, dict[str, float]]]] = {}
    for n, s, v in r.curve:
        by_node.setdefault(n, []).append((s, v))
    out += [
        world.curve(r.batch_id, n, sorted(pts, key=lambda p: p[0]), attempt=r.attempt)
        for n, pts in sorted(by_node.items())
    ]
    out += [world.metrics(r.batch_id, n, s, v, attempt=r.attempt) for n, s, v in r.metrics]
    if r.end == "finished":
        out.append(world.finished(r.batch_id, attempt=r.attempt))
    elif r.end == "preempted":
        ((n, s, *_),) = r.checkpoints
        out.append(world.preempted(r.batch_id, n, s, attempt=r.attempt))  # its uri is file:///pre/<step>
    else:
        out.append(world.failed(r.batch_id, "boom", oom=r.end == "oom", attempt=r.attempt))
    return out


# -- measures ------------------------------------------------------------------------------------------


def max_class_lines(folder: Path) -> tuple[int, str]:
    best = (0, "")
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                n = node.end_lineno - node.lineno + 1
                best = max(best, (n, f"{path.relative_to(ROOT)}:{node.name}"))
    return best


def fresh_store(path: Path) -> Store:
    engine = make_engine(f"sqlite:///{path}")
    upgrade(engine)
    return Store.open(engine)


async def _serve(url: str) -> tuple[MasterApp, Any, int]:
    settings = MasterSettings(
        database_url=url,
        auth=AuthSettings(tokens={}, admin_token=SecretStr(ADMIN)),
        scheduling=SchedulingSettings(max_attempts=MAX_ATTEMPTS),
    )
    app = MasterApp.build(settings, coordination=InProcessCoordination())
    server, port = await app.start_grpc(port=0)
    return app, server, port


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=80)
    ap.add_argument("--seed", type=int, default=7)
    ns = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        states = []
        for name in ("grpc", "bus"):
            path = Path(tmp) / f"{name}.db"
            store = fresh_store(path)
            world = make_world(store)
            if name == "grpc":
                loop = asyncio.new_event_loop()
                app, server, port = loop.run_until_complete(_serve(f"sqlite:///{path}"))
                try:
                    t = threading.Thread(target=loop.run_forever, daemon=True)
                    t.start()
                    _grpc_in_thread(world, f"127.0.0.1:{port}", ns.batches, ns.seed, loop)
                finally:
                    asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(10)
                    loop.call_soon_threadsafe(loop.stop)
                    t.join(10)
                    app.close()
            else:
                bus_path(world, ns.batches, ns.seed)
            states.append(world.state())
            store.dispose()
    grpc_state, bus_state = states
    same = grpc_state == bus_state
    if not same:
        for key in grpc_state:
            if grpc_state[key] != bus_state[key]:
                print(f"differs: {key}\n  grpc: {grpc_state[key][:10]}\n  bus:  {bus_state[key][:10]}")
    n_req, n_batches = len(grpc_state["requests"]), len(grpc_state["batches"])
    by_state: dict[str, int] = {}
    for r in grpc_state["requests"]:
        by_state[r[1]] = by_state.get(r[1], 0) + 1
    print(f"requests={n_req} batches={n_batches} request_states={dict(sorted(by_state.items()))}")
    lines, where = max_class_lines(ROOT / "services" / "master" / "store")
    print(f"largest store class: {where} ({lines} lines)")
    tables = count_status_tables(ROOT / "services")
    print(
        record(
            "ledger",
            f"same_state={str(same).lower()} report_paths=2 store_max_class_lines={lines} status_tables={tables}",
        )
    )


async def _report(stub: Any, req: pb.ReportBatchRequest, md: Any) -> Any:
    return await stub.ReportBatch(req, metadata=md)


async def _open(target: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(target)


def _grpc_in_thread(world: World, target: str, n_batches: int, seed: int, loop: asyncio.AbstractEventLoop) -> None:
    """The script runs here; each report goes over a channel owned by the server's loop thread."""
    channel = asyncio.run_coroutine_threadsafe(_open(target), loop).result(10)
    stub = pb_grpc.MasterServiceStub(channel)
    md = (("authorization", f"Bearer {ADMIN}"),)

    def send(seq: list[Report]) -> None:
        for r in seq:
            asyncio.run_coroutine_threadsafe(_report(stub, _proto(r), md), loop).result(30)

    try:
        script(world, n_batches, seed, send)
    finally:
        asyncio.run_coroutine_threadsafe(channel.close(), loop).result(10)


if __name__ == "__main__":
    main()
