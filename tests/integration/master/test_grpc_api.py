"""gRPC API through a real grpc.aio server on loopback: studies, submissions, auth, isolation, bad input,
metrics, plans and the node-manager flow up to a completed result."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import grpc
import pytest

from stagetree.core.batch import BatchSpec
from stagetree.core.text import MAX_JSON_DEPTH
from stagetree.master.app import MasterApp
from stagetree.proto.stagetree.v1 import master_pb2 as pb
from stagetree.proto.stagetree.v1 import master_pb2_grpc as pb_grpc
from tests.integration.master.conftest import ADMIN_TOKEN, TOKENS
from tests.integration.master.helpers import bearer, config_json, fixed, unique

ALICE = bearer(TOKENS["alice"])
BOB = bearer(TOKENS["bob"])
ADMIN = bearer(ADMIN_TOKEN)


@pytest.fixture
async def stub(grpc_target: str) -> AsyncIterator[pb_grpc.MasterServiceStub]:
    async with grpc.aio.insecure_channel(grpc_target) as ch:
        yield pb_grpc.MasterServiceStub(ch)


async def _code(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await call  # type: ignore[misc]
    return ei.value.code()


async def _study(stub: pb_grpc.MasterServiceStub, md: object = ALICE) -> pb.Study:
    return await stub.CreateStudy(pb.CreateStudyRequest(name=unique("study")), metadata=md)


async def test_studies_are_visible_to_their_owner_only(stub: pb_grpc.MasterServiceStub) -> None:
    s = await _study(stub)
    assert s.owner == "alice"
    assert (await stub.GetStudy(pb.GetStudyRequest(study_id=s.id), metadata=ALICE)).name == s.name
    assert s.id in [x.id for x in (await stub.ListStudies(pb.ListStudiesRequest(), metadata=ALICE)).studies]
    assert s.id not in [x.id for x in (await stub.ListStudies(pb.ListStudiesRequest(), metadata=BOB)).studies]
    assert await _code(stub.GetStudy(pb.GetStudyRequest(study_id=s.id), metadata=BOB)) == grpc.StatusCode.NOT_FOUND
    item = pb.SubmitItem(client_request_id="x", config_json=config_json(fixed()), step=3)
    call = stub.SubmitRequests(pb.SubmitRequestsRequest(study_id=s.id, items=[item]), metadata=BOB)
    assert await _code(call) == grpc.StatusCode.NOT_FOUND


async def test_authentication_is_required(stub: pb_grpc.MasterServiceStub) -> None:
    assert await _code(stub.ListStudies(pb.ListStudiesRequest())) == grpc.StatusCode.UNAUTHENTICATED
    bad = bearer("nope")
    assert await _code(stub.ListStudies(pb.ListStudiesRequest(), metadata=bad)) == grpc.StatusCode.UNAUTHENTICATED
    reg = pb.RegisterNodeManagerRequest(node_manager_id="nm", address="x", slots=[pb.Slot(id="g0")])
    assert await _code(stub.RegisterNodeManager(reg, metadata=ALICE)) == grpc.StatusCode.PERMISSION_DENIED


async def test_submit_is_idempotent_per_client_request_id(stub: pb_grpc.MasterServiceStub) -> None:
    s = await _study(stub)
    f = fixed()
    items = [
        pb.SubmitItem(client_request_id=f"r{i}", config_json=config_json(f, lr=0.1 * (i + 1)), step=10)
        for i in range(3)
    ]
    first = await stub.SubmitRequests(pb.SubmitRequestsRequest(study_id=s.id, items=items), metadata=ALICE)
    again = await stub.SubmitRequests(pb.SubmitRequestsRequest(study_id=s.id, items=items), metadata=ALICE)
    assert [r.request_id for r in first.results] == [r.request_id for r in again.results]
    assert all(r.state == pb.NOT_SCHED for r in first.results)
    assert len({r.node for r in first.results}) == 3


@pytest.mark.parametrize(
    ("config", "step", "code"),
    [
        ("{not json", 3, grpc.StatusCode.INVALID_ARGUMENT),
        (json.dumps({"tuned": {"lr": 0.1}}), 3, grpc.StatusCode.INVALID_ARGUMENT),  # no fixed part anywhere
        (
            json.dumps({"fixed": {"trainer": "m:T"}, "tuned": {"lr": {"kind": "nope"}}}),
            3,
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (json.dumps({"fixed": {"trainer": "m:T"}, "tuned": {"lr": 0.1}}), -1, grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
async def test_bad_items_are_rejected_and_change_nothing(
    stub: pb_grpc.MasterServiceStub, config: str, step: int, code: grpc.StatusCode
) -> None:
    s = await _study(stub)
    good = pb.SubmitItem(client_request_id="good", config_json=config_json(fixed()), step=5)
    bad = pb.SubmitItem(client_request_id="bad", config_json=config, step=step)
    call = stub.SubmitRequests(pb.SubmitRequestsRequest(study_id=s.id, items=[good, bad]), metadata=ALICE)
    assert await _code(call) == code
    plan = stub.GetPlan(pb.GetPlanRequest(study_id=s.id), metadata=ALICE)
    assert await _code(plan) == grpc.StatusCode.NOT_FOUND  # the study has no plan: nothing was written


async def test_unknown_study_and_oversized_batch(stub: pb_grpc.MasterServiceStub) -> None:
    item = pb.SubmitItem(client_request_id="x", config_json=config_json(fixed()), step=3)
    call = stub.SubmitRequests(pb.SubmitRequestsRequest(study_id="nope", items=[item]), metadata=ALICE)
    assert await _code(call) == grpc.StatusCode.NOT_FOUND
    s = await _study(stub)
    items = [pb.SubmitItem(client_request_id=f"r{i}", config_json=config_json(fixed()), step=3) for i in range(51)]
    call = stub.SubmitRequests(pb.SubmitRequestsRequest(study_id=s.id, items=items), metadata=ALICE)
    assert await _code(call) == grpc.StatusCode.RESOURCE_EXHAUSTED
    call = stub.CreateStudy(pb.CreateStudyRequest(name=s.name), metadata=ALICE)
    assert await _code(call) == grpc.StatusCode.ALREADY_EXISTS


async def test_node_manager_flow_completes_results(stub: pb_grpc.MasterServiceStub, app: MasterApp) -> None:
    f = fixed()
    s = await stub.CreateStudy(pb.CreateStudyRequest(name=unique("s"), fixed_json=json.dumps(f)), metadata=ALICE)
    tuned = json.dumps({"tuned": {"lr": {"kind": "multistep", "init": 0.1, "milestones": [5], "gamma": 0.5}}})
    sub = await stub.SubmitRequests(
        pb.SubmitRequestsRequest(
            study_id=s.id, items=[pb.SubmitItem(client_request_id="a", config_json=tuned, step=10)]
        ),
        metadata=ALICE,
    )
    rid = sub.results[0].request_id
    nm = unique("nm")
    reg = pb.RegisterNodeManagerRequest(node_manager_id=nm, address="local", slots=[pb.Slot(id="g0", gpu_type="cpu")])
    await stub.RegisterNodeManager(reg, metadata=ADMIN)
    await stub.Heartbeat(pb.HeartbeatRequest(node_manager_id=nm), metadata=ADMIN)

    results = stub.StreamResults(pb.StreamResultsRequest(study_id=s.id, request_ids=[rid]), metadata=ALICE)
    assignments = stub.StreamAssignments(pb.StreamAssignmentsRequest(node_manager_id=nm), metadata=ADMIN)
    report = await asyncio.to_thread(app.scheduler.run_round)
    assert len(report.dispatched) == 1

    got = await asyncio.wait_for(assignments.read(), 10)
    spec = BatchSpec.from_json(json.loads(got.batch_spec_json))
    assert (spec.batch_id, spec.attempt) == (got.batch_id, 1)
    assert got.slot_id == "g0"  # the slot the round placed it on
    assert spec.steps == 10 and spec.source.uri is None
    end = spec.end
    assignments.cancel()

    done = await stub.ReportBatch(
        pb.ReportBatchRequest(
            batch_id=got.batch_id,
            attempt=1,
            ok=True,
            metrics=[pb.MetricPoint(node=end.node, step=end.step, values={"loss": 0.25})],
            checkpoints=[pb.CheckpointPoint(node=end.node, step=end.step, uri="file:///ck", bytes=10, kind="central")],
        ),
        metadata=ADMIN,
    )
    assert list(done.completed_request_ids) == [rid]
    first = await asyncio.wait_for(results.read(), 10)
    assert first.request_id == rid and first.state == pb.DONE and dict(first.metrics) == {"loss": 0.25}

    # now cached: the same config at the same step answers at once
    again = await stub.SubmitRequests(
        pb.SubmitRequestsRequest(
            study_id=s.id, items=[pb.SubmitItem(client_request_id="b", config_json=tuned, step=10)]
        ),
        metadata=ALICE,
    )
    assert again.results[0].state == pb.DONE and dict(again.results[0].metrics) == {"loss": 0.25}
    m = await stub.GetMetrics(pb.GetMetricsRequest(study_id=s.id, config_json=tuned, step=10), metadata=ALICE)
    assert m.found and dict(m.metrics) == {"loss": 0.25}
    miss = await stub.GetMetrics(pb.GetMetricsRequest(study_id=s.id, config_json=tuned, step=11), metadata=ALICE)
    assert not miss.found
    plan = await stub.GetPlan(pb.GetPlanRequest(study_id=s.id), metadata=ALICE)
    assert [n.checkpoint_steps for n in plan.nodes] == [[10]]
    assert plan.nodes[0].requests["DONE"] == 2

    listed = await stub.ListRequests(pb.ListRequestsRequest(study_id=s.id), metadata=ALICE)
    assert [(r.client_request_id, r.state) for r in listed.results] == [("a", pb.DONE), ("b", pb.DONE)]
    one = await stub.ListRequests(pb.ListRequestsRequest(study_id=s.id, request_ids=[rid]), metadata=ALICE)
    assert [r.request_id for r in one.results] == [rid] and dict(one.results[0].metrics) == {"loss": 0.25}
    assert (
        await _code(stub.ListRequests(pb.ListRequestsRequest(study_id=s.id), metadata=BOB)) == grpc.StatusCode.NOT_FOUND
    )

    nms = await stub.ListNodeManagers(pb.ListNodeManagersRequest(), metadata=ADMIN)
    (mine,) = [n for n in nms.node_managers if n.node_manager_id == nm]
    assert mine.state == "ALIVE" and [(x.id, x.gpu_type, x.gpu_index) for x in mine.slots] == [("g0", "cpu", -1)]
    call = stub.ListNodeManagers(pb.ListNodeManagersRequest(), metadata=ALICE)
    assert await _code(call) == grpc.StatusCode.PERMISSION_DENIED


async def test_cancel_a_pending_request(stub: pb_grpc.MasterServiceStub) -> None:
    s = await _study(stub)
    sub = await stub.SubmitRequests(
        pb.SubmitRequestsRequest(
            study_id=s.id, items=[pb.SubmitItem(client_request_id="a", config_json=config_json(fixed()), step=4)]
        ),
        metadata=ALICE,
    )
    rid = sub.results[0].request_id
    res = await stub.CancelRequest(pb.CancelRequestRequest(study_id=s.id, request_id=rid), metadata=ALICE)
    assert res.state == pb.CANCELLED
    call = stub.CancelRequest(pb.CancelRequestRequest(study_id=s.id, request_id=rid), metadata=BOB)
    assert await _code(call) == grpc.StatusCode.NOT_FOUND
    stream = stub.StreamResults(pb.StreamResultsRequest(study_id=s.id, request_ids=[rid]), metadata=ALICE)
    assert [r.state async for r in stream] == [pb.CANCELLED]


async def test_json_nested_past_the_limit_is_invalid_argument_naming_it(stub: pb_grpc.MasterServiceStub) -> None:
    deep = "[" * 10_000 + "]" * 10_000  # 20 kB: under the config size limit, far past Python's recursion limit
    in_values = json.dumps({"trainer": "m:T", "values": {"x": 0}}).replace("0}}", "[" * 5_000 + "]" * 5_000 + "}}")
    for fixed_json in (deep, in_values):
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.CreateStudy(pb.CreateStudyRequest(name=unique("deep"), fixed_json=fixed_json), metadata=ALICE)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"over the limit of {MAX_JSON_DEPTH}" in (ei.value.details() or "")
    s = await _study(stub)
    config = json.dumps({"fixed": fixed(), "tuned": {"lr": 0}}).replace('"lr": 0', '"lr": ' + deep)
    item = pb.SubmitItem(client_request_id="deep", config_json=config, step=3)
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await stub.SubmitRequests(pb.SubmitRequestsRequest(study_id=s.id, items=[item]), metadata=ALICE)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "levels deep" in (ei.value.details() or "")
    query = pb.GetMetricsRequest(study_id=s.id, config_json=config, step=3)
    assert await _code(stub.GetMetrics(query, metadata=ALICE)) == grpc.StatusCode.INVALID_ARGUMENT
    got = await stub.ListRequests(pb.ListRequestsRequest(study_id=s.id), metadata=ALICE)
    assert list(got.results) == []  # nothing was written


async def test_a_message_nested_past_the_decoders_limit_is_invalid_argument(grpc_target: str) -> None:
    # an unknown group (field 15) opened 100,000 times: the decoder gives up at its recursion limit
    nested = bytes([(15 << 3) | 3]) * 100_000 + bytes([(15 << 3) | 4]) * 100_000
    async with grpc.aio.insecure_channel(grpc_target) as ch:
        for method in ("CreateStudy", "StreamResults"):
            path = f"/stagetree.v1.MasterService/{method}"
            call = ch.unary_unary(path) if method == "CreateStudy" else ch.unary_stream(path)
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                got = call(pb.CreateStudyRequest(name="x").SerializeToString() + nested, metadata=ALICE)
                if method == "CreateStudy":
                    await got
                else:
                    async for _ in got:
                        pass
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value
            assert "not a valid protobuf message" in (ei.value.details() or "")
        shallow = bytes([(15 << 3) | 3]) * 20 + bytes([(15 << 3) | 4]) * 20  # unknown but decodable: ignored
        study = pb.Study.FromString(
            await ch.unary_unary("/stagetree.v1.MasterService/CreateStudy")(
                pb.CreateStudyRequest(name=unique("groups")).SerializeToString() + shallow, metadata=ALICE
            )
        )
        assert study.owner == "alice"
