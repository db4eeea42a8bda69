"""The gRPC side of the boundary fuzzed with hypothesis (``grpc_fuzz``) against a live master on Postgres:
every answer is OK or a status of the error table that says what was wrong, never INTERNAL or UNKNOWN
(a bug), whatever the input."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest

from stagetree.proto.stagetree.v1 import master_pb2 as pb
from stagetree.proto.stagetree.v1 import master_pb2_grpc as pb_grpc
from tests.integration.master.conftest import ADMIN_TOKEN, TOKENS
from tests.integration.master.grpc_fuzz import fuzz_grpc


@pytest.mark.parametrize("fresh_db_url", ["postgres"], indirect=True)
async def test_no_message_reaches_a_server_bug(grpc_target: str) -> None:
    loop = asyncio.get_running_loop()
    user = (("authorization", f"Bearer {TOKENS['alice']}"),)
    admin = (("authorization", f"Bearer {ADMIN_TOKEN}"),)
    fixed = {"trainer": "fuzz:Net", "dataset": "d", "seed": 0}
    async with grpc.aio.insecure_channel(grpc_target) as channel:
        stub = pb_grpc.MasterServiceStub(channel)  # type: ignore[no-untyped-call]
        study = await stub.CreateStudy(pb.CreateStudyRequest(name="fuzz", fixed_json=json.dumps(fixed)), metadata=user)

        async def one(method: str, msg: Any, as_admin: bool) -> grpc.StatusCode:
            try:
                await getattr(stub, method)(msg, metadata=admin if as_admin else user, timeout=30)
            except grpc.aio.AioRpcError as exc:
                return exc.code()  # type: ignore[no-any-return]
            return grpc.StatusCode.OK

        def call(method: str, msg: Any, as_admin: bool) -> grpc.StatusCode:
            return asyncio.run_coroutine_threadsafe(one(method, msg, as_admin), loop).result(60)

        # hypothesis runs in a thread; the server and the channel stay on this loop
        report = await asyncio.to_thread(fuzz_grpc, call, study.id, fixed, examples_per_call=60)

    assert report.server_errors == 0, report
    assert report.requests >= 600, report
    assert "OK" in report.by_method["SubmitRequests"] and "OK" in report.by_method["GetMetrics"], report.by_method
