"""A resume on another number of ranks reported on the direct path (a real gRPC ``ReportBatch``), and
where a user finds it: the study's plan (REST) and the dashboard's stage tree list the node's path
changes. The report is retried, as a node manager does when it hears no answer: one path change."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest
from sqlalchemy import select

from stagetree.master.app import MasterApp
from stagetree.master.store import models as m
from stagetree.proto.stagetree.v1 import master_pb2 as pb
from stagetree.proto.stagetree.v1 import master_pb2_grpc as pb_grpc
from tests.integration.master.conftest import ADMIN_TOKEN, TOKENS
from tests.integration.master.helpers import bearer, fixed, unique

ALICE = {"Authorization": f"Bearer {TOKENS['alice']}"}
ADMIN = bearer(ADMIN_TOKEN)


@pytest.fixture
async def stub(grpc_target: str) -> AsyncIterator[pb_grpc.MasterServiceStub]:
    async with grpc.aio.insecure_channel(grpc_target) as ch:
        yield pb_grpc.MasterServiceStub(ch)


def _dispatch_on_two_slots(http: httpx.Client, app: MasterApp, step: int) -> tuple[str, int, int, str]:
    """A study with one request at ``step``, carried by a batch on two slots: (study, node, batch, nm)."""
    sid = http.post("/studies", json={"name": unique("s")}, headers=ALICE).json()["id"]
    item = {"client_request_id": "a", "config": {"fixed": fixed(), "tuned": {"lr": 0.1}}, "step": step}
    (req,) = http.post(f"/studies/{sid}/requests", json={"items": [item]}, headers=ALICE).json()
    nm = unique("nm")
    app.store.nodes.register_node_manager(nm, "127.0.0.1:1", [("g0", "cpu"), ("g1", "cpu")])
    plan_id = app.store.plans.study_plan_ids(sid)[0]
    spec = json.dumps({"stages": [{"node": req["node"], "start": 10, "end": step}], "slots": 2})
    batch = app.store.ledger.dispatch(plan_id, lambda b, a: spec, [req["request_id"]], nm, "g0", "g1")
    assert batch is not None
    return sid, int(req["node"]), batch.id, nm


def _report(batch_id: int, node: int, rescaled: pb.Rescaled | None) -> pb.ReportBatchRequest:
    return pb.ReportBatchRequest(
        batch_id=batch_id,
        attempt=1,
        ok=True,
        metrics=[pb.MetricPoint(node=node, step=20, values={"loss": 0.25})],
        checkpoints=[pb.CheckpointPoint(node=node, step=20, uri="file:///ck20", bytes=10, kind="central", ranks=2)],
        rescaled=rescaled,
    )


async def test_a_reported_rescale_shows_once_on_the_plan_and_the_tree(
    stub: pb_grpc.MasterServiceStub, http: httpx.Client, app: MasterApp
) -> None:
    sid, node, batch_id, nm = await asyncio.to_thread(_dispatch_on_two_slots, http, app, 20)
    resumed = pb.Rescaled(node=node, step=10, uri="file:///ck10", from_ranks=1, to_ranks=2)
    for _ in range(2):  # the first answer was lost: the node manager reports again
        await stub.ReportBatch(_report(batch_id, node, resumed), metadata=ADMIN)
    plan = (await asyncio.to_thread(http.get, f"/studies/{sid}/plan", headers=ALICE)).json()
    (shown,) = plan["nodes"]
    (change,) = shown["path_changes"]
    want: dict[str, Any] = {"node": node, "step": 10, "from_ranks": 1, "to_ranks": 2, "batch_id": batch_id}
    assert {k: change[k] for k in want} == want
    assert (change["attempt"], change["node_manager"], change["uri"]) == (1, nm, "file:///ck10")
    tree = (await asyncio.to_thread(http.get, f"/dashboard/studies/{sid}/tree", headers=ALICE)).json()
    assert [n["rescaled"] for n in tree["nodes"]] == [True]
    opened = await asyncio.to_thread(http.get, f"/dashboard/studies/{sid}/tree/nodes/{node}", headers=ALICE)
    assert len(opened.json()["path_changes"]) == 1
    with app.store.db.tx("test: checkpoint ranks") as s:
        assert s.scalar(select(m.Checkpoint.ranks).where(m.Checkpoint.uri == "file:///ck20")) == 2


async def test_a_report_without_a_rescale_records_none_and_a_rescale_to_the_same_count_is_refused(
    stub: pb_grpc.MasterServiceStub, http: httpx.Client, app: MasterApp
) -> None:
    sid, node, batch_id, _ = await asyncio.to_thread(_dispatch_on_two_slots, http, app, 20)
    same = pb.Rescaled(node=node, step=10, uri="file:///ck10", from_ranks=2, to_ranks=2)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ReportBatch(_report(batch_id, node, same), metadata=ADMIN)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "two different counts" in str(err.value.details())
    await stub.ReportBatch(_report(batch_id, node, None), metadata=ADMIN)
    plan = (await asyncio.to_thread(http.get, f"/studies/{sid}/plan", headers=ALICE)).json()
    assert [n["path_changes"] for n in plan["nodes"]] == [[]]
