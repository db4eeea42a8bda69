"""Learning curves end to end in the embedded mode: real worker processes train the digits MLP, its
``train()`` returns the step loss, the points travel worker -> node manager -> bus -> aggregator ->
database, and the SDK (gRPC) and REST read a trial's curve: the shared prefix's points once in the
database, in every trial's curve."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

import stagetree
from stagetree.core.sequences import MultiStep
from stagetree.embedded import Embedded, EmbeddedSettings
from stagetree.nodemanager.examples.digits import ENTRY_POINT

VALUES = {"hidden": 16, "minibatches": 1}
BRANCH, END = 8, 16


async def test_curves_through_the_pipeline_stored_once_read_per_trial(tmp_path: Path) -> None:
    configs = [{"lr": MultiStep(0.1, [BRANCH], gamma), "bs": 32} for gamma in (0.5, 0.1, 0.01)]
    settings = EmbeddedSettings(home=tmp_path / "home", workers=2, http_port=0, curve_max_per_s=0)
    async with Embedded(settings) as cluster, stagetree.connect(cluster.target, token=cluster.token) as client:
        study = await stagetree.Study.create(
            client, "curves", trainer=ENTRY_POINT, seed=0, values=VALUES, tuned=["lr", "bs"]
        )
        # another study (its own plan: another seed) asks for a point every 4 steps
        sparse = await stagetree.Study.create(
            client, "sparse", trainer=ENTRY_POINT, seed=1, values=VALUES, tuned=["lr", "bs"], curve_every_steps=4
        )
        evals = [study.submit(c, END) for c in configs]
        sparse_eval = sparse.submit(configs[0], END)
        await asyncio.wait_for(asyncio.gather(*evals, sparse_eval), 120)
        rids = [e.request_id for e in evals]
        assert all(r is not None for r in rids)
        curves = [await study.curve(r) for r in rids if r is not None]
        # the points of a batch's last steps may still be on the bus when its metrics are
        for _ in range(100):
            if all(len(c) == END for c in curves):
                break
            await asyncio.sleep(0.1)
            curves = [await study.curve(r) for r in rids if r is not None]
        assert sparse_eval.request_id is not None and sparse.info.curve_every_steps == 4
        for _ in range(100):
            sparse_curve = await sparse.curve(sparse_eval.request_id)
            if len(sparse_curve) == END // 4:
                break
            await asyncio.sleep(0.1)
        store = cluster.app.store
        plan = await study.plan()
        rows = await asyncio.to_thread(store.curves.counts, [n["id"] for n in plan["nodes"]])
        async with httpx.AsyncClient(
            base_url=cluster.http_url, headers={"authorization": f"Bearer {cluster.token}"}
        ) as http:
            thin = (await http.get(f"/api/v1/studies/{study.id}/requests/{rids[0]}/curve?max_points=4")).json()
            window = (await http.get(f"/api/v1/studies/{study.id}/requests/{rids[1]}/curve?start=5&end=10")).json()
            bad = await http.get(f"/api/v1/studies/{study.id}/requests/{rids[1]}/curve?start=10&end=5")
            missing = await http.get(f"/api/v1/studies/{study.id}/requests/999999/curve")
            per_node = (await http.get(f"/api/v1/studies/{study.id}/curves")).json()
    for c in curves:
        assert [s for s, _ in c] == list(range(1, END + 1))
        assert all("train_loss" in v for _, v in c)
    assert [s for s, _ in sparse_curve] == [4, 8, 12, 16]  # the study's own sampling
    assert curves[0][:BRANCH] == curves[1][:BRANCH] == curves[2][:BRANCH]  # one shared prefix
    assert curves[0][BRANCH:] != curves[1][BRANCH:]
    assert sum(rows.values()) == BRANCH + len(configs) * (END - BRANCH)  # stored once per plan point
    assert thin["total"] == END and [p["step"] for p in thin["points"]] == [1, 6, 11, 16]
    assert [p["step"] for p in window["points"]] == list(range(5, 11))
    assert (
        bad.status_code == 200 and bad.json()["points"] == [] and missing.status_code == 404
    )  # end < start: no points
    assert sum(n["total"] for n in per_node) == sum(rows.values())
