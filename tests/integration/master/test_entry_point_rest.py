"""A trainer entry point of the wrong form is a 4xx at the boundary, naming the fix, and writes nothing:
at study creation and in a request's own fixed part."""

from __future__ import annotations

import httpx

from tests.integration.master.helpers import fixed, unique
from tests.integration.master.test_rest_api import ALICE


def test_entry_points_are_checked_at_creation_and_in_requests(http: httpx.Client) -> None:
    name = unique("entry")
    r = http.post("/studies", json={"name": name, "fixed": fixed("quickstart.Net")}, headers=ALICE)
    assert r.status_code == 422 and "did you mean 'quickstart:Net'" in r.json()["message"], r.text
    r = http.post("/studies", json={"name": name, "fixed": fixed("__main__:Local")}, headers=ALICE)
    assert r.status_code == 422 and "trainer:Local" in r.json()["message"], r.text
    assert name not in [s["name"] for s in http.get("/studies", headers=ALICE).json()]
    sid = http.post("/studies", json={"name": name, "fixed": fixed()}, headers=ALICE).json()["id"]
    item = {"client_request_id": "a", "step": 3, "config": {"fixed": fixed("pkg.Net"), "tuned": {"lr": 0.1}}}
    r = http.post(f"/studies/{sid}/requests", json={"items": [item]}, headers=ALICE)
    assert r.status_code == 422 and "did you mean 'pkg:Net'" in r.json()["message"], r.text
    assert http.get(f"/studies/{sid}/requests", headers=ALICE).json() == []
