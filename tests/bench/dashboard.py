"""Benchmark of the dashboard at scale: a study of ``--trials`` trials with learning curves of
``--points`` points each, then its pages in headless Chromium.

    python -m tests.bench.dashboard [--trials 2000] [--points 200]

* The study: ``lr = MultiStep(0.1, [points/4], g1)`` over 20 values of ``g1`` and ``momentum =
  MultiStep(0.9, [points/2], g2)`` over ``trials/20`` values of ``g2``: trials share their first quarter,
  groups of them their second, each its last half (a plan of about ``trials + 21`` nodes). The master
  (SQLite, REST and the dashboard) runs here without a node manager: the requests are dispatched on one
  batch, and the points reach the database through the real ingest path (bus messages, encoded and
  decoded as on the wire, through an ``InProcessBus`` and the ``Aggregator``), a ``Curve`` message of at
  most 200 points per node, then the evaluation ``Metrics`` and the batch's end. Every trial's curve has
  ``--points`` points; each shared point is stored once (``curve_points`` counts what is stored).
  ``points_ingested_per_s``: stored points over the time from the first publish to the last point stored.
* ``study_page_ms`` / ``tree_page_ms``: from setting the page's URL (the app already loaded and signed in)
  to the first paint after every chart of the page is drawn (curves, parallel coordinates and the
  trials table; the tree), median of ``--runs``.
* ``live_update_ms``: with the study page open, one new curve point is published on the bus; the time
  until the page has drawn it (the aggregator stores it and wakes ``curves``, the server-sent event
  reaches the page, which fetches the new points and redraws), median of ``--runs``.

Targets: ``study_page_ms`` and ``tree_page_ms`` <= 1500, ``live_update_ms`` <= 1000.
The last line printed is
``trials=<n> curve_points=<n> study_page_ms=<t> tree_page_ms=<t> live_update_ms=<t> points_ingested_per_s=<r>``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from stagetree.aggregator.aggregator import Aggregator
from stagetree.bus.inprocess import InProcessBus
from stagetree.bus.messages import BatchFinished, Curve, Message, Metrics, decode, encode, make_msg_id, route
from stagetree.core.batch import Point
from stagetree.core.sequences import MultiStep
from stagetree.master.app import MasterApp
from stagetree.master.auth import Principal
from stagetree.master.coordination import InProcessCoordination
from stagetree.master.service import SubmitItem
from stagetree.master.settings import AuthSettings, MasterSettings
from stagetree.master.store.ingest import Ingestor
from stagetree.master.store.schema import upgrade
from stagetree.master.store.store import make_engine
from tests.browser.harness import Background, chromium_path

TOKEN = "bench-token"
OWNER = "bench"
NM = "bench-nm"
GROUPS = 20
FIXED = {"trainer": "stagetree.nodemanager.examples.digits:DigitsMLP", "seed": 0, "values": {}}


def configs(trials: int, points: int) -> list[dict[str, Any]]:
    per = max(1, trials // GROUPS)
    out = []
    for i in range(trials):
        g1, g2 = 0.5 + 0.02 * (i // per), 0.3 + 0.6 * (i % per) / per
        out.append(
            {"lr": MultiStep(0.1, [points // 4], round(g1, 6)), "momentum": MultiStep(0.9, [points // 2], round(g2, 6))}
        )
    return out


def build(home: Path, trials: int, points: int) -> tuple[MasterApp, InProcessCoordination, str, int]:
    url = f"sqlite:///{home / 'bench.db'}"
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    coordination = InProcessCoordination()
    settings = MasterSettings(
        database_url=url,
        auth=AuthSettings(tokens={OWNER: SecretStr(TOKEN)}, admin_token=SecretStr("bench-admin")),
    )
    app = MasterApp.build(settings, coordination=coordination)
    who = Principal(OWNER)
    study = app.service.create_study(who, "bench-dashboard", json.dumps(FIXED))
    items = []
    for i, cfg in enumerate(configs(trials, points)):
        tuned = {name: seq.to_json() for name, seq in cfg.items()}
        items.append(SubmitItem(f"r{i:06d}", json.dumps({"tuned": tuned}), points, f"trial-{i}"))
    for k in range(0, len(items), 500):
        app.service.submit(who, study.id, items[k : k + 500])
    store = app.store
    store.nodes.register_node_manager(NM, "127.0.0.1:1", [("slot0", "cpu")])
    reqs = store.requests.get_requests(study.id)
    plan_id = reqs[0].plan_id
    ranges = own_ranges(app, study.id)
    stages = [{"node": n, "start": a, "end": b} for n, (a, b) in sorted(ranges.items())]
    spec = json.dumps({"stages": stages})  # what the study's stats read: the steps it ran, each once
    batch = store.ledger.dispatch(plan_id, lambda b, a: spec, [r.id for r in reqs], NM, "slot0")
    assert batch is not None
    return app, coordination, study.id, batch.id


def own_ranges(app: MasterApp, study_id: str) -> dict[int, tuple[int, int]]:
    """node -> the steps ``(a, b]`` it owns on the study's trials' paths."""
    reqs = app.store.requests.get_requests(study_id)
    plan = app.service.plans.refresh(reqs[0].plan_id)
    own: dict[int, tuple[int, int]] = {}
    for r in reqs:
        for node, a, b in plan.path(Point(r.node, r.step)):
            _, hi = own.get(node, (a, a))
            own[node] = (a, max(hi, b))
    return own


def messages(app: MasterApp, study_id: str, batch_id: int, points: int) -> list[Message]:
    """Every node's own points (a shared point once), the evaluations, then the batch's end."""
    reqs = app.store.requests.get_requests(study_id)
    seq = iter(range(10**9))
    out: list[Message] = []

    def mid() -> str:
        return make_msg_id(NM, batch_id, 1, next(seq))

    for node, (a, b) in sorted(own_ranges(app, study_id).items()):
        steps = list(range(a + 1, b + 1))
        for k in range(0, len(steps), 200):
            part = steps[k : k + 200]
            values = [{"train_loss": 2.3 * 0.985**s + 0.001 * (node % 97)} for s in part]
            out.append(
                Curve(msg_id=mid(), node_manager=NM, batch_id=batch_id, attempt=1, node=node, steps=part, values=values)
            )
    for r in reqs:
        acc = 0.5 + 0.45 * ((r.id * 7919) % 1000) / 1000
        out.append(
            Metrics(
                msg_id=mid(),
                node_manager=NM,
                batch_id=batch_id,
                attempt=1,
                node=r.node,
                step=r.step,
                metrics={"accuracy": acc, "loss": 1 - acc},
            )
        )
    out.append(BatchFinished(msg_id=mid(), node_manager=NM, batch_id=batch_id, attempt=1, steps=points))
    return out


def stored_points(app: MasterApp) -> int:
    with app.store.db.tx("count") as s:
        from sqlalchemy import func, select

        from stagetree.master.store import models as m

        return int(s.scalar(select(func.count()).select_from(m.CurvePoint)) or 0)


def publish(bus: InProcessBus, msgs: list[Message]) -> None:
    for msg in msgs:
        wire = decode(encode(msg))  # as on the wire
        topic, key = route(wire)
        bus.publish(topic, key, wire)


class Http:
    """The master's REST app (with the dashboard) under uvicorn, on the ``Background`` loop."""

    async def start(self, app: MasterApp) -> str:
        import uvicorn

        from stagetree.master.api.rest import create_rest_app

        config = uvicorn.Config(create_rest_app(app), host="127.0.0.1", port=0, log_level="warning")
        self.server = uvicorn.Server(config)
        self.task = asyncio.get_running_loop().create_task(self.server.serve())
        while not self.server.started:
            await asyncio.sleep(0.02)
        return f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        self.server.should_exit = True
        await asyncio.wait_for(self.task, 20)


PAINTED = """async ([hash, ready]) => {
  const t0 = performance.now();
  location.hash = hash;
  const ok = () => ready.every((sel) => document.querySelector(sel));
  while (!ok()) await new Promise((r) => setTimeout(r, 5));
  await new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)));
  return performance.now() - t0;
}"""

RESOURCES = """() => performance.getEntriesByType('resource').filter((e) => e.name.includes('/api/'))
  .map((e) => `${e.name.split('/api/v1')[1].split('?')[0]} ${Math.round(e.startTime)}..${Math.round(e.responseEnd)}`)"""

LIVE = """async (before) => {
  const el = () => document.querySelector('#curves');
  while (Number(el().dataset.drawnPoints) <= before) await new Promise((r) => setTimeout(r, 2));
  await new Promise((r) => requestAnimationFrame(r));
  return performance.now();
}"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=2000)
    p.add_argument("--points", type=int, default=200)
    p.add_argument("--runs", type=int, default=5)
    ns = p.parse_args(argv)
    path = chromium_path()
    if path is None:
        print("no Chromium: apt-get install -y chromium", file=sys.stderr)
        return 1
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        app, coordination, study_id, batch_id = build(Path(d), ns.trials, ns.points)
        print(f"study of {ns.trials} trials submitted and dispatched in {time.perf_counter() - t:.1f} s", flush=True)
        bus = InProcessBus()
        aggregator = Aggregator(
            bus,
            Ingestor(app.store, app.service.plans),
            coordination,
            max_latency_s=0.005,
            poll_timeout_s=0.05,
            name="bench-aggregator",
        )
        aggregator.start()
        msgs = messages(app, study_id, batch_id, ns.points)
        curve_msgs = [m for m in msgs if isinstance(m, Curve)]
        want = sum(len(m.steps) for m in curve_msgs)
        t = time.perf_counter()
        publish(bus, msgs)
        while stored_points(app) < want:
            time.sleep(0.05)
        ingest_s = time.perf_counter() - t
        curve_points = stored_points(app)
        done = sum(1 for r in app.store.requests.get_requests(study_id) if str(r.state) == "DONE")
        print(f"{curve_points} curve points ingested in {ingest_s:.1f} s; {done} requests done", flush=True)

        bg = Background()
        http = Http()
        url = bg.run(http.start(app))
        study_ms, tree_ms, live_ms = [], [], []
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=path, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(120_000)
            page.on("console", lambda m: print("console:", m.text, file=sys.stderr))
            page.goto(f"{url}/dashboard/#token={TOKEN}")
            page.wait_for_selector("#studies-table tr[data-study]")
            study_ready = ["#curves[data-ready='1']", "#parallel[data-lines]", "#trials tbody tr"]
            for _ in range(ns.runs):
                page.evaluate("location.hash = '#/'")
                page.wait_for_selector("#studies-table tr[data-study]")
                study_ms.append(page.evaluate(PAINTED, [f"#/study/{study_id}", study_ready]))
                page.evaluate("location.hash = '#/'")
                page.wait_for_selector("#studies-table tr[data-study]")
                tree_ms.append(page.evaluate(PAINTED, [f"#/tree/{study_id}", ["#tree[data-ready='1']"]]))
            print(f"drawn: {page.get_attribute('#tree', 'data-node-count')} tree nodes", flush=True)
            page.evaluate("performance.clearResourceTimings()")
            page.evaluate(PAINTED, [f"#/study/{study_id}", study_ready])
            answers = page.evaluate(RESOURCES)
            print("study page's requests (ms, from the hash change): " + ", ".join(answers), flush=True)
            page.evaluate(f"location.hash = '#/study/{study_id}'")
            page.wait_for_selector("#curves[data-ready='1']")
            page.wait_for_function("document.querySelector('#live.on')")
            leaf = max(m.node for m in curve_msgs)
            for i in range(ns.runs):
                before = int(page.get_attribute("#curves", "data-drawn-points") or 0)
                page.evaluate(
                    f"before => {{ window.__seen = null; ({LIVE})(before).then((t) => {{ window.__seen = t; }}); }}",
                    before,
                )
                point = Curve(
                    msg_id=make_msg_id(NM, batch_id, 1, 10**8 + i),
                    node_manager=NM,
                    batch_id=batch_id,
                    attempt=1,
                    node=leaf,
                    steps=[ns.points + 1 + i],
                    values=[{"train_loss": 0.01}],
                )
                sent = page.evaluate("performance.now()")
                publish(bus, [point])
                page.wait_for_function("window.__seen !== null")
                live_ms.append(page.evaluate("window.__seen") - sent)
            drawn = page.get_attribute("#curves", "data-drawn-points")
            print(
                f"study page draws {drawn} of {page.get_attribute('#curves', 'data-total-points')} points", flush=True
            )
            browser.close()
        bg.run(http.stop())
        aggregator.stop(10.0)
        bus.close()
        app.close()
        bg.close()
    print(f"study_page_ms runs: {[round(x) for x in study_ms]}; tree_page_ms runs: {[round(x) for x in tree_ms]}")
    print(f"live_update_ms runs: {[round(x) for x in live_ms]}")
    print(
        f"trials={ns.trials} curve_points={curve_points} study_page_ms={statistics.median(study_ms):.0f} "
        f"tree_page_ms={statistics.median(tree_ms):.0f} live_update_ms={statistics.median(live_ms):.0f} "
        f"points_ingested_per_s={curve_points / ingest_s:.0f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
