"""Load for the overload checks, shared by ``test_overload.py`` and ``tests.bench.faults``: SDK clients
submitting one-item batches back to back, each answer recorded, so a check can compare what the master
accepted with what it stored."""

from __future__ import annotations

import asyncio
import time
import uuid

from stagetree.client.sdk import Client
from stagetree.proto.stagetree.v1 import master_pb2 as pb


async def hammer(clients: list[Client], study_id: str, seconds: float, tasks_per_client: int) -> dict[str, int]:
    """Each client submits one-item batches back to back from ``tasks_per_client`` tasks for ``seconds``;
    returns client request id -> request id of every submission the master answered."""
    accepted: dict[str, int] = {}
    stop = time.monotonic() + seconds

    async def loop(client: Client, k: int) -> None:
        n = 0
        while time.monotonic() < stop:
            n += 1
            cid = uuid.uuid4().hex
            cfg = f'{{"tuned": {{"lr": {0.0001 * (k * 100_000 + n):.6f}}}}}'
            item = pb.SubmitItem(client_request_id=cid, config_json=cfg, step=5)
            resp = await client.call(
                "SubmitRequests", pb.SubmitRequestsRequest(study_id=study_id, items=[item]), idempotent=True
            )
            accepted[cid] = resp.results[0].request_id

    await asyncio.gather(
        *(loop(c, i * tasks_per_client + t) for i, c in enumerate(clients) for t in range(tasks_per_client))
    )
    return accepted
