"""Overload: more clients than the master admits at once. The master sheds what is past its admission
limit (gRPC RESOURCE_EXHAUSTED with retry-after-ms, HTTP 429 with Retry-After) instead of queueing it;
the SDK waits as asked and retries; every call admitted is served, once."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from stagetree.client.cli import RestClient
from stagetree.client.sdk import connect
from stagetree.master.app import MasterApp
from stagetree.proto.stagetree.v1 import master_pb2 as pb
from tests.integration.master.conftest import TOKENS
from tests.integration.master.helpers import fixed, unique
from tests.integration.master.load import hammer

ALICE = {"Authorization": f"Bearer {TOKENS['alice']}"}


@pytest.mark.parametrize("fresh_db_url", ["postgres"], indirect=True)
async def test_twenty_clients_past_the_limit_are_shed_and_retried_and_every_accepted_call_is_served(
    app: MasterApp, grpc_target: str
) -> None:
    app.admission.limit = 4
    clients = [connect(grpc_target, token=TOKENS["alice"], reconnect_s=60) for _ in range(20)]
    try:
        study = await clients[0].call(
            "CreateStudy", pb.CreateStudyRequest(name=unique("load"), fixed_json=_fixed()), idempotent=False
        )
        accepted = await hammer(clients, study.id, seconds=3.0, tasks_per_client=2)
    finally:
        for c in clients:
            await c.close()
    assert app.admission.refused > 0 and sum(c.shed for c in clients) > 0  # load was shed, and retried
    assert app.admission.peak <= 4 and app.admission.in_flight == 0
    rows = app.store.requests.get_requests(study.id)
    assert {r.client_request_id: r.id for r in rows} == accepted  # none lost, none twice
    assert len(accepted) >= 40


def _fixed() -> str:
    return json.dumps(fixed())


def test_rest_past_the_limit_is_429_with_retry_after_and_health_still_answers(
    app: MasterApp, http: httpx.Client
) -> None:
    sid = http.post("/studies", json={"name": unique("l"), "fixed": fixed()}, headers=ALICE).json()["id"]
    item = {"client_request_id": "w", "config": {"tuned": {"lr": 0.1}}, "step": 3}
    assert http.post(f"/studies/{sid}/requests", json={"items": [item]}, headers=ALICE).status_code == 200
    app.admission.limit = 1  # the long poll below holds it (the request never finishes: no node manager)
    with httpx.Client(base_url=http.base_url, timeout=10) as other:
        held = threading.Thread(
            target=lambda: other.get(f"/studies/{sid}/requests", params={"wait_s": 1.5}, headers=ALICE)
        )
        held.start()
        deadline = time.monotonic() + 5
        while app.admission.in_flight < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        r = http.get("/studies", headers=ALICE)
        assert r.status_code == 429 and r.headers["Retry-After"] == "1" and r.json()["error"] == "RESOURCE_EXHAUSTED"
        assert "MAX_IN_FLIGHT" in r.json()["message"] and r.json()["retry_after_s"] > 0
        assert http.get("/health").status_code == 200  # never shed
        held.join()
    assert http.get("/studies", headers=ALICE).status_code == 200
    deadline = time.monotonic() + 5
    while app.admission.in_flight and time.monotonic() < deadline:  # left once the answer went out
        time.sleep(0.01)
    assert app.admission.in_flight == 0


def test_the_cli_rest_client_waits_out_a_429_and_sends_the_call_again(app: MasterApp, http: httpx.Client) -> None:
    sid = http.post("/studies", json={"name": unique("cli"), "fixed": fixed()}, headers=ALICE).json()["id"]
    item = {"client_request_id": "w", "config": {"tuned": {"lr": 0.1}}, "step": 3}
    assert http.post(f"/studies/{sid}/requests", json={"items": [item]}, headers=ALICE).status_code == 200
    app.admission.limit = 1  # the long poll below holds it for 2 s (the request never finishes)
    refused = app.admission.refused
    with httpx.Client(base_url=http.base_url, timeout=10) as other:
        held = threading.Thread(
            target=lambda: other.get(f"/studies/{sid}/requests", params={"wait_s": 2}, headers=ALICE)
        )
        held.start()
        deadline = time.monotonic() + 5
        while app.admission.in_flight < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        cli = RestClient(str(http.base_url), TOKENS["alice"])
        studies = cli.get("/studies")  # 429 (Retry-After: 1) until the long poll ends, then served
        held.join()
    assert app.admission.refused > refused
    assert sid in [s["id"] for s in studies]
