"""Ledger benchmark: ``python -m tests.bench.ledger [--batches N] [--seed S]``.

One mixed sequence of batch reports (successes, user failures, out-of-memory failures, preemptions,
reports delivered twice, reports for an attempt that is not the running one, late reports of batches
that ended) is applied through both write paths into fresh SQLite databases:

- the gRPC path: ``ReportBatch`` calls over a real channel to a master on loopback, carrying the
  attempt's bus messages as a node manager sends them (``events``);
- the bus path: the same messages (encoded and decoded as the bus carries them) through the
  aggregator's ``Ingestor``.

Between reports, the requests sent back to the queue are dispatched again the same way in both
databases (sorted by id, three to a batch), so both see the same batch ids. The two databases must end
in the same state (requests, batches, attempts, metrics, checkpoints, curve points, path changes, the
trainers' log lines). Also measured, by
reading the code (``ast``) under ``services/``: ``ingest_functions``, the functions that write a report's
effects (those that both store metrics and end attempts: ``record_metrics_in`` and ``end_attempts_in``);
``event_definitions``, the worker event types (the bus message classes) whose name more than one class
defines; the largest class under ``services/master/store/``; and the number of error-to-status tables.
Last line: ``same_state=<true|false> report_paths=2 ingest_functions=<n> event_definitions=<n>
store_max_class_lines=<n> status_tables=<n>`` (targets: true, 1, 0, <= 400, 1).
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

from stagetree.bus.messages import MESSAGE_TYPES, Message, decode, encode, encode_many
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


def _proto(r: Report, msgs: list[Message]) -> pb.ReportBatchRequest:
    return pb.ReportBatchRequest(batch_id=r.batch_id, attempt=r.attempt, events=encode_many(msgs))


def bus_path(world: World, n_batches: int, seed: int) -> None:
    ing = Ingestor(world.store, max_failures=MAX_ATTEMPTS)
    sent: dict[int, tuple[Report, list[Message]]] = {}  # id -> the report, its messages: sent again, the same ids

    def send(seq: list[Report]) -> None:
        for r in seq:
            if id(r) not in sent:  # the report is kept with its messages, so its id is never reused
                sent[id(r)] = (r, _messages(world, r))
            msgs = sent[id(r)][1]
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
    out += [
        world.log_line(r.batch_id, i, f"{r.end} {n}:{s}", n, s, attempt=r.attempt)
        for i, (n, s, _) in enumerate(r.metrics)
    ]
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


def _functions(folder: Path) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    out = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                out.append((f"{path.relative_to(ROOT)}:{node.name}", node))
    return out


def ingest_functions(folder: Path) -> list[str]:
    """The functions that write a report's effects: they store metrics and end attempts."""
    out = []
    for where, fn in _functions(folder):
        called = {n.func.attr for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
        if {"record_metrics_in", "end_attempts_in"} <= called:
            out.append(where)
    return out


def class_definitions(folder: Path) -> dict[str, list[str]]:
    """Class name -> where each class of that name is defined (generated protobuf code left out)."""
    out: dict[str, list[str]] = {}
    for path in sorted(folder.rglob("*.py")):
        if "proto" in path.relative_to(folder).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    return out


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
    ingests = ingest_functions(ROOT / "services")
    print(f"ingest functions: {ingests}")
    classes = class_definitions(ROOT / "services")
    clashes = {name: where for name, where in classes.items() if len(where) > 1}
    print(f"class names defined more than once: {clashes}")
    events = sorted({cls.__name__ for cls in MESSAGE_TYPES.values()} & set(clashes))
    print(
        record(
            "ledger",
            f"same_state={str(same).lower()} report_paths=2 ingest_functions={len(ingests)} "
            f"event_definitions={len(events)} store_max_class_lines={lines} status_tables={tables}",
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

    sent: dict[int, tuple[Report, list[Message]]] = {}  # id -> the report, its messages: sent again, the same ids

    def send(seq: list[Report]) -> None:
        for r in seq:
            if id(r) not in sent:  # the report is kept with its messages, so its id is never reused
                sent[id(r)] = (r, _messages(world, r))
            msgs = sent[id(r)][1]
            asyncio.run_coroutine_threadsafe(_report(stub, _proto(r, msgs), md), loop).result(30)

    try:
        script(world, n_batches, seed, send)
    finally:
        asyncio.run_coroutine_threadsafe(channel.close(), loop).result(10)


if __name__ == "__main__":
    main()
