"""REST API through a real uvicorn server on loopback (httpx client): the same use cases and the same
error table as gRPC."""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from tests.integration.master.conftest import ADMIN_TOKEN, TOKENS
from tests.integration.master.helpers import fixed, unique

ALICE = {"Authorization": f"Bearer {TOKENS['alice']}"}
BOB = {"Authorization": f"Bearer {TOKENS['bob']}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def _item(cid: str, f: dict[str, object], step: int = 5, lr: object = 0.1) -> dict[str, object]:
    return {"client_request_id": cid, "config": {"fixed": f, "tuned": {"lr": lr}}, "step": step}


def test_health_and_openapi(http: httpx.Client) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    paths = http.get("/openapi.json").json()["paths"]
    assert "/api/v1/studies/{study_id}/requests" in paths


def test_the_docs_page_loads_everything_from_the_master(http: httpx.Client) -> None:
    page = http.get("/docs")
    assert page.status_code == 200 and "swagger-ui" in page.text
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert assets and all(a.startswith("/api/v1/") for a in assets), assets  # no CDN: works offline
    for asset in assets:
        got = http.get(asset.removeprefix("/api/v1"))
        assert got.status_code == 200 and got.content, asset
    assert "/api/v1/openapi.json" in page.text


def test_study_lifecycle_and_isolation(http: httpx.Client) -> None:
    r = http.post("/studies", json={"name": unique("s")}, headers=ALICE)
    assert r.status_code == 201
    sid = r.json()["id"]
    assert http.get(f"/studies/{sid}", headers=ALICE).json()["owner"] == "alice"
    assert http.get(f"/studies/{sid}", headers=BOB).status_code == 404
    assert http.get("/studies", headers=BOB).json() == []
    assert http.get("/studies").status_code == 401
    assert http.get("/studies", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert http.post("/studies", json={"name": r.json()["name"]}, headers=ALICE).status_code == 409


def test_submit_cancel_and_query(http: httpx.Client) -> None:
    sid = http.post("/studies", json={"name": unique("s")}, headers=ALICE).json()["id"]
    f = fixed()
    r = http.post(f"/studies/{sid}/requests", json={"items": [_item("a", f), _item("b", f, lr=0.2)]}, headers=ALICE)
    assert r.status_code == 200, r.text
    a, b = r.json()
    assert a["state"] == "NOT_SCHED" and a["node"] != b["node"]
    again = http.post(f"/studies/{sid}/requests", json={"items": [_item("a", f)]}, headers=ALICE).json()
    assert again[0]["request_id"] == a["request_id"]
    c = http.delete(f"/studies/{sid}/requests/{b['request_id']}", headers=ALICE).json()
    assert c["state"] == "CANCELLED"
    listed = http.get(f"/studies/{sid}/requests", params={"ids": [a["request_id"]]}, headers=ALICE).json()
    assert [x["request_id"] for x in listed] == [a["request_id"]]
    q = http.post(
        f"/studies/{sid}/metrics/query", json={"config": {"fixed": f, "tuned": {"lr": 0.1}}, "step": 5}, headers=ALICE
    )
    assert q.json() == {"found": False, "metrics": None, "node": None, "step": None}
    plan = http.get(f"/studies/{sid}/plan", headers=ALICE).json()
    assert len(plan["nodes"]) == 2 and plan["fixed"]["trainer"] == f["trainer"]


def test_long_poll_answers_when_the_requests_finish(http: httpx.Client) -> None:
    sid = http.post("/studies", json={"name": unique("s")}, headers=ALICE).json()["id"]
    (a,) = http.post(f"/studies/{sid}/requests", json={"items": [_item("a", fixed())]}, headers=ALICE).json()
    t0 = time.monotonic()
    waited = http.get(f"/studies/{sid}/requests", params={"wait_s": 0.3}, headers=ALICE).json()
    assert [x["state"] for x in waited] == ["NOT_SCHED"] and time.monotonic() - t0 >= 0.3  # timed out
    cancel = threading.Timer(
        0.3, lambda: http.delete(f"/studies/{sid}/requests/{a['request_id']}", headers=ALICE).raise_for_status()
    )
    t0 = time.monotonic()
    cancel.start()
    done = http.get(f"/studies/{sid}/requests", params={"wait_s": 8}, headers=ALICE).json()
    assert [x["state"] for x in done] == ["CANCELLED"] and time.monotonic() - t0 < 5  # woken, not timed out
    too_long = http.get(f"/studies/{sid}/requests", params={"wait_s": 600}, headers=ALICE)
    assert too_long.status_code == 422
    assert http.get(f"/studies/{sid}/requests", params={"wait_s": 1}, headers=BOB).status_code == 404


@pytest.mark.parametrize(
    ("items", "status", "code"),
    [
        ([{"client_request_id": "x", "config": {"tuned": {"lr": 0.1}}, "step": 5}], 422, "INVALID_ARGUMENT"),
        ([_item("x", fixed(), step=-1)], 422, "INVALID_ARGUMENT"),
        ([_item("x", fixed(), lr={"kind": "exponential", "init": 0.1})], 422, "INVALID_ARGUMENT"),
        ([_item(f"x{i}", fixed()) for i in range(51)], 413, "RESOURCE_EXHAUSTED"),
        ([], 422, "INVALID_ARGUMENT"),
    ],
)
def test_bad_input_is_rejected_and_changes_nothing(
    http: httpx.Client, items: list[dict[str, object]], status: int, code: str
) -> None:
    sid = http.post("/studies", json={"name": unique("s")}, headers=ALICE).json()["id"]
    r = http.post(f"/studies/{sid}/requests", json={"items": [_item("good", fixed()), *items]}, headers=ALICE)
    if items:
        assert r.status_code == status, r.text
        assert r.json()["error"] == code and r.json()["message"]
    else:
        assert r.status_code == 200  # one good item alone is fine; an empty batch is checked below
        r = http.post(f"/studies/{sid}/requests", json={"items": []}, headers=ALICE)
        assert r.status_code == status and r.json()["error"] == code
        return
    assert http.get(f"/studies/{sid}/requests", headers=ALICE).json() == []


def test_unknown_study_and_node_manager_admin_only(http: httpx.Client) -> None:
    r = http.post("/studies/nope/requests", json={"items": [_item("a", fixed())]}, headers=ALICE)
    assert r.status_code == 404 and r.json()["error"] == "NOT_FOUND"
    body = {"node_manager_id": unique("nm"), "slots": [{"id": "g0"}]}
    assert http.post("/hosts", json=body, headers=ALICE).status_code == 403
    assert http.post("/hosts", json=body, headers=ADMIN).status_code == 201
    hosts = http.get("/hosts", headers=ADMIN).json()
    assert [n["node_manager_id"] for n in hosts] == [body["node_manager_id"]]
    # /nodes: the deprecated alias, the same resource (and admin only too)
    assert http.get("/nodes", headers=ADMIN).json() == hosts
    assert http.get("/nodes", headers=ALICE).status_code == 403
    paths = http.get("/openapi.json").json()["paths"]
    assert all(op.get("deprecated") for op in paths["/api/v1/nodes"].values())
    assert not any(op.get("deprecated") for op in paths["/api/v1/hosts"].values())
