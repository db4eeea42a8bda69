"""Benchmark of the dashboard at scale: a study of ``--trials`` trials with learning curves of
``--points`` points each, a plan of ``--tree-trials`` trials for the stage tree, then the pages in
headless Chromium.

    python -m tests.bench.dashboard [--trials 2000] [--points 200] [--tree-trials 10000] [--shots DIR]

* The study: ``lr = MultiStep(0.1, [points/4], g1)`` over 20 values of ``g1`` and ``momentum =
  MultiStep(0.9, [points/2], g2)`` over ``trials/20`` values of ``g2``: trials share their first quarter,
  groups of them their second, each its last half (a plan of about ``trials + 21`` nodes). The master
  (SQLite, REST and the dashboard) runs here without a node manager: the requests are dispatched on one
  batch, and the points reach the database through the real ingest path (bus messages, encoded and
  decoded as on the wire, through an ``InProcessBus`` and the ``Aggregator``), a ``Curve`` message of at
  most 200 points per node, then the evaluation ``Metrics`` and the batch's end. Every trial's curve has
  ``--points`` points; each shared point is stored once (``curve_points`` counts what is stored). Beside
  them, ``CRASHES`` trials of their own batch end with the ``batch_failed`` a node manager sends when the
  trainer raised two frames deep (``error_text`` of a real traceback, and the worker log's note).
  ``points_ingested_per_s``: stored points over the time from the first publish to the last point stored.
* ``study_page_ms`` / ``tree_page_ms`` / ``trial_page_ms``: from setting the page's URL (the app already
  loaded and signed in) to the first paint after every chart of the page is drawn (study: step and
  evaluation curves, parallel coordinates and the trials table; tree: the tree; trial: its curve,
  schedule and rungs), median of ``--runs``. The tree is that of a second study of ``--tree-trials``
  trials in the same shape (another seed, so another plan; evaluations, no curves):
  ``tree_nodes`` is how many nodes the page holds. The first run of each page reads the database; the
  later ones find the server's answers kept (``dashboard.cache``: the studies are finished, so their
  versions do not move), as a researcher going back and forth between the pages does (every run's
  figure is in ``runs`` of the results file). The parallel coordinates draw their 2,000 lines 400 a
  frame after their first (progressive): "drawn" is their first frame.
* ``live_update_ms``: with the study page open, one new curve point is published on the bus; the time
  until the page has drawn it (the aggregator stores it and wakes ``curves``, the server-sent event
  reaches the page, which fetches the new points and redraws), median of ``--runs``.
* ``eval_metric_plotted``: the study page's evaluation chart draws the trials' ``accuracy`` at their
  rungs. ``traceback_in_ui``: a click on a crashed trial's row opens its page showing the traceback's
  frames and the worker log's path.
* ``rebuilds_of_idle_study``: the (finished) study's page is open while a third study runs for 10 s
  (curve points every 0.1 s and its requests finishing one by one through the same bus); how many
  times the idle page fetched and redrew. ``busy_page_rebuilds`` (printed, not a target) is the same
  count on the running study's own page, in a second tab: it shows the events were there to hear.

Targets: ``study_page_ms`` and ``tree_page_ms`` (at 10,000 nodes) <= 1500, ``trial_page_ms`` <= 500,
``live_update_ms`` <= 1000, ``eval_metric_plotted`` and ``traceback_in_ui`` true,
``rebuilds_of_idle_study`` 0. ``tests.bench.record`` keeps the figures in
``tests/bench/results/dashboard.json``. The last line printed is ``trials=<n> curve_points=<n>
study_page_ms=<t> tree_page_ms=<t> live_update_ms=<t> points_ingested_per_s=<r> tree_nodes=<n>
trial_page_ms=<t> eval_metric_plotted=<b> traceback_in_ui=<b> rebuilds_of_idle_study=<n>``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from stagetree.aggregator.aggregator import Aggregator
from stagetree.bus.inprocess import InProcessBus
from stagetree.bus.messages import (
    BatchFailed,
    BatchFinished,
    Curve,
    Message,
    Metrics,
    decode,
    encode,
    make_msg_id,
    route,
)
from stagetree.core.batch import Point
from stagetree.core.failures import log_note
from stagetree.core.sequences import MultiStep
from stagetree.master.app import MasterApp
from stagetree.master.auth import Principal
from stagetree.master.coordination import InProcessCoordination
from stagetree.master.service import SubmitItem
from stagetree.master.settings import AuthSettings, MasterSettings
from stagetree.master.store.ingest import Ingestor
from stagetree.master.store.schema import upgrade
from stagetree.master.store.store import make_engine
from stagetree.nodemanager.runtime.executor import error_text
from tests.bench.record import record
from tests.browser.harness import Background, chromium_path

TOKEN = "bench-token"
OWNER = "bench"
NM = "bench-nm"
GROUPS = 20
CRASHES = 3
IDLE_WINDOW_S = 10.0
TRAINER = "stagetree.nodemanager.examples.digits:DigitsMLP"


def fixed(seed: int) -> dict[str, Any]:
    return {"trainer": TRAINER, "seed": seed, "values": {}}


def configs(trials: int, points: int) -> list[dict[str, Any]]:
    per = max(1, trials // GROUPS)
    out = []
    for i in range(trials):
        g1, g2 = 0.5 + 0.02 * (i // per), 0.3 + 0.6 * (i % per) / per
        out.append(
            {"lr": MultiStep(0.1, [points // 4], round(g1, 6)), "momentum": MultiStep(0.9, [points // 2], round(g2, 6))}
        )
    return out


def make_app(home: Path) -> tuple[MasterApp, InProcessCoordination]:
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
    app.store.nodes.register_node_manager(NM, "127.0.0.1:1", [("slot0", "cpu"), ("slot1", "cpu"), ("slot2", "cpu")])
    return app, coordination


def add_study(
    app: MasterApp, name: str, seed: int, cfgs: list[dict[str, Any]], step: int, slot: str, prefix: str = "trial"
) -> tuple[str, int]:
    """A study of these trials, all dispatched on one batch; (study id, batch id)."""
    who = Principal(OWNER)
    study = app.service.create_study(who, name, json.dumps(fixed(seed)))
    items = []
    for i, cfg in enumerate(cfgs):
        tuned = {k: seq.to_json() for k, seq in cfg.items()}
        items.append(SubmitItem(f"r{i:06d}", json.dumps({"tuned": tuned}), step, f"{prefix}-{i}"))
    for k in range(0, len(items), 500):
        app.service.submit(who, study.id, items[k : k + 500])
    return study.id, dispatch(app, study.id, slot)


def dispatch(app: MasterApp, study_id: str, slot: str, labels: set[str] | None = None) -> int:
    store = app.store
    reqs = [r for r in store.requests.get_requests(study_id) if labels is None or r.label in labels]
    ranges = own_ranges(app, study_id, {r.id for r in reqs})
    stages = [{"node": n, "start": a, "end": b} for n, (a, b) in sorted(ranges.items())]
    spec = json.dumps({"stages": stages})  # what the study's stats read: the steps it ran, each once
    batch = store.ledger.dispatch(reqs[0].plan_id, lambda b, a: spec, [r.id for r in reqs], NM, slot)
    assert batch is not None
    return batch.id


def own_ranges(app: MasterApp, study_id: str, ids: set[int] | None = None) -> dict[int, tuple[int, int]]:
    """node -> the steps ``(a, b]`` it owns on the study's trials' paths."""
    reqs = [r for r in app.store.requests.get_requests(study_id) if ids is None or r.id in ids]
    plan = app.service.plans.refresh(reqs[0].plan_id)
    own: dict[int, tuple[int, int]] = {}
    for r in reqs:
        for node, a, b in plan.path(Point(r.node, r.step)):
            _, hi = own.get(node, (a, a))
            own[node] = (a, max(hi, b))
    return own


class Ids:
    def __init__(self, batch_id: int) -> None:
        self.batch_id = batch_id
        self.seq = iter(range(10**9))

    def __call__(self) -> str:
        return make_msg_id(NM, self.batch_id, 1, next(self.seq))


def messages(app: MasterApp, study_id: str, batch_id: int, points: int, curves: bool = True) -> list[Message]:
    """Every node's own points (a shared point once), the evaluations, then the batch's end."""
    reqs = [r for r in app.store.requests.get_requests(study_id) if r.batch_id == batch_id]
    mid = Ids(batch_id)
    out: list[Message] = []
    for node, (a, b) in sorted(own_ranges(app, study_id, {r.id for r in reqs}).items()) if curves else []:
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


def _train_one_step() -> None:
    _apply_update()


def _apply_update() -> None:
    raise FloatingPointError("loss is NaN after the update (learning rate too high?)")


def crash(batch_id: int) -> BatchFailed:
    """The batch_failed a node manager sends when the trainer raised two frames deep."""
    try:
        _train_one_step()
    except FloatingPointError as e:
        error = f"{error_text(e, traceback.format_exc())}\n{log_note(f'/srv/nm/logs/batch-{batch_id}-a1.log', NM)}"
        return BatchFailed(
            msg_id=make_msg_id(NM, batch_id, 1, 0),
            node_manager=NM,
            batch_id=batch_id,
            attempt=1,
            error=error,
            traceback=traceback.format_exc(),
            oom=False,
            user_error=True,
        )
    raise AssertionError("unreachable")


def stored_points(app: MasterApp) -> int:
    with app.store.db.tx("count") as s:
        from sqlalchemy import func, select

        from stagetree.master.store import models as m

        return int(s.scalar(select(func.count()).select_from(m.CurvePointRow)) or 0)


def finished(app: MasterApp, study_id: str) -> int:
    return sum(1 for r in app.store.requests.get_requests(study_id) if r.state.is_finished())


def publish(bus: InProcessBus, msgs: list[Message]) -> None:
    for msg in msgs:
        wire = decode(encode(msg))  # as on the wire
        topic, key = route(wire)
        bus.publish(topic, key, wire)


def wait_for(check: Any, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("the bench's messages were not all applied")
        time.sleep(0.05)


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

REBUILDS = "sid => ((window.__stagetree || {}).rebuilds || {})[sid] || 0"
STUDY_READY = ["#curves[data-ready='1']", "#eval-curves[data-ready='1']", "#parallel[data-lines]", "#trials tbody tr"]
TRIAL_READY = ["#trial-curve[data-ready='1']", "#schedule-chart[data-ready='1']", "#rungs tbody tr"]


def run_busy(bus: InProcessBus, app: MasterApp, study_id: str, batch_id: int, stop: threading.Event) -> int:
    """Another study running: a curve point every 0.1 s on its nodes, and its requests answered one by
    one, until ``stop``; how many messages went."""
    reqs = app.store.requests.get_requests(study_id)
    nodes = sorted(own_ranges(app, study_id))
    mid = Ids(batch_id)
    step, sent = 1000, 0
    while not stop.is_set():
        step += 1
        node = nodes[step % len(nodes)]
        publish(bus, [Curve(msg_id=mid(), node_manager=NM, batch_id=batch_id, attempt=1, node=node, steps=[step],
                            values=[{"train_loss": 1.0 / step}])])  # fmt: skip
        sent += 1
        if step % 5 == 0 and reqs:
            r = reqs.pop()
            publish(bus, [Metrics(msg_id=mid(), node_manager=NM, batch_id=batch_id, attempt=1, node=r.node,
                                  step=r.step, metrics={"accuracy": 0.5})])  # fmt: skip
            sent += 1
        time.sleep(0.1)
    return sent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=2000)
    p.add_argument("--points", type=int, default=200)
    p.add_argument("--tree-trials", type=int, default=10_000)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--shots", type=Path, default=None, help="save the 10,000-node tree's screenshot here")
    p.add_argument(
        "--no-save", action="store_true", help="do not record the figures (tests/bench/results/dashboard.json)"
    )
    ns = p.parse_args(argv)
    path = chromium_path()
    if path is None:
        print("no Chromium: apt-get install -y chromium", file=sys.stderr)
        return 1
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        app, coordination = make_app(Path(d))
        study_id, batch_id = add_study(app, "bench-dashboard", 0, configs(ns.trials, ns.points), ns.points, "slot0")
        crash_cfgs = [{"lr": MultiStep(0.1, [ns.points // 4], 1.5 + i), "momentum": 0.9} for i in range(CRASHES)]
        who = Principal(OWNER)
        app.service.submit(
            who,
            study_id,
            [
                SubmitItem(
                    f"c{i}",
                    json.dumps({"tuned": {k: v if isinstance(v, float) else v.to_json() for k, v in c.items()}}),
                    ns.points,
                    f"crash-{i}",
                )
                for i, c in enumerate(crash_cfgs)
            ],
        )
        crash_batch = dispatch(app, study_id, "slot1", {f"crash-{i}" for i in range(CRASHES)})
        tree_id, tree_batch = add_study(app, "bench-tree", 1, configs(ns.tree_trials, 40), 40, "slot2")
        print(
            f"studies of {ns.trials} (+{CRASHES} crashing) and {ns.tree_trials} trials submitted and dispatched in "
            f"{time.perf_counter() - t:.1f} s",
            flush=True,
        )
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
        wait_for(lambda: stored_points(app) >= want)
        ingest_s = time.perf_counter() - t
        curve_points = stored_points(app)
        publish(bus, [crash(crash_batch)])
        publish(bus, messages(app, tree_id, tree_batch, 40, curves=False))
        wait_for(lambda: finished(app, study_id) == ns.trials + CRASHES and finished(app, tree_id) == ns.tree_trials)
        print(f"{curve_points} curve points ingested in {ingest_s:.1f} s; every request answered", flush=True)
        busy_id, busy_batch = add_study(app, "bench-busy", 2, configs(60, 40), 40, "slot0", prefix="busy")

        bg = Background()
        http = Http()
        url = bg.run(http.start(app))
        study_ms: list[float] = []
        tree_ms: list[float] = []
        trial_ms: list[float] = []
        live_ms: list[float] = []
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=path, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(120_000)
            page.on("console", lambda m: print("console:", m.text, file=sys.stderr) if m.type == "error" else None)
            page.on("pageerror", lambda e: print("page error:", e, file=sys.stderr))
            page.goto(f"{url}/dashboard/#token={TOKEN}")
            page.wait_for_selector("#studies-table tr[data-study]")
            for _ in range(ns.runs):
                page.evaluate("location.hash = '#/'")
                page.wait_for_selector("#studies-table tr[data-study]")
                study_ms.append(page.evaluate(PAINTED, [f"#/study/{study_id}", STUDY_READY]))
                trial_ms.append(page.evaluate(PAINTED, [f"#/trial/{study_id}/label/trial-7", TRIAL_READY]))
                page.evaluate("location.hash = '#/'")
                page.wait_for_selector("#studies-table tr[data-study]")
                tree_ms.append(page.evaluate(PAINTED, [f"#/tree/{tree_id}", ["#tree[data-ready='1']"]]))
            tree_nodes = int(page.get_attribute("#tree", "data-node-count") or 0)
            print(f"drawn: {tree_nodes} tree nodes, {page.get_attribute('#tree', 'data-rows')} rows open", flush=True)
            if ns.shots is not None:
                ns.shots.mkdir(parents=True, exist_ok=True)
                page.fill("#tree-search", f"trial-{min(4321, ns.tree_trials - 1)}")
                page.press("#tree-search", "Enter")
                page.wait_for_selector("#node-trials")
                page.wait_for_timeout(500)
                page.screenshot(path=str(ns.shots / "dashboard-tree-10k.png"))
            page.evaluate("performance.clearResourceTimings()")
            page.evaluate(PAINTED, [f"#/study/{study_id}", STUDY_READY])
            answers = page.evaluate(RESOURCES)
            print("study page's requests (ms, from the hash change): " + ", ".join(answers), flush=True)
            eval_points = int(page.get_attribute("#eval-curves", "data-points") or 0)
            eval_plotted = eval_points > 0 and page.input_value("#eval-metric") == "accuracy"
            print(f"evaluation chart: {eval_points} rungs of accuracy drawn", flush=True)

            # a crashed trial: its row opens its page, with the traceback and the worker log's path
            page.select_option("#state-filter", "failed")
            page.click("#trials tbody tr[data-state=FAILED]")
            page.wait_for_selector("#traceback")
            tb = page.inner_text("#traceback")
            traceback_in_ui = (
                "in _apply_update" in tb
                and "in _train_one_step" in tb
                and page.inner_text("#log-path").endswith(".log")
            )

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

            # the study is idle now; another runs for IDLE_WINDOW_S while its page is open (and the busy
            # study's page in a second tab)
            page.wait_for_timeout(1500)
            busy_page = browser.new_page(viewport={"width": 1400, "height": 1000})
            busy_page.goto(f"{url}/dashboard/#token={TOKEN}")
            busy_page.wait_for_selector("#studies-table tr[data-study]")
            busy_page.evaluate(f"location.hash = '#/study/{busy_id}'")
            busy_page.wait_for_selector("#curves[data-ready='1']")
            busy_page.wait_for_function("document.querySelector('#live.on')")
            idle_before = page.evaluate(REBUILDS, study_id)
            stop = threading.Event()
            busy = threading.Thread(target=lambda: run_busy(bus, app, busy_id, busy_batch, stop), daemon=True)
            busy.start()
            page.wait_for_timeout(IDLE_WINDOW_S * 1000)
            stop.set()
            busy.join(10)
            page.wait_for_timeout(1000)
            rebuilds_idle = page.evaluate(REBUILDS, study_id) - idle_before
            rebuilds_busy = busy_page.evaluate(REBUILDS, busy_id)
            print(f"in {IDLE_WINDOW_S:.0f} s of another study running: idle page rebuilt {rebuilds_idle} times, "
                  f"the running study's page {rebuilds_busy} times", flush=True)  # fmt: skip
            browser.close()
        bg.run(http.stop())
        aggregator.stop(10.0)
        bus.close()
        app.close()
        bg.close()
    print(f"study_page_ms runs: {[round(x) for x in study_ms]}; tree_page_ms runs: {[round(x) for x in tree_ms]}; "
          f"trial_page_ms runs: {[round(x) for x in trial_ms]}")  # fmt: skip
    print(f"live_update_ms runs: {[round(x) for x in live_ms]}")
    figures = {
        "trials": ns.trials,
        "curve_points": curve_points,
        "study_page_ms": round(statistics.median(study_ms)),
        "tree_page_ms": round(statistics.median(tree_ms)),
        "live_update_ms": round(statistics.median(live_ms)),
        "points_ingested_per_s": round(curve_points / ingest_s),
        "tree_nodes": tree_nodes,
        "trial_page_ms": round(statistics.median(trial_ms)),
        "eval_metric_plotted": eval_plotted,
        "traceback_in_ui": traceback_in_ui,
        "rebuilds_of_idle_study": rebuilds_idle,
    }
    line = " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in figures.items())
    runs = {"study_page_ms": study_ms, "tree_page_ms": tree_ms, "trial_page_ms": trial_ms, "live_update_ms": live_ms}
    print(line if ns.no_save else record("dashboard", line, extra={"busy_page_rebuilds": rebuilds_busy, "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
