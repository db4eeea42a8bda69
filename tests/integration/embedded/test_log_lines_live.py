"""A trainer's log lines end to end in the embedded mode: real worker processes train the digits MLP, which
logs a line every other step (``log_text``); the lines travel worker -> node manager -> bus -> aggregator
-> database, and REST and the SDK (gRPC) show them with the request they trained."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

import stagetree
from stagetree.embedded import Embedded, EmbeddedSettings
from stagetree.nodemanager.examples.digits import ENTRY_POINT

END = 8


async def test_a_trainers_lines_reach_the_requests_record(tmp_path: Path) -> None:
    settings = EmbeddedSettings(home=tmp_path / "home", workers=1, http_port=0)
    async with Embedded(settings) as cluster, stagetree.connect(cluster.target, token=cluster.token) as client:
        study = await stagetree.Study.create(
            client, "logs", trainer=ENTRY_POINT, seed=0, values={"hidden": 16, "log_every": 2}, tuned=["lr", "bs"]
        )
        evaluation = study.submit({"lr": 0.1, "bs": 32}, END)
        await asyncio.wait_for(evaluation, 120)
        rid = evaluation.request_id
        assert rid is not None
        url = f"/api/v1/studies/{study.id}/requests/{rid}/logs"
        async with httpx.AsyncClient(base_url=cluster.http_url, timeout=30) as http:
            body: dict[str, Any] = {}
            for _ in range(200):  # the lines travel on the events topic: they may land after the metrics
                got = await http.get(url, headers={"authorization": f"Bearer {cluster.token}"})
                assert got.status_code == 200, got.text
                body = got.json()
                if len(body["lines"]) >= END // 2:
                    break
                await asyncio.sleep(0.1)
            via_sdk = await study.logs(rid)
            wrong_token = await http.get(url, headers={"authorization": "Bearer not-a-token"})
            missing = await http.get(
                f"/api/v1/studies/no-such-study/requests/{rid}/logs",
                headers={"authorization": f"Bearer {cluster.token}"},
            )
    lines = body["lines"]
    assert [(x["seq"], x["step"]) for x in lines] == [(0, 2), (1, 4), (2, 6), (3, 8)]
    assert all(x["line"].startswith(f"step {x['step']} train_loss ") for x in lines)
    assert len({x["batch_id"] for x in lines}) == 1 and all(x["attempt"] == 1 for x in lines)
    assert wrong_token.status_code == 401 and missing.status_code == 404
    assert [(x.batch_id, x.attempt, x.seq, x.node, x.step, x.at, x.line) for x in via_sdk] == [
        (x["batch_id"], x["attempt"], x["seq"], x["node"], x["step"], x["at"], x["line"]) for x in lines
    ]
