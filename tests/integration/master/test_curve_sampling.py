"""Learning-curve sampling set per study (REST, gRPC), carried into the batch specs the round dispatches,
and a direct gRPC report (no bus) that carries an attempt's curve points into the database."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest

from stagetree.bus.messages import BatchFinished, Curve, Metrics
from stagetree.core.batch import BatchSpec
from stagetree.core.errors import InvalidArgument
from stagetree.master.app import MasterApp
from stagetree.master.auth import Principal
from stagetree.master.curves import CurveService
from stagetree.master.service import SubmitItem
from stagetree.nodemanager.link import BatchReport, GrpcMasterLink
from stagetree.proto.stagetree.v1 import master_pb2 as pb
from stagetree.proto.stagetree.v1 import master_pb2_grpc as pb_grpc
from tests.integration.conftest import ADMIN_TOKEN, TOKENS
from tests.integration.master.helpers import bearer, config_json, fixed, unique

ALICE = Principal("alice")
ADMIN = Principal("admin", admin=True)
ALICE_REST = {"authorization": f"Bearer {TOKENS['alice']}"}


def _dispatched_specs(app: MasterApp, slots: int) -> list[BatchSpec]:
    nm = unique("nm")
    app.service.register_node_manager(ADMIN, nm, "local", [(f"g{i}", "cpu") for i in range(slots)])
    app.coordination.heartbeat(nm, 30)
    app.scheduler.run_round()
    return [BatchSpec.from_json(json.loads(a.spec_json)) for a in app.service.take_assignments(ADMIN, nm)]


def test_a_batch_keeps_every_point_its_studies_ask_for(app: MasterApp) -> None:
    f = fixed()  # one plan: the same fixed part, one owner
    every4 = app.service.create_study(ALICE, unique("a"), curve_every_steps=4, curve_max_per_s=2.0)
    every6 = app.service.create_study(ALICE, unique("b"), curve_every_steps=6, curve_max_per_s=5.0)
    assert (every4.curve_every_steps, every4.curve_max_per_s) == (4, 2.0)
    shared = config_json(f, lr=0.1)
    app.service.submit(ALICE, every4.id, [SubmitItem("x", shared, 24)])
    app.service.submit(ALICE, every6.id, [SubmitItem("x", shared, 24)])
    (spec,) = _dispatched_specs(app, 1)  # one batch serves both studies' requests
    assert (spec.curve_every_steps, spec.curve_max_per_s) == (2, 5.0)  # steps at gcd(4, 6), the higher rate

    plain = app.service.create_study(ALICE, unique("c"))  # sets nothing: the master's settings
    app.service.submit(ALICE, plain.id, [SubmitItem("y", config_json(fixed(), lr=0.2), 10)])
    (spec,) = _dispatched_specs(app, 1)
    settings = app.settings.scheduling
    assert (spec.curve_every_steps, spec.curve_max_per_s) == (settings.curve_every_steps, settings.curve_max_per_s)

    off = app.service.create_study(ALICE, unique("d"), curve_every_steps=0)
    app.service.submit(ALICE, off.id, [SubmitItem("z", config_json(fixed(), lr=0.3), 10)])
    (spec,) = _dispatched_specs(app, 1)
    assert spec.curve_every_steps == 0  # no curve


def test_bad_sampling_is_refused_over_rest_and_creates_nothing(app: MasterApp, http: httpx.Client) -> None:
    for body in (
        {"curve_every_steps": -1},
        {"curve_every_steps": 1.5},
        {"curve_every_steps": 10**12},
        {"curve_max_per_s": -0.5},
        {"curve_max_per_s": "fast"},
    ):
        name = unique("bad")
        r = http.post("/studies", json={"name": name, **body}, headers=ALICE_REST)
        assert r.status_code == 422, (body, r.text)
        assert name not in [s["name"] for s in http.get("/studies", headers=ALICE_REST).json()]
    r = http.post(
        "/studies", json={"name": unique("ok"), "curve_every_steps": 5, "curve_max_per_s": 0}, headers=ALICE_REST
    )
    assert r.status_code == 201 and (r.json()["curve_every_steps"], r.json()["curve_max_per_s"]) == (5, 0.0)
    assert http.get(f"/studies/{r.json()['id']}", headers=ALICE_REST).json()["curve_every_steps"] == 5

    with pytest.raises(InvalidArgument, match="curve_max_per_s"):
        app.service.create_study(ALICE, unique("inf"), curve_max_per_s=float("inf"))


async def test_the_grpc_api_takes_the_sampling_and_refuses_a_bad_one(grpc_target: str) -> None:
    async with grpc.aio.insecure_channel(grpc_target) as ch:
        stub = pb_grpc.MasterServiceStub(ch)  # type: ignore[no-untyped-call]
        md = bearer(TOKENS["alice"])
        made = await stub.CreateStudy(pb.CreateStudyRequest(name=unique("g"), curve_every_steps=3), metadata=md)
        assert made.HasField("curve_every_steps") and made.curve_every_steps == 3
        assert not made.HasField("curve_max_per_s")  # unset: the master's default
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.CreateStudy(pb.CreateStudyRequest(name=unique("g"), curve_every_steps=-2), metadata=md)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "curve_every_steps" in (e.value.details() or "")


async def test_a_direct_grpc_report_carries_the_attempts_curve(app: MasterApp, grpc_target: str) -> None:
    study = app.service.create_study(ALICE, unique("s"))
    (req,) = app.service.submit(ALICE, study.id, [SubmitItem("r", config_json(fixed()), 6)])
    (spec,) = _dispatched_specs(app, 1)
    node = spec.stages[-1].node
    link = GrpcMasterLink(grpc_target, ADMIN_TOKEN, rpc_timeout_s=5)
    try:
        ids = {"node_manager": "nm", "batch_id": spec.batch_id, "attempt": spec.attempt}
        steps = list(range(1, 7))
        messages = (
            Curve(msg_id="c", **ids, node=node, steps=steps, values=[{"loss": 1.0 / s} for s in steps]),
            Metrics(msg_id="m", **ids, node=node, step=6, metrics={"acc": 0.5}),
            BatchFinished(msg_id="f", **ids, steps=6),
        )
        report = BatchReport(spec.batch_id, spec.attempt, messages)
        assert await link.report(report) == [req.id]
        assert await link.report(report) == []  # delivered twice (a retry): nothing new, the curve stored once
    finally:
        await link.close()
    got = CurveService(app.service).trial_curve(ALICE, study.id, req.id)
    assert [(p.step, p.values) for p in got.points] == [(s, {"loss": 1.0 / s}) for s in range(1, 7)]
    assert sum(app.store.curves.counts([node]).values()) == 6
