"""A trainer's log lines reported on the direct path (a real gRPC ``ReportBatch`` whose ``events`` are the
bus messages, retried as a node manager retries when it hears no answer), kept once in PostgreSQL, and
read back with the request over REST and gRPC: by its owner only (another owner's study does not exist),
with its ids checked."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest

from stagetree.bus.messages import BatchFinished, BatchMessage, LogLine, Metrics, encode_many
from stagetree.core.loglines import MAX_LINE_CHARS
from stagetree.master.app import MasterApp
from stagetree.proto.stagetree.v1 import master_pb2 as pb
from stagetree.proto.stagetree.v1 import master_pb2_grpc as pb_grpc
from tests.integration.master.conftest import ADMIN_TOKEN, TOKENS
from tests.integration.master.helpers import bearer, fixed, unique

ALICE = {"Authorization": f"Bearer {TOKENS['alice']}"}
BOB = {"Authorization": f"Bearer {TOKENS['bob']}"}
ADMIN = bearer(ADMIN_TOKEN)
STEP = 20


@pytest.fixture
async def stub(grpc_target: str) -> AsyncIterator[pb_grpc.MasterServiceStub]:
    async with grpc.aio.insecure_channel(grpc_target) as ch:
        yield pb_grpc.MasterServiceStub(ch)


def _dispatched(http: httpx.Client, app: MasterApp) -> tuple[str, int, int, int]:
    """Alice's study with one request at ``STEP`` on a running batch: (study, request, node, batch)."""
    sid = http.post("/studies", json={"name": unique("s")}, headers=ALICE).json()["id"]
    item = {"client_request_id": "a", "config": {"fixed": fixed(), "tuned": {"lr": 0.1}}, "step": STEP}
    (req,) = http.post(f"/studies/{sid}/requests", json={"items": [item]}, headers=ALICE).json()
    nm = unique("nm")
    app.store.nodes.register_node_manager(nm, "127.0.0.1:1", [("g0", "cpu")])
    plan_id = app.store.plans.study_plan_ids(sid)[0]
    spec = json.dumps({"stages": [{"node": req["node"], "start": 0, "end": STEP}]})
    batch = app.store.ledger.dispatch(plan_id, lambda b, a: spec, [req["request_id"]], nm, "g0")
    assert batch is not None
    return sid, int(req["request_id"]), int(req["node"]), batch.id


def _events(batch_id: int, node: int, lines: list[str]) -> list[bytes]:
    common = {"node_manager": "nm", "batch_id": batch_id, "attempt": 1}
    msgs: list[BatchMessage] = [
        LogLine(msg_id=f"nm:{batch_id}:1:{i}", **common, seq=i, node=node, step=5 * (i + 1), at=1.7e9 + i, line=line)
        for i, line in enumerate(lines)
    ]
    msgs.append(Metrics(msg_id=f"nm:{batch_id}:1:m", **common, node=node, step=STEP, metrics={"loss": 0.5}))
    msgs.append(BatchFinished(msg_id=f"nm:{batch_id}:1:f", **common, steps=STEP))
    return encode_many(msgs)


async def test_log_lines_reported_directly_are_kept_once_and_shown_to_the_owner_alone(
    stub: pb_grpc.MasterServiceStub, http: httpx.Client, app: MasterApp
) -> None:
    sid, rid, node, batch_id = await asyncio.to_thread(_dispatched, http, app)
    lines = ["epoch 1: loss 2.3", "x" * MAX_LINE_CHARS, "héllo ✓"]
    report = pb.ReportBatchRequest(batch_id=batch_id, attempt=1, events=_events(batch_id, node, lines))
    for _ in range(2):  # the first answer was lost: the node manager reports again
        await stub.ReportBatch(report, metadata=ADMIN)

    def get(path: str, headers: dict[str, str]) -> httpx.Response:
        return http.get(path, headers=headers)

    got = await asyncio.to_thread(get, f"/studies/{sid}/requests/{rid}/logs", ALICE)
    assert got.status_code == 200, got.text
    body = got.json()
    assert body["request_id"] == rid
    assert [(x["batch_id"], x["attempt"], x["seq"], x["node"], x["step"]) for x in body["lines"]] == [
        (batch_id, 1, 0, node, 5),
        (batch_id, 1, 1, node, 10),
        (batch_id, 1, 2, node, 15),
    ]
    assert [x["line"] for x in body["lines"]] == lines and body["lines"][2]["at"] == 1.7e9 + 2
    # another owner: the study does not exist for bob, nor the request
    assert (await asyncio.to_thread(get, f"/studies/{sid}/requests/{rid}/logs", BOB)).status_code == 404
    # a request that is not the study's, ids out of range or not numbers
    other = (await asyncio.to_thread(http.post, "/studies", json={"name": unique("o")}, headers=ALICE)).json()["id"]
    assert (await asyncio.to_thread(get, f"/studies/{other}/requests/{rid}/logs", ALICE)).status_code == 404
    assert (await asyncio.to_thread(get, f"/studies/{sid}/requests/999999999/logs", ALICE)).status_code == 404
    for bad in ("0", "-1", "abc", str(2**63)):
        assert (await asyncio.to_thread(get, f"/studies/{sid}/requests/{bad}/logs", ALICE)).status_code == 422
    assert (await asyncio.to_thread(get, f"/studies/{sid}/requests/{rid}/logs", {})).status_code == 401
    # the same over gRPC (the SDK's Study.logs)
    ask = pb.GetRequestLogRequest(study_id=sid, request_id=rid)
    answer = await stub.GetRequestLog(ask, metadata=bearer(TOKENS["alice"]))
    assert [(x.seq, x.line, x.at) for x in answer.lines] == [(x["seq"], x["line"], x["at"]) for x in body["lines"]]
    for who, req, code in [
        ("bob", ask, grpc.StatusCode.NOT_FOUND),
        ("alice", pb.GetRequestLogRequest(study_id=sid, request_id=0), grpc.StatusCode.INVALID_ARGUMENT),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetRequestLog(req, metadata=bearer(TOKENS[who]))
        assert err.value.code() == code
