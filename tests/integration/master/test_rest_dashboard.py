"""The dashboard's reads through a real uvicorn server, on Postgres and SQLite: a study of labelled trials
(one with two rungs, one that fails with a traceback) as the Studies, Study, Trial, Stage tree and Cluster
pages read it; each read the owner's only (another owner gets 404, no token 401) and bad input a 422."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from stagetree.core.batch import Point
from stagetree.core.failures import log_note
from stagetree.core.lifecycle import MetricPoint
from stagetree.core.sequences import MultiStep
from stagetree.dashboard import routes as dashboard_routes
from stagetree.dashboard.schemas import Curves
from stagetree.master.app import MasterApp
from stagetree.master.auth import ADMIN, Principal
from stagetree.master.store.activity import ActivityReader
from tests.integration.master.conftest import TOKENS
from tests.integration.master.helpers import fixed, unique
from tests.reports import attempt_report

ALICE = {"Authorization": f"Bearer {TOKENS['alice']}"}
BOB = {"Authorization": f"Bearer {TOKENS['bob']}"}
ROOT_ADMIN = Principal(ADMIN, admin=True)
BRANCH, END = 4, 8
TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/home/me/trainer.py", line 40, in train\n'
    "    self.step_once()\n"
    '  File "/home/me/trainer.py", line 52, in step_once\n'
    "    raise ValueError('boom')\n"
    "ValueError: boom"
)


def _item(cid: str, gamma: float, step: int, label: str, fixed_part: dict[str, Any]) -> dict[str, Any]:
    lr = MultiStep(0.1, [BRANCH], gamma).to_json()
    return {
        "client_request_id": cid,
        "config": {"fixed": fixed_part, "tuned": {"lr": lr}},
        "step": step,
        "label": label,
    }


def _spec(app: MasterApp, plan_id: int, reqs: list[dict[str, Any]]) -> str:
    plan = app.service.plans.refresh(plan_id)
    stages: dict[int, tuple[int, int]] = {}
    for r in reqs:
        for node, a, b in plan.path(Point(r["node"], r["step"])):
            lo, hi = stages.get(node, (a, b))
            stages[node] = (min(lo, a), max(hi, b))
    return json.dumps({"stages": [{"node": n, "start": a, "end": b} for n, (a, b) in sorted(stages.items())]})


def _study(http: httpx.Client, app: MasterApp) -> dict[str, Any]:
    """trial-0 (rungs at BRANCH and END), trial-1 (END), both done; trial-2 (END) fails with a traceback."""
    fx = fixed()
    sid = http.post("/studies", json={"name": unique("dash")}, headers=ALICE).json()["id"]
    items = [
        _item("a", 0.5, BRANCH, "trial-0", fx),
        _item("b", 0.5, END, "trial-0", fx),
        _item("c", 0.2, END, "trial-1", fx),
        _item("d", 0.05, END, "trial-2", fx),
    ]
    reqs = http.post(f"/studies/{sid}/requests", json={"items": items}, headers=ALICE).json()
    store = app.store
    nm = unique("nm")
    store.nodes.register_node_manager(nm, "127.0.0.1:1", [("slot0", "cpu"), ("slot1", "cpu")])
    pid = store.plans.study_plan_ids(sid)[0]
    ok = store.ledger.dispatch(
        pid, lambda b, a: _spec(app, pid, reqs[:3]), [r["request_id"] for r in reqs[:3]], nm, "slot0"
    )
    bad = store.ledger.dispatch(pid, lambda b, a: _spec(app, pid, reqs[3:]), [reqs[3]["request_id"]], nm, "slot1")
    assert ok is not None and bad is not None
    store.curves.record([(reqs[0]["node"], s, {"train_loss": 1.0 / s}) for s in range(1, BRANCH + 1)])
    metrics = [
        MetricPoint(r["node"], r["step"], {"accuracy": 0.5 + 0.1 * i, "loss": 1.0 - 0.1 * i})
        for i, r in enumerate(reqs[:3])
    ]
    app.service.report_batch(ROOT_ADMIN, attempt_report(ok.id, 1, True, metrics))
    error = f"ValueError: boom\n{TRACEBACK}\n{log_note(f'/srv/nm/logs/batch-{bad.id}-a1.log', nm)}"
    app.service.report_batch(ROOT_ADMIN, attempt_report(bad.id, 1, False, error=error, user_error=True))
    return {"sid": sid, "reqs": reqs, "nm": nm, "ok": ok.id, "bad": bad.id, "pid": pid, "fixed": fx}


def test_pages_read_trials_their_rungs_and_a_failure_with_its_traceback(http: httpx.Client, app: MasterApp) -> None:
    s = _study(http, app)
    sid, reqs = s["sid"], s["reqs"]
    (row,) = [x for x in http.get("/dashboard/studies", headers=ALICE).json() if x["id"] == sid]
    assert row["state"] == "done" and row["trials"] == 3 and row["counts"]["DONE"] == 3
    assert row["trial_counts"] == {"DONE": 2, "FAILED": 1} and row["duration_s"] >= 0

    page = http.get(f"/dashboard/studies/{sid}", headers=ALICE).json()
    trials = {t["key"]: t for t in page["trials"]}
    assert list(trials) == ["trial-0", "trial-1", "trial-2"]
    assert [r["step"] for r in trials["trial-0"]["rungs"]] == [BRANCH, END]
    assert trials["trial-0"]["metrics"]["accuracy"] == pytest.approx(0.6) and trials["trial-0"]["metric_step"] == END
    assert trials["trial-2"]["state"] == "FAILED" and trials["trial-2"]["error"] == "ValueError: boom"
    assert page["features"] == ["lr.final"]  # what differs between the trials: the rate after the drop
    assert {t["features"]["lr.final"] for t in trials.values()} == {0.05, 0.02, 0.005}
    assert set(page["importance"]) == {"accuracy", "loss"}
    assert page["best"]["trial"] == "trial-1" and page["best"]["metric"] == "accuracy"
    assert "lr=MultiStep(0.1, [4], 0.5)" in trials["trial-0"]["schedule"]  # the canonical printed form, whole

    trial = http.get(f"/dashboard/studies/{sid}/trial", params={"label": "trial-2"}, headers=ALICE).json()
    assert trial["state"] == "FAILED" and trial["failure"]["headline"] == "ValueError: boom"
    assert "line 52, in step_once" in trial["failure"]["traceback"]
    assert trial["failure"]["log_path"] == f"/srv/nm/logs/batch-{s['bad']}-a1.log"
    assert trial["failure"]["node_manager"] == s["nm"]
    assert [(a["batch_id"], a["state"]) for a in trial["attempts"]] == [(s["bad"], "FAILED")]
    first = trial["path"][0]  # the shared first steps: trial-0 and trial-1 ran them too
    assert (first["start"], first["end"]) == (0, BRANCH) and first["shared_with"] == 2
    assert {t["key"] for t in first["trials"]} == {"trial-0", "trial-1"}
    (lr,) = trial["schedule"]["hps"]
    assert lr["numeric"] and [0, 0.1] in lr["points"] and [END, pytest.approx(0.005)] in lr["points"]
    by_id = http.get(f"/dashboard/studies/{sid}/trial?request_id={reqs[0]['request_id']}", headers=ALICE).json()
    assert by_id["key"] == "trial-0" and by_id["curve"]["total"] == BRANCH

    tree = http.get(f"/dashboard/studies/{sid}/tree", headers=ALICE).json()
    nodes = {n["id"]: n for n in tree["nodes"]}
    failed_node = reqs[3]["node"]
    root = next(n for n in tree["nodes"] if n["parent"] is None)
    # the shared root was trained for the other trials: it is done, the failure is trial-2's own node's
    assert root["state"] == "done" and root["trials"] == 3
    assert nodes[failed_node]["state"] == "failed" and nodes[reqs[2]["node"]]["state"] == "done"
    assert {t["key"]: t["state"] for t in tree["trials"]} == {"trial-0": "DONE", "trial-1": "DONE", "trial-2": "FAILED"}
    detail = http.get(f"/dashboard/studies/{sid}/tree/nodes/{root['id']}", headers=ALICE).json()
    assert detail["trial_count"] == 3 and detail["state"] == "done" and detail["curve_points"] == BRANCH
    assert {t["key"]: t["error"] for t in detail["trials"]}["trial-2"] == "ValueError: boom"

    ev = http.get(f"/dashboard/studies/{sid}/curves?metric=accuracy", headers=ALICE).json()
    assert ev["kind"] == "eval" and ev["eval_metrics"] == ["accuracy", "loss"] and ev["metrics"] == ["train_loss"]
    assert {t["key"]: [p[:2] for p in t["points"]] for t in ev["trials"]} == {
        "trial-0": [[BRANCH, 0.5], [END, pytest.approx(0.6)]],
        "trial-1": [[END, pytest.approx(0.7)]],
    }
    step = http.get(f"/dashboard/studies/{sid}/curves?metric=train_loss&times=true", headers=ALICE).json()
    (own,) = [n for n in step["nodes"] if n["points"]]
    assert step["kind"] == "step" and len(own["points"]) == BRANCH and len(own["times"]) == BRANCH
    # the curves are written as built, not through their response model: they must still match it
    for answer in (ev, step, http.get(f"/dashboard/studies/{sid}/curves", headers=ALICE).json()):
        Curves.model_validate(answer)
    # "loss" is both a step metric's name nowhere and an evaluation metric: kind picks it
    assert http.get(f"/dashboard/studies/{sid}/curves?metric=loss", headers=ALICE).json()["kind"] == "eval"

    cluster = http.get("/dashboard/cluster", headers=ALICE).json()
    assert [f["trial"] for f in cluster["failures"] if f["study_id"] == sid] == ["trial-2"]
    assert not [d for d in cluster["decisions"] if d["study_id"] == sid]  # a crash is no policy decision


def test_every_dashboard_read_is_the_owners_only_and_checks_its_input(http: httpx.Client, app: MasterApp) -> None:
    s = _study(http, app)
    sid, node = s["sid"], s["reqs"][0]["node"]
    paths = [
        f"/dashboard/studies/{sid}",
        f"/dashboard/studies/{sid}/trial?label=trial-0",
        f"/dashboard/studies/{sid}/tree",
        f"/dashboard/studies/{sid}/tree/nodes/{node}",
        f"/dashboard/studies/{sid}/curves?metric=accuracy",
        f"/dashboard/studies/{sid}/batches/{s['bad']}/log",
    ]
    for path in paths:
        assert http.get(path, headers=ALICE).status_code == 200, path
        assert http.get(path, headers=BOB).status_code == 404, path
        assert http.get(path).status_code == 401, path
    bad = [
        f"/dashboard/studies/{sid}/trial",  # neither label nor request_id
        f"/dashboard/studies/{sid}/trial?label=trial-0&request_id=1",
        f"/dashboard/studies/{sid}/trial?label=",
        f"/dashboard/studies/{sid}/trial?request_id=0",
        f"/dashboard/studies/{sid}/tree/nodes/0",
        f"/dashboard/studies/{sid}/curves?kind=other",
        f"/dashboard/studies/{sid}/curves?since=-1",
        f"/dashboard/studies/{sid}/batches/{s['bad']}/log?attempt=0",
        f"/dashboard/studies/{sid}/batches/{s['bad']}/log?tail_bytes=0",
        f"/dashboard/studies/{sid}/tree?plan_key={'x' * 200}",
    ]
    for path in bad:
        r = http.get(path, headers=ALICE)
        assert r.status_code == 422 and r.json()["error"] == "INVALID_ARGUMENT", (path, r.text)
    missing = [
        f"/dashboard/studies/{sid}/trial?label=nobody",
        f"/dashboard/studies/{sid}/trial?request_id=999999999",
        f"/dashboard/studies/{sid}/tree/nodes/999999999",
        f"/dashboard/studies/{sid}/batches/999999999/log",
        f"/dashboard/studies/{sid}/batches/{s['bad']}/log?attempt=2",
    ]
    for path in missing:
        assert http.get(path, headers=ALICE).status_code == 404, path
    # another study of alice's cannot read this study's batch's log
    other = http.post("/studies", json={"name": unique("other")}, headers=ALICE).json()["id"]
    assert http.get(f"/dashboard/studies/{other}/batches/{s['ok']}/log", headers=ALICE).status_code == 404


def test_a_worker_log_is_read_where_the_master_can_and_located_where_it_cannot(
    http: httpx.Client, app: MasterApp, tmp_path: Path
) -> None:
    s = _study(http, app)
    url = f"/dashboard/studies/{s['sid']}/batches/{s['bad']}/log"
    away = http.get(url, headers=ALICE).json()
    assert not away["readable"] and s["nm"] in away["where"] and away["files"] == []
    log = tmp_path / "batch.log"
    log.write_text("start\n" + "x" * 100 + "\nValueError: boom\n")
    app.worker_logs = lambda nm, b, a: [log] if (nm, b, a) == (s["nm"], s["bad"], 1) else []
    try:
        here = http.get(url, headers=ALICE).json()
        assert here["readable"] and here["files"][0]["text"].endswith("ValueError: boom\n")
        tail = http.get(url + "?tail_bytes=17", headers=ALICE).json()["files"][0]
        assert tail["text"] == "ValueError: boom\n" and tail["truncated"]
    finally:
        app.worker_logs = None


def test_a_batch_sent_ahead_does_not_make_its_slot_busier(http: httpx.Client, app: MasterApp) -> None:
    fx = fixed()
    sid = http.post("/studies", json={"name": unique("ahead")}, headers=ALICE).json()["id"]
    items = [_item("a", 0.5, END, "trial-a", fx), _item("b", 0.2, END, "trial-b", fx)]
    reqs = http.post(f"/studies/{sid}/requests", json={"items": items}, headers=ALICE).json()
    store, nm = app.store, unique("nm")
    store.nodes.register_node_manager(nm, "127.0.0.1:1", [("slot0", "cpu")])
    pid = store.plans.study_plan_ids(sid)[0]
    first = store.ledger.dispatch(pid, lambda b, a: _spec(app, pid, reqs[:1]), [reqs[0]["request_id"]], nm, "slot0")
    ahead = store.ledger.dispatch(pid, lambda b, a: _spec(app, pid, reqs[1:]), [reqs[1]["request_id"]], nm, "slot0")
    assert first is not None and ahead is not None
    with store.db.tx("started") as tx:
        store.ledger.mark_started_in(tx, [(first.id, 1, None)], time.time())
    (host,) = [h for h in http.get("/dashboard/cluster", headers=ALICE).json()["node_managers"] if h["id"] == nm]
    (slot,) = host["slots"]
    assert slot["work"]["batch_id"] == first.id and slot["work"]["started"]
    assert slot["work"]["studies"] == [
        {"id": sid, "name": slot["work"]["studies"][0]["name"], "trials": ["trial-a"], "trial_count": 1}
    ]
    assert [w["batch_id"] for w in slot["next"]] == [ahead.id] and slot["next"][0]["sent_ahead"]
    ov = app.service.overview(ROOT_ADMIN)
    assert ov.slots_sent_ahead >= 1 and ov.slots_busy <= ov.slots
    # bob sees the slot busy, not whose work it is
    (bobs,) = [h for h in http.get("/dashboard/cluster", headers=BOB).json()["node_managers"] if h["id"] == nm]
    assert bobs["slots"][0]["work"] == {"busy": True, "sent_ahead": False}


def test_a_batch_on_two_slots_makes_both_busy_in_the_clusters_history(http: httpx.Client, app: MasterApp) -> None:
    """The busy history counts each slot a batch holds (its ``batch_slots``), not only its rank 0's."""
    fx = fixed()
    sid = http.post("/studies", json={"name": unique("wide")}, headers=ALICE).json()["id"]
    reqs = http.post(
        f"/studies/{sid}/requests", json={"items": [_item("a", 0.5, END, "trial-a", fx)]}, headers=ALICE
    ).json()
    store, nm = app.store, unique("nm")
    store.nodes.register_node_manager(nm, "127.0.0.1:1", [("g0", "cpu"), ("g1", "cpu"), ("g2", "cpu")])
    pid = store.plans.study_plan_ids(sid)[0]
    wide = store.ledger.dispatch(pid, lambda b, a: _spec(app, pid, reqs), [reqs[0]["request_id"]], nm, "g1", "g2")
    assert wide is not None
    with store.db.tx("started") as tx:
        store.ledger.mark_started_in(tx, [(wide.id, 1, None)], time.time())
    ran = ActivityReader(store.db).intervals(time.time() - 60)
    assert sorted(slot for host, slot, _, end in ran if host == nm and end is None) == ["g1", "g2"]
    (host,) = [h for h in http.get("/dashboard/cluster", headers=ALICE).json()["node_managers"] if h["id"] == nm]
    assert {s["id"]: s["work"] is not None for s in host["slots"]} == {"g0": False, "g1": True, "g2": True}
    trial = http.get(f"/dashboard/studies/{sid}/trial", params={"label": "trial-a"}, headers=ALICE).json()
    assert [(a["slot"], a["slots"]) for a in trial["attempts"]] == [("g1", ["g1", "g2"])]


@pytest.fixture
def keepalive_1s(monkeypatch: pytest.MonkeyPatch) -> None:
    """A keepalive comment every second, so that a ``_Listener``'s thread sees its ``close`` within one (at
    the default 15 s each listener's close waited out its stream's next comment)."""
    monkeypatch.setattr(dashboard_routes, "KEEPALIVE_S", 1.0)


class _Listener:
    """A study's event stream read on a thread of its own, until ``close`` (with ``keepalive_1s``)."""

    def __init__(self, base_url: str, study_id: str, since: float | None = None) -> None:
        self.client = httpx.Client(base_url=base_url, headers=ALICE, timeout=30)
        self.seen: list[str] = []
        self.closed = False
        self.thread = threading.Thread(target=self._read, args=(study_id, since), daemon=True)
        self.thread.start()

    def _read(self, study_id: str, since: float | None = None) -> None:
        try:
            q = "" if since is None else f"&since={since}"
            with self.client.stream("GET", f"/dashboard/events?study={study_id}{q}") as r:
                for line in r.iter_lines():
                    if self.closed:
                        return
                    if line.startswith("event: "):
                        self.seen.append(line[7:])
        except (httpx.HTTPError, RuntimeError):
            pass  # closed

    def close(self) -> None:
        self.closed = True
        self.thread.join(10)
        self.client.close()


@pytest.mark.usefixtures("keepalive_1s")
def test_a_study_scoped_event_stream_hears_only_its_study(http: httpx.Client, app: MasterApp) -> None:
    fx = fixed()
    idle = http.post("/studies", json={"name": unique("idle")}, headers=ALICE).json()["id"]
    busy = http.post("/studies", json={"name": unique("busy")}, headers=ALICE).json()["id"]
    assert http.get(f"/dashboard/events?study={idle}", headers=BOB).status_code == 404
    idle, busy_l = _Listener(str(http.base_url), idle), _Listener(str(http.base_url), busy)
    try:
        deadline = time.monotonic() + 20
        while (idle.seen, busy_l.seen) != (["hello"], ["hello"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        for i in range(5):  # the busy study gets requests and curve points; the idle one nothing
            (r,) = http.post(
                f"/studies/{busy}/requests", json={"items": [_item(f"r{i}", 0.5, END + i, f"t{i}", fx)]}, headers=ALICE
            ).json()
            app.store.curves.record([(r["node"], END + i, {"train_loss": 0.5})])
            app.coordination.notify("curves")
            time.sleep(0.3)
        deadline = time.monotonic() + 20
        while not {"counts", "curves"} <= set(busy_l.seen) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert {"counts", "curves"} <= set(busy_l.seen)
        assert idle.seen == ["hello"]
    finally:
        idle.close()
        busy_l.close()


@pytest.mark.usefixtures("keepalive_1s")
def test_a_stream_opened_after_the_page_read_its_curves_announces_the_points_in_between(
    http: httpx.Client, app: MasterApp
) -> None:
    """The study page reads its curves, then opens its stream: a point stored in between has already woken
    every stream open then, so the stream's first event says so (given the curves' ``as_of``)."""
    fx = fixed()
    sid = http.post("/studies", json={"name": unique("between")}, headers=ALICE).json()["id"]
    (r,) = http.post(
        f"/studies/{sid}/requests", json={"items": [_item("r0", 0.5, END, "t0", fx)]}, headers=ALICE
    ).json()
    app.store.curves.record([(r["node"], 1, {"train_loss": 0.9})])
    as_of = http.get(f"/dashboard/studies/{sid}/curves", headers=ALICE).json()["as_of"]
    time.sleep(0.05)
    app.store.curves.record([(r["node"], 2, {"train_loss": 0.8})])  # after the page's read, before its stream
    app.coordination.notify("curves")
    late, current = (
        _Listener(str(http.base_url), sid, since=as_of),
        _Listener(str(http.base_url), sid, since=time.time()),
    )
    try:
        deadline = time.monotonic() + 20
        while (len(late.seen) < 2 or not current.seen) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert late.seen[:2] == ["hello", "curves"]
        time.sleep(0.5)
        assert current.seen == ["hello"]  # a page that read after the point: nothing to catch up
    finally:
        late.close()
        current.close()


def test_the_pages_kept_between_reads_follow_every_change(http: httpx.Client, app: MasterApp) -> None:
    """The study page, the stage tree and the curves are kept while what they were built from is unchanged
    (``dashboard.cache``): a read after each kind of change shows it."""
    s = _study(http, app)
    sid, reqs, pid = s["sid"], s["reqs"], s["pid"]

    def read() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]:
        page = http.get(f"/dashboard/studies/{sid}", headers=ALICE).json()
        tree = http.get(f"/dashboard/studies/{sid}/tree", headers=ALICE).json()
        curves = http.get(f"/dashboard/studies/{sid}/curves", headers=ALICE).json()
        (row,) = [x for x in http.get("/dashboard/studies", headers=ALICE).json() if x["id"] == sid]
        return page, tree, curves, row

    page, tree, curves, row = read()
    again = read()
    assert again[0] == page and again[1] == tree and again[3] == row
    assert {k: v for k, v in again[2].items() if k != "as_of"} == {k: v for k, v in curves.items() if k != "as_of"}

    # a curve point: in the curves
    node = reqs[2]["node"]
    app.store.curves.record([(node, END, {"train_loss": 0.25})])
    _, _, curves, _ = read()
    assert [END, 0.25] in next(n for n in curves["nodes"] if n["node"] == node)["points"]

    # a new trial: on the page, in the list, in the tree; then answered, with its metrics
    fx = s["fixed"]
    (new,) = http.post(
        f"/studies/{sid}/requests", json={"items": [_item("e", 0.9, END, "trial-3", fx)]}, headers=ALICE
    ).json()
    page, tree, _, row = read()
    assert page["trials"][-1]["key"] == "trial-3" and page["trials"][-1]["state"] == "NOT_SCHED"
    assert row["trials"] == 4 and {t["key"] for t in tree["trials"]} >= {"trial-3"}
    batch = app.store.ledger.dispatch(pid, lambda b, a: _spec(app, pid, [new]), [new["request_id"]], s["nm"], "slot0")
    assert batch is not None
    assert read()[0]["trials"][-1]["state"] == "SCHED"
    app.service.report_batch(
        ROOT_ADMIN, attempt_report(batch.id, 1, True, [MetricPoint(new["node"], END, {"accuracy": 0.99})])
    )
    page, tree, _, row = read()
    assert page["trials"][-1]["metrics"] == {"accuracy": 0.99} and page["best"]["trial"] == "trial-3"
    assert row["best"]["trial"] == "trial-3"
    assert {t["key"]: t["state"] for t in tree["trials"]}["trial-3"] == "DONE"

    # a checkpoint: on its node in the tree
    app.store.checkpoints.record_checkpoint(node, END, "file:///ck", 10, "full")
    tree = read()[1]
    assert END in next(n for n in tree["nodes"] if n["id"] == node)["checkpoints"]


def test_an_unchanged_study_is_not_built_again(app: MasterApp, http: httpx.Client) -> None:
    from stagetree.dashboard.tree import TreeViews
    from stagetree.dashboard.views import DashboardViews

    s = _study(http, app)
    alice = Principal("alice")
    views, trees = DashboardViews(app.service), TreeViews(app.service)
    first, tree = views.study(alice, s["sid"]), trees.tree_json(alice, s["sid"])
    assert views.study(alice, s["sid"]) == first and trees.tree_json(alice, s["sid"]) == tree
    assert (views.pages.builds, trees.trees.builds) == (1, 1)
    app.service.cancel(alice, s["sid"], s["reqs"][3]["request_id"])  # finished already: nothing changes
    views.study(alice, s["sid"])
    assert views.pages.builds == 1
    fx = s["fixed"]
    http.post(f"/studies/{s['sid']}/requests", json={"items": [_item("e", 0.9, END, "t", fx)]}, headers=ALICE)
    assert len(views.study(alice, s["sid"])["trials"]) == 4 and views.pages.builds == 2
    assert json.loads(trees.tree_json(alice, s["sid"]))["trials"][-1]["key"] == "t" and trees.trees.builds == 2
