"""The REST boundary against inputs that once reached a 500 or wrote: NaN and Infinity, lone surrogates,
NUL, integers past 64 bits, oversized bodies. Each gets a clear 4xx and changes nothing."""

from __future__ import annotations

import math
from collections.abc import Iterator

import httpx
import pytest

from stagetree.core.text import MAX_JSON_DEPTH
from stagetree.master.api.grpc_api import result_pb
from stagetree.master.app import MasterApp
from tests.integration.master.conftest import TOKENS
from tests.integration.master.helpers import fixed, unique
from tests.integration.master.test_rest_api import ADMIN, ALICE

BIG = "100000000000000000000"  # past 2**63


@pytest.fixture
def study(http: httpx.Client) -> Iterator[str]:
    r = http.post("/studies", json={"name": unique("bounds"), "fixed": fixed()}, headers=ALICE)
    assert r.status_code == 201
    yield r.json()["id"]


def _raw(http: httpx.Client, method: str, path: str, body: str, headers: dict[str, str]) -> httpx.Response:
    return http.request(method, path, content=body.encode(), headers={**headers, "Content-Type": "application/json"})


def _nothing_written(http: httpx.Client, study: str) -> None:
    assert http.get(f"/studies/{study}/requests", headers=ALICE).json() == []
    assert http.get(f"/studies/{study}/plan", headers=ALICE).status_code in (404, 422)


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_refused_before_any_route(http: httpx.Client, study: str, number: str) -> None:
    body = '{"items": [{"client_request_id": "a", "config": {"tuned": {"lr": 0.1}}, "step": @}]}'.replace("@", number)
    r = _raw(http, "POST", f"/studies/{study}/requests", body, ALICE)
    assert (
        r.status_code == 422 and r.json()["error"] == "INVALID_ARGUMENT" and number.lstrip("-") in r.json()["message"]
    )
    slot = '{"node_manager_id": "nm-x", "address": "a", "slots": [{"id": "g0", "share": @}]}'.replace("@", number)
    assert _raw(http, "POST", "/hosts", slot, ADMIN).status_code == 422
    _nothing_written(http, study)


def test_lone_surrogates_and_control_characters_are_refused(http: httpx.Client, study: str) -> None:
    for cid in ('"x\\ud800"', '"x\\u0000y"', '"a\\nb"'):
        body = '{"items": [{"client_request_id": @, "config": {"tuned": {"lr": 0.1}}, "step": 3}]}'.replace("@", cid)
        r = _raw(http, "POST", f"/studies/{study}/requests", body, ALICE)
        assert r.status_code == 422, (cid, r.text)
    r = _raw(http, "POST", "/studies", '{"name": "bad\\ud800", "fixed": null}', ALICE)
    assert r.status_code == 422
    r = _raw(http, "POST", "/studies", '{"name": "nul\\u0000name"}', ALICE)
    assert r.status_code == 422 and "control characters" in r.json()["message"]
    assert http.get(f"/studies/{study}%00x", headers=ALICE).status_code == 422
    _nothing_written(http, study)


def test_integers_past_64_bits_are_a_4xx(http: httpx.Client, study: str) -> None:
    assert http.delete(f"/studies/{study}/requests/{BIG}", headers=ALICE).status_code == 422
    assert http.get(f"/studies/{study}/requests?ids={BIG}", headers=ALICE).status_code == 422
    assert http.get(f"/studies/{study}/requests?ids=9223372036854775808", headers=ALICE).status_code == 422
    step = '{"items": [{"client_request_id": "a", "config": {"tuned": {"lr": 0.1}}, "step": @}]}'.replace("@", BIG)
    assert _raw(http, "POST", f"/studies/{study}/requests", step, ALICE).status_code == 422
    node = '{"node_manager_id": "nm-y", "address": "a", "slots": [{"id": "g0", "memory_bytes": @}]}'.replace("@", BIG)
    assert _raw(http, "POST", "/hosts", node, ADMIN).status_code == 422
    node = '{"node_manager_id": "nm-y", "address": "a", "slots": [{"id": "g0", "gpu_index": @}]}'.replace("@", BIG)
    assert _raw(http, "POST", "/hosts", node, ADMIN).status_code == 422
    _nothing_written(http, study)


def test_a_body_over_the_limit_is_413_before_it_is_read(app: MasterApp, http: httpx.Client, study: str) -> None:
    limit = app.settings.limits.max_body_bytes
    name = "n" * (limit + 10)
    r = http.post("/studies", json={"name": name}, headers=ALICE)
    assert (
        r.status_code == 413 and r.json()["error"] == "RESOURCE_EXHAUSTED" and "MAX_BODY_BYTES" in r.json()["message"]
    )

    def chunks() -> Iterator[bytes]:  # no Content-Length: refused while it streams in
        yield b'{"name": "'
        for _ in range(limit // 65536 + 2):
            yield b"n" * 65536
        yield b'"}'

    r = http.post("/studies", content=chunks(), headers={**ALICE, "Content-Type": "application/json"})
    assert r.status_code == 413
    assert [s["name"] for s in http.get("/studies", headers=ALICE).json() if len(s["name"]) > 1000] == []


def test_a_resend_must_repeat_the_item_exactly(http: httpx.Client, study: str) -> None:
    def lr(gamma: float) -> dict[str, object]:
        return {"tuned": {"lr": {"kind": "multistep", "init": 0.1, "milestones": [5], "gamma": gamma}}}

    item = {"client_request_id": "r1", "config": lr(0.5), "step": 10}
    (first,) = http.post(f"/studies/{study}/requests", json={"items": [item]}, headers=ALICE).json()
    nodes = http.get(f"/studies/{study}/plan", headers=ALICE).json()["nodes"]
    (again,) = http.post(f"/studies/{study}/requests", json={"items": [item]}, headers=ALICE).json()
    assert again["request_id"] == first["request_id"]  # an equal resend stays idempotent
    for changed, why in (
        ({**item, "step": 12}, "step 10, now 12"),
        ({**item, "config": {"tuned": {"lr": 0.3}}}, "another config"),
        ({**item, "config": lr(0.9)}, "another config"),
    ):
        fresh = {"client_request_id": "r2", "config": {"tuned": {"lr": 0.7}}, "step": 4}
        r = http.post(f"/studies/{study}/requests", json={"items": [fresh, changed]}, headers=ALICE)
        assert r.status_code == 409 and r.json()["error"] == "ALREADY_EXISTS" and why in r.json()["message"], r.text
    assert [x["request_id"] for x in http.get(f"/studies/{study}/requests", headers=ALICE).json()] == [
        first["request_id"]
    ]  # the fresh item of a refused call was not written either
    assert http.get(f"/studies/{study}/plan", headers=ALICE).json()["nodes"] == nodes  # nor any plan node


def test_non_finite_metrics_are_served_as_the_spec_declares_on_rest_and_grpc(
    app: MasterApp, http: httpx.Client
) -> None:
    sid = http.post("/studies", json={"name": unique("nan"), "fixed": fixed()}, headers=ALICE).json()["id"]
    item = {"client_request_id": "d", "config": {"tuned": {"lr": 0.1}}, "step": 3}
    (req,) = http.post(f"/studies/{sid}/requests", json={"items": [item]}, headers=ALICE).json()
    app.store.requests.record_metrics(req["node"], 3, {"loss": math.nan, "gn": math.inf, "low": -math.inf, "acc": 0.5})

    (got,) = http.get(f"/studies/{sid}/requests", headers=ALICE).json()
    assert got["metrics"] == {"loss": "NaN", "gn": "Infinity", "low": "-Infinity", "acc": 0.5}
    q = http.post(f"/studies/{sid}/metrics/query", json={"config": item["config"], "step": 3}, headers=ALICE).json()
    assert q["metrics"] == got["metrics"]
    spec = http.get("/openapi.json").json()
    declared = spec["components"]["schemas"]["MetricValue"]["anyOf"]
    assert {"type": "string", "enum": ["NaN", "Infinity", "-Infinity"]} in declared
    # gRPC carries the same values as doubles
    (rec,) = app.service.get_requests(app.auth.authenticate(TOKENS["alice"]), sid, None)
    msg = result_pb(rec)
    assert math.isnan(msg.metrics["loss"]) and msg.metrics["gn"] == math.inf and msg.metrics["low"] == -math.inf


def test_the_spec_declares_auth_typed_configs_and_each_routes_statuses(http: httpx.Client) -> None:
    spec = http.get("/openapi.json").json()
    assert spec["components"]["securitySchemes"]["HTTPBearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "a user's token, or the admin token for /hosts",
    }
    schemas = spec["components"]["schemas"]
    item = schemas["ItemIn"]["properties"]["config"]
    assert item["allOf"] == [{"$ref": "#/components/schemas/TrialConfig"}]
    assert schemas["TrialConfig"]["properties"]["tuned"]["additionalProperties"] == {
        "$ref": "#/components/schemas/Sequence"
    }
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            codes = set(op["responses"])
            if path.endswith("/health"):
                assert "security" not in op and codes == {"200", "503"}
                continue
            assert op["security"] == [{"HTTPBearer": []}], (path, method)
            assert {"401", "422", "429", "503"} <= codes, (path, method)
            if "{study_id}" in path:
                assert "404" in codes, (path, method)
            if method in ("post", "delete"):
                assert "413" in codes, (path, method)


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_json_nested_past_the_limit_is_a_422_naming_it_and_writes_nothing(http: httpx.Client, study: str) -> None:
    studies = len(http.get("/studies", headers=ALICE).json())
    for body in (
        _nested(100_000),  # the whole body
        '{"name": "deep", "fixed": {"trainer": "m:T", "values": {"x": @}}}'.replace("@", _nested(5_000)),
    ):
        r = _raw(http, "POST", "/studies", body, ALICE)
        assert r.status_code == 422 and f"limit of {MAX_JSON_DEPTH}" in r.json()["message"], r.text[:300]
    deep_seq = '{"kind": "constant", "value": @}'.replace("@", _nested(5_000))
    item = '{"items": [{"client_request_id": "d", "config": {"tuned": {"lr": @}}, "step": 3}]}'.replace("@", deep_seq)
    r = _raw(http, "POST", f"/studies/{study}/requests", item, ALICE)
    assert r.status_code == 422 and "levels deep" in r.json()["message"]
    query = '{"config": {"tuned": {"lr": @}}, "step": 3}'.replace("@", _nested(MAX_JSON_DEPTH))
    assert _raw(http, "POST", f"/studies/{study}/metrics/query", query, ALICE).status_code == 422
    assert len(http.get("/studies", headers=ALICE).json()) == studies
    _nothing_written(http, study)


def test_sequences_nested_as_deep_as_a_user_writes_them_pass_the_limit(http: httpx.Client, study: str) -> None:
    seq: dict[str, object] = {"kind": "cosine", "init": 0.1, "min_value": 0.0, "period": 5}
    for i in range(8):  # a warmup of a piecewise of a warmup ... eight times over: 26 levels in the body
        seq = {"kind": "warmup", "init": 0.0, "period": 2, "then": seq}
        if i % 2:
            seq = {"kind": "piecewise", "pieces": [0.05, seq], "boundaries": [1]}
    item = {"client_request_id": "nested", "config": {"tuned": {"lr": seq}}, "step": 3}
    r = http.post(f"/studies/{study}/requests", json={"items": [item]}, headers=ALICE)
    assert r.status_code == 200, r.text


def test_an_id_repeated_in_one_call_is_one_request_or_a_409_and_unknown_fields_are_named(
    http: httpx.Client, study: str
) -> None:
    item = {"client_request_id": "twice", "config": {"tuned": {"lr": 0.1}}, "step": 3}
    first, again = http.post(f"/studies/{study}/requests", json={"items": [item, item]}, headers=ALICE).json()
    assert first["request_id"] == again["request_id"]  # the same item twice: one request, as a resend is
    other = {**item, "step": 4}
    r = http.post(
        f"/studies/{study}/requests",
        json={"items": [{**item, "client_request_id": "x"}, {**other, "client_request_id": "x"}]},
        headers=ALICE,
    )
    assert r.status_code == 409 and r.json()["error"] == "ALREADY_EXISTS"
    slot = {"id": "g0"}
    r = http.post("/hosts", json={"node_manager_id": "nm-dup", "slots": [slot, slot]}, headers=ADMIN)
    assert r.status_code == 409 and "slots[1].id" in r.json()["message"]
    typo = {"kind": "cosine", "init": 0.1, "min_value": 0.0, "period": 5, "gama": 2.0}
    bad = {"client_request_id": "typo", "config": {"tuned": {"lr": typo}}, "step": 3}
    r = http.post(f"/studies/{study}/requests", json={"items": [bad]}, headers=ALICE)
    assert r.status_code == 422 and "gama: is not a field of cosine" in r.json()["message"]
    assert [x["client_request_id"] for x in http.get(f"/studies/{study}/requests", headers=ALICE).json()] == ["twice"]
