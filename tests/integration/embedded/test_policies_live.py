"""Studies that choose scheduling policies, end to end on the embedded mode with real training
(``stagetree.master.policies``): Hermes time-sharing preempts a running batch that later resumes with
results equal to a straight run, HyperSack packing decides how many batches share one device, GENIE
serves an urgent study's work before a normal one's; an unknown policy name creates nothing."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from sqlalchemy import select
from sqlalchemy.orm import Session

import stagetree
from stagetree.core.errors import InvalidArgument
from stagetree.embedded import Embedded, EmbeddedSettings
from stagetree.master.store import models as m
from stagetree.nodemanager.examples.digits import ENTRY_POINT, DigitsMLP, digits_batch
from stagetree.nodemanager.runtime.checkpoints import LocalCheckpointStore
from stagetree.nodemanager.runtime.executor import run_batch

VALUES = {"hidden": 32, "minibatches": 20}  # about 3 ms a step on one core


@asynccontextmanager
async def cluster_and_client(home: Path, workers: int, http: bool = False) -> AsyncIterator[tuple[Embedded, Any]]:
    async with (
        Embedded(EmbeddedSettings(home=home, workers=workers, http_port=0 if http else None)) as cluster,
        stagetree.connect(cluster.target, token=cluster.token) as client,
    ):
        yield cluster, client


def batches_of(cluster: Embedded, study_id: str) -> list[tuple[int, str, float, float, int, str]]:
    """(batch id, state, created, updated, end step, its rank 0 slot) of the batches of the study's plans."""
    store = cluster.app.store
    plans = store.plans.study_plan_ids(study_id)
    with Session(store.db.engine) as s:
        rows = s.scalars(select(m.Batch).where(m.Batch.plan_id.in_(plans))).all()
        first = dict(s.execute(select(m.BatchSlot.batch_id, m.BatchSlot.slot_id).where(m.BatchSlot.rank == 0)).all())
        return sorted(
            (b.id, b.state, b.created_at, b.updated_at, int(json.loads(b.spec_json)["stages"][-1]["end"]), first[b.id])
            for b in rows
        )


async def settled(cluster: Embedded, study_id: str) -> list[tuple[int, str, float, float, int, str]]:
    """``batches_of`` once none is RUNNING: a result comes with its evaluation, before its batch's end is
    recorded."""
    deadline = time.monotonic() + 30
    while True:
        batches = await asyncio.to_thread(batches_of, cluster, study_id)
        if all(s != "RUNNING" for _, s, *_ in batches) or time.monotonic() > deadline:
            return batches
        await asyncio.sleep(0.1)


def straight_run(hps: dict[str, Any], step: int, tmp: Path, seed: int) -> dict[str, float]:
    got: dict[str, float] = {}

    def emit(kind: str, payload: dict[str, Any]) -> None:
        if kind == "metrics":
            got.update(payload["metrics"])

    spec = digits_batch([(1, 0, step, hps)], evals=[(1, step)], fixed_values=VALUES, seed=seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a worker of a one-thread slot: the float sums then add up in the same order
    try:
        assert run_batch(spec, DigitsMLP, LocalCheckpointStore(tmp), emit).status == "finished"
    finally:
        torch.set_num_threads(threads)
    return got


async def wait_running(cluster: Embedded, n: int = 1, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(await asyncio.to_thread(cluster.app.store.batches.running_batches)) < n:
        assert time.monotonic() < deadline, "no batch started"
        await asyncio.sleep(0.05)


async def test_hermes_preempts_a_running_batch_that_resumes_exactly(tmp_path: Path) -> None:
    policies = {"time_share": "hermes", "time_share_params": {"quantum_s": 1.0, "eval_every": 50}}
    a, b = {"lr": 0.1, "bs": 32}, {"lr": 0.05, "bs": 32}
    end = 500
    async with cluster_and_client(tmp_path / "home", workers=1) as (cluster, client):
        study = await stagetree.Study.create(
            client, "hermes", trainer=ENTRY_POINT, seed=0, values=VALUES, tuned=["lr", "bs"], policies=policies
        )
        assert study.info.policies is not None and study.info.policies["time_share"] == "hermes"
        first = study.submit(a, end)
        await wait_running(cluster)
        second = study.submit(b, end)
        got = await asyncio.wait_for(asyncio.gather(first, second), 300)
        batches = await settled(cluster, study.id)
    states = [s for _, s, *_ in batches]
    assert "PREEMPTED" in states, batches  # a batch really yielded its slot ...
    assert states.count("DONE") >= 2  # ... and the rest of its work ran later
    for cfg, res in zip((a, b), got, strict=True):
        want = straight_run(cfg, end, tmp_path / "straight", seed=0)
        for k in want:
            assert res[k] == pytest.approx(want[k], abs=1e-6), (cfg, k)


@pytest.mark.parametrize(("compute", "together"), [(40, True), (60, False)])
async def test_packing_decides_how_many_batches_share_the_device(
    tmp_path: Path, compute: float, together: bool
) -> None:
    policies = {"placement": "wfd", "placement_params": {"compute": compute}}
    async with cluster_and_client(tmp_path / "home", workers=2) as (cluster, client):
        study = await stagetree.Study.create(
            client, "pack", trainer=ENTRY_POINT, seed=2, values=VALUES, tuned=["lr", "bs"], policies=policies
        )
        configs = [{"lr": 0.1, "bs": 32}, {"lr": 0.2, "bs": 32}]
        await asyncio.wait_for(asyncio.gather(*(study.eval(c, 300 + 100 * i) for i, c in enumerate(configs))), 300)
        batches = await settled(cluster, study.id)
    assert len(batches) == 2 and all(s == "DONE" for _, s, *_ in batches)
    (_, _, _c1, u1, e1, s1), (_, _, c2, _u2, _e2, s2) = sorted(batches, key=lambda r: r[2])
    assert e1 == 400  # WFD: the longer work first
    if together:  # two 40% batches fit one device: both run at once, on its two slots
        assert c2 < u1 and {s1, s2} == {"cpu0", "cpu1"}
    else:  # two 60% batches do not: the second waits for the first to finish
        assert c2 >= u1


async def test_genie_serves_urgent_work_before_normal_work(tmp_path: Path) -> None:
    async with cluster_and_client(tmp_path / "home", workers=1, http=True) as (cluster, client):
        with pytest.raises(InvalidArgument, match="valid: \\['urgent', 'prior', 'normal'\\]"):
            await stagetree.Study.create(
                client, "bad", trainer=ENTRY_POINT, values=VALUES, tuned=["lr", "bs"], policies={"qos": "asap"}
            )
        async with httpx.AsyncClient(base_url=f"{cluster.http_url}/api/v1") as http:
            fixed = {"trainer": ENTRY_POINT, "policies": {"placement": "best_fit"}}
            auth = {"Authorization": f"Bearer {cluster.token}"}
            r = await http.post("/studies", json={"name": "bad", "fixed": fixed}, headers=auth)
            assert r.status_code == 422 and "'wfd'" in r.text, r.text
        assert await client.list_studies() == []  # nothing created

        normal = await stagetree.Study.create(
            client, "normal", trainer=ENTRY_POINT, seed=4, values=VALUES, tuned=["lr", "bs"], policies={"qos": "normal"}
        )
        urgent = await stagetree.Study.create(
            client, "urgent", trainer=ENTRY_POINT, seed=5, values=VALUES, tuned=["lr", "bs"], policies={"qos": "urgent"}
        )
        blocker = normal.submit({"lr": 0.3, "bs": 32}, 600)
        await wait_running(cluster)
        # both wait behind the blocker, equally long; without the urgent class the earlier one goes first
        later = normal.submit({"lr": 0.2, "bs": 32}, 500)
        await asyncio.sleep(0.3)
        sooner = urgent.submit({"lr": 0.1, "bs": 32}, 500)
        await asyncio.wait_for(asyncio.gather(blocker, later, sooner), 300)
        nb = await asyncio.to_thread(batches_of, cluster, normal.id)
        ub = await asyncio.to_thread(batches_of, cluster, urgent.id)
    blocker_batch = next(r for r in nb if r[4] == 600)
    normal_batch = next(r for r in nb if r[4] == 500)
    urgent_batch = next(r for r in ub if r[4] == 500)
    assert blocker_batch[2] < urgent_batch[2] < normal_batch[2]


async def test_pop_kills_poor_trials_early_and_lets_promising_ones_finish(tmp_path: Path) -> None:
    policies = {
        "search": "pop",
        "search_params": {
            "metric": "accuracy",
            "target": 0.9,
            "kill_threshold": 0.5,
            "report_every": 25,
            "eval_every": 8,  # a boundary every 8 reports: step 200, 400, ...
            "t_max_s": 600,
            "max_epochs": 48,
        },
    }
    good, poor = [{"lr": 0.1, "bs": 32}, {"lr": 0.03, "bs": 32}], {"lr": 0.0001, "bs": 32}
    async with cluster_and_client(tmp_path / "home", workers=2) as (cluster, client):
        study = await stagetree.Study.create(
            client, "pop", trainer=ENTRY_POINT, seed=6, values=VALUES, tuned=["lr", "bs"], policies=policies
        )
        evals = [study.submit(poor, 1200), *(study.submit(c, 600) for c in good)]
        got = await asyncio.wait_for(asyncio.gather(*evals, return_exceptions=True), 300)
        requests = await asyncio.to_thread(cluster.app.store.requests.get_requests, study.id)
        batches = await asyncio.to_thread(batches_of, cluster, study.id)
    assert isinstance(got[0], stagetree.EvalCancelled) and "poor trial" in str(got[0]), got[0]  # the client sees why
    killed = next(r for r in requests if r.step == 1200)
    assert killed.state == "CANCELLED" and "poor trial" in (killed.error or "")
    assert next(s for _, s, _, _, end, _ in batches if end == 1200) == "ABORTED"  # stopped before its end
    for res in got[1:]:
        assert isinstance(res, dict) and res["accuracy"] > 0.9  # the promising trials ran to their end
