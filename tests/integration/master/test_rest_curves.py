"""The curve and dashboard routes through a real uvicorn server: owner isolation (another owner's study,
request or page is a 404, no token a 401) and bad input refused with 422, changing nothing."""

from __future__ import annotations

import json
import time

import httpx

from stagetree.master.app import MasterApp
from tests.integration.master.conftest import TOKENS
from tests.integration.master.helpers import fixed, unique

ALICE = {"Authorization": f"Bearer {TOKENS['alice']}"}
BOB = {"Authorization": f"Bearer {TOKENS['bob']}"}


def test_curves_and_dashboard_pages_are_the_owners_only(http: httpx.Client) -> None:
    sid = http.post("/studies", json={"name": unique("s")}, headers=ALICE).json()["id"]
    item = {"client_request_id": "a", "config": {"fixed": fixed(), "tuned": {"lr": 0.1}}, "step": 5}
    (req,) = http.post(f"/studies/{sid}/requests", json={"items": [item]}, headers=ALICE).json()
    rid = req["request_id"]
    mine = http.get(f"/studies/{sid}/requests/{rid}/curve", headers=ALICE)
    assert mine.status_code == 200 and mine.json()["points"] == [] and mine.json()["step"] == 5
    assert http.get(f"/studies/{sid}/curves", headers=ALICE).json()[0]["total"] == 0
    for path in (
        f"/studies/{sid}/requests/{rid}/curve",
        f"/studies/{sid}/curves",
        f"/dashboard/studies/{sid}",
        f"/dashboard/studies/{sid}/tree",
        f"/dashboard/studies/{sid}/curves?metric=loss",
    ):
        assert http.get(path, headers=BOB).status_code == 404, path
        assert http.get(path).status_code == 401, path
    assert http.get("/dashboard/studies", headers=BOB).json() == []
    assert [s["id"] for s in http.get("/dashboard/studies", headers=ALICE).json()] == [sid]
    for bad in ("max_points=-1", "start=-1", "max_points=100001"):
        r = http.get(f"/studies/{sid}/requests/{rid}/curve?{bad}", headers=ALICE)
        assert r.status_code == 422 and r.json()["error"] == "INVALID_ARGUMENT", bad
    empty = http.get(f"/studies/{sid}/requests/{rid}/curve?start=5&end=2", headers=ALICE)  # an empty range
    assert empty.status_code == 200 and empty.json()["points"] == [] and empty.json()["total"] == 0
    assert http.get(f"/studies/{sid}/requests/{rid + 10**6}/curve", headers=ALICE).status_code == 404
    assert http.get(f"/dashboard/studies/{sid}/curves", headers=ALICE).json()["metric"] is None  # no curve yet
    assert http.get(f"/dashboard/studies/{sid}/curves?metric=", headers=ALICE).status_code == 422


def test_the_tree_shows_a_running_node_with_its_progress(http: httpx.Client, app: MasterApp) -> None:
    sid = http.post("/studies", json={"name": unique("s")}, headers=ALICE).json()["id"]
    item = {"client_request_id": "a", "config": {"fixed": fixed(), "tuned": {"lr": 0.1}}, "step": 10}
    (req,) = http.post(f"/studies/{sid}/requests", json={"items": [item]}, headers=ALICE).json()
    store = app.store
    nm = unique("nm")
    store.nodes.register_node_manager(nm, "127.0.0.1:1", [("slot0", "cpu")])
    plan_id = store.plans.study_plan_ids(sid)[0]
    spec = json.dumps({"stages": [{"node": req["node"], "start": 0, "end": 10}]})
    assert store.ledger.dispatch(plan_id, lambda b, a: spec, [req["request_id"]], nm, "slot0") is not None
    store.curves.record([(req["node"], s, {"loss": 1.0 / s}) for s in range(1, 5)])
    (node,) = http.get(f"/dashboard/studies/{sid}/tree", headers=ALICE).json()["nodes"]
    assert node["state"] == "running" and node["progress"] == 0.4
    assert http.get(f"/dashboard/studies/{sid}/tree/nodes/{node['id']}", headers=ALICE).json()["curve_points"] == 4
    assert http.get("/dashboard/cluster", headers=BOB).status_code == 200  # bob sees the slot busy, not whose
    slots = [
        s
        for n in http.get("/dashboard/cluster", headers=BOB).json()["node_managers"]
        if n["id"] == nm
        for s in n["slots"]
    ]
    assert slots == [{**slots[0], "work": {"busy": True, "sent_ahead": False}}]
    mine = [
        s
        for n in http.get("/dashboard/cluster", headers=ALICE).json()["node_managers"]
        if n["id"] == nm
        for s in n["slots"]
    ]
    assert mine[0]["work"]["step"] == 4 and mine[0]["work"]["nodes"] == [req["node"]]


def test_gpu_telemetry_the_aggregators_wrote_shows_on_the_cluster_page(http: httpx.Client, app: MasterApp) -> None:
    nm = unique("nm")
    app.store.nodes.register_node_manager(nm, "10.0.0.7:1", [("gpu0", "A100")])

    def sample(gpu: int, util: float, ts: float) -> dict[str, object]:
        return {
            "type": "gpu_telemetry",
            "node_manager": nm,
            "gpu_index": gpu,
            "utilization": util,
            "memory_used": 1 << 30,
            "memory_total": 80 << 30,
            "processes": [],
            "ts": ts,
        }

    now = time.time()
    assert app.store.telemetry.keep([sample(0, 40.0, now - 1), sample(0, 55.0, now), sample(1, 5.0, now)]) == 2
    assert app.store.telemetry.keep([sample(0, 10.0, now - 5)]) == 0  # older than the stored one: ignored
    app.store.telemetry.keep([{**sample(2, 99.0, now - 3600)}])  # a GPU not heard from for an hour
    (mine,) = [n for n in http.get("/dashboard/cluster", headers=BOB).json()["node_managers"] if n["id"] == nm]
    assert [(g["gpu_index"], g["utilization"]) for g in mine["gpus"]] == [(0, 55.0), (1, 5.0)]
